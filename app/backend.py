"""The one seam between the app and the rest of the project (engine, converter).

`ChatApp` receives a `Backend`; the real one imports `engine` and `converter` lazily so the UI
starts (and its tests run) without them. Tests pass a fake with the same methods.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from app.settings import AppConfig, GenParams, engine_config_kwargs

ProgressFn = Callable[[Any], None]


class Backend(Protocol):
    """What the app needs from the engine and converter packages."""

    def load_engine(self, model_dir: Path, config: AppConfig, progress: ProgressFn) -> Any:
        """Engine.load(...) — returns an object with the engine facade's methods."""

    def sampling_params(self, gen: GenParams) -> Any:
        """engine.sampling.SamplingParams for one turn."""

    def message(self, role: str, content: str, reasoning: str = "") -> Any:
        """engine.chat.Message, for re-feeding a saved conversation."""

    def check_source(self, path: Path) -> list[str]:
        """Problems with a downloaded checkpoint directory ([] = convertible)."""

    def convert(
        self, src: Path, dst: Path, progress: ProgressFn, cancel: threading.Event
    ) -> Path:
        """Convert `src` into `dst` (resumable); returns `dst`."""

    def ensure_demo(self, data_dir: Path, progress: ProgressFn) -> Path:
        """The converted demo model directory, built once."""


class RealBackend:
    """The project's engine and converter, imported on first use."""

    def load_engine(self, model_dir: Path, config: AppConfig, progress: ProgressFn) -> Any:
        import torch

        from engine.config import EngineConfig
        from engine.engine import Engine

        from kernels.backend import tilelang_available

        kwargs = engine_config_kwargs(config, cuda_available=torch.cuda.is_available(),
                                      tilelang_available=tilelang_available())
        return Engine.load(model_dir, EngineConfig(**kwargs), progress=progress)

    def sampling_params(self, gen: GenParams) -> Any:
        from engine.sampling import SamplingParams

        return SamplingParams(
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            max_tokens=gen.max_tokens,
            thinking=gen.think,
        )

    def message(self, role: str, content: str, reasoning: str = "") -> Any:
        from engine.chat import Message

        return Message(role, content, reasoning)

    def check_source(self, path: Path) -> list[str]:
        from app.wizard import check_source

        return check_source(path)

    def convert(
        self, src: Path, dst: Path, progress: ProgressFn, cancel: threading.Event
    ) -> Path:
        from app.wizard import run_conversion

        return run_conversion(src, dst, progress, cancel)

    def ensure_demo(self, data_dir: Path, progress: ProgressFn) -> Path:
        from app.demo import ensure_demo_model

        return ensure_demo_model(data_dir, progress)


def history_messages(backend: Backend, messages: Sequence[Any]) -> list[Any]:
    """Engine messages for a conversation's `ChatMessage`s (role, content, reasoning)."""
    return [backend.message(m.role, m.content, m.reasoning) for m in messages]
