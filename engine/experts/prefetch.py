"""Prefetch accounting: what prefetch hints predicted, which reads they started, and whether the
real route then used them in time (issue 27 item 3).

Two sources of hints reach an ExpertProvider (engine/experts/provider.py):

* "hash": the hash layers' experts, known exactly from the token ids (`prefetch`);
* "lookahead": layer L+1's gate applied to layer L's MoE input (`Transformer.predict_next`,
  handed over by `prefetch_predicted`), a prediction.

Per source the ledger counts, at the moment the real route of the hinted layer asks for its
experts (`route`):

* `predicted` / `routed`: the distinct experts the route asked for on a hinted layer, and how
  many of them the hint named (`accuracy`; per call: a one-token decode call counts each of its
  k choices, a prefill call the union of its tokens' choices);
* `issued`: reads a hint started (the expert was not resident); of those, `used` were asked for
  by the route while still resident: `in_time` had arrived, `in_flight` were still being read
  (the route waited, less than a miss would have); `unused` were not asked for, were evicted
  first, or were forgotten by a flush;
* `skipped`: reads a lookahead hint did not start because its gate (engine/experts/hint_gate.py)
  was closed; of those, `skipped_used` were asked for by the route (they would have been used).
  Every lookahead read, started or skipped, is settled into the gate as used or not.

Engine-thread bookkeeping only (like ExpertCache): not thread-safe.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

from engine.experts.hint_gate import HintGate

ExpertKey = tuple[int, int]
SOURCES = ("hash", "lookahead")
_FIELDS = ("hinted", "issued", "used", "in_time", "in_flight", "unused", "predicted", "routed", "skipped",
           "skipped_used")
GATED = "lookahead"  # the source whose reads a HintGate allows (hash hints are exact)


@dataclass(frozen=True)
class PrefetchStats:
    """One source's counters (module docstring)."""

    source: str
    hinted: int = 0  # (layer, expert) hints given, resident or not
    issued: int = 0  # reads started by a hint
    used: int = 0  # issued reads the route then asked for (in_time + in_flight)
    in_time: int = 0
    in_flight: int = 0
    unused: int = 0
    predicted: int = 0  # distinct routed experts the hint named
    routed: int = 0  # distinct experts the route asked for on hinted layers
    skipped: int = 0  # reads not started: the hint gate was closed
    skipped_used: int = 0  # skipped reads the route then asked for

    @property
    def accuracy(self) -> float:
        """Share of the routed experts the hints named (nan before any hinted layer ran)."""
        return self.predicted / self.routed if self.routed else float("nan")

    def line(self) -> str:
        return (f"{self.source} prefetch: accuracy {self.accuracy:.1%} ({self.predicted}/{self.routed}), "
                f"{self.issued} reads issued, {self.used} used ({self.in_time} in time, {self.in_flight} in flight), "
                f"{self.unused} unused" + (f", {self.skipped} skipped ({self.skipped_used} would have been used)"
                                           if self.skipped else ""))


class PrefetchLedger:
    """Pending hints per layer and the counters per source (module docstring)."""

    def __init__(self, gate: HintGate | None = None) -> None:
        """`gate`: decides whether lookahead hints may start reads (default: a HintGate())."""
        self._counts = {s: Counter() for s in SOURCES}
        self._predicted: dict[int, tuple[str, set[int]]] = {}  # layer -> (source, predicted experts)
        self._reads: dict[ExpertKey, str] = {}  # reads issued by a hint, not yet settled -> source
        self._skipped: set[ExpertKey] = set()  # lookahead reads the closed gate skipped, not yet settled
        self.gate = HintGate() if gate is None else gate

    def may_read(self, source: str) -> bool:
        """Whether a hint of `source` may start reads now (hash: always; lookahead: its gate)."""
        return source != GATED or self.gate.open

    def skipped(self, key: ExpertKey) -> None:
        """A lookahead hint did not start the read of `key` (`may_read` was False)."""
        if key not in self._skipped:
            self._counts[GATED]["skipped"] += 1
            self._skipped.add(key)

    def predict(self, layer: int, ids: Iterable[int], source: str) -> None:
        """A hint for `layer` named these experts (counted against its next route)."""
        ids = {int(i) for i in ids}
        old = self._predicted.get(layer)
        if old is not None and old[0] == source:
            ids |= old[1]
        self._predicted[layer] = (source, ids)
        self._counts[source]["hinted"] += len(ids) - (len(old[1]) if old is not None and old[0] == source else 0)

    def issued(self, key: ExpertKey, source: str) -> None:
        """A hint started the read of `key`."""
        if key not in self._reads:
            self._counts[source]["issued"] += 1
        self._reads[key] = source

    def route(self, layer: int, ids: Iterable[int], arrival: Callable[[ExpertKey], str]) -> None:
        """The real route of `layer` asks for `ids`: settle the layer's hints. `arrival(key)` says
        where an issued read stands now: "in_time", "in_flight" or "gone" (not resident)."""
        ids = {int(i) for i in ids}
        hint = self._predicted.pop(layer, None)
        if hint is not None:
            c = self._counts[hint[0]]
            c["routed"] += len(ids)
            c["predicted"] += len(ids & hint[1])
        for key in [k for k in self._reads if k[0] == layer]:
            source = self._reads.pop(key)
            c = self._counts[source]
            state = arrival(key) if key[1] in ids else "gone"
            if state == "gone":
                c["unused"] += 1
            else:
                c["used"] += 1
                c[state] += 1
            if source == GATED:
                self.gate.outcome(state != "gone")
        for key in [k for k in self._skipped if k[0] == layer]:
            self._skipped.remove(key)
            used = key[1] in ids
            self._counts[GATED]["skipped_used"] += used
            self.gate.outcome(used)

    def forget(self) -> None:
        """Drop every pending hint (a flush): issued reads count as unused; the gate starts over
        (open: after a flush the cache holds nothing and guesses pay again)."""
        for source in self._reads.values():
            self._counts[source]["unused"] += 1
        self._reads.clear()
        self._skipped.clear()
        self._predicted.clear()
        self.gate.reset()

    def stats(self) -> dict[str, PrefetchStats]:
        return {s: PrefetchStats(s, **{f: self._counts[s][f] for f in _FIELDS}) for s in SOURCES}
