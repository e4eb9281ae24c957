"""HostTier (engine/experts/host_tier.py) on the CPU: admission, eviction by its own policy,
holds that are never evicted, a budget it never exceeds, I/O errors that leave it consistent,
and O_DIRECT-aligned slots. (Its use behind a CUDA arena needs a GPU: not run here.)"""

from __future__ import annotations

import random

import pytest

from engine import pack as layout
from converter.convert import convert
from converter.synth import SynthOptions, tiny_config, write_checkpoint
from engine.config import ConfigError, EngineConfig
from engine.experts.cache import ExpertCacheError
from engine.experts.host_tier import HostTier, pinned_tier
from engine.experts.page_locked import PinError
from engine.experts.store import ExpertChecksumError, ExpertReadError, ExpertStore
from engine.weights import open_model


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("tier")
    return convert(write_checkpoint(root / "ckpt", tiny_config(), SynthOptions(seed=2)), root / "pack")


class FlakyStore(ExpertStore):
    """Reads of the records in `bad` fail with EIO (every attempt); `corrupt` ones get a flipped byte."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.bad: set[tuple[int, int]] = set()
        self.corrupt: set[tuple[int, int]] = set()
        self.reads = 0

    def read_into(self, layer, expert, out):
        self.reads += 1
        if (layer, expert) in self.bad:
            raise ExpertReadError(f"reading expert {expert} of layer {layer} failed: Input/output error")
        super().read_into(layer, expert, out)

    def _pread(self, fd, out, offset):
        n = super()._pread(fd, out, offset)
        layer = next(u for u, f in self._fds.items() if f == fd)
        if (layer, (offset - self._where[layer][1]) // self.record_bytes) in self.corrupt:
            out[0] ^= 0x5A
        return n


def _store(pack) -> FlakyStore:
    return FlakyStore(pack, layout.read_manifest(pack))


def _record(pack, layer, expert) -> bytes:
    s = ExpertStore(pack, layout.read_manifest(pack))
    buf = bytearray(s.record_bytes)
    s.read_into(layer, expert, memoryview(buf))
    s.close()
    return bytes(buf)


def test_admission_hits_eviction_and_holds(pack):
    store = _store(pack)
    r = store.record_bytes
    tier = HostTier(store, 3 * r + r // 2, num_layers=6, policy="lru", pin_memory=False)
    assert tier.slots == 3 and tier.nbytes == 3 * r and tier.data.data_ptr() % 4096 == 0  # O_DIRECT-ready
    for e in (0, 1, 2):
        slot, must_read = tier.hold((1, e))
        assert must_read
        tier.read((1, e), slot)
        tier.done((1, e))
        assert bytes(tier.data[slot].numpy()) == _record(pack, 1, e)
    assert store.reads == 3
    slot, must_read = tier.hold((1, 0))  # a RAM hit: nothing to read
    assert not must_read and bytes(tier.data[slot].numpy()) == _record(pack, 1, 0)
    assert tier.hold((1, 0)) is None  # already in transfer
    tier.done((1, 0))
    held = tier.hold((1, 1))  # a hit; (1, 1) in transfer: never the victim
    slot3, must_read = tier.hold((2, 5))  # evicts the least recently used unheld: (1, 2)
    assert must_read and (1, 2) not in tier and (1, 1) in tier and (1, 0) in tier
    assert slot3 != held[0]
    tier.read((2, 5), slot3)
    assert tier.hold((3, 3)) is not None  # the last unheld slot: (1, 0) goes
    assert tier.hold((3, 4)) is None  # every slot is in transfer: read past the tier
    assert tier.held() == {(1, 1), (2, 5), (3, 3)}
    for key in ((1, 1), (2, 5), (3, 3)):
        tier.done(key)
    assert tier.flush() and len(tier.cache) == 0 and tier.held() == frozenset()
    s = tier.stats()
    assert (s.hits, s.misses, s.evictions) == (2, 6, 2) and s.capacity_entries == 3  # (3, 4): a miss not admitted
    with pytest.raises(ExpertCacheError, match="not held"):
        tier.done((1, 1))
    with pytest.raises(ExpertCacheError, match="smaller than one expert record"):
        HostTier(store, r - 1, num_layers=6, pin_memory=False)
    store.close()


def test_a_record_the_device_drops_is_refreshed_in_the_tier_without_counting_a_lookup(pack):
    store = _store(pack)
    tier = HostTier(store, 2 * store.record_bytes, num_layers=6, policy="lru", pin_memory=False)
    for e in (0, 1):  # (1, 0) read first: the tier's least recently used
        slot, _ = tier.hold((1, e))
        tier.read((1, e), slot)
        tier.done((1, e))
    before = tier.stats()
    tier.refresh((1, 0))  # the device evicted it: its next miss will come here
    tier.refresh((4, 4))  # not in the tier: nothing happens
    after = tier.stats()
    assert (after.hits, after.misses) == (before.hits, before.misses)
    tier.hold((2, 2))  # a new record evicts (1, 1) now, not (1, 0)
    assert (1, 0) in tier and (1, 1) not in tier and (4, 4) not in tier
    store.close()


def test_never_exceeds_its_budget_and_io_errors_leave_it_consistent(pack):
    store = _store(pack)
    r = store.record_bytes
    tier = HostTier(store, 5 * r, num_layers=6, policy="lru", pin_memory=False)
    store.bad = {(2, 3), (4, 9)}
    store.corrupt = {(0, 7)}
    rng = random.Random(0)
    in_flight: list[tuple[tuple[int, int], int, bool]] = []
    failures = 0
    for _ in range(400):
        if in_flight and (rng.random() < 0.5 or len(in_flight) == tier.slots):
            key, slot, must_read = in_flight.pop(rng.randrange(len(in_flight)))
            ok = True
            if must_read:
                try:
                    tier.read(key, slot)
                except ExpertReadError as e:  # EIO, or a checksum mismatch
                    ok, failures = False, failures + 1
                    assert f"expert {key[1]} of layer {key[0]}" in str(e)
                    assert isinstance(e, ExpertChecksumError) == (key == (0, 7))
            tier.done(key, ok)
            if ok:
                assert bytes(tier.data[slot].numpy()) == _record(pack, *key)
            else:
                assert key not in tier  # a failed read leaves no record behind
        else:
            key = (rng.choice([0, 2, 4]), rng.randrange(12))
            got = tier.hold(key)
            if got is not None:
                in_flight.append((key, *got))
        # invariants: within budget, holds are held (not pinned) and resident, slots distinct
        assert len(tier.cache) <= tier.slots and tier.nbytes <= 5 * r
        assert tier.held() == {k for k, _, _ in in_flight} == tier.cache.held() and not tier.cache.pinned()
        assert all(k in tier for k in tier.held())
        assert len(set(tier.cache.resident().values())) == len(tier.cache)
    assert failures > 0
    store.close()


def test_config_and_cpu_have_one_tier(pack):
    assert EngineConfig(host_cache_bytes=5 << 29).host_cache_bytes == 5 << 29
    for bad in (-1, float("nan"), float("inf"), 2.5):
        with pytest.raises(ConfigError, match="host_cache_bytes"):
            EngineConfig(host_cache_bytes=bad)
    files = open_model(pack, cache_bytes=4 * layout.read_manifest(pack).record.record_bytes,
                       host_cache_bytes=1 << 30)
    try:
        assert files.experts.tier is None and files.experts.arena.on_host  # the arena is the RAM tier
    finally:
        files.close()


def test_a_tier_that_cannot_be_pinned_is_halved_until_it_can(pack):
    """The memory a process may pin can be less than free RAM (container or locked-memory
    limits): the tier halves its budget until the allocation succeeds, or gives up below one
    record; other errors are not swallowed."""
    store = ExpertStore(pack, layout.read_manifest(pack))
    record = store.record_bytes
    tried = []

    def make(limit):
        def build(store, budget, **kw):
            tried.append(budget)
            if budget > limit:
                raise PinError("cudaHostRegister failed")
            return HostTier(store, budget, pin_memory=False, **kw)
        return build

    tier = pinned_tier(store, 10 * record, num_layers=4, make=make(3 * record))
    assert tried == [10 * record, 5 * record, 5 * record // 2] and tier.slots == 2
    tried.clear()
    assert pinned_tier(store, 4 * record, num_layers=4, make=make(0)) is None and tried == [4 * record, 2 * record, record]

    def broken(store, budget, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        pinned_tier(store, 4 * record, num_layers=4, make=broken)
    store.close()


def test_the_cache_snapshot_reports_the_tier_and_where_misses_came_from(pack):
    """The app's panes and /stats show the tier (engine.stats.cache_snapshot): its fill, RAM hits
    and disk reads; reset_stats (after the warm-up) zeroes the counters, not what it holds."""
    from types import SimpleNamespace

    from engine.experts.cache import ExpertCache
    from engine.stats import cache_snapshot

    store = _store(pack)
    r = store.record_bytes
    tier = HostTier(store, 4 * r, num_layers=6, pin_memory=False)
    device = ExpertCache(2 * r, r, num_layers=6, num_experts=store.count)
    args = SimpleNamespace(n_layers=6)
    assert cache_snapshot(device, args, [0] * 6).tier is None
    for key in ((1, 0), (1, 1), (1, 0)):  # two disk reads, then a RAM hit
        slot, must_read = tier.hold(key)
        if must_read:
            tier.read(key, slot)
        tier.done(key)
    t = cache_snapshot(device, args, [0] * 6, tier).tier
    assert (t.ram_hits, t.disk_reads, t.entries, t.capacity_entries) == (1, 2, 2, 4)
    assert t.used_bytes == 2 * r and t.capacity_bytes == 4 * r and t.hit_rate == pytest.approx(1 / 3)
    assert not t.filling and t.fill_error is None  # no fill
    tier.reset_stats()
    t = cache_snapshot(device, args, [0] * 6, tier).tier
    assert (t.ram_hits, t.disk_reads, t.entries) == (0, 0, 2)
    running = SimpleNamespace(running=True, error=None)  # a TierFill's figures (engine/experts/tier_fill.py)
    assert cache_snapshot(device, args, [0] * 6, tier, running).tier.filling
    failed = SimpleNamespace(running=False, error="filling the host RAM tier stopped at expert 3 of layer 1: EIO")
    t = cache_snapshot(device, args, [0] * 6, tier, failed).tier
    assert not t.filling and t.fill_error == failed.error
    store.close()
