"""Streaming execution from the converted layout: logits bitwise equal to the official checkpoint
at any cache budget, waves below one call's needs, prefetch, pins, stats, store, I/O pool, trace."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from converter.convert import convert
from converter.synth import SynthOptions, tiny_config, write_checkpoint
from engine import pack as layout
from engine.checkpoint import CheckpointError, TensorIndex
from engine.experts.cache import CacheFullError, ExpertCacheError
from engine.experts.io_pool import IOPool
from engine.experts.trace import RoutingTrace
from engine.experts.store import ExpertReadError, ExpertStore, aligned_empty
from engine.experts.trace import TraceWriter, read_records
from engine.model import Transformer
from engine.experts.weights import ExpertWeights
from engine.numerics import Numerics
from engine.weights import open_model, open_official

E, K, UNITS = 16, 4, 6  # tiny: experts per layer, experts per token, 5 layers + MTP
MAIN = UNITS - 1  # the layers the engine routes: their experts are the pool (not the MTP block's)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", tiny_config(),
                            SynthOptions(seed=1, n_shards=2))


@pytest.fixture(scope="module")
def packed(source: Path, tmp_path_factory) -> Path:
    return convert(source, tmp_path_factory.mktemp("out") / "pack")


@pytest.fixture(scope="module")
def record_bytes(packed: Path) -> int:
    return layout.read_manifest(packed).record.record_bytes


PROMPT = torch.tensor([0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3])
DECODE = [7, 123, 400]


def run(files, numerics: str, prompt: torch.Tensor, decode: list[int], log=None) -> list[torch.Tensor]:
    """Prefill `prompt`, then decode token by token; returns the logits of every call."""
    model = Transformer(files.get, files.args, Numerics.named(numerics))
    state = model.new_state()
    outs = [model.forward(prompt, state, files.experts, log=log)]
    for t in decode:
        outs.append(model.forward(torch.tensor([t]), state, files.experts, log=log))
    return outs


@pytest.fixture(scope="module")
def reference(source: Path) -> dict[str, list[torch.Tensor]]:
    files = open_official(source)
    refs = {"exact": run(files, "exact", PROMPT, DECODE), "native": run(files, "native", PROMPT[:5], [9])}
    files.close()
    return refs


def io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dsv4-io")]


BUDGETS = {"everything": None, "quarter_pool": UNITS * E // 4, "one_layer": E, "one_token_call": K,
           "one_record": 1}


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_logits_bitwise_equal_exact(packed, reference, record_bytes, budget):
    slots = BUDGETS[budget]
    calls: list[tuple[int, int]] = []  # (layer, distinct experts) of every MoE call

    def log(kind, layer, start, sel):
        if kind == "experts":
            calls.append((layer, len(set(sel.flatten().tolist()))))

    files = open_model(packed, cache_bytes=None if slots is None else slots * record_bytes)
    assert files.converted and io_threads() == ["dsv4-io-0", "dsv4-io-1"]
    outs = run(files, "exact", PROMPT, DECODE, log=log)
    for got, want in zip(outs, reference["exact"]):
        assert torch.equal(got, want)
    s = files.experts.stats()
    cache = files.experts.cache
    assert s == cache.stats()  # the provider's stats are the cache's counters
    assert s.hits + s.misses == sum(n for _, n in calls)  # one lookup per distinct expert per call
    assert s.bytes_read == s.admissions * record_bytes and s.admissions >= s.misses
    assert s.used_bytes <= s.capacity_bytes and s.entries <= s.capacity_entries
    assert s.pinned == s.pinned_pending == 0 and cache.pinned() == cache.held() == frozenset()  # no hold leaks
    assert s.capacity_entries == (MAIN * E if slots is None else slots)  # the pool: the main layers'
    if slots is None:
        assert s.evictions == 0 and s.misses + s.hits > s.misses
    if slots == 1:
        assert s.hits == 0 and s.misses == s.admissions == sum(n for _, n in calls)
    files.close()
    assert io_threads() == []


@pytest.mark.parametrize("budget", ["quarter_pool", "one_token_call"])
def test_logits_bitwise_equal_native(packed, reference, record_bytes, budget):
    files = open_model(packed, cache_bytes=BUDGETS[budget] * record_bytes, policy="lru")
    outs = run(files, "native", PROMPT[:5], [9])
    for got, want in zip(outs, reference["native"]):
        assert torch.equal(got, want)
    files.close()


def expert_bytes(source: Path, layer: int, e: int) -> list[bytes]:
    """The bytes of an official expert's six tensors as a record holds them (weights in record order)."""
    with TensorIndex.open(source) as idx:
        return weight_bytes(ExpertWeights.from_official(idx.get_expert(layer, e)))


def weight_bytes(w) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes()
            for t in (w.w1, w.w1_scale, w.w3, w.w3_scale, w.w2, w.w2_scale)]


def test_hits_first_then_misses_in_waves_with_one_record(source, packed, record_bytes):
    files = open_model(packed, cache_bytes=record_bytes)
    p = files.experts
    assert [e for e, _ in p.experts(3, [5])] == [5]
    order = []
    for e, w in p.experts(3, [1, 5, 9, 2]):  # budget 1: strictly one expert at a time
        assert weight_bytes(w) == expert_bytes(source, 3, e)
        assert len(p.cache) == 1
        order.append(e)
    assert order[0] == 5 and sorted(order) == [1, 2, 5, 9]  # the hit comes first
    s = p.stats()
    assert (s.hits, s.misses, s.evictions) == (1, 4, 3)
    files.close()


def test_one_call_budget_overlaps_hits_and_reads(source, packed, record_bytes):
    files = open_model(packed, cache_bytes=4 * record_bytes)
    p = files.experts
    list(p.experts(2, [0, 1]))
    got = {e: weight_bytes(w) for e, w in p.experts(2, [3, 1, 0, 7])}
    assert got == {e: expert_bytes(source, 2, e) for e in (0, 1, 3, 7)}
    s = p.stats()
    assert (s.hits, s.misses, s.evictions, s.entries) == (2, 4, 0, 4)
    files.close()


def test_early_stop_leaves_nothing_held(packed, record_bytes):
    files = open_model(packed, cache_bytes=2 * record_bytes)
    p = files.experts
    gen = p.experts(1, [0, 1, 2, 3])
    next(gen)
    gen.close()
    assert p.cache.pinned() == p.cache.held() == frozenset() and not p._loads
    assert len(list(p.experts(1, [4, 5, 6]))) == 3
    files.close()


def test_prefetch_then_hits(source, packed, record_bytes):
    files = open_model(packed, cache_bytes=8 * record_bytes)
    p = files.experts
    p.prefetch(0, [3, 4, 3, 6, 7, 8, 9])  # prefetch takes at most half the slots: 4
    s = p.stats()
    assert (s.admissions, s.hits + s.misses) == (4, 0)
    assert [e for e, _ in p.experts(0, [9, 3, 4])][:2] == [3, 4]  # prefetched = hits, first
    s = p.stats()
    assert (s.hits, s.misses) == (2, 1) and p.cache.pinned() == p.cache.held() == frozenset()
    assert (0, 6) in p.cache and (0, 7) in p.cache  # an unused hint stays cached, unheld
    p.prefetch(1, [0, 1, 2, 3])
    p.prefetch(2, [0, 1])  # over the limit: ignored
    assert p.stats().admissions == 4 + 1 + 4 and (2, 0) not in p.cache
    list(p.experts(2, list(range(8))))  # 4 free slots: runs in two waves, layer 1 kept
    assert p.cache.held() == {(1, 0), (1, 1), (1, 2), (1, 3)} and p.cache.pinned() == frozenset()
    for key in p.cache.resident():
        if key[0] == 2:
            p.cache.pin(key)  # now every slot is pinned or held for layer 1
    assert [e for e, _ in p.experts(3, [0])] == [0]  # the layer-1 prefetch holds give way
    assert p.cache.pinned() == {k for k in p.cache.resident() if k[0] == 2} and p.cache.held() == frozenset()
    assert sum(k[0] == 1 for k in p.cache.resident()) == 3
    files.close()


def test_record_ends_the_layers_prefetch_holds(packed):
    """A layer served from the arena without `experts` (whole-mode decode, the prefill cell path)
    reports its use through `record`: that ends the layer's prefetch holds, as `experts` does."""
    files = open_model(packed)
    p = files.experts
    assert p.load_all()
    p.prefetch(0, [1, 2, 3])
    assert p.cache.held() == {(0, 1), (0, 2), (0, 3)}
    p.record(0, [2, 5])
    assert p.cache.held() == p.cache.pinned() == frozenset()
    files.close()


def test_record_routes_is_record_layer_by_layer(packed, record_bytes):
    """A step's routes counted in one call (whole-mode decode, DecodeRunner) leave the cache, its
    policy and the usage counts as `record` layer by layer does: resident, with a layer's
    prefetch holds kept (which end at that layer's lookups) and with a streaming budget; an
    expert used but not resident is named."""
    routes = [[3, 1, 3, 0], [2, 15], [], [7, 7, 9, 4], [0, 1, 2, 3]]  # the MAIN layers, repeats, one empty
    for budget, prefetch in ((None, False), (None, True), (4 * UNITS * record_bytes, False)):
        pair = [open_model(packed, cache_bytes=budget) for _ in range(2)]
        for files in pair:
            p = files.experts
            if budget is None:
                assert p.load_all()
            else:  # the routes' experts resident, a few more beside them
                for layer, ids in enumerate(routes):
                    p.acquire(layer, ids + [11])
                    p.release(layer)
            if prefetch:  # held until their layer's lookups, the empty route's layer included
                p.prefetch(4, [1, 2, 12])
                p.prefetch(2, [8])
        one, many = (files.experts for files in pair)
        for _ in range(3):
            for layer, ids in enumerate(routes):
                one.record(layer, ids)
            many.record_routes(routes)
        assert many.cache.stats() == one.cache.stats() and many.cache.held() == one.cache.held() == frozenset()
        assert many.usage.uses == one.usage.uses and many.usage.layer_uses == one.usage.layer_uses
        assert many.hottest(UNITS * E) == one.hottest(UNITS * E)
        assert many.cache.resident() == one.cache.resident()
        if budget is not None:  # the same victims: the policies agree
            for files in pair:
                files.experts.acquire(5, list(range(E)))
            assert many.cache.resident() == one.cache.resident()
        for files in pair:
            files.close()
    files = open_model(packed, cache_bytes=3 * UNITS * record_bytes)
    with pytest.raises(ExpertCacheError, match="expert 6 of layer 1 was used but is not resident"):
        files.experts.record_routes([[], [6]])
    files.close()


def test_forward_uses_hash_layer_prefetch(packed, record_bytes):
    files = open_model(packed)
    run(files, "exact", PROMPT[:3], [])
    s = files.experts.stats()
    assert sum(s.layer_hits[:3]) > 0 and sum(s.layer_hits[3:]) == 0  # only hash layers prefetch
    files.close()


def test_user_pins_respected_and_cache_full_error(packed, record_bytes):
    files = open_model(packed, cache_bytes=2 * record_bytes)
    p = files.experts
    assert p.cache.pin((4, 5)) is False  # pending until admitted
    list(p.experts(4, [5, 6, 7, 8]))
    assert p.cache.pinned() == {(4, 5)} and (4, 5) in p.cache
    assert p.cache.pin((4, 6)) is False
    list(p.experts(4, [6]))
    with pytest.raises(CacheFullError, match="holds a pinned expert"):
        list(p.experts(4, [9]))
    assert p.cache.pinned() == {(4, 5), (4, 6)}
    p.cache.unpin_all()
    assert len(p.flush()) == 2 and len(p.cache) == 0
    files.close()


def test_store_reads_records_with_and_without_o_direct(source, packed, record_bytes):
    m = layout.read_manifest(packed)
    with TensorIndex.open(packed) as idx:
        want = idx.get("layers.2.ffn.experts")[11].numpy().tobytes()
    for o_direct in (False, True):
        store = ExpertStore(packed, m, o_direct=o_direct)
        buf = aligned_empty(record_bytes)
        assert buf.data_ptr() % 4096 == 0
        store.read_into(2, 11, memoryview(buf.numpy()))
        assert buf.numpy().tobytes() == want
        if o_direct:
            assert store.o_direct or "buffered" in store.o_direct_note
            odd = torch.empty(record_bytes + 1, dtype=torch.uint8)[1:]  # unaligned: EINVAL
            store.read_into(2, 11, memoryview(odd.numpy()))  # falls back, still correct
            assert odd.numpy().tobytes() == want and not store.o_direct
            assert "buffered" in store.o_direct_note
        with pytest.raises(ExpertReadError, match="no expert record"):
            store.read_into(9, 0, memoryview(buf.numpy()))
        store.close()
    files = open_model(packed, cache_bytes=4 * record_bytes, o_direct=True)
    assert [e for e, _ in files.experts.experts(2, [11])] == [11]
    files.close()


def test_store_reports_truncated_file(packed, tmp_path, record_bytes):
    broken = Path(shutil.copytree(packed, tmp_path / "b"))
    m = layout.read_manifest(broken)
    store = ExpertStore(broken, m)
    with TensorIndex.open(broken) as idx:
        cut = idx.info("layers.4.ffn.experts").offset + 3 * record_bytes
    with open(broken / "layer_04.safetensors", "r+b") as f:
        f.truncate(cut)
    with pytest.raises(ExpertReadError, match="truncated"):
        store.read_into(4, 5, memoryview(aligned_empty(record_bytes).numpy()))
    store.close()


def test_io_pool_named_threads_and_explicit_stop():
    pool = IOPool(3, name="dsv4-io-test")
    assert io_threads() == []  # nothing runs before start()
    pool.start()
    assert pool.threads() == ["dsv4-io-test-0", "dsv4-io-test-1", "dsv4-io-test-2"]
    assert pool.submit(lambda a, b: a + b, 2, 3).result() == 5
    fut = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result()
    assert pool.submit(threading.current_thread).result().name.startswith("dsv4-io-test-")
    pool.close()
    assert pool.threads() == [] and io_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(print)


def test_open_model_layouts(source, packed, tmp_path):
    official = open_model(source)
    assert not official.converted
    official.close()
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(packed / "layer_00.safetensors", partial)
    with pytest.raises(CheckpointError, match="did not finish"):
        open_model(partial)
    with pytest.raises(CheckpointError, match="neither a converted model"):
        open_model(tmp_path)


def test_routing_trace(packed, tmp_path):
    files = open_model(packed)
    with TraceWriter(tmp_path / "t.jsonl") as writer:
        run(files, "exact", PROMPT[:4], [3, 9], log=RoutingTrace(writer))
    files.close()
    recs = list(read_records(tmp_path / "t.jsonl"))
    assert [(r.step, r.layer, r.tokens) for r in recs] == (
        [(0, i, 4) for i in range(5)] + [(1, i, 1) for i in range(5)] + [(2, i, 1) for i in range(5)])
    assert all(len(row) == K for r in recs for row in r.experts)
