"""The memory plan (engine/memory_plan.py): made from headers before anything is allocated, with
injected machine figures (discrete H200, unified DGX Spark, too small), and the engine's close
giving every byte back."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch

from converter import synth
from converter.convert import convert
from engine.config import ConfigError, EngineConfig, ModelArgs
from engine.engine import Engine
from engine.errors import EngineError
from engine.memory import MemInfo
from engine.memory_plan import (GiB, Machine, MemoryPlanError, ModelFootprint, gib_to_bytes, make_plan,
                                state_bytes, unified_machine)
from engine.sampling import SamplingParams
from engine.weights import model_footprint

GB = 10**9


def flash_args(layers: int = 43) -> ModelArgs:
    return ModelArgs.from_dict(synth.flash_config(layers), "flash")


def flash_footprint(experts: int = 256) -> ModelFootprint:
    """DeepSeek-V4-Flash's shape: ~8 GiB resident, 43 x 256 records of 12.75 MiB (4 KiB-aligned)."""
    args = flash_args()
    record = -(-args.expert_record_bytes() // 4096) * 4096
    return ModelFootprint(args, weights=8 * GiB, pool=43 * experts * record, record=record, top_k=6, streamed=True)


H200 = Machine("cuda:0", unified=False, total=143 * GiB, available=140 * GiB, host_total=125 * GiB,
               host_available=110 * GiB)
SPARK = unified_machine("cuda:0", MemInfo(total=128 * GB, available=118 * GB, cached=2 * GB))


def test_discrete_h200_gives_the_cache_what_is_left_and_plans_a_host_tier():
    fp = flash_footprint()
    plan = make_plan(fp, EngineConfig(device="cuda"), H200)
    assert plan.limit == 140 * GiB and not plan.machine.unified
    left = plan.limit - (plan.weights + plan.state + plan.workspace + plan.framework + plan.margin)
    assert plan.cache == left // fp.record * fp.record  # whole records only
    assert 0 < plan.cache < fp.pool and not plan.resident
    assert plan.total + plan.margin <= plan.limit
    # the host tier wants the whole pool (it is inclusive); here free host RAM minus the headroom
    # is less, so it takes that, and reads stay buffered (the page cache serves what falls past it)
    host_left = 110 * GiB - int(0.15 * 125 * GiB)
    assert host_left < fp.pool and plan.host_cache == host_left // fp.record * fp.record
    assert not plan.direct_reads
    # asked for, the tier is capped to what was asked
    small = make_plan(fp, EngineConfig(device="cuda", cache_bytes=100 * GiB, host_cache_bytes=80 * GiB), H200)
    assert small.host_cache == 80 * GiB // fp.record * fp.record > fp.pool - small.cache
    huge = make_plan(fp, EngineConfig(device="cuda", cache_bytes=100 * GiB, host_cache_bytes=400 * GiB), H200)
    assert huge.host_cache == host_left // fp.record * fp.record
    # a host with RAM for the whole pool: the tier holds all of it, and reads each record once,
    # with O_DIRECT (the page cache would hold a second copy)
    big_host = Machine("cuda:0", unified=False, total=143 * GiB, available=140 * GiB, host_total=512 * GiB,
                       host_available=480 * GiB)
    whole = make_plan(fp, EngineConfig(device="cuda"), big_host)
    assert whole.host_cache == fp.pool and whole.direct_reads and not whole.resident
    assert not whole.forced_direct  # the tier decides: pinned smaller (a locked-memory limit), buffered again
    assert not replace(whole, host_cache=fp.pool // 2).direct_reads
    forced = make_plan(fp, EngineConfig(device="cuda", o_direct=True), big_host)
    assert forced.forced_direct and replace(forced, host_cache=fp.pool // 2).direct_reads
    capped = make_plan(fp, EngineConfig(device="cuda", host_cache_bytes=fp.pool // 2), big_host)
    assert capped.host_cache == fp.pool // 2 // fp.record * fp.record and not capped.direct_reads
    text = "\n".join(plan.lines())
    assert "expert cache" in text and "host RAM tier" in text and "% of the pool" in text


def test_unified_spark_keeps_the_machine_under_90_percent_and_reads_directly():
    fp = flash_footprint()
    plan = make_plan(fp, EngineConfig(device="cuda"), SPARK)
    # others use 10 GB now (total - available); the whole machine stays under 90 % of 128 GB
    assert plan.limit == int(118 * GB - 0.1 * 128 * GB)
    assert plan.total + plan.margin <= plan.limit
    assert plan.host_cache == 0  # one RAM tier on unified memory: the arena itself
    assert plan.direct_reads  # the page cache would hold the same bytes twice
    cpu = make_plan(fp, EngineConfig(device="cpu"), unified_machine("cpu", MemInfo(128 * GB, 118 * GB, 0)))
    assert not cpu.direct_reads


def test_too_small_is_refused_before_loading_with_the_numbers_and_the_fix():
    small = Machine("cuda:0", False, total=16 * GiB, available=9 * GiB, host_total=64 * GiB, host_available=60 * GiB)
    with pytest.raises(MemoryPlanError) as err:
        make_plan(flash_footprint(), EngineConfig(device="cuda"), small)
    msg = str(err.value)
    assert "resident weights 8.00 GiB" in msg and "over the 9.00 GiB available" in msg
    assert "6 experts" in msg and "raise the memory limit (--memory-gb)" in msg
    assert "lower the context limit (max_seq_len)" in msg  # a setting in the app, a flag in the engine's tools


def test_memory_gb_caps_the_plan_and_cache_gb_fixes_the_cache():
    fp = flash_footprint()
    capped = make_plan(fp, EngineConfig(device="cuda", memory_bytes=40 * GiB), H200)
    assert capped.limit == 40 * GiB and capped.total + capped.margin <= 40 * GiB
    fixed = make_plan(fp, EngineConfig(device="cuda", cache_bytes=20 * GiB), H200)
    assert fixed.cache == 20 * GiB and fixed.cache_fixed and "fixed by --cache-gb" in "\n".join(fixed.lines())
    with pytest.raises(MemoryPlanError, match="--cache-gb 100.00 GiB does not fit"):
        make_plan(fp, EngineConfig(device="cuda", cache_bytes=100 * GiB, memory_bytes=60 * GiB), H200)
    with pytest.raises(MemoryPlanError, match="fewer than one layer's 6 experts"):
        make_plan(fp, EngineConfig(device="cuda", cache_bytes=fp.record), H200)


def test_a_tiny_models_too_small_cache_names_a_budget_that_fits_one_layer():
    fp = flash_footprint()
    tiny = replace(fp, record=28_672, pool=28_672 * 96)  # the tiny synthetic model's records
    with pytest.raises(MemoryPlanError) as err:
        make_plan(tiny, EngineConfig(device="cuda", cache_bytes=1024), H200)
    assert str(err.value).endswith(f"fewer than one layer's 6 experts (0.00016 GiB); give --cache-gb 0.000161 or more")
    at_least = float(str(err.value).split("give --cache-gb ")[1].split()[0])
    assert make_plan(tiny, EngineConfig(device="cuda", cache_bytes=gib_to_bytes(at_least, "x")), H200).cache >= 6 * 28_672


def test_a_cache_above_the_pool_is_capped_and_said_so():
    fp = flash_footprint(experts=4)  # a 4-expert pack: 2.2 GB of experts
    plan = make_plan(fp, EngineConfig(device="cuda", cache_bytes=10 * GiB), H200)
    assert plan.cache == fp.pool and plan.resident
    assert any("capped" in n for n in plan.notes)
    auto = make_plan(fp, EngineConfig(device="cuda"), H200)
    assert auto.cache == fp.pool and auto.resident and auto.host_cache == 0


def test_long_contexts_cost_state_and_can_be_refused():
    args = flash_args()
    short, long = (state_bytes(args, n, torch.bfloat16) for n in (4096, 1 << 20))
    assert long > 100 * short
    with pytest.raises(MemoryPlanError, match="max_seq_len 1048576"):
        make_plan(flash_footprint(), EngineConfig(device="cuda", max_seq_len=1 << 20), H200)
    assert make_plan(flash_footprint(), EngineConfig(device="cuda", max_seq_len=1 << 16), H200).state == (
        12 * state_bytes(args, 1 << 16, torch.bfloat16))  # live, working copy, 8 snapshots, graph homes


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300, -1.0, 0.0, True, "8"])
def test_gib_options_refuse_nonsense(value):
    with pytest.raises(MemoryPlanError, match="--cache-gb must be a positive number of GiB"):
        gib_to_bytes(value, "--cache-gb")
    assert gib_to_bytes(1.5, "--cache-gb") == 3 * GiB // 2 and gib_to_bytes(None, "x") is None


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    src = synth.write_checkpoint(root / "hf", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    convert(src, root / "conv")
    return src, root / "conv"


def test_footprint_from_headers_matches_what_the_engine_loads(packs):
    src, conv = packs
    fp = model_footprint(conv)
    assert fp.streamed and fp.pool > 0 and fp.pool % fp.record == 0
    eng = Engine.load(conv, EngineConfig(prefill_chunk=32), warmup=False)
    try:
        assert eng.plan.resident and eng.plan.cache == fp.pool  # the tiny pool fits any machine
        loaded = eng.model.weight_bytes  # counted at load
        assert abs(loaded - fp.weights) <= 0.05 * fp.weights, (loaded, fp.weights)
        sess = eng.new_session()
        eng.runtime.reserve(sess.state, eng.config.max_seq_len)  # the plan's state is for max_seq_len
        assert sess.state.nbytes() == state_bytes(fp.args, eng.config.max_seq_len, torch.bfloat16)
        assert eng.info["memory_plan"][0].startswith("memory plan")
    finally:
        eng.close()
    official = model_footprint(src)
    assert not official.streamed and official.weights == pytest.approx(fp.weights, rel=0.02)
    notes = make_plan(official, EngineConfig(cache_bytes=1 << 20), H200).notes
    assert notes == ("official checkpoint: experts are read from its mmapped shards (convert it to stream them); "
                     "--cache-gb is ignored",)


def test_engine_load_is_refused_by_the_plan(packs):
    _, conv = packs
    with pytest.raises(MemoryPlanError, match="the model does not fit: resident weights 0.08 GiB"):
        Engine.load(conv, EngineConfig(memory_bytes=256 << 20), warmup=False)


def test_engine_load_names_a_file_given_as_the_model_and_a_missing_gpu(packs, tmp_path):
    _, conv = packs
    with pytest.raises(EngineError, match=r"manifest.json is a file, not a model directory; give the directory"):
        Engine.load(conv / "manifest.json", EngineConfig(), warmup=False)
    with pytest.raises(EngineError, match=r"nothing does not exist"):
        Engine.load(tmp_path / "nothing", EngineConfig(), warmup=False)
    with pytest.raises(ConfigError, match="the tilelang backend runs on a CUDA GPU, not on device 'cpu'"):
        EngineConfig(backend="tilelang")
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="device 'cuda': this machine has no usable CUDA GPU"):
            Engine.load(conv, EngineConfig(device="cuda"), warmup=False)


def test_close_gives_back_the_weights_the_arena_and_the_session_states(packs):
    _, conv = packs
    eng = Engine.load(conv, EngineConfig(prefill_chunk=32, cache_bytes=64 * model_footprint(conv).record))
    sess = eng.new_session()
    events = list(eng.generate(sess, "Hi", SamplingParams(temperature=0.0, max_tokens=3)))
    assert type(events[-1]).__name__ == "TurnFinished"
    probes = [weakref.ref(eng.model), weakref.ref(sess.state.layers[0].kv), weakref.ref(eng.runtime)]
    ids = sess.ids
    eng.close()
    gc.collect()
    assert [p() for p in probes] == [None, None, None]
    assert sess.ids == ids  # the conversation's ids stay readable
    with pytest.raises(RuntimeError, match="closed"):
        eng.stats()


def test_a_context_beyond_the_model_is_refused_at_load(packs):
    """Every entry point (the TUI too) gets the check, not only the CLIs."""
    from engine.config import ConfigError

    _, conv = packs
    with pytest.raises(ConfigError, match="max_seq_len 2,000,000 is outside 1..1,048,576"):
        Engine.load(conv, EngineConfig(max_seq_len=2_000_000), warmup=False)


def test_the_framework_term_counts_the_decode_graph_sets_the_homes_keep():
    """CUDA: 1 GiB plus the graph sets each kept home may hold, per layer (0.14 GiB a set at 43
    layers on the H200, outside the caching allocator): the layered step's three control flows,
    the whole step's three and the chunk step, through a cache smaller than the pool (steps and
    chunks guessed whole; the layered three alone without guessing) as with every expert
    resident (the layered ones after a flush); the CPU keeps no graphs."""
    from engine.graph_homes import HOMES, homes_for
    from engine.memory_plan import GRAPH_SET_BYTES_PER_LAYER, framework_bytes, graph_sets

    assert (graph_sets(False, True), graph_sets(True, True), graph_sets(True, False)) == (7, 7, 3)
    full = make_plan(flash_footprint(), EngineConfig(device="cuda"), H200).framework  # 158 GB: a bounded cache
    assert full == framework_bytes(H200, 43, HOMES, 7) and 8 * GiB < full < 9 * GiB and HOMES == 8
    unguessed = make_plan(flash_footprint(), EngineConfig(device="cuda", guess_whole_steps=False), H200).framework
    assert unguessed == framework_bytes(H200, 43, HOMES, 3) == full - HOMES * 4 * GRAPH_SET_BYTES_PER_LAYER * 43
    resident = make_plan(flash_footprint(experts=4), EngineConfig(device="cuda"), H200)  # a 2.2 GB pool: all of it
    assert resident.cache == resident.pool
    resident = resident.framework
    assert resident == framework_bytes(H200, 43) == GiB + HOMES * 7 * GRAPH_SET_BYTES_PER_LAYER * 43 == full
    assert framework_bytes(H200, 4) < framework_bytes(H200, 43)
    # a longer context keeps a home per capacity (the warm-up captures each): 16..8,192 entries at 16,384
    args = flash_footprint().args
    assert homes_for(args, 4096) == 8 and homes_for(args, 16384) == 10 and homes_for(args, 1024) == 8
    longer = make_plan(flash_footprint(), EngineConfig(device="cuda", max_seq_len=16384), H200).framework
    assert longer == framework_bytes(H200, 43, 10, 7) == full + 2 * 7 * GRAPH_SET_BYTES_PER_LAYER * 43
    assert framework_bytes(Machine("cpu", unified=True, total=24 * GiB, available=20 * GiB, host_total=24 * GiB,
                                   host_available=20 * GiB), 43) == GiB // 2
