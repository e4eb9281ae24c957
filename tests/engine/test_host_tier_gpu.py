"""The host-RAM tier behind a CUDA arena (engine/experts/host_tier.py) on the tiny model: the
same logits as without it, RAM hits on the second pass, nothing held afterwards; the layered
CUDA-graph decode through it equals the eager step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from converter.convert import convert
from engine.decode_graph import DecodeRunner
from engine.experts.page_locked import ALIGNMENT, PageLocked
from engine.model import Transformer
from engine.numerics import Numerics
from engine.weights import open_model
from kernels.backend import make_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = torch.tensor([0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3])
DECODE = [7, 123, 400, 9, 77]


@pytest.fixture(scope="module")
def packed(separated_ckpt, tmp_path_factory) -> Path:
    return convert(separated_ckpt, tmp_path_factory.mktemp("out") / "pack")


def _open(packed, host: int | None, fill: bool = False):
    full = open_model(packed)
    record, pool = full.experts.store.record_bytes, full.args.n_layers * full.experts.store.count  # main layers'
    full.close()
    return (open_model(packed, cache_bytes=12 * record, device="cuda", host_cache_bytes=host, fill_tier=fill),
            record, pool)


def _pass(files, model) -> list[torch.Tensor]:
    state = model.new_state()
    outs = [model.forward(PROMPT.cuda(), state, files.experts, last_only=True)]
    outs += [model.forward(torch.tensor([t]).cuda(), state, files.experts, last_only=True) for t in DECODE]
    return [o.float().cpu() for o in outs]


def test_tier_serves_misses_with_the_same_bytes(packed):
    plain, record, pool = _open(packed, None)
    tiered, _, _ = _open(packed, pool * record)
    try:
        assert plain.experts.tier is None and tiered.experts.tier is not None
        tier = tiered.experts.tier
        assert tier.pinned_memory and tier.nbytes <= pool * record and tier.data.is_pinned()
        dev = torch.device("cuda")
        ms = [Transformer(lambda n, f=f: f.get(n).to(dev), f.args, Numerics.named("native", make_backend("torch", dev)))
              for f in (plain, tiered)]
        want = _pass(plain, ms[0])
        got = _pass(tiered, ms[1])
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        first = tier.stats()
        assert first.misses > 0
        got2 = _pass(tiered, ms[1])  # the arena (12 slots) misses again; the tier now holds them
        assert all(torch.equal(a, b) for a, b in zip(want, got2))
        second = tier.stats()
        assert second.hits > first.hits and second.misses == first.misses
        cache = tiered.experts.cache
        assert tier.held() == frozenset() and cache.pinned() == cache.held() == frozenset()
    finally:
        plain.close()
        tiered.close()
    assert not tier.data.is_pinned()  # closing the files unlocked the tier's memory


def test_layered_graph_decode_through_the_tier_equals_eager(packed):
    files, record, pool = _open(packed, None)
    files.close()
    files, _, _ = _open(packed, (pool // 2) * record)
    try:
        dev = torch.device("cuda")
        model = Transformer(lambda n: files.get(n).to(dev), files.args,
                            Numerics.named("native", make_backend("torch", dev)))
        state = model.new_state()
        tok = model.forward(PROMPT.cuda(), state, files.experts, last_only=True).argmax(-1)
        eager = state.clone()
        runner = DecodeRunner(model, files.experts, whole=False, graphs=True)
        for _ in range(6):
            want = model.forward(tok, eager, files.experts, last_only=True)
            got = runner.step(state, tok)
            rel = ((want.float() - got.float()).abs().max() / want.float().abs().max()).item()
            assert rel <= 1e-3, rel
            tok = want.argmax(-1)
        runner.settle()
        assert runner.capture_error is None and runner.captures >= 1
        assert files.experts.tier.stats().hits > 0 and files.experts.tier.held() == frozenset()
    finally:
        files.close()


def test_a_whole_pool_tier_reads_direct_fills_in_the_background_and_then_serves_every_miss(packed):
    """With a tier of the whole pool the store reads with O_DIRECT (unless the filesystem refuses
    it) and the background fill reads every record once; a pass then finds every miss in RAM, with
    the logits of the plain cache. A tier of half the pool keeps buffered reads."""
    plain, record, pool = _open(packed, None)
    half, _, _ = _open(packed, (pool // 2) * record)
    whole, _, _ = _open(packed, pool * record, fill=True)
    try:
        assert not half.experts.store.o_direct and half.experts.fill is None
        store = whole.experts.store
        assert store.o_direct or "refused" in store.o_direct_note
        fill = whole.experts.fill
        for _ in range(3000):
            if not fill.running:
                break
            time.sleep(0.01)
        assert not fill.running and fill.error is None
        tier = whole.experts.tier
        main = whole.args.n_layers * store.count  # the fill reads the main layers' experts
        assert fill.filled == main and len(tier.cache) == main and tier.stats().misses == 0
        dev = torch.device("cuda")
        ms = [Transformer(lambda n, f=f: f.get(n).to(dev), f.args, Numerics.named("native", make_backend("torch", dev)))
              for f in (plain, whole)]
        want, got = _pass(plain, ms[0]), _pass(whole, ms[1])
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        s = tier.stats()
        assert s.hits > 0 and s.misses == 0 and whole.experts.cache.stats().misses > 0  # every miss from RAM
    finally:
        for f in (plain, half, whole):
            f.close()
    assert not fill.running


def test_page_locked_buffer_is_exactly_sized_aligned_pinned_and_unlocks_once():
    size = 3 * ALIGNMENT + 123  # not a power of two: torch's pinned allocator would round it up
    buf = PageLocked(size)
    t = buf.tensor
    assert t.numel() == size and t.data_ptr() % ALIGNMENT == 0 and t.is_pinned() and buf.locked
    t.copy_(torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8))
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), t)
    buf.close()
    buf.close()  # idempotent
    assert not buf.locked and not t.is_pinned() and t[5].item() == 5  # ordinary memory, still readable
