"""Eviction policies of the expert cache: LRU, LFU (frequency buckets, ties by recency), SLRU.

Each orders the resident, unpinned keys only; `engine.experts.cache.ExpertCache` does slots,
bytes, pinning and statistics around one of them. Every operation is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Protocol

ExpertKey = tuple[int, int]  # (layer, expert)


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
