"""Events yielded by `Engine.generate` and posted while loading.

The engine never calls into the UI: it yields these values from a generator that a worker
thread drains. Every event is immutable.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.stats import StepStats, TurnStats


@dataclass(frozen=True)
class TextDelta:
    """Newly decoded text. `channel` is "thinking" (reasoning before </think>) or "answer"."""

    text: str
    channel: str = "answer"


@dataclass(frozen=True)
class StepUpdate:
    """Statistics after a step; consumers may drop all but the newest."""

    stats: StepStats


@dataclass(frozen=True)
class TurnFinished:
    """The turn ended; the session already holds the completion (unless cancelled early)."""

    stats: TurnStats
    reasoning: str
    content: str


@dataclass(frozen=True)
class EngineFailure:
    """A turn failed; the session is left as it was before the turn. `message` is for users."""

    message: str


@dataclass(frozen=True)
class ContextOverflow(EngineFailure):
    """The turn's prompt (the conversation with the new message, as rendered and tokenised for
    the turn) is `prompt_tokens` tokens, not below the context limit `limit` (max_seq_len), so
    the turn was refused before any step. engine.turn.Turns is the one place this rule is
    checked; `message` gives a chat's advice, and a front end with other advice (the engine CLI
    names its flag) words its own from the numbers."""

    prompt_tokens: int = 0
    limit: int = 0


@dataclass(frozen=True)
class LoadProgress:
    """Progress while loading or warming up: `done`/`total` in `unit` (bytes, layers, …)."""

    phase: str
    done: int
    total: int
    unit: str = ""
    message: str = ""


Event = TextDelta | StepUpdate | TurnFinished | EngineFailure
