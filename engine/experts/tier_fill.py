"""TierFill: fills the host-RAM tier's free slots from the disk in the background after load.

A tier that can hold the whole expert pool is otherwise filled on demand: the first turns after
a load read their misses from the disk (a 20-token prompt's TTFT 2.1-2.3 s on the H200 at a 50 %
device cache, against tens of ms once the tier holds the records). Named threads,
"dsv4-tier-fill-0".., read the records the tier lacks into its free slots:

    fill = TierFill(tier, keys, busy=lambda: pool.pending > 0, threads=4).start()
    fill.progress()   # (records filled, records it set out to fill)
    fill.stop()       # joins the threads (the owner calls it before closing the tier or the store)

* Several threads, because a record's first read is also checked against its sha256 (the
  store): one thread alternated disk and hash and filled at ~0.5 GB/s on the H200 (294 of 1,032
  records in a 10.6 s load); with FILL_THREADS reads the disk's own rate is the limit.
* It never evicts: it stops when the tier is full (a tier smaller than the pool keeps what it
  read first, and the cache policy takes over from there).
* It yields to demand reads: while `busy()` says the engine's I/O threads have work, it waits
  (a demand read waits at most for the records the filler's threads are reading).
* `keys`, the order of the fill: `fill_order` takes each layer's experts a block at a time
  across all layers, so that a tier smaller than the pool holds a share of every layer, and
  a layer's experts arrive together (one visit of the layer for a policy that follows the
  layer cycle, engine/experts/policy.py).
* A record that fails to read (I/O error, checksum) leaves the tier consistent (`done(key,
  ok=False)`) and stops every thread of the fill; `error` says why. Demand reads of that record then report it
  as they would without a filler.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Sequence

from engine.experts.cache import ExpertKey
from engine.experts.host_tier import HostTier

FILL_BLOCK = 32  # experts of one layer taken together (fill_order)
FILL_THREADS = 4  # reads (and checksums) in flight at once
YIELD_S = 0.002  # how long a filler thread waits before it looks at `busy` again


def fill_order(layers: Sequence[int], n_experts: int, block: int = FILL_BLOCK) -> list[ExpertKey]:
    """Every (layer, expert): experts [0, block) of each layer in turn, then [block, 2 block), ..."""
    return [(layer, e) for start in range(0, n_experts, block) for layer in layers
            for e in range(start, min(start + block, n_experts))]


class TierFill:
    """The background filler of one HostTier (module docstring). Start once; stop is idempotent."""

    def __init__(self, tier: HostTier, keys: Iterable[ExpertKey], busy: Callable[[], bool],
                 threads: int = FILL_THREADS, name: str = "dsv4-tier-fill") -> None:
        if threads < 1:
            raise ValueError(f"a tier fill needs at least one thread, got {threads}")
        self.tier, self.busy, self.name, self.size = tier, busy, name, threads
        self._keys = list(keys)
        self._next = iter(self._keys)
        self._lock = threading.Lock()  # guards _next, filled and error
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.filled = 0  # records this filler read into the tier
        self.error: str | None = None  # why the fill stopped early (a failed read)

    def start(self) -> "TierFill":
        if self._threads:
            raise RuntimeError(f"{self.name} was started already")
        self._threads = [threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True)
                         for i in range(self.size)]
        for t in self._threads:
            t.start()
        return self

    def progress(self) -> tuple[int, int]:
        """(records filled so far, records the fill set out to read)."""
        return self.filled, len(self._keys)

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def _take(self) -> ExpertKey | None:
        with self._lock:
            return None if self._stop.is_set() else next(self._next, None)

    def _run(self) -> None:
        while (key := self._take()) is not None:
            while self.busy():
                if self._stop.wait(YIELD_S):
                    return
            if self._stop.is_set() or self.tier.full:
                return
            slot = self.tier.claim_free(key)
            if slot is None:  # in the tier already, or being read by the engine
                continue
            try:
                self.tier.read(key, slot)
            except Exception as e:  # noqa: BLE001 - any failed read stops the fill, reported
                self.tier.done(key, ok=False)
                with self._lock:
                    if self.error is None:
                        self.error = (f"filling the host RAM tier stopped at expert {key[1]} of layer "
                                      f"{key[0]}: {e}")
                self._stop.set()
                return
            self.tier.done(key)
            with self._lock:
                self.filled += 1

    def stop(self) -> None:
        """Stop after the records being read, and join the threads."""
        self._stop.set()
        for t in self._threads:
            t.join()
