"""Messages the engine service (worker threads) posts to the app.

Each engine job ends with exactly one of `TurnDone`, `CallDone` or `EngineError`; the app
clears its busy state on those. Streamed text and statistics are not carried by messages:
`TokensReady` and `StatsChanged` only say "newer data waits in the service" (take it with
`EngineService.take_text()` / `take_stats()`), and at most one of each is pending at a time,
so a UI slower than the engine never works through a backlog.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.message import Message


class LoadProgressed(Message):
    """Progress of loading/warming up (engine.events.LoadProgress)."""

    def __init__(self, progress: Any) -> None:
        super().__init__()
        self.progress = progress


class EngineReady(Message):
    """The engine loaded; `info` is Engine.info."""

    def __init__(self, info: dict) -> None:
        super().__init__()
        self.info = info


class TokensReady(Message):
    """Decoded text of the running turn waits in `EngineService.take_text()`."""


class StatsChanged(Message):
    """A newer StepStats snapshot waits in `EngineService.take_stats()`."""


class TurnDone(Message):
    """A turn ended (engine.events.TurnFinished); `regenerated` for /regen turns."""

    def __init__(self, stats: Any, reasoning: str, content: str, regenerated: bool) -> None:
        super().__init__()
        self.stats = stats
        self.reasoning = reasoning
        self.content = content
        self.regenerated = regenerated


class CallDone(Message):
    """An engine call (`label`: "flush", "pin", …) returned `result`."""

    def __init__(self, label: str, result: Any) -> None:
        super().__init__()
        self.label = label
        self.result = result


class EngineError(Message):
    """A job failed; `message` is one line for the user, `job` names what failed."""

    def __init__(self, job: str, message: str) -> None:
        super().__init__()
        self.job = job
        self.message = message


class ConvertProgressed(Message):
    """Conversion / demo-building progress (converter ConvertProgress or LoadProgress)."""

    def __init__(self, progress: Any) -> None:
        super().__init__()
        self.progress = progress


class ModelReady(Message):
    """A converted model directory is ready to load (after conversion or demo building)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__()
        self.model_dir = model_dir


class ModelFailed(Message):
    """Conversion or demo building failed or was cancelled."""

    def __init__(self, message: str, cancelled: bool = False) -> None:
        super().__init__()
        self.message = message
        self.cancelled = cancelled
