"""Expert cache: which (layer, expert) records are resident, and in which arena slot.

Pure Python bookkeeping around an eviction policy (engine/experts/policy.py), no device memory. The device arena owns fixed-size slots
0..capacity-1; this object decides what occupies them. Every operation is O(1) except
`hottest`, `resident`, `flush` and `stats` (linear in what they return) and `unpin` under LFU
(linear in the number of distinct frequencies).

Flow on the decode path: `lookup(key)` -> slot (hit) or None (miss); on a miss the store
calls `admit(key)` -> (slot, evicted key or None), loads the record into that slot, and, if the
load fails, calls `discard(key)` to give the slot back. `admit` may also be called without a
prior miss (prefetch, e.g. hash layers 0-2).

Two ways to keep a key from eviction: `pin` (the user's `/pin`: the key leaves the eviction
policy until `unpin`) and `hold` (a provider's transient hold while a call uses the key, or
while a transfer reads or writes it: `release` ends it). Holding a resident key tells the
policy nothing (its lookups are its uses, as without the hold); only when the policy names a
held key as its victim does `admit` set it aside (out of the policy, and picks again) until its
release. A key admitted while held enters the policy at its release, with the uses made by
then (so a prefetch the route never asked for counts one use, when it is let go, as a hit
counts its use at its lookup). The hold/release pair of an expert a decode step finds resident
thus costs no policy work; as pin/unpin it cost a removal and a re-insertion.

Not thread-safe: call it from the engine thread only; `stats()` snapshots are immutable and
may be handed to the UI.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable

from engine.experts.policy import POLICIES, EvictionPolicy, ExpertKey


class ExpertCacheError(Exception):
    """Misuse of the expert cache (bad key, bad budget, too many pins, double admit)."""


class CacheFullError(ExpertCacheError):
    """Every slot holds a pinned expert, so nothing can be evicted to admit a new one."""


@dataclass(frozen=True)
class CacheStats:
    """Immutable snapshot of an ExpertCache's counters (since the last `reset_stats`)."""

    policy: str
    hits: int
    misses: int
    hit_rate: float  # hits / lookups, 0.0 before any lookup
    hit_rate_window: float  # over the last `window_lookups` lookups
    window_lookups: int
    evictions: int  # capacity evictions by `admit` (not flush/discard)
    flushed: int  # keys evicted by `flush` (a user's "evicted" figure is evictions + flushed)
    admissions: int
    bytes_read: int  # admissions * entry_bytes: what the store streamed in
    entries: int
    pinned: int  # pinned and resident
    pinned_pending: int  # pinned, not yet resident (loaded on next use)
    used_bytes: int
    capacity_bytes: int  # the budget given
    capacity_entries: int  # slots
    entry_bytes: int
    layer_hits: tuple[int, ...]  # [num_layers]
    layer_misses: tuple[int, ...]  # [num_layers]

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    @property
    def per_layer_hit_rate(self) -> tuple[float, ...]:
        """Cumulative hit rate per layer, 0.0 for a layer not looked up yet."""
        return tuple(h / (h + m) if h + m else 0.0 for h, m in zip(self.layer_hits, self.layer_misses))


def add_per_layer(counts: list[int], keys: list[ExpertKey]) -> None:
    """counts[layer] += the number of `keys` of that layer, for the layers `counts` has."""
    per_layer = Counter(layer for layer, _ in keys)
    for layer in per_layer.keys() & range(len(counts)):
        counts[layer] += per_layer[layer]


class _Unranked:
    """The policy of a cache with a slot for every key: such a cache never evicts, so it never
    asks for a victim, and the policy it was given is told nothing (a whole-mode decode step's 258
    lookups then cost no policy work). Keeps that policy's name for the statistics."""

    def __init__(self, name: str) -> None:
        self.name = name

    def add(self, key: ExpertKey, count: int = 1) -> None:
        pass

    def touch(self, key: ExpertKey) -> None:
        pass

    def discard(self, key: ExpertKey) -> None:
        pass

    def victim(self) -> ExpertKey | None:
        return None

    def __len__(self) -> int:
        return 0

    def __contains__(self, key: object) -> bool:
        return False


class ExpertCache:
    """Slots, byte budget, pinning and statistics around an eviction policy.

    capacity_slots = capacity_bytes // entry_bytes; slot ids 0..capacity_slots-1, freed slots
    are reused. Pinned keys are never evicted; pinning a key that is not resident marks it
    pending: it is pinned as soon as it is admitted (the `/pin L:E` behaviour: loads on next
    use, then never evicts). At most capacity_slots keys can be pinned.

    `pool_layers`: the layers 0..pool_layers-1 whose keys its user routes, the pool (default
    every layer; the engine passes its main layers, the key range also covering the MTP block's
    row, which it never routes). A cache with a slot for every key of the pool never evicts for
    them, so it runs without an eviction policy (nothing to rank; `lookup_many` of resident keys
    does no policy work), and admits a key beyond the pool only into a spare slot (one no key of
    the pool can need), else ExpertCacheError naming the fix: it could never be evicted.
    """

    def __init__(
        self,
        capacity_bytes: int,
        entry_bytes: int,
        *,
        num_layers: int,
        num_experts: int,
        policy: str | Callable[[int], EvictionPolicy] = "lfu",
        window: int = 1024,
        pool_layers: int | None = None,
    ) -> None:
        if entry_bytes <= 0:
            raise ExpertCacheError(f"entry_bytes must be positive, got {entry_bytes}")
        if capacity_bytes < entry_bytes:
            raise ExpertCacheError(
                f"expert cache budget of {capacity_bytes} bytes is smaller than one expert "
                f"record ({entry_bytes} bytes); give the cache at least one record's worth"
            )
        if num_layers <= 0 or num_experts <= 0 or window <= 0:
            raise ExpertCacheError(
                f"num_layers, num_experts and window must be positive, got "
                f"{num_layers}, {num_experts}, {window}"
            )
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ExpertCacheError(
                    f"unknown cache policy {policy!r}; choose one of {sorted(POLICIES)}"
                )
            policy = POLICIES[policy]
        self.capacity_bytes = capacity_bytes
        self.entry_bytes = entry_bytes
        self.capacity_slots = capacity_bytes // entry_bytes
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window = window
        self.pool_layers = num_layers if pool_layers is None else pool_layers
        if not 0 < self.pool_layers <= num_layers:
            raise ExpertCacheError(f"pool_layers must be in [1, {num_layers}], got {pool_layers}")
        self.pool = self.pool_layers * num_experts  # the keys its user routes
        self._ranked = self.capacity_slots < self.pool  # else it never evicts (for the pool's keys)
        given = policy(self.capacity_slots)
        self._policy: EvictionPolicy = given if self._ranked else _Unranked(given.name)
        self._slots: dict[ExpertKey, int] = {}
        self._per_layer = [0] * num_layers  # resident keys of each layer
        self._uses: Counter[ExpertKey] = Counter()  # uses since admission, resident keys only
        self._free: list[int] = list(range(self.capacity_slots - 1, -1, -1))  # pop() -> 0 first
        self._pinned: set[ExpertKey] = set()
        self._held: set[ExpertKey] = set()  # transient holds (`hold`)
        self._suspended: set[ExpertKey] = set()  # held keys out of the policy since it named them victims
        self._history: Counter[ExpertKey] = Counter()  # all-time lookups, survives eviction
        self.reset_stats()

    @property
    def policy_name(self) -> str:
        return self._policy.name

    def _check(self, key: ExpertKey) -> ExpertKey:
        layer, expert = key
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise ExpertCacheError(
                f"expert key {key!r} out of range: layer must be in [0, {self.num_layers}) "
                f"and expert in [0, {self.num_experts})"
            )
        return key

    def lookup(self, key: ExpertKey) -> int | None:
        """Slot of `key` if resident (a hit, counts as a use), else None (a miss)."""
        slot = self._slots.get(self._check(key))
        hit = slot is not None
        self._history[key] += 1
        if len(self._window) == self.window:
            self._window_hits -= self._window[0]
        self._window.append(hit)
        self._window_hits += hit
        if hit:
            self._hits += 1
            self._layer_hits[key[0]] += 1
            self._uses[key] += 1
            if key not in self._pinned and key not in self._suspended:
                self._policy.touch(key)
        else:
            self._misses += 1
            self._layer_misses[key[0]] += 1
        return slot

    def lookup_many(self, keys: list[ExpertKey]) -> list[int | None]:
        """`lookup` of each key in order, as one call: the same slots, statistics and policy
        uses, with the bookkeeping done per call rather than per key (a whole-mode decode step
        looks up every layer's experts at once, after the step: DecodeRunner)."""
        num_layers, num_experts = self.num_layers, self.num_experts
        if not all(0 <= layer < num_layers and 0 <= expert < num_experts for layer, expert in keys):
            for key in keys:
                self._check(key)  # raises, naming the first key out of range
        get = self._slots.get
        slots = [get(key) for key in keys]
        hits = [slot is not None for slot in slots]
        self._history.update(keys)
        window, n = self._window, len(hits)
        if n >= self.window:
            self._window_hits = sum(hits[n - self.window:])
        else:
            drop = len(window) + n - self.window  # the oldest entries the new ones push out
            if drop > 0:
                self._window_hits -= sum(islice(window, drop))
            self._window_hits += sum(hits)
        window.extend(hits)
        found = sum(hits)
        self._hits += found
        self._misses += n - found
        layer_hits, layer_misses, uses = self._layer_hits, self._layer_misses, self._uses
        if found == n and not self._ranked:  # every key resident, no policy to tell
            uses.update(keys)
            add_per_layer(layer_hits, keys)
            return slots
        pinned, suspended, touch = self._pinned, self._suspended, self._policy.touch
        for key, hit in zip(keys, hits):
            if hit:
                layer_hits[key[0]] += 1
                uses[key] += 1
                if key not in pinned and key not in suspended:
                    touch(key)
            else:
                layer_misses[key[0]] += 1
        return slots

    def touch(self, key: ExpertKey) -> bool:
        """Tell the policy that resident, unpinned `key` was used without a lookup (no hit or miss
        is counted); False when `key` is not resident."""
        if key not in self._slots:
            return False
        if key not in self._pinned and key not in self._suspended:
            self._policy.touch(key)
        return True

    def peek(self, key: ExpertKey) -> int | None:
        """Slot of `key` if resident, else None; changes no statistics or order."""
        return self._slots.get(key)

    def contains(self, key: ExpertKey) -> bool:
        return key in self._slots

    __contains__ = contains

    def admit(self, key: ExpertKey) -> tuple[int, ExpertKey | None]:
        """Make `key` resident: returns (its slot, the key evicted to free it or None).

        Raises ExpertCacheError if `key` is already resident, CacheFullError if every slot
        is pinned.
        """
        if self._check(key) in self._slots:
            raise ExpertCacheError(f"expert {key!r} is already resident in slot {self._slots[key]}")
        if not self._ranked and key[0] >= self.pool_layers:
            beyond = sum(self._per_layer[self.pool_layers:])
            if len(self._free) <= self.pool - (len(self._slots) - beyond):  # it would take a pool key's slot
                raise ExpertCacheError(
                    f"expert {key!r} is outside this cache's pool (layers 0-{self.pool_layers - 1}, every "
                    f"expert of which has a slot, so none is ever evicted) and no spare slot is left; give "
                    f"the cache a budget of more than {self.pool + beyond} records to also hold it"
                )
        evicted = None
        if not self._free:
            evicted = self._policy.victim()
            while evicted is not None and evicted in self._held:  # out of the policy until released
                self._policy.discard(evicted)
                self._suspended.add(evicted)
                evicted = self._policy.victim()
            if evicted is None:
                raise CacheFullError(
                    f"cannot admit expert {key!r}: all {self.capacity_slots} slots hold pinned "
                    f"or held experts; unpin some or give the cache a larger budget"
                )
            self._remove(evicted)
            self._evictions += 1
        slot = self._free.pop()
        self._slots[key] = slot
        self._per_layer[key[0]] += 1
        self._uses[key] = 1
        if key in self._held:  # the policy hears of it at its release, with the uses made by then
            self._suspended.add(key)
        elif key not in self._pinned:
            self._policy.add(key)
        self._admissions += 1
        return slot, evicted

    def _remove(self, key: ExpertKey) -> int:
        slot = self._slots.pop(key)
        self._per_layer[key[0]] -= 1
        del self._uses[key]
        self._suspended.discard(key)
        if key in self._policy:
            self._policy.discard(key)
        self._free.append(slot)
        return slot

    def discard(self, key: ExpertKey) -> int | None:
        """Drop `key` if resident (e.g. its load failed); returns the freed slot or None.

        A pinned key stays pinned (pending) and is pinned again when next admitted.
        """
        return self._remove(key) if key in self._slots else None

    def pin(self, key: ExpertKey) -> bool:
        """Pin `key`; True if it is resident now, False if it is pinned on its next admission.

        Idempotent. Raises ExpertCacheError when capacity_slots keys are already pinned.
        """
        if self._check(key) in self._pinned:
            return key in self._slots
        if len(self._pinned) >= self.capacity_slots:
            raise ExpertCacheError(
                f"cannot pin expert {key!r}: all {self.capacity_slots} slots are already "
                f"pinned; unpin some first"
            )
        self._pinned.add(key)
        self._suspended.discard(key)
        if key in self._policy:
            self._policy.discard(key)
        return key in self._slots

    def unpin(self, key: ExpertKey) -> bool:
        """Unpin `key`; returns whether it was pinned. A resident key becomes evictable again,
        keeping its uses since admission (as the most recent among equals); a held one once
        released."""
        if key not in self._pinned:
            return False
        self._pinned.remove(key)
        if key in self._slots:
            self._restore(key)
        return True

    def _restore(self, key: ExpertKey) -> None:
        """Give resident, unpinned `key` back to the policy (now, or at its release if held)."""
        if key in self._held:
            self._suspended.add(key)
        else:
            self._policy.add(key, self._uses[key])

    def hold(self, key: ExpertKey) -> None:
        """Keep `key` from eviction until `release(key)`, without telling the policy (module
        docstring); it may be resident or about to be admitted. Idempotent. Raises
        ExpertCacheError when capacity_slots keys are already pinned or held (a pinned key
        takes no further slot)."""
        if self._check(key) in self._held:
            return
        if key not in self._pinned and len(self._pinned) + len(self._held) >= self.capacity_slots:
            raise ExpertCacheError(
                f"cannot hold expert {key!r}: all {self.capacity_slots} slots are pinned or held"
            )
        self._held.add(key)

    def release(self, key: ExpertKey) -> bool:
        """End the hold of `key`; returns whether it was held. A key the policy named as a
        victim while held goes back to it (as `unpin` does)."""
        if key not in self._held:
            return False
        self._held.remove(key)
        if key in self._suspended:
            self._suspended.remove(key)
            if key in self._slots and key not in self._pinned:
                self._restore(key)
        return True

    def held(self) -> frozenset[ExpertKey]:
        """The keys held now (`hold`), resident or about to be admitted."""
        return frozenset(self._held)

    def holds(self, key: ExpertKey) -> bool:
        """Whether `key` is held now (`hold`)."""
        return key in self._held

    def unpin_all(self) -> list[ExpertKey]:
        """Unpin every pinned key (the `/unpin` command without a list); returns them."""
        keys = sorted(self._pinned)
        for key in keys:
            self.unpin(key)
        return keys

    def pinned(self) -> frozenset[ExpertKey]:
        """All pinned keys, resident or pending."""
        return frozenset(self._pinned)

    def flush(self) -> list[ExpertKey]:
        """Evict every resident key neither pinned nor held; returns them."""
        evicted = [k for k in self._slots if k not in self._pinned and k not in self._held]
        for key in evicted:
            self._remove(key)
        self._flushed += len(evicted)
        return evicted

    def hottest(self, n: int) -> list[ExpertKey]:
        """The n keys looked up most often so far (all time, including evicted ones)."""
        return [key for key, _ in self._history.most_common(n)]

    def resident(self) -> dict[ExpertKey, int]:
        """Copy of the key -> slot map."""
        return dict(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def resident_in(self, layer: int) -> int:
        """How many experts of `layer` are resident (O(1))."""
        return self._per_layer[layer]

    def stats(self) -> CacheStats:
        lookups = self._hits + self._misses
        pinned_resident = sum(1 for k in self._pinned if k in self._slots)
        return CacheStats(
            policy=self._policy.name,
            hits=self._hits,
            misses=self._misses,
            hit_rate=self._hits / lookups if lookups else 0.0,
            hit_rate_window=self._window_hits / len(self._window) if self._window else 0.0,
            window_lookups=len(self._window),
            evictions=self._evictions,
            flushed=self._flushed,
            admissions=self._admissions,
            bytes_read=self._admissions * self.entry_bytes,
            entries=len(self._slots),
            pinned=pinned_resident,
            pinned_pending=len(self._pinned) - pinned_resident,
            used_bytes=len(self._slots) * self.entry_bytes,
            capacity_bytes=self.capacity_bytes,
            capacity_entries=self.capacity_slots,
            entry_bytes=self.entry_bytes,
            layer_hits=tuple(self._layer_hits),
            layer_misses=tuple(self._layer_misses),
        )

    def reset_stats(self, *, history: bool = False) -> None:
        """Zero the counters and the window; with history=True also forget `hottest` counts."""
        self._hits = self._misses = self._evictions = self._flushed = self._admissions = 0
        self._layer_hits = [0] * self.num_layers
        self._layer_misses = [0] * self.num_layers
        self._window: deque[bool] = deque(maxlen=self.window)
        self._window_hits = 0
        if history:
            self._history.clear()
