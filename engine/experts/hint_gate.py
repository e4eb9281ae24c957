"""HintGate: whether router-lookahead hints may start reads, from how often recent ones were used.

A lookahead hint (engine/experts/prefetch.py, "lookahead") reads the predicted experts that are
not resident. When the cache already holds nearly every expert the route asks for, a right
guess is resident anyway and the reads a hint starts are mostly its wrong guesses: they take
the host-to-device link from the misses' own copies and evict experts that are needed later,
and save nothing. So the gate watches the outcome of the last `window` would-be reads — a read
a hint started, or one it skipped while the gate was closed, settled by the route of its layer
as used (asked for) or not — and closes when fewer than `low` of them were used, reopening
once `high` are (hysteresis: a share near one threshold does not flip it every step). Skipped
reads keep being settled while it is closed, so it reopens when the guesses start to pay
(after a flush, say, or when the conversation moves to experts the cache does not hold). It
decides nothing before `least` outcomes.

The figure behind it (`python -m bench.lookahead_replay route_W130.csv --slots 1024,3700,8000
--accuracy off,0.5,0.88 --gate both --warm 1`, a warm cache, stand-in predictors): a hint right
half the time, ungated, read 2.5-5.4 times the bytes of no hints at 1,024 and 3,700 slots (9 and
36 % of the pool) for 0.134 and 0.007 fewer misses a routed use; gated, no more than without
hints. Right 88 % of the time the gate stays open there (56-71 % of the reads used); at 8,000
slots, where every routed expert is cached, it closes after 168 reads, against 1,185 ungated.

Engine-thread bookkeeping only: not thread-safe.
"""

from __future__ import annotations

from collections import deque


class HintGate:
    """Open (hint reads allowed) or closed, from the used share of the last `window` outcomes."""

    def __init__(self, window: int = 512, low: float = 0.25, high: float = 0.35, least: int = 128):
        if not 0 < least <= window:
            raise ValueError(f"a hint gate needs 0 < least <= window, got least={least}, window={window}")
        if not 0 <= low <= high <= 1:
            raise ValueError(f"a hint gate needs 0 <= low <= high <= 1, got low={low}, high={high}")
        self.window, self.low, self.high, self.least = window, low, high, least
        self._outcomes: deque[bool] = deque(maxlen=window)
        self._used = 0  # True entries in _outcomes
        self.open = True

    def outcome(self, used: bool) -> None:
        """One would-be read settled: `used` when the route asked for it."""
        if len(self._outcomes) == self.window:
            self._used -= self._outcomes[0]
        self._outcomes.append(used)
        self._used += used
        if len(self._outcomes) < self.least:
            return
        share = self._used / len(self._outcomes)
        if self.open and share < self.low:
            self.open = False
        elif not self.open and share >= self.high:
            self.open = True

    @classmethod
    def never_closing(cls) -> HintGate:
        """A gate that lets every hint read (low = 0: no share is below it), for comparisons."""
        return cls(low=0.0, high=0.0)

    @property
    def used_share(self) -> float:
        """The used share of the outcomes in the window (nan before any)."""
        return self._used / len(self._outcomes) if self._outcomes else float("nan")

    def reset(self) -> None:
        """Forget every outcome and open (a flush: the cache's contents start over)."""
        self._outcomes.clear()
        self._used = 0
        self.open = True
