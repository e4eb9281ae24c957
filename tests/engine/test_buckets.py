"""Shape buckets (engine/buckets.py) and the warm-up plan that runs each of them (engine/warmup.py)."""

from __future__ import annotations

import pytest

from converter import synth
from engine.buckets import capacity_buckets, chunk_buckets, chunk_lengths, longest_chunk
from engine.config import EngineConfig, ModelArgs
from engine.state import LayerState, new_layer_state
from engine.runtime import SHORT_PREFILL
from kernels.fp4_moe import GROUPED_MIN_CELLS
from engine.warmup import plan_warmup
from kernels.bf16_gemm import CUBLAS_ROW_BUCKET, cublas_rows
from kernels.fp8_gemm import GEMV_MAX_M

import torch


@pytest.mark.parametrize("chunk", [256, 100, 1, 64, 2048])
def test_chunk_lengths_cover_the_prompt_with_bucketed_lengths_only(chunk):
    """Lengths up to GEMV_MAX_M (the GEMV kernels compile per row count) are buckets the warm-up
    runs; longer ones reach shape-dynamic kernels only, and there is at most one of them that is
    not a full chunk."""
    allowed = set(chunk_buckets(chunk))
    for n in range(0, 3 * chunk + 5):
        lengths = chunk_lengths(n, chunk)
        assert sum(lengths) == n and all(n_ in allowed or n_ > GEMV_MAX_M for n_ in lengths)
        assert all(n_ <= longest_chunk(chunk) for n_ in lengths)
        assert lengths == sorted(lengths, reverse=True)
        assert sum(1 for n_ in lengths if n_ != chunk and n_ > GEMV_MAX_M) <= 1
        assert len(lengths) <= n // chunk + max(1, GEMV_MAX_M.bit_length())


@pytest.mark.parametrize("chunk", [2048, 256, 100, 17, 1000])
def test_the_buckets_meet_every_cublas_row_count_a_prompt_can(chunk):
    """Every chunk a prompt can make reaches cuBLAS with rows (`cublas_rows`) that a bucket the
    warm-up runs has: a prompt of a new length meets no new cuBLAS shape."""
    warmed = {cublas_rows(n) for n in chunk_buckets(chunk)}
    for n in range(1, 2 * chunk + 40):
        assert {cublas_rows(n_) for n_ in chunk_lengths(n, chunk)} <= warmed, n
    assert cublas_rows(728) == 768 and cublas_rows(16) == 16 and cublas_rows(17) == CUBLAS_ROW_BUCKET


def test_chunk_examples():
    assert chunk_lengths(203, 256) == [203]
    assert chunk_lengths(600, 256) == [256, 256, 88]
    assert chunk_lengths(13, 256) == [8, 4, 1]
    assert chunk_lengths(16, 256) == [16] and chunk_lengths(17, 256) == [17]
    assert chunk_lengths(724, 2048) == [724] and chunk_lengths(2052, 2048) == [2052]
    assert chunk_lengths(4100, 2048) == [2052, 2048] and chunk_lengths(2065, 2048) == [2048, 17]
    assert chunk_lengths(9, 8) == [8, 1]  # chunks short enough for the GEMVs stay bucketed
    assert longest_chunk(2048) == 2048 + GEMV_MAX_M and longest_chunk(8) == 8
    assert chunk_buckets(256) == [272, 256, 128, 64, 32, 16, 8, 4, 2, 1]  # 272: 512 cuBLAS rows
    assert chunk_buckets(100) == [100, 64, 32, 16, 8, 4, 2, 1]
    assert chunk_buckets(2048)[:9] == [2064, 2048, 1792, 1536, 1280, 1024, 768, 512, 256]
    with pytest.raises(ValueError):
        chunk_lengths(5, 0)


def test_capacity_buckets_are_the_capacities_reserve_passes_through():
    for max_seq_len, ratio in ((4096, 4), (4096, 128), (1 << 20, 4), (100, 4)):
        seen = []
        st = new_layer_state(8, 16, ratio, 16, torch.float32, "meta")
        seen.append(st.capacity)
        for pos in range(0, max_seq_len + 1, 3):
            if st.reserve(pos // ratio + 1):
                seen.append(st.capacity)
        st.reserve(max_seq_len // ratio + 1)
        if st.capacity != seen[-1]:
            seen.append(st.capacity)
        assert seen == capacity_buckets(max_seq_len, ratio), (max_seq_len, ratio)


def test_the_warm_up_runs_every_bucket_on_the_gpu_and_little_on_the_cpu():
    args = ModelArgs.from_dict(synth.flash_config(43), "flash")
    config = EngineConfig(prefill_chunk=256, max_seq_len=4096)
    full = plan_warmup(args, config, full=True)
    assert [s.tokens for s in full if s.kind == "prefill"] == chunk_buckets(256)
    assert [s.capacity for s in full if s.kind == "decode"] == capacity_buckets(4096, 4) == [16, 32, 64, 128, 256,
                                                                                             512, 1024, 2048]
    assert len(plan_warmup(args, config, full=False)) == 2
    # with a graph runner, chunks of at most SHORT_PREFILL tokens replay the decode step: no buckets for
    # them, but one chunk just longer (few cells per expert: the grouped GEMV, not the dequantising path)
    graphed = plan_warmup(args, config, full=True, graphed_short=True)
    assert [s.tokens for s in graphed if s.kind == "prefill"] == [n for n in chunk_buckets(256) if n > SHORT_PREFILL] + [
        SHORT_PREFILL + 1]
    assert (SHORT_PREFILL + 1) * args.n_activated_experts < GROUPED_MIN_CELLS <= 32 * args.n_activated_experts
    assert [s for s in graphed if s.kind == "decode"] == [s for s in full if s.kind == "decode"]


def test_prefill_runs_in_bucketed_chunks(tmp_path):
    from engine.engine import Engine

    ckpt = synth.write_checkpoint(tmp_path / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    eng = Engine.load(ckpt, EngineConfig(prefill_chunk=32), warmup=False)
    try:
        state = eng.model.new_state()
        results = list(eng.runtime.prefill(state, list(range(3, 3 + 75)), 32))
        assert [r.tokens for r in results] == [43, 32] and state.pos == 75  # 11 more rows join a chunk
        results = list(eng.runtime.prefill(state, list(range(3, 3 + 11)), 32))
        assert [r.tokens for r in results] == [8, 2, 1] and state.pos == 86
    finally:
        eng.close()


def test_each_decode_bucket_steps_at_its_own_capacity():
    """The warm-up's decode steps of capacity bucket c run on caches of exactly c entries of the
    smallest ratio (no growth mid-bucket): the smallest bucket too, whose steps cannot reach the
    position where every kind of window completes (the first decode steps of a short chat); so
    does its graphed chunk step, when the runtime runs them."""
    from engine.buckets import MIN_ENTRIES
    from engine.warmup import DECODE_BASE, run_warmup

    args = ModelArgs.from_dict(synth.flash_config(43), "flash")
    ratio = min(r for r in args.compress_ratios if r)

    def capacity(last: int) -> int:
        cap = MIN_ENTRIES
        while cap < last // ratio + 1:
            cap *= 2
        return cap

    class State:
        def __init__(self, pos=0, cap=MIN_ENTRIES):
            self.pos, self.cap = pos, cap

        def clone(self):
            return State(self.pos, self.cap)

    class Runtime:  # the engine's runtime as run_warmup uses it: caches grow as positions need
        seen: list[tuple[int, int]] = []
        chunks: list[tuple[int, int]] = []

        def step(self, state, tokens):
            if len(tokens) == 1:
                self.seen.append((state.cap, state.pos))
            state.cap = max(state.cap, capacity(state.pos + len(tokens) - 1))
            state.pos += len(tokens)

        def guesses_steps(self):
            return False

        def warm_chunk(self, state, token):
            state.cap = max(state.cap, capacity(state.pos + 16))  # DecodeRunner.chunk's reserve
            self.chunks.append((state.cap, state.pos))
            state.pos += 16
            return True

        def reserve(self, state, last):
            state.cap = max(state.cap, capacity(last))

        def settle(self):
            pass

    class Model:
        def new_state(self):
            return State()

    config = EngineConfig(prefill_chunk=2048, max_seq_len=4096)
    decode = [s for s in plan_warmup(args, config, full=True, graphed_short=True) if s.kind == "decode"]
    assert decode[0].capacity == MIN_ENTRIES and decode[0].base < DECODE_BASE <= decode[1].base
    for step in decode:
        rt = Runtime()
        rt.seen, rt.chunks = [], []
        run_warmup([step], rt, Model(), 7, config.max_seq_len, lambda *a: None)
        caps = {cap for cap, pos in rt.seen if pos >= step.base}
        assert caps == {step.capacity}, (step, rt.seen)
        assert rt.chunks[-1] == (step.capacity, 0), (step, rt.chunks)  # the bucket's chunk graph
        windows = {pos for cap, pos in rt.seen if pos >= step.base and (pos + 1) % ratio == 0}
        assert windows  # a step completes a window of the smallest ratio
