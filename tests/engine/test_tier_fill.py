"""TierFill (engine/experts/tier_fill.py) on the CPU: the background fill of a host-RAM tier reads
every record the tier lacks into its free slots with the store's bytes, never evicts, yields to
demand reads, stops on request and on a failed read (leaving the tier consistent), and runs on
named threads. Also HostTier.claim_free and IOPool.pending, which it relies on."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from converter.convert import convert
from converter.synth import SynthOptions, tiny_config, write_checkpoint
from engine import pack as layout
from engine.experts.cache import ExpertCache
from engine.experts.host_tier import HostTier
from engine.experts.io_pool import IOPool
from engine.experts.store import ExpertReadError, ExpertStore
from engine.experts.tier_fill import TierFill, fill_order
from engine.stats import cache_snapshot


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("fill")
    return convert(write_checkpoint(root / "ckpt", tiny_config(), SynthOptions(seed=3)), root / "pack")


class CountingStore(ExpertStore):
    """Counts reads; the records in `bad` fail with EIO; `gate`, when set, blocks each read until set."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.bad: set[tuple[int, int]] = set()
        self.reads: list[tuple[int, int]] = []
        self.gate: threading.Event | None = None

    def read_into(self, layer, expert, out):
        if self.gate is not None:
            self.gate.wait()
        self.reads.append((layer, expert))
        if (layer, expert) in self.bad:
            raise ExpertReadError(f"reading expert {expert} of layer {layer} failed: Input/output error")
        super().read_into(layer, expert, out)


def _store(pack) -> CountingStore:
    return CountingStore(pack, layout.read_manifest(pack))


def _record(store, key) -> bytes:
    buf = bytearray(store.record_bytes)
    ExpertStore.read_into(store, key[0], key[1], memoryview(buf))
    return bytes(buf)


def _finish(fill: TierFill, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while fill.running and time.monotonic() < end:
        time.sleep(0.01)
    assert not fill.running, "the fill did not finish"


def test_fill_order_takes_a_block_of_every_layer_in_turn():
    assert fill_order([0, 1], 5, block=2) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3),
                                             (0, 4), (1, 4)]
    assert fill_order([3], 3) == [(3, 0), (3, 1), (3, 2)]
    assert len(set(fill_order(range(43), 256))) == 43 * 256


def test_a_whole_pool_tier_is_filled_with_the_stores_bytes_on_named_threads(pack):
    store = _store(pack)
    layers = store.layers()
    keys = fill_order(layers, store.count)
    tier = HostTier(store, len(keys) * store.record_bytes, num_layers=len(layers), pin_memory=False)
    tier.hold(keys[3])  # the engine reads this one itself: the filler skips it
    fill = TierFill(tier, keys, busy=lambda: False, threads=3)
    store.gate = threading.Event()
    fill.start()
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("dsv4-tier-fill"))
    store.gate.set()
    _finish(fill)
    assert names == ["dsv4-tier-fill-0", "dsv4-tier-fill-1", "dsv4-tier-fill-2"]
    tier.done(keys[3], ok=False)  # the engine's read failed: the key leaves the tier
    assert fill.error is None and fill.progress() == (len(keys) - 1, len(keys))
    assert sorted(store.reads) == sorted(k for k in keys if k != keys[3])  # each record read once
    for key in keys:
        if key != keys[3]:
            slot = tier.cache.peek(key)
            assert bytes(tier.data[slot].numpy()) == _record(store, key)
    s = tier.stats()
    assert (s.hits, s.misses, s.evictions) == (0, 1, 0)  # the engine's one lookup; a fill is none
    assert tier.held() == frozenset() and not tier.full
    with pytest.raises(RuntimeError, match="started already"):
        fill.start()
    store.close()


def test_a_smaller_tier_fills_its_free_slots_with_a_share_of_every_layer_and_never_evicts(pack):
    store = _store(pack)
    layers = store.layers()
    tier = HostTier(store, 2 * len(layers) * store.record_bytes, num_layers=len(layers), pin_memory=False)
    fill = TierFill(tier, fill_order(layers, store.count, block=2), busy=lambda: False, threads=1).start()
    _finish(fill)
    assert tier.full and fill.filled == tier.slots and len(store.reads) == tier.slots
    assert sorted(tier.cache.resident()) == [(layer, e) for layer in layers for e in (0, 1)]
    assert tier.stats().evictions == 0
    store.close()


def test_the_fill_waits_while_demand_reads_are_in_flight_and_stops_on_request(pack):
    store = _store(pack)
    keys = fill_order(store.layers(), store.count)
    tier = HostTier(store, len(keys) * store.record_bytes, num_layers=len(store.layers()), pin_memory=False)
    busy = threading.Event()
    busy.set()
    fill = TierFill(tier, keys, busy=busy.is_set).start()
    time.sleep(0.1)
    assert fill.running and store.reads == [] and fill.filled == 0  # demand reads first
    t = time.monotonic()
    fill.stop()
    assert time.monotonic() - t < 1.0 and not fill.running and store.reads == []
    fill.stop()  # idempotent
    resumed = TierFill(tier, keys, busy=busy.is_set).start()
    time.sleep(0.05)
    busy.clear()
    _finish(resumed)
    assert resumed.filled == len(keys)
    store.close()


def test_a_failed_read_stops_the_fill_and_leaves_the_tier_consistent(pack):
    store = _store(pack)
    keys = fill_order(store.layers(), store.count)
    bad = keys[5]
    store.bad = {bad}
    tier = HostTier(store, len(keys) * store.record_bytes, num_layers=len(store.layers()), pin_memory=False)
    fill = TierFill(tier, keys, busy=lambda: False, threads=1).start()
    _finish(fill)
    assert fill.filled == 5 and f"expert {bad[1]} of layer {bad[0]}" in fill.error
    assert "Input/output error" in fill.error
    assert bad not in tier and tier.held() == frozenset() and len(tier.cache) == 5
    assert all(k in tier for k in keys[:5])
    device = ExpertCache(store.record_bytes, store.record_bytes, num_layers=len(store.layers()), num_experts=store.count)
    shown = cache_snapshot(device, SimpleNamespace(n_layers=len(store.layers())), [0], tier, fill).tier
    assert not shown.filling and shown.fill_error == fill.error  # what the app's panes and /stats show
    store.close()
    store = _store(pack)  # several threads: every one stops; the tier stays consistent
    store.bad = {bad}
    tier = HostTier(store, len(keys) * store.record_bytes, num_layers=len(store.layers()), pin_memory=False)
    fill = TierFill(tier, keys, busy=lambda: False, threads=4).start()
    _finish(fill)
    assert fill.error is not None and bad not in tier and tier.held() == frozenset()
    assert len(tier.cache) == fill.filled < len(keys)
    with pytest.raises(ValueError, match="at least one thread"):
        TierFill(tier, keys, busy=lambda: False, threads=0)
    store.close()


def test_claim_free_takes_only_free_slots_and_holds_the_key(pack):
    store = _store(pack)
    tier = HostTier(store, 2 * store.record_bytes, num_layers=4, policy="lru", pin_memory=False)
    slot = tier.claim_free((1, 1))
    assert slot is not None and tier.held() == {(1, 1)}
    assert tier.hold((1, 1)) is None  # being filled: the engine reads past the tier
    assert tier.claim_free((1, 1)) is None
    tier.read((1, 1), slot)
    tier.done((1, 1))
    assert tier.hold((1, 1)) == (slot, False)  # now a RAM hit
    tier.done((1, 1))
    assert tier.claim_free((2, 0)) is not None and tier.full
    assert tier.claim_free((3, 0)) is None and (1, 1) in tier  # full: nothing is evicted
    store.close()


def test_the_io_pool_counts_pending_work():
    pool = IOPool(1).start()
    gate = threading.Event()
    try:
        assert pool.pending == 0
        first = pool.submit(gate.wait)
        second = pool.submit(lambda: 1 / 0)
        assert pool.pending == 2
        gate.set()
        first.result(timeout=5)
        with pytest.raises(ZeroDivisionError):
            second.result(timeout=5)
        end = time.monotonic() + 5
        while pool.pending and time.monotonic() < end:
            time.sleep(0.001)
        assert pool.pending == 0
    finally:
        pool.close()
