"""The engine's expert pool is the main layers' routed experts: the pack also stores the MTP
block's (unit n_layers), but the engine never runs the block, so `load_all` reads only the main
layers', `all_resident` asks only for them (decode's misses bring them back after a flush, and
the decode runner returns to whole mode), and the memory plan's pool counts only them."""

from __future__ import annotations

import torch

from engine import pack as layout
from engine.checkpoint import TensorIndex
from engine.config import EngineConfig
from engine.decode_graph import DecodeRunner
from engine.memory_plan import GiB, Machine, make_plan
from engine.model import Transformer
from engine.numerics import Numerics
from engine.weights import model_footprint, open_model

PROMPT = [0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3, 77]


def _sizes(packed) -> tuple[int, int, int]:
    """(main layers, experts per layer, record bytes) of the pack, which also holds the MTP block's experts."""
    m = layout.read_manifest(packed)
    n_layers = model_footprint(packed).args.n_layers
    assert [u.layer for u in m.units] == list(range(n_layers + 1))  # the MTP block is unit n_layers
    return n_layers, m.count, m.record.record_bytes


def _refill(provider, layers: range, count: int) -> None:
    """Use every expert of `layers` as decode does: the eager MoE through `experts`, the decode
    runner's layered steps through `acquire`/`release` (alternate layers)."""
    for layer in layers:
        if layer % 2:
            provider.acquire(layer, range(count))
            provider.release(layer)
        else:
            assert sorted(e for e, _ in provider.experts(layer, range(count))) == list(range(count))


def test_a_cache_of_the_main_layers_experts_loads_the_whole_pool(packed):
    """A cache of exactly the main layers' experts (the default budget) holds the pool: `load_all`
    reads them, and no MTP expert, and `all_resident` is True."""
    n_layers, count, record = _sizes(packed)
    for budget in (n_layers * count * record, None):
        files = open_model(packed, cache_bytes=budget)
        try:
            p = files.experts
            assert p.cache.capacity_slots == n_layers * count
            assert not p.all_resident()
            assert p.load_all() and p.all_resident()
            assert {key[0] for key in p.cache.resident()} == set(range(n_layers))  # no MTP expert read
            assert p.stats().admissions == n_layers * count
        finally:
            files.close()


def test_decode_misses_make_the_pool_resident_again_after_a_flush(packed):
    """After a flush, using every main-layer expert again (as decode's misses do) makes the pool
    resident: `all_resident` turns True with the last of them, no MTP expert needed."""
    n_layers, count, _ = _sizes(packed)
    files = open_model(packed)
    try:
        p = files.experts
        assert p.load_all() and p.all_resident()
        assert len(p.flush()) == n_layers * count and not p.all_resident()
        _refill(p, range(n_layers - 1), count)
        assert not p.all_resident()  # one layer's experts still missing
        _refill(p, range(n_layers - 1, n_layers), count)
        assert p.all_resident() and len(p.cache) == n_layers * count
    finally:
        files.close()


def test_an_mtp_expert_in_the_cache_does_not_stand_in_for_a_main_one(packed):
    """With an MTP expert resident (only a user of the block would read one), as many experts as
    the pool are resident while one main-layer expert is missing: not all resident yet."""
    n_layers, count, record = _sizes(packed)
    files = open_model(packed, cache_bytes=(n_layers * count + 1) * record)
    try:
        p = files.experts
        p.acquire(n_layers, [0])  # the MTP block's expert 0
        p.release(n_layers)
        _refill(p, range(n_layers - 1), count)
        p.acquire(n_layers - 1, range(count - 1))
        p.release(n_layers - 1)
        assert len(p.cache) == n_layers * count and not p.all_resident()
        p.acquire(n_layers - 1, [count - 1])
        p.release(n_layers - 1)
        assert p.all_resident() and (n_layers, 0) in p.cache
    finally:
        files.close()


def test_the_decode_runner_returns_to_whole_mode_once_the_main_layers_are_resident(packed):
    """/flush sends the runner to layered steps, whose misses bring back main-layer experts only;
    once every main-layer expert is resident again the runner is back to one whole step (and
    chunk steps), with the logits of the eager forward."""
    n_layers, count, _ = _sizes(packed)
    files, ref_files = open_model(packed), open_model(packed)
    try:
        p = files.experts
        assert p.load_all()
        model = Transformer(files.get, files.args, Numerics.named("native"))
        ref_model = Transformer(ref_files.get, ref_files.args, Numerics.named("native"))
        state, ref_state = model.new_state(), ref_model.new_state()
        model.forward(torch.tensor(PROMPT), state, p)
        ref_model.forward(torch.tensor(PROMPT), ref_state, ref_files.experts)
        runner = DecodeRunner(model, p, whole=True, graphs=False)

        def step(tok: int) -> None:
            want = ref_model.forward(torch.tensor([tok]), ref_state, ref_files.experts, last_only=True)
            got = runner.step(state, tok)
            assert ((want - got).abs().max() / want.abs().max()).item() <= 1e-4

        step(3)
        assert runner.whole and runner.can_chunk()
        runner.settle()  # as Engine.flush_cache does
        p.flush()
        for tok in (4, 5):
            step(tok)
            assert not runner.whole and not runner.can_chunk()
        assert all(layer < n_layers for layer, _ in p.cache.resident())  # decode reads no MTP expert
        _refill(p, range(n_layers), count)  # the rest of the pool, as later tokens' misses would
        assert runner.can_chunk()
        step(6)
        assert runner.whole
    finally:
        files.close()
        ref_files.close()


def test_the_memory_plans_pool_is_the_main_layers_experts(packed, separated_ckpt):
    """The footprint's pool is the main layers' records: a cache budget of exactly them holds the
    whole pool (every expert resident), and the provider opened with it loads them all; one record
    less streams, with a host tier of the pool that reads each record once (O_DIRECT). An official
    checkpoint's pool leaves the MTP block's expert tensors out too."""
    n_layers, count, record = _sizes(packed)
    fp = model_footprint(packed)
    assert fp.pool == n_layers * count * record  # not the (n_layers + 1) units the pack holds
    machine = Machine("cuda:0", unified=False, total=80 * GiB, available=78 * GiB, host_total=128 * GiB,
                      host_available=120 * GiB)
    plan = make_plan(fp, EngineConfig(device="cuda", cache_bytes=fp.pool), machine)
    assert plan.resident and plan.cache == plan.pool == fp.pool and plan.host_cache == 0
    assert "every expert resident" in plan.summary() and not plan.notes  # not capped: it is the pool
    less = make_plan(fp, EngineConfig(device="cuda", cache_bytes=fp.pool - record), machine)
    assert not less.resident and less.host_cache == fp.pool and less.direct_reads
    assert f"{n_layers * count - 1} of {n_layers * count} experts" in "\n".join(less.lines())
    assert layout.read_manifest(packed).pool_bytes(n_layers) == fp.pool
    files = open_model(packed, cache_bytes=plan.cache)
    try:
        assert files.experts.load_all() and files.experts.all_resident()
    finally:
        files.close()
    official = model_footprint(separated_ckpt)
    with TensorIndex.open(separated_ckpt) as index:
        experts = {n: index.info(n).nbytes for n in index.names() if ".ffn.experts." in n}
    mtp = sum(b for n, b in experts.items() if n.startswith("mtp."))
    assert mtp > 0 and official.pool == sum(experts.values()) - mtp


def test_a_whole_pool_cache_refuses_the_mtp_blocks_experts_clearly_and_holds_nothing(packed):
    """A cache of exactly the pool never evicts, so an MTP expert admitted into it would keep a
    main-layer expert out for good: it is refused with the fix named, and the call leaves no
    hold behind; the main layers still all load."""
    import pytest

    from engine.experts.cache import ExpertCacheError

    n_layers, count, _ = _sizes(packed)
    files = open_model(packed)  # the default budget: the pool
    try:
        p = files.experts
        with pytest.raises(ExpertCacheError, match="outside this cache's pool.*no spare slot.*more than"):
            list(p.experts(n_layers, [0]))
        with pytest.raises(ExpertCacheError, match="outside this cache's pool"):
            p.acquire(n_layers, [0])
        assert p.cache.held() == frozenset() and len(p.cache) == 0
        assert p.load_all() and p.all_resident()
    finally:
        files.close()


def test_the_pool_is_resident_only_once_its_last_read_has_landed(packed, monkeypatch):
    """After a flush, the last missing expert pinned (its read starts at once, joined on its next
    use): a whole step reads every slot through the table without acquiring, so `all_resident`
    says no while that read is in flight, and yes once it has landed (joining nothing: it is a
    query, asked outside the engine's lock too); the slot then holds the record's bytes."""
    import threading
    import time

    n_layers, count, record = _sizes(packed)
    files = open_model(packed)
    try:
        p = files.experts
        assert p.load_all()
        p.flush()
        _refill(p, range(n_layers), count)
        last = (n_layers - 1, count - 1)
        old = p.cache.peek(last)
        p.cache.discard(last)  # as if evicted: the one expert missing, its slot overwritten
        p.arena.clear(*last)
        p.arena.data[old].zero_()
        release = threading.Event()
        read = p.store.read_into

        def held_back(layer, expert, out):
            if (layer, expert) == last:
                release.wait(10)
            read(layer, expert, out)

        monkeypatch.setattr(p.store, "read_into", held_back)
        p.pin([last])  # its read waits on the I/O thread until `release`
        assert not p.all_resident() and p.reading()  # counted complete, its bytes not there yet
        release.set()
        deadline = time.monotonic() + 10
        while not p.all_resident() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.all_resident() and not p.reading()
        slot = p.cache.peek(last)
        want = bytearray(record)
        read(last[0], last[1], memoryview(want))
        assert bytes(p.arena.data[slot].numpy()) == bytes(want)
    finally:
        release.set()
        files.close()
