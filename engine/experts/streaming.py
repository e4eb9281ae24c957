"""StreamingExperts: the ExpertProvider (engine/experts/provider.py) that streams routed
experts through a bounded cache.

Parts: `ExpertCache` (policy: which keys are resident, in which slot; stats), `ExpertArena`
(slot memory + zero-copy ExpertWeights views), `ExpertStore` (one read per record) and `IOPool`
(named I/O threads). All cache bookkeeping happens on the calling (engine) thread; I/O threads
only copy bytes into slots.

`experts(layer, ids)` looks every id up once (hits and misses counted by the cache), starts the
misses' reads at once, yields the hits first while those reads run, then each miss as its read
completes. Budgets smaller than one call's needs work in waves: a key of the current call is
held (pinned transiently) from its lookup or admission until the consumer has used it (asks for
the next item), so it is never evicted before use; a miss is admitted only when a slot can be
freed without evicting a held key, i.e. after earlier experts of the call were used. With a
budget of one record the call runs strictly one expert at a time.

`prefetch(layer, ids)` (hash layers know their experts from the token ids) admits and starts
reading those experts early and holds them until `experts(layer, ...)` uses them; prefetch holds
take at most `prefetch_share` of the slots, and are dropped if the current call needs their
slots. Later lookups of prefetched experts count as hits; `bytes_read` counts every admission.
`prefetch_predicted(layer, ids, keep)` (router lookahead) does the same for predicted experts,
holding the resident `keep` keys (the current layer's route) while it admits, so that no expert
the current layer needs is evicted for a guess. With `keep` (the eager model hints before the
current layer's call) the hint waits until that call has queued its own reads (the I/O queue is
FIFO: guesses never delay the current layer's misses); without it (the decode runner hints once
the current layer's experts are held) it is issued at once, and with a `fence()` taken before the
runner launched work that reads only held experts, its reads wait only for the work before it.
A lookahead hint reads only while its gate is open (engine/experts/hint_gate.py: closed while
fewer than a quarter of recent hint reads were used, as when the cache holds nearly every expert
the route asks for and the reads are the wrong guesses); a closed gate's would-be reads are
settled by the route all the same (`prefetches`: skipped), so it reopens when guesses pay.
A hint's slot-table writes are not sent to the device by the hint (one host->device copy and an
event fewer per layer of a streamed step): its experts are read through the table only by
kernels launched after their layer's `acquire`, which sends the whole table (or, for a layer
whose experts are all `resident` and acquired after its kernels' launch, after the decode
runner's `arena.sync_table`), and a caller that
reads the table without acquiring (a whole-graph step once every expert is resident) syncs it
first (`arena.sync_table`, nothing when it is clean).
`prefetches` (engine/experts/prefetch.py) counts the hints against the route that settles them:
in `experts` and `acquire`, before any read of the call is joined, a prefetched read is "in
time" when its read has completed.

With a device arena and a `HostTier` (engine/experts/host_tier.py), a miss is served from host
RAM when the tier holds the record: one asynchronous host->device copy, enqueued by the engine
thread on the provider's copy stream, which the kernels that read the slot wait for on the
device (no host round trip; a later disk read into that tier slot waits for the copy); else it is read
from the disk into a tier slot on an I/O thread and copied from there; without a tier (or when
every tier slot is in transfer) it is read into a pinned staging buffer. On the CPU the arena
is the only tier.

Transient holds use `ExpertCache.hold`/`release` (no policy work for a resident key; one
admitted while held enters the policy at its release) on keys the user has not pinned; a user
pin made while a forward call is running (another thread) is not supported (the cache is not
thread-safe anyway). A user pin (`pin`) of an expert that is not resident starts its read at
once: it takes its slot now (counted as pinned), and the read is joined on the expert's next use.
"""

from __future__ import annotations

import queue
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from engine.experts.arena import ExpertArena
from engine.experts.cache import CacheFullError, ExpertCache, ExpertCacheError, ExpertKey
from engine.experts.hint_gate import HintGate
from engine.experts.host_tier import HostTier
from engine.experts.io_pool import IOPool
from engine.experts.provider import ExpertProvider
from engine.experts.store import ExpertReadError, ExpertStore, aligned_empty
from engine.experts.tier_fill import TierFill, fill_order
from engine.experts.weights import ExpertWeights


class _DeviceCopy:
    """A RAM-tier hit's read: one host->device copy enqueued on the provider's copy stream from
    the engine thread (no I/O thread, no host wait). Joining it makes the consumer's stream wait
    for `event` on the device; `done()` says whether the copy has completed. The copies of one
    provider call share the event recorded after the last of them (`_Batch`)."""

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None  # set when the call's copies are all enqueued

    def done(self) -> bool:
        return self.event is not None and self.event.query()

    def result(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class _Batch:
    """The device-side bookkeeping of one provider call's admissions, done once for all of them:
    the event after the compute stream's work so far (no admitted slot is written before the
    kernels enqueued earlier, which may read the records it held, are done), and the call's
    RAM-tier copies, enqueued together after one wait for that event."""

    def __init__(self, freed: torch.cuda.Event) -> None:
        self.freed = freed  # the compute stream's work so far, or up to a fence taken earlier
        self.copies: list[tuple[_DeviceCopy, int, int]] = []  # (copy, arena slot, tier slot)


class _Hint(NamedTuple):
    """A lookahead hint for `layer`'s experts `ids`, holding the resident `keep` keys (the
    current layer's route), issued once the call of `after` (keep's layer) has queued its reads."""

    layer: int
    ids: list[int]
    keep: list[ExpertKey]

    @property
    def after(self) -> int:
        return self.keep[0][0]


class StreamingExperts(ExpertProvider):
    """ExpertProvider over an ExpertStore, an ExpertCache and an ExpertArena (module docstring)."""

    def __init__(self, store: ExpertStore, arena: ExpertArena, cache: ExpertCache, pool: IOPool,
                 prefetch_share: float = 0.5, *, n_layers: int | None = None, top_k: int = 1,
                 tier: HostTier | None = None, hint_gate: HintGate | None = None):
        """`n_layers`: the main layers, units 0..n_layers-1 (default: every unit): the layers
        the engine routes, whose experts are the pool (`load_all`, `all_resident`, `fill_tier`)
        and whose uses are counted per layer; a unit from n_layers on (the MTP block) is read
        only when asked for; `top_k`: experts routed per token (that many slots are never pinned
        by the user); `tier`: the host-RAM tier behind a device arena (None: reads go straight
        to the arena); `hint_gate`: when lookahead hints may read (engine/experts/hint_gate.py)."""
        super().__init__(len(store.layers()) if n_layers is None else n_layers, store.count, top_k, hint_gate)
        if arena.slots != cache.capacity_slots:
            raise ValueError(f"arena has {arena.slots} slots but the cache {cache.capacity_slots}")
        self.store, self.arena, self.cache, self.pool = store, arena, cache, pool
        self.main_layers = [layer for layer in store.layers() if layer < self.n_layers]  # the pool's units
        self._beyond = range(self.n_layers, cache.num_layers)  # the cache's rows past them (the MTP block's)
        self._loads: dict[ExpertKey, Future | _DeviceCopy] = {}  # reads started, not yet joined
        self._prefetched: dict[int, list[ExpertKey]] = {}  # layer -> keys held for its next call
        self._acquired: dict[int, list[ExpertKey]] = {}  # layer -> keys held by acquire()
        self._deferred: _Hint | None = None  # a lookahead hint waiting for the call of its keep's layer
        self._prefetch_limit = int(cache.capacity_slots * prefetch_share)
        self._staging: queue.SimpleQueue | None = None
        if not arena.on_host:  # device arena: read into pinned host buffers, then copy on own streams
            self._staging = queue.SimpleQueue()  # (pinned buffer, copy stream) pairs, one per I/O thread
            for _ in range(pool.size):
                self._staging.put((aligned_empty(store.record_bytes, pin_memory=True),
                                   torch.cuda.Stream(arena.device)))
        if tier is not None and arena.on_host:
            raise ValueError("a host-RAM tier sits behind a device arena; this arena is in host memory already")
        self.tier = tier
        self._tiered: set[ExpertKey] = set()  # loads holding a tier slot
        # RAM-tier hits: copies on one stream; a disk read into a tier slot first waits for the
        # slot's last copy (the slot is released when its copy is joined, maybe still in flight)
        self._copy = torch.cuda.Stream(arena.device) if tier is not None else None
        self._copied: dict[int, torch.cuda.Event] = {}  # tier slot -> its last copy to the device
        self._batch: _Batch | None = None  # the current call's (`_batched`), made at its first admission
        self._batching = 0  # depth of `_batched` contexts
        self._stream: torch.cuda.Stream | None = None  # the compute stream, asked once per `_batched` call
        self.fill: TierFill | None = None  # the tier's background filler (`fill_tier`)
        self._closed = False

    # ------------------------------------------------------------------ holds and reads
    def _hold(self, key: ExpertKey, user: frozenset) -> bool:
        """Protect `key` from eviction; False when the cache cannot pin more keys now."""
        if key in user or self.cache.holds(key):
            return True
        try:
            self.cache.hold(key)
        except ExpertCacheError:
            return False
        return True

    def _release(self, key: ExpertKey) -> None:
        self.cache.release(key)

    def _load(self, key: ExpertKey, slot: int, freed: torch.cuda.Event | None,
              src: tuple[int, bool] | None = None, copying: torch.cuda.Event | None = None) -> None:
        """Runs on an I/O thread: bytes of record `key` into arena slot `slot`.

        Device arenas: the bytes come from host tier slot `src[0]` (read from the disk first
        when `src[1]`), or are read into a pinned staging buffer; they are copied on the
        buffer's own stream, so uploads overlap the compute stream's kernels. The copy first
        waits for `freed` (recorded on the compute stream when the slot was reassigned: kernels
        enqueued before may still read the record it held), and is complete before the read's
        future resolves (the consumer joins it before enqueuing kernels that read the slot).
        `copying`: the tier slot's last copy to the device, which a disk read into it waits for."""
        if self._staging is None:
            self.store.read_into(key[0], key[1], self.arena.host_buffer(slot))
            return
        buf, stream = self._staging.get()
        try:
            if src is not None:
                if src[1]:
                    if copying is not None:  # the slot's previous record may still be copying out
                        copying.synchronize()
                    self.tier.read(key, src[0])
                host = self.tier.data[src[0]]
            else:
                self.store.read_into(key[0], key[1], memoryview(buf.numpy()))
                host = buf
            stream.wait_event(freed)
            with torch.cuda.stream(stream):
                self.arena.data[slot].copy_(host, non_blocking=True)
            stream.synchronize()  # before the buffer is reused and the future resolves
        finally:
            self._staging.put((buf, stream))

    def _start(self, key: ExpertKey, slot: int) -> None:
        """Start the read of admitted `key` into arena slot `slot` (from the host tier if any).
        A RAM-tier hit is one copy enqueued here on the copy stream (`_DeviceCopy`); a read from
        the disk runs on an I/O thread (`_load`)."""
        freed = src = None
        if self._staging is not None:  # the compute stream's work so far may still read the slot
            if self._batch is None:
                self._batch = _Batch(self.fence())
            freed = self._batch.freed
            if self.tier is not None:
                src = self.tier.hold(key)
                if src is not None:
                    self._tiered.add(key)
        if src is not None and not src[1]:  # enqueued with the batch's other copies (`_close_batch`)
            copy = _DeviceCopy()
            self._batch.copies.append((copy, slot, src[0]))
            self._loads[key] = copy
        else:
            copying = self._copied.pop(src[0], None) if src is not None else None
            self._loads[key] = self.pool.submit(self._load, key, slot, freed, src, copying)
        if not self._batching:  # an admission outside a provider call's batch (a user pin)
            self._close_batch()

    def _close_batch(self, table: bool = True) -> None:
        """Enqueue the batch's RAM-tier copies on the copy stream (after the compute stream's work
        before the batch), record the event after them, and write the slot table (`table`; a
        hint's writes wait for the next call that syncs it, module docstring)."""
        batch, self._batch = self._batch, None
        if batch is not None and batch.copies:
            done = torch.cuda.Event()
            with torch.cuda.stream(self._copy):
                self._copy.wait_event(batch.freed)
                for _, slot, tier_slot in batch.copies:
                    self.arena.data[slot].copy_(self.tier.data[tier_slot], non_blocking=True)
                done.record(self._copy)
            for copy, _, tier_slot in batch.copies:
                copy.event = done
                self._copied[tier_slot] = done
        if table:
            self.arena.sync_table(self._stream)

    @contextmanager
    def _batched(self, table: bool = True) -> Iterator[None]:
        """One provider call's admissions (`_Batch`): the event after its RAM-tier copies and the
        slot table's writes (`ExpertArena.sync_table`, unless not `table`) come once, at the
        end; nested calls join the outer batch (whose `table` counts). The compute stream is
        asked for once per call (`_compute`: ~250 asks a streamed step otherwise)."""
        if not self._batching and self._staging is not None:
            self._stream = self.arena.current_stream()
        self._batching += 1
        try:
            yield
        finally:
            self._batching -= 1
            if not self._batching:
                try:
                    self._close_batch(table)
                finally:
                    self._stream = None

    def _compute(self) -> torch.cuda.Stream:
        """The calling thread's current stream (the one asked at the call's start in a batch)."""
        return self._stream if self._stream is not None else self.arena.current_stream()

    def _admit(self, key: ExpertKey, user: frozenset) -> bool:
        """Hold `key`, make it resident and start its read; False if no slot can be freed now."""
        if not self._hold(key, user):
            return False
        try:
            slot, evicted = self.cache.admit(key)
        except CacheFullError:
            self._release(key)
            return False
        except BaseException:  # e.g. a key outside a whole-pool cache's pool: nothing stays held
            self._release(key)
            raise
        if evicted is not None:
            self.arena.clear(*evicted)
            if self.tier is not None:
                self.tier.refresh(evicted)
        self.arena.assign(key[0], key[1], slot)
        self._start(key, slot)
        return True

    def _join(self, key: ExpertKey, reraise: bool = True, waited: set | None = None) -> None:
        """Wait for the read of `key` if one is pending; a failed read un-admits the key.
        `waited`: the copy events the current stream waits for already (the copies of one call
        share an event), collected by a caller joining several keys on one stream."""
        fut = self._loads.pop(key, None)
        if fut is None:
            return
        if isinstance(fut, _DeviceCopy):  # kernels enqueued from now on wait for the copy on the device
            if waited is None or fut.event not in waited:
                self._compute().wait_event(fut.event)
                if waited is not None:
                    waited.add(fut.event)
            self._tiered.remove(key)
            self.tier.done(key)
            return
        try:
            with self.usage.waiting():  # the host is blocked on the read (a device copy never blocks it)
                fut.result()
        except BaseException as e:
            if key in self._tiered:
                self._tiered.remove(key)
                self.tier.done(key, ok=False)
            self.arena.clear(*key)
            self.cache.discard(key)
            self._release(key)
            if reraise:
                if isinstance(e, ExpertReadError):
                    raise
                raise ExpertReadError(f"loading expert {key[1]} of layer {key[0]} failed: {e!r}") from e
            return
        if key in self._tiered:
            self._tiered.remove(key)
            self.tier.done(key)

    def _settle(self, key: ExpertKey) -> None:
        """Finish any read of `key` (errors dropped: the key is un-admitted) and release it."""
        self._join(key, reraise=False)
        self._release(key)

    def _drop_prefetches(self) -> None:
        self._deferred = None
        for keys in self._prefetched.values():
            for key in keys:
                self._settle(key)
        self._prefetched.clear()

    # ------------------------------------------------------------------ ExpertProvider
    def _experts(self, layer: int, ids: Iterable[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield (id, weights) once per distinct id: hits first, then misses as they arrive."""
        keys = [(layer, e) for e in dict.fromkeys(int(i) for i in ids)]
        user = self.pinned()
        ready: deque[ExpertKey] = deque()
        waiting: deque[ExpertKey] = deque()
        unprotected: set[ExpertKey] = set()  # hits we could not hold: admit nothing until used
        loading: dict[ExpertKey, Future] = {}

        def issue() -> bool:
            started = False
            with self._batched():
                while waiting and not unprotected and self._admit(waiting[0], user):
                    key = waiting.popleft()
                    loading[key] = self._loads[key]
                    started = True
            return started

        self.prefetches.route(layer, [k[1] for k in keys], self._arrival)
        try:
            for key in set(self._prefetched.pop(layer, ())) - set(keys):
                self._settle(key)  # a prefetch hint this call does not use
            for key in keys:
                if self.cache.lookup(key) is None:
                    waiting.append(key)
                else:
                    ready.append(key)
                    if not self._hold(key, user):
                        unprotected.add(key)
            issue()
            with self._batched():
                self._issue_deferred(layer)  # after this call's own reads are queued
            while ready or loading or waiting:
                if ready:
                    key = ready.popleft()
                elif loading:  # a RAM-tier copy is consumed at once (its kernels wait on the device)
                    key = next((k for k, f in loading.items() if isinstance(f, _DeviceCopy) or f.done()), None)
                    if key is None:
                        with self.usage.waiting():
                            wait(list(loading.values()), return_when=FIRST_COMPLETED)
                        key = next(k for k, f in loading.items() if f.done())
                    del loading[key]
                else:
                    self._drop_prefetches()  # their slots are needed now
                    if not issue():
                        raise CacheFullError(
                            f"cannot load expert {waiting[0][1]} of layer {layer}: every one of "
                            f"the {self.cache.capacity_slots} cache slots holds a pinned expert; "
                            "unpin some or give the expert cache a larger budget")
                    continue
                self._join(key)
                yield key[1], self.arena.weights(self.cache.peek(key))
                unprotected.discard(key)
                self._release(key)
                issue()
        except BaseException:  # a failed read or an abandoned call: no hint outlives it either
            self._drop_prefetches()
            raise
        finally:  # normal end, consumer stopped early, or an error: leave nothing held
            for key in keys:
                self._settle(key)

    # ------------------------------------------------------------------ slot-table access
    def _acquire(self, layer: int, ids: Iterable[int]) -> None:
        """Make every id of `layer` resident at once and hold them until `release(layer)`.

        For kernels that read experts through `arena.table` (the CUDA-graph decode): lookups
        count as hits/misses like `experts`; misses are read before this returns. Raises
        CacheFullError when the budget cannot hold all of them at the same time."""
        keys = [(layer, e) for e in dict.fromkeys(int(i) for i in ids)]
        user = self.pinned()
        self.prefetches.route(layer, [k[1] for k in keys], self._arrival)
        for key in set(self._prefetched.pop(layer, ())) - set(keys):
            self._settle(key)
        held: list[ExpertKey] = []
        self._acquired[layer] = held
        with self._batched():
            for key in keys:
                hit = self.cache.lookup(key) is not None
                ok = self._hold(key, user) if hit else self._admit(key, user)
                if not ok and not hit:
                    self._drop_prefetches()
                    ok = self._admit(key, user)
                if not ok:
                    self.release(layer)
                    raise CacheFullError(f"cannot hold the {len(keys)} experts of layer {layer} at once in "
                                         f"{self.cache.capacity_slots} cache slots; unpin some or give the "
                                         "expert cache a larger budget")
                held.append(key)
            self._issue_deferred(layer)
        try:
            waited: set = set()
            for key in keys:
                self._join(key, waited=waited)
        except BaseException:
            self.release(layer)
            self._drop_prefetches()
            raise

    def resident(self, layer: int, ids: Sequence[int]) -> bool:
        loads, cache = self._loads, self.cache
        return all(cache.contains((layer, e)) and (layer, e) not in loads for e in ids)

    def _landed(self, key: ExpertKey) -> bool:
        """Whether the bytes of `key`'s read are in its slot: no read pending, or one that has
        completed without an error and is not joined yet (a pin's, say, of an expert not used
        since: it stays in `_loads` until then)."""
        fut = self._loads.get(key)
        if fut is None:
            return True
        if isinstance(fut, _DeviceCopy):
            return fut.done()
        return fut.done() and fut.exception() is None

    def reading(self) -> bool:
        return not all(fut.done() for fut in self._loads.values())

    def wait_reads(self) -> None:
        futures = []
        for fut in self._loads.values():
            if isinstance(fut, _DeviceCopy):
                fut.result()  # the copy's event
            else:
                futures.append(fut)
        wait(futures)

    def first_missing(self, routes: Sequence[Sequence[int]]) -> int | None:
        if isinstance(routes, np.ndarray) and routes.ndim == 2:
            # a step's [n_layers, width] ids: one lookup in the slot table, then, of the routed
            # keys with a read not joined yet (a key being read has its slot already; landed
            # hints' reads can be many), those whose read has not landed
            bad = ~self.arena.rows_resident(routes)
            loads = self._loads
            if loads:
                for layer, row in enumerate(routes.tolist()):
                    if not bad[layer] and any((layer, e) in loads and not self._landed((layer, e)) for e in row):
                        bad[layer] = True
            first = np.flatnonzero(bad)
            return int(first[0]) if first.size else None
        contains = self.cache.contains
        for layer, ids in enumerate(routes):
            for e in ids:
                if not contains((layer, e)) or not self._landed((layer, e)):
                    return layer
        return None

    def can_acquire(self, n: int) -> bool:
        acquired = sum(len(keys) for keys in self._acquired.values())
        return n <= self.cache.capacity_slots - len(self.pinned()) - acquired

    def release(self, layer: int) -> None:
        """Drop the holds of `acquire(layer)`."""
        for key in self._acquired.pop(layer, ()):
            self._settle(key)

    def load_all(self, on_unit: Callable[[int, int], None] | None = None) -> bool:
        """Read every expert of the main layers (`main_layers`: the pool; not the MTP block's,
        which the engine never routes) into the arena when the budget holds them all (then
        `arena.table` is complete for every layer the engine routes), calling
        `on_unit(units done, units)` as it goes; False, reading nothing, when it does not."""
        units = self.main_layers
        if len(units) * self.store.count > self.cache.capacity_slots:
            return False
        for i, u in enumerate(units):
            if on_unit is not None:
                on_unit(i, len(units))
            self._acquire(u, range(self.store.count))
            self.release(u)
        if on_unit is not None:
            on_unit(len(units), len(units))
        return True

    def all_resident(self) -> bool:
        """Every expert of the main layers (the pool) is in the arena, e.g. after `load_all`, or
        once decode's misses have brought them all back after a flush; experts of the MTP block
        in the cache, if any, neither count nor matter. O(1) (per-layer counts of the cache)
        unless reads are not joined yet when the count is complete (the last expert pinned, or
        hinted, and not used yet): then each must have landed (`_landed`), since a whole step
        reads every slot through the table without an `acquire`. A query only: it joins and
        waits for nothing (`DecodeRunner.can_chunk` asks it outside the engine's lock, and a
        step that waited here for a disk read would idle the device), so a read in flight keeps
        the steps layered (or guessed) until it lands; a failed one, until it is joined."""
        cache = self.cache
        beyond = sum(cache.resident_in(layer) for layer in self._beyond)
        if len(cache) - beyond != len(self.main_layers) * self.store.count:
            return False
        return all(self._landed(key) for key in self._loads)

    def _record(self, layer: int, ids: Iterable[int]) -> None:
        """Cache lookups of experts used through the slot table (all hits). This is the layer's
        call, so its prefetch holds end here (as in `experts`)."""
        for key in self._prefetched.pop(layer, ()):
            self._settle(key)
        for e in dict.fromkeys(int(i) for i in ids):
            if self.cache.lookup((layer, e)) is None:
                raise ExpertCacheError(f"expert {e} of layer {layer} was used but is not resident")

    def _record_routes(self, routes: Sequence[Sequence[int]], keys: list[ExpertKey]) -> None:
        """A step's lookups in one cache call (`ExpertCache.lookup_many`); layer by layer while
        prefetch holds are kept (each ends at its layer's lookups)."""
        if self._prefetched:
            super()._record_routes(routes, keys)
            return
        for key, slot in zip(keys, self.cache.lookup_many(keys)):
            if slot is None:
                raise ExpertCacheError(f"expert {key[1]} of layer {key[0]} was used but is not resident")

    def prefetch(self, layer: int, ids: Iterable[int], fence: torch.cuda.Event | None = None) -> None:
        """Start reading these experts of `layer` now and keep them until its next call; with
        `fence`, reads into freed slots wait only for the device work before it."""
        self._prefetch(layer, ids, "hash", (), fence)

    def prefetch_predicted(self, layer: int, ids: Iterable[int], keep: Iterable[ExpertKey] = (),
                           fence: torch.cuda.Event | None = None) -> None:
        """`prefetch` of predicted experts; the resident `keep` keys are held meanwhile (never
        evicted). With `keep`, issued when the call of keep's layer has queued its reads (module
        docstring); without, at once, its reads waiting for the device work before `fence` (if
        given) instead of all work queued so far."""
        keep = list(dict.fromkeys(keep))
        if self._deferred is not None:  # an older hint whose call never came: issue it now
            self._issue_deferred(self._deferred.after)
        if keep:
            self._deferred = _Hint(layer, list(ids), keep)
        else:
            self._prefetch(layer, ids, "lookahead", (), fence)

    def fence(self) -> torch.cuda.Event | None:
        """An event recorded on the compute stream now (device arenas; None for a host arena)."""
        if self._staging is None:
            return None
        event = torch.cuda.Event()
        event.record(self._compute())
        return event

    def _issue_deferred(self, layer: int) -> None:
        """Issue the hint waiting for `layer`'s call, if any."""
        hint = self._deferred
        if hint is not None and hint.after == layer:
            self._deferred = None
            self._prefetch(hint.layer, hint.ids, "lookahead", hint.keep)

    def _prefetch(self, layer: int, ids: Iterable[int], source: str, keep: Iterable[ExpertKey],
                  fence: torch.cuda.Event | None = None) -> None:
        ids = list(dict.fromkeys(int(i) for i in ids))
        self.prefetches.predict(layer, ids, source)
        user = self.pinned()
        kept = [key for key in dict.fromkeys(keep)
                if not self.cache.holds(key) and self.cache.peek(key) is not None and key not in user
                and self._hold(key, user)]
        try:
            with self._batched(table=False):
                if fence is not None and self._batch is None:  # this hint's reads wait for the fence only
                    self._batch = _Batch(fence)
                mine = self._prefetched.setdefault(layer, [])
                holding = sum(len(v) for v in self._prefetched.values())  # prefetch holds, counted once
                for e in ids:
                    key = (layer, e)
                    if self.cache.holds(key):
                        continue
                    if holding >= self._prefetch_limit:
                        break
                    if self.cache.peek(key) is not None:
                        if not self._hold(key, user):
                            break
                    elif not self.prefetches.may_read(source):  # its gate is closed: settled, not read
                        self.prefetches.skipped(key)
                        continue
                    elif not self._admit(key, user):
                        break
                    else:
                        self.prefetches.issued(key, source)
                    mine.append(key)
                    holding += 1
        finally:
            for key in kept:
                self._release(key)

    def _arrival(self, key: ExpertKey) -> str:
        """Where a prefetched read stands now (engine/experts/prefetch.py PrefetchLedger.route)."""
        if self.cache.peek(key) is None:
            return "gone"
        fut = self._loads.get(key)
        return "in_time" if fut is None or fut.done() else "in_flight"

    # ------------------------------------------------------------------ management
    def pinned(self) -> frozenset[ExpertKey]:
        """The keys the user pinned (not this provider's transient holds)."""
        return self.cache.pinned()

    def _pin_one(self, key: ExpertKey) -> None:
        """Pin `key` and, when it is not resident, admit it and start its read now."""
        self._drop_prefetches()  # their holds would count against the pin limit
        self.cache.pin(key)
        self._release(key)  # a transient hold becomes the user's pin
        if self.cache.peek(key) is None and not self._admit(key, frozenset({key})):
            self.cache.unpin(key)
            raise CacheFullError(f"cannot load pinned expert {key[1]} of layer {key[0]}: every cache "
                                 "slot is pinned or in use")

    def _unpin_one(self, key: ExpertKey) -> None:
        self._settle(key)  # a read still in flight finishes (or is un-admitted) first
        self.cache.unpin(key)

    def flush(self) -> list[ExpertKey]:
        """Evict every unpinned expert (after pending reads finish); returns the evicted keys."""
        self.settle_records()
        self._drop_prefetches()
        self.prefetches.forget()
        for key in list(self._loads):
            self._settle(key)
        evicted = self.cache.flush()
        for key in evicted:
            self.arena.clear(*key)
        self.arena.sync_table()
        return evicted

    def fill_tier(self) -> TierFill | None:
        """Start filling the host tier's free slots from the disk in the background, the main
        layers' experts (engine/experts/tier_fill.py), yielding to this provider's reads; None
        without a tier. Once; `close` stops it."""
        if self.tier is None or self.fill is not None or self._closed:
            return None
        self.fill = TierFill(self.tier, fill_order(self.main_layers, self.store.count),
                             busy=lambda: self.pool.pending > 0).start()
        return self.fill

    def close(self) -> None:
        """Stop the tier's filler, finish pending reads, stop the I/O threads, close the files.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.fill is not None:
            self.fill.stop()
        for fut in self._loads.values():
            if isinstance(fut, _DeviceCopy):
                fut.result()
            else:
                wait([fut])
        self._loads.clear()
        if self._copy is not None:  # RAM-tier copies joined on the device only may still run
            self._copy.synchronize()
        self.pool.close()
        self.store.close()
        if self.tier is not None:
            self.tier.close()
