"""Expert-cache policy: which (layer, expert) records are resident, and in which arena slot.

Pure Python bookkeeping, no device memory. The device arena owns fixed-size slots
0..capacity-1; this object decides what occupies them. Every operation is O(1) except
`hottest`, `resident`, `flush` and `stats` (linear in what they return) and `unpin` under LFU
(linear in the number of distinct frequencies).

Flow on the decode path: `lookup(key)` -> slot (hit) or None (miss); on a miss the store
calls `admit(key)` -> (slot, evicted key or None), loads the record into that slot, and, if the
load fails, calls `discard(key)` to give the slot back. `admit` may also be called without a
prior miss (prefetch, e.g. hash layers 0-2).

Not thread-safe: call it from the engine thread only; `stats()` snapshots are immutable and
may be handed to the UI.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Protocol

ExpertKey = tuple[int, int]  # (layer, expert)


class ExpertCacheError(Exception):
    """Misuse of the expert cache (bad key, bad budget, too many pins, double admit)."""


class CacheFullError(ExpertCacheError):
    """Every slot holds a pinned expert, so nothing can be evicted to admit a new one."""


class EvictionPolicy(Protocol):
    """Eviction order over the resident, *unpinned* keys (pinned keys are never in it).

    `add(key, count)`: key becomes evictable, having been used `count` times since admission.
    `touch(key)`: key was used again. `discard(key)`: key leaves. `victim()`: the key to
    evict next (not removed), or None when empty.
    """

    name: str

    def add(self, key: ExpertKey, count: int = 1) -> None: ...
    def touch(self, key: ExpertKey) -> None: ...
    def discard(self, key: ExpertKey) -> None: ...
    def victim(self) -> ExpertKey | None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used: evicts the key whose last use is oldest."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first

    def add(self, key: ExpertKey, count: int = 1) -> None:
        self._order[key] = None

    def touch(self, key: ExpertKey) -> None:
        self._order.move_to_end(key)

    def discard(self, key: ExpertKey) -> None:
        del self._order[key]

    def victim(self) -> ExpertKey | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class _FreqNode:
    """One frequency bucket in LFUPolicy's doubly linked list (keys oldest-entered first)."""

    __slots__ = ("freq", "keys", "prev", "next")

    def __init__(self, freq: int) -> None:
        self.freq = freq
        self.keys: OrderedDict[ExpertKey, None] = OrderedDict()
        self.prev: _FreqNode = self
        self.next: _FreqNode = self


class LFUPolicy:
    """Least frequently used (uses since admission); ties -> least recently used.

    O(1) LFU (Shah, Mitra, Matani 2010): a circular doubly linked list of frequency buckets in
    increasing frequency, each an ordered dict of keys in the order they entered the bucket,
    which is the order of their last use.
    """

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        self._head = _FreqNode(0)  # sentinel: head.next is the lowest-frequency bucket
        self._node_of: dict[ExpertKey, _FreqNode] = {}

    def _insert_after(self, node: _FreqNode, freq: int) -> _FreqNode:
        new = _FreqNode(freq)
        new.prev, new.next = node, node.next
        node.next.prev = new
        node.next = new
        return new

    def _unlink_if_empty(self, node: _FreqNode) -> None:
        if not node.keys:
            node.prev.next = node.next
            node.next.prev = node.prev

    def add(self, key: ExpertKey, count: int = 1) -> None:
        if count < 1:
            raise ExpertCacheError(f"LFU count must be >= 1, got {count}")
        prev = self._head
        while prev.next is not self._head and prev.next.freq < count:
            prev = prev.next
        node = prev.next if prev.next.freq == count else self._insert_after(prev, count)
        node.keys[key] = None
        self._node_of[key] = node

    def touch(self, key: ExpertKey) -> None:
        node = self._node_of[key]
        nxt = node.next
        if nxt is self._head or nxt.freq != node.freq + 1:
            nxt = self._insert_after(node, node.freq + 1)
        del node.keys[key]
        nxt.keys[key] = None
        self._node_of[key] = nxt
        self._unlink_if_empty(node)

    def discard(self, key: ExpertKey) -> None:
        node = self._node_of.pop(key)
        del node.keys[key]
        self._unlink_if_empty(node)

    def victim(self) -> ExpertKey | None:
        first = self._head.next
        return None if first is self._head else next(iter(first.keys))

    def __len__(self) -> int:
        return len(self._node_of)

    def __contains__(self, key: object) -> bool:
        return key in self._node_of


class SLRUPolicy:
    """Segmented LRU: new keys enter probation; a second use promotes to protected.

    The protected segment holds at most `protected_fraction` of capacity; its overflow is
    demoted to the most recent end of probation. Victims come from probation's LRU end, or
    from protected's when probation is empty.
    """

    name = "slru"

    def __init__(self, capacity: int, protected_fraction: float = 0.8) -> None:
        if not 0.0 <= protected_fraction <= 1.0:
            raise ExpertCacheError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        self._protected_cap = int(capacity * protected_fraction)
        self._probation: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._protected: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first

    def _protect(self, key: ExpertKey) -> None:
        self._protected[key] = None
        while len(self._protected) > self._protected_cap:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def add(self, key: ExpertKey, count: int = 1) -> None:
        if count >= 2:
            self._protect(key)
        else:
            self._probation[key] = None

    def touch(self, key: ExpertKey) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
        else:
            del self._probation[key]
            self._protect(key)

    def discard(self, key: ExpertKey) -> None:
        if key in self._protected:
            del self._protected[key]
        else:
            del self._probation[key]

    def victim(self) -> ExpertKey | None:
        segment = self._probation or self._protected
        return next(iter(segment), None)

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lfu": LFUPolicy,
    "lru": LRUPolicy,
    "slru": SLRUPolicy,
}


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


class ExpertCache:
    """Slots, byte budget, pinning and statistics around an eviction policy.

    capacity_slots = capacity_bytes // entry_bytes; slot ids 0..capacity_slots-1, freed slots
    are reused. Pinned keys are never evicted; pinning a key that is not resident marks it
    pending: it is pinned as soon as it is admitted (the `/pin L:E` behaviour: loads on next
    use, then never evicts). At most capacity_slots keys can be pinned.
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
        self._policy: EvictionPolicy = policy(self.capacity_slots)
        self._slots: dict[ExpertKey, int] = {}
        self._uses: dict[ExpertKey, int] = {}  # uses since admission, resident keys only
        self._free: list[int] = list(range(self.capacity_slots - 1, -1, -1))  # pop() -> 0 first
        self._pinned: set[ExpertKey] = set()
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
            if key not in self._pinned:
                self._policy.touch(key)
        else:
            self._misses += 1
            self._layer_misses[key[0]] += 1
        return slot

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
        evicted = None
        if not self._free:
            evicted = self._policy.victim()
            if evicted is None:
                raise CacheFullError(
                    f"cannot admit expert {key!r}: all {self.capacity_slots} slots hold pinned "
                    f"experts; unpin some or give the cache a larger budget"
                )
            self._remove(evicted)
            self._evictions += 1
        slot = self._free.pop()
        self._slots[key] = slot
        self._uses[key] = 1
        if key not in self._pinned:
            self._policy.add(key)
        self._admissions += 1
        return slot, evicted

    def _remove(self, key: ExpertKey) -> int:
        slot = self._slots.pop(key)
        del self._uses[key]
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
        if key in self._policy:
            self._policy.discard(key)
        return key in self._slots

    def unpin(self, key: ExpertKey) -> bool:
        """Unpin `key`; returns whether it was pinned. A resident key becomes evictable again,
        keeping its uses since admission (as the most recent among equals)."""
        if key not in self._pinned:
            return False
        self._pinned.remove(key)
        if key in self._slots:
            self._policy.add(key, self._uses[key])
        return True

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
        """Evict every unpinned resident key; returns them. Pinned keys stay."""
        evicted = [k for k in self._slots if k not in self._pinned]
        for key in evicted:
            self._remove(key)
        return evicted

    def hottest(self, n: int) -> list[ExpertKey]:
        """The n keys looked up most often so far (all time, including evicted ones)."""
        return [key for key, _ in self._history.most_common(n)]

    def resident(self) -> dict[ExpertKey, int]:
        """Copy of the key -> slot map."""
        return dict(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

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
        self._hits = self._misses = self._evictions = self._admissions = 0
        self._layer_hits = [0] * self.num_layers
        self._layer_misses = [0] * self.num_layers
        self._window: deque[bool] = deque(maxlen=self.window)
        self._window_hits = 0
        if history:
            self._history.clear()
