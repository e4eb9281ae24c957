"""The engine's own errors (engine.engine and engine.turn raise them)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine cannot be used as asked (closed, model directory unusable)."""
