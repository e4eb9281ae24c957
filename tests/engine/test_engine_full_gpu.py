"""The user's path on CUDA: kernels compiled once at load (none during a chat), memory given back
by close(), peak memory within the plan."""

from __future__ import annotations

import gc

import pytest
import torch

from converter import synth
from converter.convert import convert
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import TurnFinished
from engine.sampling import SamplingParams
from kernels.backend import built_kernels, compiled_kernels

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_pack")
    src = synth.write_checkpoint(root / "hf", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    convert(src, root / "conv")
    return root / "conv"


def _prompt(n_words: int) -> str:
    return " ".join(f"w{i % 97}" for i in range(n_words))


@pytest.mark.parametrize("cache_share", [1.0, 0.5])
def test_no_kernel_compiles_during_a_five_turn_chat(pack, cache_share):
    """Kernels and decode graph sets are all made at load: a chat of five turns, every expert
    resident or through a cache of half the pool (steps and chunks guessed whole), compiles no
    kernel and captures no graph set."""
    probe = Engine.load(pack, EngineConfig(device="cuda", backend="tilelang"), warmup=False)
    pool = probe.plan.pool
    probe.close()
    cache = None if cache_share == 1.0 else int(pool * cache_share)
    eng = Engine.load(pack, EngineConfig(device="cuda", backend="tilelang", cache_bytes=cache,
                                         max_seq_len=8192))
    try:
        after_load, built = compiled_kernels(), built_kernels()
        assert after_load > 0
        runner = eng.runtime.runner
        captured = runner.captures  # the warm-up's: every capacity's sets, both modes through a bounded cache
        sess = eng.new_session()
        for words in (3, 40, 700, 1500, 12):  # prompts of ~3 to ~2,000 tokens, then a short follow-up
            events = list(eng.generate(sess, _prompt(words), GREEDY))
            assert isinstance(events[-1], TurnFinished), events[-1]
        assert sess.position > 2000
        assert compiled_kernels() == after_load, f"compiled during the chat: {sorted(built_kernels() - built)}"
        assert runner.capture_error is None
        assert runner.captures == captured, f"{runner.captures - captured} graph sets captured during the chat"
    finally:
        eng.close()


def test_close_returns_every_byte_and_peak_stays_within_the_plan(pack):
    gc.collect()
    torch.cuda.synchronize()
    # the engine's close frees every stream's cuBLAS workspace, an earlier test's too (under xdist
    # a worker's earlier tests left 64 MiB of them once): count from where a close returns
    torch._C._cuda_clearCublasWorkspaces()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eng = Engine.load(pack, EngineConfig(device="cuda", backend="tilelang"))
    sess = eng.new_session()
    for words in (5, 300, 20):
        assert isinstance(list(eng.generate(sess, _prompt(words), GREEDY))[-1], TurnFinished)
    plan = eng.plan
    peak = torch.cuda.max_memory_allocated() - before
    eng.close()
    assert peak <= 1.05 * (plan.total - plan.framework), (peak, plan.lines())
    gc.collect()
    assert torch.cuda.memory_allocated() == before
