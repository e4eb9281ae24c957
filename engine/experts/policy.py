"""Eviction policies of the expert cache.

Each orders the resident, unpinned keys only; `engine.experts.cache.ExpertCache` does slots,
bytes, pinning and statistics around one of them. Policies (names as in `POLICIES`):

- "lru": least recently used. "lfu": least frequently used since admission (ties by recency).
- "slru": segmented LRU with a ghost list, so a key re-used after its eviction from probation
  is still promoted (SLRUPolicy says why it matters).
- "arc": adaptive replacement cache (Megiddo & Modha 2003).
- "lfu-aging": use counts whose weight halves every `capacity` uses (LRFU, Lee et al. 2001).
- "next-use" (the engine's default, DEFAULT_POLICY): expected next use from the MoE layer
  cycle and decayed per-layer use counts (NextUsePolicy).

`bench/cache_replay.py` replays real DeepSeek-V4-Flash routing traces through these classes.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Callable, Protocol

ExpertKey = tuple[int, int]  # (layer, expert)


class PolicyError(ValueError):
    """Bad policy parameter or misuse of a policy object."""


class EvictionPolicy(Protocol):
    """Eviction order over the resident, *unpinned* keys (pinned keys are never in it).

    `add(key, count)`: key becomes evictable, having been used `count` times since admission.
    `touch(key)`: key was used again. `discard(key)`: key leaves (evicted right after
    `victim()` returned it, or flushed, dropped, pinned). `victim()`: the key to evict next
    (not removed), or None when empty.
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
            raise PolicyError(f"LFU count must be >= 1, got {count}")
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
    """Segmented LRU: new keys enter probation; a second use promotes them to protected.

    The protected segment holds at most `protected_fraction` of capacity; its overflow is
    demoted to the most recent end of probation. Victims come from probation's LRU end, or
    from protected's when probation is empty.

    A ghost list remembers the last `ghost_fraction * capacity` keys evicted from the cache;
    a remembered key that is admitted again counts as a second use and goes to protected.
    Without it, when probation (20 % of 256 slots on the real traces) is shorter than the
    reuse distance (one token: ~240 accesses), no key is ever used twice while in probation,
    promotions stop and protected keeps the keys promoted during the first tokens forever:
    the hit rate collapsed to LFU's (13.6 % vs LRU's 40.8 % on route_W130 at 256 slots).
    """

    name = "slru"

    def __init__(self, capacity: int, protected_fraction: float = 0.8,
                 ghost_fraction: float = 1.0) -> None:
        if not 0.0 <= protected_fraction <= 1.0:
            raise PolicyError(f"protected_fraction must be in [0, 1], got {protected_fraction}")
        if ghost_fraction < 0.0:
            raise PolicyError(f"ghost_fraction must be >= 0, got {ghost_fraction}")
        self._protected_cap = int(capacity * protected_fraction)
        self._ghost_cap = int(capacity * ghost_fraction)
        self._probation: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._protected: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._ghost: OrderedDict[ExpertKey, None] = OrderedDict()  # evicted keys, oldest first
        self._victim: ExpertKey | None = None

    def _protect(self, key: ExpertKey) -> None:
        self._protected[key] = None
        while len(self._protected) > self._protected_cap:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def add(self, key: ExpertKey, count: int = 1) -> None:
        remembered = self._ghost.pop(key, 0) is None
        if count >= 2 or remembered:
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
        if key == self._victim and self._ghost_cap > 0:
            self._ghost[key] = None
            if len(self._ghost) > self._ghost_cap:
                self._ghost.popitem(last=False)
        self._victim = None

    def victim(self) -> ExpertKey | None:
        self._victim = next(iter(self._probation or self._protected), None)
        return self._victim

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected


class ARCPolicy:
    """Adaptive replacement cache (Megiddo & Modha, FAST 2003), on this interface.

    T1: keys used once since admission, T2: used at least twice (both LRU ordered); ghost
    lists B1 and B2 remember keys evicted from each (at most `capacity` each). Admitting a
    key remembered in B1 grows T1's target size p, one in B2 shrinks it; victims come from
    T1 while it exceeds p. Differences from the paper: the adaptation happens when the key is
    admitted (after the victim was chosen), and only keys evicted through `victim()` become
    ghosts (flushed, dropped or pinned keys are forgotten).
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self._cap = max(1, capacity)
        self._p = 0.0  # target size of T1
        self._t1: OrderedDict[ExpertKey, None] = OrderedDict()
        self._t2: OrderedDict[ExpertKey, None] = OrderedDict()
        self._b1: OrderedDict[ExpertKey, None] = OrderedDict()
        self._b2: OrderedDict[ExpertKey, None] = OrderedDict()
        self._victim: ExpertKey | None = None

    def add(self, key: ExpertKey, count: int = 1) -> None:
        if key in self._b1:
            self._p = min(self._cap, self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        elif count >= 2:
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: ExpertKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]
        self._t2[key] = None

    def discard(self, key: ExpertKey) -> None:
        source, ghosts = (self._t1, self._b1) if key in self._t1 else (self._t2, self._b2)
        del source[key]
        if key == self._victim:
            ghosts[key] = None
            if len(ghosts) > self._cap:
                ghosts.popitem(last=False)
        self._victim = None

    def victim(self) -> ExpertKey | None:
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            self._victim = next(iter(self._t1))
        else:
            self._victim = next(iter(self._t2), None)
        return self._victim

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


class _LazyMinHeap:
    """Min-heap of (score, key) where an entry is current iff `score == scores[key]`."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[float, ExpertKey]] = []

    def push(self, score: float, key: ExpertKey, live: int, scores: dict[ExpertKey, float]) -> None:
        heapq.heappush(self.entries, (score, key))
        if len(self.entries) > 2 * live + 64:  # compact: drop stale entries
            self.entries = [e for e in self.entries if scores.get(e[1]) == e[0]]
            heapq.heapify(self.entries)

    def top(self, scores: dict[ExpertKey, float]) -> tuple[float, ExpertKey] | None:
        entries = self.entries
        while entries and scores.get(entries[0][1]) != entries[0][0]:
            heapq.heappop(entries)
        return entries[0] if entries else None


def _log_add(a: float | None, b: float) -> float:
    """log(exp(a) + exp(b)), with a=None meaning exp(a) = 0."""
    if a is None:
        return b
    return max(a, b) + math.log1p(math.exp(-abs(a - b)))


class LFUAgingPolicy:
    """LFU with aging: evicts the smallest use count, each use's weight halving every
    `half_life` uses of the cache (default: capacity). O(log n) per operation.

    Scores are kept as log(sum of 2**(use time / half_life)), which orders keys like the
    decayed counts without ever rescaling them. A key's count restarts at admission. A key
    that left without being evicted (pinned: the engine holds every expert of a call) and is
    added back with count >= 2 gets its score back: the hit that led to the hold was counted
    by `touch` already.
    """

    name = "lfu-aging"

    def __init__(self, capacity: int, half_life: float | None = None) -> None:
        self._rate = math.log(2.0) / (half_life or max(1, capacity))
        self._time = 0
        self._score: dict[ExpertKey, float] = {}
        self._parked: dict[ExpertKey, float] = {}  # scores of keys that left but were not evicted
        self._victim: ExpertKey | None = None
        self._heap = _LazyMinHeap()

    def _use(self, key: ExpertKey, weight: int) -> None:
        self._time += 1
        score = _log_add(self._score.get(key), math.log(weight) + self._time * self._rate)
        self._score[key] = score
        self._heap.push(score, key, len(self._score), self._score)

    def add(self, key: ExpertKey, count: int = 1) -> None:
        if count < 1:
            raise PolicyError(f"use count must be >= 1, got {count}")
        parked = self._parked.pop(key, None)
        if parked is not None and count >= 2:  # back from a hold: its uses are in its score
            self._score[key] = parked
            self._heap.push(parked, key, len(self._score), self._score)
        else:
            self._use(key, count)

    def touch(self, key: ExpertKey) -> None:
        self._use(key, 1)

    def discard(self, key: ExpertKey) -> None:
        score = self._score.pop(key)
        if key != self._victim:
            self._parked[key] = score
        self._victim = None

    def victim(self) -> ExpertKey | None:
        top = self._heap.top(self._score)
        self._victim = None if top is None else top[1]
        return self._victim
    def __len__(self) -> int:
        return len(self._score)

    def __contains__(self, key: object) -> bool:
        return key in self._score


class NextUsePolicy:
    """Evicts the key expected to be needed last, from the MoE layer cycle and decayed counts.

    The engine looks experts up layer by layer, in the same cycle every token (decode step or
    prefill chunk). The policy follows that cycle from the keys it is given: a key of another
    layer than the previous key, or a lookup hit (`touch`) of a key already used in the
    current visit, starts a visit of its layer (an `add` of such a key is the engine giving
    back a key it held for the call, not a new use); the cycle's length is the number of
    distinct layers seen. For a resident key (layer l, expert e):

    - d: layer visits until l comes round again (cycle - visits since l's last visit). For
      the layer being visited now d = cycle: the engine looks up every expert
      of a call before it admits the misses, and holds the call's experts (pinned, so not in
      this policy) until they are used, so no other key of this layer is needed before its
      next visit;
    - c: its uses, each weighted gamma**(visits of l since that use); kept after eviction, so
      a re-admitted expert keeps its history (bounded by the distinct keys, layers x experts);
    - p = (c + prior) / (1 / (1 - gamma) + 1): the chance that l's next visit selects it;
    - expected next use = d + cycle * (1/p - 1) layer visits; the victim maximises it;
    - but when that victim is dead (c < `dead`: no evidence left that it will be needed) and
      so is the least recently used key, that one goes: among keys the counts know nothing
      about, recency is the better guess. It decides only near-full caches (3,300-4,300 slots
      on route_W130), where it kept the default from falling 1-3 hits below LRU.

    Within a layer all keys share d, so each layer keeps a min-heap of c (stored as log of a
    growing-weight sum, which never needs rescaling), and the layers' least used keys sit in a
    heap of layers (`_priority`), refreshed for the layers that changed: `victim` is
    O(changed layers x log n), one or two layers per eviction in decode. gamma=0.93, prior=0.1
    and dead=0.01 were chosen on route_W130 (bench/cache_replay.py); route_W50 is the
    held-out check.
    """

    name = "next-use"

    def __init__(self, capacity: int, gamma: float = 0.93, prior: float = 0.1,
                 dead: float = 0.01) -> None:
        if not 0.0 < gamma < 1.0:
            raise PolicyError(f"gamma must be in (0, 1), got {gamma}")
        if prior <= 0.0:
            raise PolicyError(f"prior must be > 0, got {prior}")
        if dead < 0.0:
            raise PolicyError(f"dead must be >= 0, got {dead}")
        self._prior, self._dead = prior, dead
        self._recency: OrderedDict[ExpertKey, None] = OrderedDict()  # resident keys, least recent first
        self._rate = -math.log(gamma)  # log-weight gained per visit of a key's layer
        self._window = 1.0 / (1.0 - gamma)
        self._visit = 0  # layer visits so far, all layers
        self._layer: int | None = None  # layer being visited now
        self._last_visit: dict[int, int] = {}  # layer -> self._visit at its last visit
        self._visits: dict[int, int] = {}  # layer -> its own number of visits
        self._heaps: dict[int, _LazyMinHeap] = {}
        self._live: dict[int, int] = {}  # layer -> resident keys of that layer
        self._history: dict[ExpertKey, float] = {}  # key -> log weighted use count
        self._counted: dict[ExpertKey, int] = {}  # key -> its layer's visit of its last counted use
        self._score: dict[ExpertKey, float] = {}  # resident keys -> score in their heap
        self._cycle = 0  # the cycle length the layer priorities were computed with
        self._dirty: set[int] = set()  # layers whose priority changed since the last victim()
        self._prio: dict[int, tuple[float, ExpertKey]] = {}  # layer -> (priority, its candidate)
        self._layer_heap: list[tuple[float, int, ExpertKey]] = []  # (-priority, layer, key), lazy

    def _use(self, key: ExpertKey, weight: int, lookup: bool) -> None:
        layer = key[0]
        if layer != self._layer or (lookup and self._counted.get(key) == self._visits[layer]):
            self._layer = layer
            self._visit += 1
            self._last_visit[layer] = self._visit
            self._visits[layer] = self._visits.get(layer, 0) + 1
            self._dirty.add(layer)
        visit = self._visits[layer]
        if self._counted.get(key) != visit:  # one use per key per visit
            self._counted[key] = visit
            self._history[key] = _log_add(self._history.get(key), math.log(weight) + visit * self._rate)
        self._recency[key] = None
        self._recency.move_to_end(key)
        score = self._history[key]
        if self._score.get(key) != score:
            self._score[key] = score
            self._heaps[layer].push(score, key, self._live[layer], self._score)
            self._dirty.add(layer)

    def add(self, key: ExpertKey, count: int = 1) -> None:
        if count < 1:
            raise PolicyError(f"use count must be >= 1, got {count}")
        layer = key[0]
        if layer not in self._heaps:
            self._heaps[layer] = _LazyMinHeap()
            self._live[layer] = 0
        self._live[layer] += 1
        self._score[key] = math.nan  # resident; its heap entry is pushed by _use
        self._use(key, count, lookup=False)

    def touch(self, key: ExpertKey) -> None:
        self._use(key, 1, lookup=True)

    def discard(self, key: ExpertKey) -> None:
        del self._score[key]
        del self._recency[key]
        self._live[key[0]] -= 1
        self._dirty.add(key[0])

    def _count(self, key: ExpertKey) -> float:
        """c: the key's decayed use count now."""
        return math.exp(self._history[key] - self._visits[key[0]] * self._rate)

    def _priority(self, layer: int, cycle: int) -> tuple[float, ExpertKey]:
        """(last visit + cycle * (1/p - 1), key) of the layer's least used resident key.

        A key's expected next use is d + cycle * (1/p - 1) with d = last visit - (visits so
        far - cycle): the term (cycle - visits so far) is common to every layer, so layers
        rank by this priority, which changes only when the layer itself does."""
        log_count, key = self._heaps[layer].top(self._score)
        count = math.exp(log_count - self._visits[layer] * self._rate)
        odds = (self._window + 1.0) / (count + self._prior) - 1.0
        return self._last_visit[layer] + cycle * odds, key

    def victim(self) -> ExpertKey | None:
        cycle = len(self._last_visit)
        if cycle != self._cycle:  # a layer seen for the first time: every priority changes
            self._cycle = cycle
            self._dirty.update(self._last_visit)
        heap, prio = self._layer_heap, self._prio
        for layer in self._dirty:
            if self._live.get(layer):
                prio[layer] = entry = self._priority(layer, cycle)
                heapq.heappush(heap, (-entry[0], layer, entry[1]))
            else:
                prio.pop(layer, None)
        self._dirty.clear()
        if len(heap) > 4 * len(prio) + 64:  # compact: drop stale entries
            heap[:] = [(-v, layer, key) for layer, (v, key) in prio.items()]
            heapq.heapify(heap)
        while heap:
            neg, layer, key = heap[0]
            if prio.get(layer) == (-neg, key):
                break
            heapq.heappop(heap)
        else:
            return None
        if self._count(key) < self._dead:  # no evidence left: the least recent dead key goes
            oldest = next(iter(self._recency))
            if self._count(oldest) < self._dead:
                return oldest
        return key

    def __len__(self) -> int:
        return len(self._score)

    def __contains__(self, key: object) -> bool:
        return key in self._score


DEFAULT_POLICY = "next-use"
"""The engine's default (EngineConfig.cache_policy): the best on the shipped routing traces."""

POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "arc": ARCPolicy,
    "lfu": LFUPolicy,
    "lfu-aging": LFUAgingPolicy,
    "lru": LRUPolicy,
    "next-use": NextUsePolicy,
    "slru": SLRUPolicy,
}
