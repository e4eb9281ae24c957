"""Keeping Python's cyclic garbage collector off the streaming path.

A full (generation 2) collection walks every container object the process holds: torch,
Textual, the engine and the transcript. While an answer streams, those pauses were the slowest
keypresses (measured with `bench/ui_latency.py`: collections of 160–200 ms, p99 keypress latency
235–280 ms). Once the engine is ready, almost everything alive stays alive until exit, so the
app (the TUI, `--plain` and the server alike) moves it into the collector's permanent
generation (`gc.freeze`): later collections only walk what was created since. Objects frozen
still die by reference counting; only cycles among them outlive their use, so the app unfreezes
when it closes.
"""

from __future__ import annotations

import gc


class HeapFreeze:
    """Freeze the objects alive now (after one full collection); `release` undoes it."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze(self) -> int:
        """Collect, then freeze what survived. Returns the number of objects now frozen."""
        gc.collect()
        gc.freeze()
        self.frozen = True
        return gc.get_freeze_count()

    def release(self) -> None:
        """Hand the frozen objects back to the collector (no-op unless frozen)."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
