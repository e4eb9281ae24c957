"""ExpertProvider: the one interface between routed experts and everything that uses them.

The model's MoE, the decode runner and the Engine's cache controls talk to one object:

* data: `experts(layer, ids)` yields (id, ExpertWeights) once per distinct id, in any order;
  `prefetch(layer, ids)` is a hint (hash layers know their experts from the token ids);
  `prefetch_predicted(layer, ids, keep, fence)` a predicted one (router lookahead: layer L+1's
  gate on layer L's state), which never evicts the `keep` experts (the current layer's), its
  reads waiting only for the device work before `fence()` when given one; hints never
  change results, only residency; `prefetch_stats()` counts them (engine/experts/prefetch.py);
  `acquire(layer, ids)` / `release(layer)` hold a layer's experts resident in `arena` for kernels
  that read them through its slot table (`can_acquire(n)`: whether n of them fit now);
  `record(layer, ids)` counts uses made that way (the one-launch prefill, a replayed decode
  step), `record_later(layer, counts)` from per-expert counts on the device without waiting for
  them (counted at `settle_records()`, which the runtime calls once it has queued the next call,
  and which every statistic and control here calls first); `all_resident()`; `load_all(on_unit)`
  (both over the pool: the experts of the main layers 0..n_layers-1, which the model routes; the
  MTP block's, layer n_layers, are not routed: the engine does not run the block);
* `arena`: the engine.experts.arena.ExpertArena the experts live in, or None when they are not
  held in slots (an official checkpoint's experts, read from its shards);
* `cache`: the engine.experts.cache.ExpertCache deciding residency, or None when every expert is
  resident without one; `tier`: the pinned host-RAM tier behind a device arena
  (engine.experts.host_tier.HostTier), or None; `fill`: that tier's background filler
  (engine.experts.tier_fill.TierFill), or None;
* controls: `flush`, `pin` (all or nothing; never the slots a turn needs), `unpin`, `pinned`,
  `contents`, `hottest`, `stats`;
* `usage`: every use counted once, here, whichever path used the expert (`experts`, `acquire`,
  `record`), with the seconds the host was blocked on expert reads (`ExpertUsage.waiting`,
  around the implementations' blocking waits only: not their lookups, holds, admissions and
  hints, nor the counting of uses).

Implementations: engine.experts.resident.ResidentExperts (official layout) and
engine.experts.streaming.StreamingExperts (a converted pack through a bounded cache).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import torch

from engine.experts.cache import CacheStats, ExpertCache, ExpertCacheError, ExpertKey, add_per_layer
from engine.experts.hint_gate import HintGate
from engine.experts.prefetch import PrefetchLedger, PrefetchStats
from engine.experts.weights import ExpertWeights


def used_experts(counts: list[int]) -> list[int]:
    """The experts (indices) whose use count in `counts` (one per expert of a layer) is not zero."""
    return [e for e, c in enumerate(counts) if c]


class ExpertUsage:
    """All-time uses per (layer, expert) and per layer, and seconds the host spent blocked on
    expert reads (`wait_s`; a step's "expert wait", engine/runtime.py)."""

    def __init__(self, n_layers: int) -> None:
        self.uses: Counter[ExpertKey] = Counter()
        self.layer_uses = [0] * n_layers  # main layers only (the MTP block is not counted per layer)
        self.wait_s = 0.0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the block's seconds in `wait_s`: a provider wraps the calls that block on an
        expert read (a read's future, a mapped shard's fetch) in it, and nothing else."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - t0

    def reset(self) -> None:
        """Forget every use and wait counted so far."""
        self.uses.clear()
        self.layer_uses[:] = [0] * len(self.layer_uses)
        self.wait_s = 0.0

    def count(self, layer: int, ids: Iterable[int]) -> None:
        """One use of each distinct id of `layer`."""
        for e in dict.fromkeys(int(i) for i in ids):
            self.uses[(layer, e)] += 1
            if 0 <= layer < len(self.layer_uses):
                self.layer_uses[layer] += 1

    def count_keys(self, keys: list[ExpertKey]) -> None:
        """One use of each key, distinct (layer, expert) keys in any order, in one call (`count`
        layer by layer, without a Python call per layer)."""
        self.uses.update(keys)
        add_per_layer(self.layer_uses, keys)


class ExpertProvider(ABC):
    """Supplies routed experts (module docstring). Subclasses implement `_experts`, `prefetch`
    and `all_resident`, and where they hold experts in an arena `_acquire`/`release`/`_record`,
    timing their blocking waits on reads with `usage.waiting()`; this class counts usage and
    implements the controls over `cache` (nothing to control when it is None)."""

    arena = None  # engine.experts.arena.ExpertArena | None
    cache: ExpertCache | None = None
    tier = None  # engine.experts.host_tier.HostTier | None
    fill = None  # engine.experts.tier_fill.TierFill | None: the tier's background filler

    def __init__(self, n_layers: int, n_experts: int, top_k: int, hint_gate: HintGate | None = None) -> None:
        """`n_layers` main layers (the MTP block, if any, is layer n_layers), `n_experts` per
        layer, `top_k` experts routed per token (the slots a turn needs stay unpinnable);
        `hint_gate`: when lookahead hints may read (engine/experts/hint_gate.py; default HintGate())."""
        self.n_layers, self.n_experts, self.top_k = n_layers, n_experts, top_k
        self.usage = ExpertUsage(n_layers)
        self.prefetches = PrefetchLedger(hint_gate)  # what hints predicted and issued, settled by the routes
        self._later: deque[tuple[int, torch.Tensor, torch.cuda.Event]] = deque()  # record_later's, not yet counted

    # ------------------------------------------------------------------ data
    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield (expert id, weights) once for every distinct id in `ids`, in any order."""
        for item in self._experts(layer, ids):
            self.usage.count(layer, [item[0]])
            yield item

    @abstractmethod
    def _experts(self, layer: int, ids: Iterable[int]) -> Iterator[tuple[int, ExpertWeights]]: ...

    @abstractmethod
    def prefetch(self, layer: int, ids: Iterable[int], fence: object | None = None) -> None:
        """Hint: `layer` will need these experts soon. `fence` as for `prefetch_predicted`."""

    def prefetch_predicted(self, layer: int, ids: Iterable[int], keep: Iterable[ExpertKey] = (),
                           fence: object | None = None) -> None:
        """Hint: `layer` will probably need these experts (router lookahead); never evicts a
        resident expert of `keep`. `fence` (from `fence()`, taken before launching work that
        reads only experts held until this call): the hint's reads into freed slots wait only for
        the device work before it, not for that launch. Nothing to do when every expert is
        resident."""

    def fence(self) -> object | None:
        """A point in the device's queued work, for `prefetch_predicted` (None: nothing is queued
        asynchronously, e.g. an arena in host memory)."""
        return None

    def prefetch_stats(self) -> dict[str, PrefetchStats]:
        """Per hint source ("hash", "lookahead"): accuracy, reads issued, used in time or in flight."""
        return self.prefetches.stats()

    def resident(self, layer: int, ids: Sequence[int]) -> bool:
        """Whether every one of these experts of `layer` is in `arena` now, with no read of it
        pending: kernels enqueued now read them right, and `acquire` would only do bookkeeping
        (lookups, holds, hints), so it may run after those kernels are launched (DecodeRunner's
        layered steps). Always, when every expert is addressable without slots."""
        return True

    def reading(self) -> bool:
        """Whether a read of an expert into `arena` is still in flight (a hint's, a pin's): a
        step guessed now could find its expert missing (never, by default). A read that failed
        is not in flight: it leaves its key unlanded until joined, which `first_missing` reports
        (a guess's verdict then redoes the step, whose join raises the error); a caller reading
        slots without that check must use `all_resident`."""
        return False

    def wait_reads(self) -> None:
        """Wait until every read started so far has landed or failed (`reading` is then False),
        joining none of them: no statistic changes (the warm-up, before a step it guesses whole;
        nothing to wait for, by default)."""

    def first_missing(self, routes: Sequence[Sequence[int]]) -> int | None:
        """The first layer of `routes` (a step's expert ids, layer by layer from layer 0) with
        an expert that is not in `arena` now, or whose read has not landed; None when every
        one is resident (always, when every expert is addressable without slots). Changes no
        statistic: a guessed whole step (engine/step_guess.py) checks its routes with it."""
        return None

    def acquire(self, layer: int, ids: Iterable[int]) -> None:
        """Make these experts of `layer` resident in `arena` at once and hold them until
        `release(layer)`; counts their use."""
        ids = list(ids)
        self._acquire(layer, ids)
        self.usage.count(layer, ids)

    def _acquire(self, layer: int, ids: list[int]) -> None:
        """Nothing to hold when every expert is addressable without slots."""

    def can_acquire(self, n: int) -> bool:
        """Whether `acquire` of n distinct experts of one layer fits now: the slots neither the
        user's pins nor another layer's `acquire` hold (always, without a cache)."""
        return True

    def release(self, layer: int) -> None:
        """Drop the holds of `acquire(layer)`."""

    def record(self, layer: int, ids: Iterable[int]) -> None:
        """Count uses of experts known resident (read through the arena's slot table)."""
        ids = list(ids)
        self._record(layer, ids)
        self.usage.count(layer, ids)

    def _record(self, layer: int, ids: list[int]) -> None:
        """Cache bookkeeping of such uses (none without a cache)."""

    def record_routes(self, routes: Sequence[Sequence[int]]) -> None:
        """`record(layer, routes[layer])` for every layer 0, 1, ... in order (one whole-mode step's
        routes, or a chunk step's distinct experts per layer, as ints), as one call: the same
        counts and cache bookkeeping (DecodeRunner, with no Python call per layer)."""
        keys = [(layer, e) for layer, ids in enumerate(routes) for e in dict.fromkeys(ids)]
        self._record_routes(routes, keys)
        self.usage.count_keys(keys)

    def _record_routes(self, routes: Sequence[Sequence[int]], keys: list[ExpertKey]) -> None:
        """`_record` of every layer's routes (`keys`: their distinct (layer, expert) pairs in
        order); by default layer by layer."""
        for layer, ids in enumerate(routes):
            self._record(layer, list(ids))

    def record_later(self, layer: int, counts: torch.Tensor) -> None:
        """`record` the experts of `layer` whose count in `counts` [n_experts] (uses per expert, on
        the device) is not zero, without waiting for the device: their copy to the host is queued
        now and counted by the next `settle_records()` (on the CPU, at once)."""
        if counts.device.type != "cuda":
            self.record(layer, used_experts(counts.tolist()))
            return
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(counts.device))
        self._later.append((layer, host, done))

    def settle_records(self, wait: bool = True, most: int | None = None) -> None:
        """Count what `record_later` queued, in order: waiting for its copies (i.e. for the calls
        that made the counts), or without `wait` only those whose copies have completed (a call
        queued after the one the caller waited for keeps running); at most `most` of them (None:
        all), so that a caller between launches spends a bounded time here."""
        while self._later and (most is None or most > 0):
            layer, host, done = self._later[0]
            if not wait and not done.query():
                return
            done.synchronize()
            self._later.popleft()
            self.record(layer, used_experts(host.tolist()))
            most = None if most is None else most - 1

    @abstractmethod
    def all_resident(self) -> bool:
        """Every expert of the main layers (the pool) is resident now (then `arena`, if any,
        holds every expert the model routes)."""

    def load_all(self, on_unit: Callable[[int, int], None] | None = None) -> bool:
        """Make every expert of the main layers (the pool) resident when the budget holds them
        all; False when it does not."""
        return self.all_resident()

    def close(self) -> None:
        """Stop I/O threads and close files (nothing by default). Idempotent."""

    # ------------------------------------------------------------------ controls
    @property
    def pin_limit(self) -> int:
        """How many experts the user may pin: every slot but one layer's top-k."""
        return 0 if self.cache is None else max(0, self.cache.capacity_slots - self.top_k)

    def pinned(self) -> frozenset[ExpertKey]:
        """The keys the user pinned (resident, or still loading)."""
        return frozenset() if self.cache is None else self.cache.pinned()

    def pin(self, keys: Iterable[tuple[int, int]]) -> list[ExpertKey]:
        """Pin these (layer, expert) keys, all or none: raises ExpertCacheError, pinning nothing,
        when they would leave fewer than `top_k` slots unpinned, or when there is no cache (an
        official checkpoint: every expert is read from its shards, resident already). Returns the
        keys."""
        self.settle_records()
        keys = [(int(layer), int(e)) for layer, e in dict.fromkeys(keys)]
        if self.cache is None:
            raise ExpertCacheError("nothing to pin: this model has no expert cache (an official checkpoint "
                                   "reads every expert from its shards); convert it with dsv4-convert to "
                                   "stream experts through a cache and pin them")
        pinned = self.pinned()
        new = [k for k in keys if k not in pinned]
        if len(pinned) + len(new) > self.pin_limit:
            raise ExpertCacheError(
                f"cannot pin {len(new)} more expert(s): {len(pinned)} of the {self.cache.capacity_slots} "
                f"cache slots are pinned and {self.top_k} must stay free for a layer's routed experts "
                f"(at most {self.pin_limit} pins); unpin some or give the expert cache a larger budget")
        done: list[ExpertKey] = []
        try:
            for key in new:
                self._pin_one(key)
                done.append(key)
        except BaseException:
            for key in done:  # rolled back whole
                self._unpin_one(key)
            raise
        return keys

    def _pin_one(self, key: ExpertKey) -> None:
        self.cache.pin(key)

    def _unpin_one(self, key: ExpertKey) -> None:
        self.cache.unpin(key)

    def unpin(self, keys: Iterable[tuple[int, int]] | None = None) -> list[ExpertKey]:
        """Unpin these keys (None: every pinned key); returns those that were pinned."""
        pinned = self.pinned()
        wanted = sorted(pinned) if keys is None else [(int(a), int(b)) for a, b in dict.fromkeys(keys)]
        out = [k for k in wanted if k in pinned]
        for key in out:
            self._unpin_one(key)
        return out

    def flush(self) -> list[ExpertKey]:
        """Evict every unpinned expert; returns the evicted keys (none without a cache)."""
        self.settle_records()
        return [] if self.cache is None else self.cache.flush()

    def hottest(self, n: int) -> list[ExpertKey]:
        """The n experts used most so far (all time)."""
        self.settle_records()
        if self.cache is not None:
            return self.cache.hottest(n)
        return [k for k, _ in self.usage.uses.most_common(n)]

    def contents(self) -> list[tuple[int, int, bool, int]]:
        """(layer, expert, pinned, all-time uses) of every resident expert, sorted."""
        self.settle_records()
        uses = self.usage.uses
        if self.cache is None:
            return [(layer, e, False, uses.get((layer, e), 0)) for layer in range(self.n_layers)
                    for e in range(self.n_experts)]
        pinned = self.pinned()
        return [(layer, e, (layer, e) in pinned, uses.get((layer, e), 0))
                for layer, e in sorted(self.cache.resident())]

    def stats(self) -> CacheStats | None:
        """The cache's counters, or None when every expert is resident without a cache."""
        self.settle_records()
        return None if self.cache is None else self.cache.stats()

    def reset_stats(self) -> None:
        """Zero the statistics (usage, waits, the cache's counters and its `hottest` history),
        e.g. after the engine's warm-up, whose scratch lookups are no user's. What is resident,
        pinned, and what the eviction policy knows stay as they are."""
        self.settle_records()
        self.usage.reset()
        if self.cache is not None:
            self.cache.reset_stats(history=True)
        if self.tier is not None:
            self.tier.reset_stats()
