"""The one seam between the app and the rest of the project (engine, converter).

`ChatApp` receives a `Backend`; the real one imports `engine` and `converter` lazily so the UI
starts (and its tests run) without them. Tests pass a fake with the same methods. `EngineLike` is
the engine facade as the app drives it: engine.engine.Engine and tests/app/fake_engine.FakeEngine
both are one.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol, Sequence, TypeVar

from app.settings import AppConfig

if TYPE_CHECKING:
    from app.conversation import ChatMessage
    from engine.chat import Message
    from converter.convert import ConvertProgress
    from engine.events import Event, LoadProgress
    from engine.sampling import SamplingParams
    from engine.stats import StepStats

ProgressFn = Callable[["LoadProgress | ConvertProgress"], None]


class SessionLike(Protocol):
    """What the app reads of an engine's session (engine.session.Session)."""

    @property
    def messages(self) -> Sequence[Message]:
        """The conversation so far (user and assistant messages)."""

    @property
    def position(self) -> int:
        """Tokens of the conversation the engine has processed."""


S = TypeVar("S", bound=SessionLike)


class EngineLike(Protocol[S]):
    """The engine facade's methods the app calls (engine/engine.py states their contracts)."""

    @property
    def info(self) -> dict[str, Any]: ...

    def new_session(self, system: str | None = None, history: Sequence[Message] = ()) -> S: ...

    def generate(self, session: S, user_text: str, params: SamplingParams,
                 cancel: threading.Event) -> Generator[Event, None, None]: ...

    def regenerate(self, session: S, params: SamplingParams,
                   cancel: threading.Event) -> Generator[Event, None, None]: ...

    def undo(self, session: S) -> None: ...

    def flush_cache(self) -> int: ...

    def pin(self, keys: list[tuple[int, int]]) -> None: ...

    def pin_hot(self, n: int) -> list[tuple[int, int]]: ...

    def unpin(self, keys: list[tuple[int, int]] | None = None) -> None: ...

    def cache_contents(self) -> list[tuple[int, int, bool, int]]: ...

    def stats(self) -> StepStats: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """What the app needs from the engine and converter packages."""

    def load_engine(self, model_dir: Path, config: AppConfig, progress: ProgressFn) -> EngineLike:
        """Engine.load(...) — returns an object with the engine facade's methods."""

    def message(self, role: str, content: str, reasoning: str = "") -> Message:
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

    def load_engine(self, model_dir: Path, config: AppConfig, progress: ProgressFn) -> EngineLike:
        from engine.engine import Engine

        return Engine.load(model_dir, config.engine, progress=progress)

    def message(self, role: str, content: str, reasoning: str = "") -> Message:
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


def history_messages(backend: Backend, messages: Sequence[ChatMessage]) -> list[Message]:
    """Engine messages for a conversation's `ChatMessage`s (role, content, reasoning)."""
    return [backend.message(m.role, m.content, m.reasoning) for m in messages]
