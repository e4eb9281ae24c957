"""HostTier: the host-RAM tier between the disk and a device arena (GPU arena <- RAM <- disk).

Fixed-size record slots in one host allocation of `budget_bytes // record_bytes` records
(page-locked when CUDA is available, engine/experts/page_locked.py, so that a slot is the source
of one asynchronous host->device copy; 4 KiB aligned, so that O_DIRECT disk reads land in a slot
directly; `close()` unlocks it). Which records it
holds is decided by its own ExpertCache (its own eviction policy instance, its own hit/miss
counters); it never holds more than its budget. On the CPU (and on unified memory) there is no
such tier: the arena itself is in RAM and is filled by direct reads.

Protocol (bookkeeping on the engine thread, bytes on the I/O threads):

    got = tier.hold(key)        # engine thread: (slot, must_read) or None when every slot is held
    tier.read(key, slot)        # I/O thread, only when must_read: disk -> slot
    ... copy tier.data[slot] to the device ...
    tier.done(key, ok)          # engine thread: releases the slot; ok=False (a failed read) drops it

A held slot is never evicted nor reassigned, so a transfer from or into it cannot race another
key's. A failed read leaves the key out of the tier, its slot free, nothing held.

A background filler (engine/experts/tier_fill.py) takes free slots from its own threads:

    slot = tier.claim_free(key)  # a filler thread: a free slot held for key, or None
    tier.read(key, slot); tier.done(key, ok)

so the bookkeeping methods take one lock (uncontended but for the filler's few calls); the
slot bytes are never touched under it.
"""

from __future__ import annotations

import threading

import torch

from engine.experts.cache import CacheFullError, CacheStats, ExpertCache, ExpertCacheError, ExpertKey
from engine.experts.page_locked import PageLocked, PinError
from engine.experts.store import ExpertStore, aligned_empty


class HostTier:
    """Record slots in host RAM over an ExpertStore (module docstring)."""

    def __init__(self, store: ExpertStore, budget_bytes: int, *, num_layers: int, policy: str = "lru",
                 pin_memory: bool | None = None):
        """`budget_bytes`: the most host memory the slots may take (at least one record);
        `pin_memory`: page-locked slots (default: when CUDA is available)."""
        record = store.record_bytes
        if budget_bytes < record:
            raise ExpertCacheError(f"host cache budget of {budget_bytes} bytes is smaller than one expert record "
                                   f"({record} bytes); give it at least one record or none at all")
        self.store = store
        self.cache = ExpertCache(budget_bytes, record, num_layers=num_layers, num_experts=store.count, policy=policy)
        self.pinned_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        nbytes = self.cache.capacity_slots * record
        self._locked = PageLocked(nbytes) if self.pinned_memory else None
        flat = aligned_empty(nbytes) if self._locked is None else self._locked.tensor
        self.data = flat.view(self.cache.capacity_slots, record)
        self._views = [memoryview(self.data[s].numpy()) for s in range(self.slots)]
        self._lock = threading.Lock()  # the bookkeeping: the engine thread's and the filler's

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        """Host bytes of the slots (never above the budget)."""
        return self.data.numel()

    def hold(self, key: ExpertKey) -> tuple[int, bool] | None:
        """Reserve `key`'s slot for one transfer: (slot, True) when its bytes must be read from
        the disk first (a miss: admitted, evicting the least valuable unheld record), (slot,
        False) on a RAM hit; None when every slot is held (read past the tier) or `key` is
        already held. Counts a lookup in the tier's statistics."""
        with self._lock:
            if self.cache.holds(key):  # a transfer of it is in flight
                return None
            slot = self.cache.lookup(key)
            must_read = slot is None
            if must_read:
                try:
                    slot, _ = self.cache.admit(key)
                except CacheFullError:
                    return None
            self.cache.hold(key)
            return slot, must_read

    def claim_free(self, key: ExpertKey) -> int | None:
        """For a background fill: admit `key` into a free slot and hold it (read it, then
        `done`); None when `key` is already in the tier or no slot is free. Never evicts and
        counts no lookup."""
        with self._lock:
            if key in self.cache or self.full:
                return None
            slot, _ = self.cache.admit(key)
            self.cache.hold(key)
            return slot

    @property
    def full(self) -> bool:
        """Every slot holds a record (held or not)."""
        return len(self.cache) >= self.cache.capacity_slots

    def read(self, key: ExpertKey, slot: int) -> None:
        """Runs on an I/O thread: record `key` from the disk into `slot` (checked by the store)."""
        self.store.read_into(key[0], key[1], self._views[slot])

    def refresh(self, key: ExpertKey) -> None:
        """The device cache dropped `key`: if the tier holds it, that is a use (the next miss of
        `key` comes here). Without it, a record the device holds for long turns into the tier's
        least recently used and leaves the tier just before the device drops it too (trace
        replay, bench/tier_replay.py: at a 50 % cache with uniform routing, 53 % of the device's
        misses were RAM hits without, 61 % with)."""
        with self._lock:
            self.cache.touch(key)

    def done(self, key: ExpertKey, ok: bool = True) -> None:
        """End the transfer of `hold(key)`; when it failed (`ok` False) the key leaves the tier."""
        with self._lock:
            if not self.cache.release(key):
                raise ExpertCacheError(f"expert {key!r} is not held in the host tier")
            if not ok:
                self.cache.discard(key)

    def held(self) -> frozenset[ExpertKey]:
        with self._lock:
            return self.cache.held()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self.cache

    def flush(self) -> list[ExpertKey]:
        """Drop every record not in transfer; returns them."""
        with self._lock:
            return self.cache.flush()

    def stats(self) -> CacheStats:
        with self._lock:
            return self.cache.stats()

    def reset_stats(self) -> None:
        """Zero the counters (what the tier holds, and its policy's history, stay)."""
        with self._lock:
            self.cache.reset_stats()

    def close(self) -> None:
        """Unlock the slots' memory (no transfer may be in flight; the owner has joined them).
        Idempotent; the tier's records stay readable."""
        if self._locked is not None:
            self._locked.close()


def pinned_tier(store: ExpertStore, budget_bytes: int, *, num_layers: int, policy: str = "lru",
                make=HostTier) -> HostTier | None:
    """A HostTier (`make`) of `budget_bytes`, or of half that, and so on, when its page-locked
    allocation fails: the memory the system lets a process pin can be less than its free RAM
    (container limits, locked-memory caps), which no probe sees. None when not even one record
    can be pinned. Other errors propagate."""
    while budget_bytes >= store.record_bytes:
        try:
            return make(store, budget_bytes, num_layers=num_layers, policy=policy)
        except PinError:
            budget_bytes //= 2
    return None
