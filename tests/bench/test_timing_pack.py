"""bench/timing_pack.py: a timing-only pack with N experts per layer whose records are file holes,
loaded through the Engine with forced routing over every expert; the memory plan at 256 experts."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from bench.timing_pack import TIMING_NOTE, disk_usage, is_timing_pack, make_timing_pack, zero_record_sha256
from converter import synth
from converter.convert import convert
from converter.verify import verify
from engine import pack as layout
from engine.checkpoint import TensorIndex
from engine.experts.store import ExpertChecksumError, ExpertStore, aligned_empty

N = 64  # experts per layer in the timing pack (the tiny source has 16)
HEADER = "pos,layer,n,e0,e1,e2,e3,e4,e5,w0,w1,w2,w3,w4,w5\n"


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny model converted, its timing pack with N experts per layer)."""
    root = tmp_path_factory.mktemp("tp")
    ckpt = synth.write_checkpoint(root / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    src = convert(ckpt, root / "pack")
    return src, make_timing_pack(src, root / "timing", N)


def test_zero_record_digest_is_sha256_of_zeros():
    assert zero_record_sha256(3 * 4096) == hashlib.sha256(bytes(3 * 4096)).hexdigest()
    assert zero_record_sha256((1 << 24) + 4096) == hashlib.sha256(bytes((1 << 24) + 4096)).hexdigest()


def test_timing_pack_is_sparse_marked_and_verifies(packs):
    src, tp = packs
    manifest = layout.read_manifest(tp)
    source = layout.read_manifest(src)
    assert is_timing_pack(tp) and not is_timing_pack(src)
    doc = json.loads((tp / "manifest.json").read_text())
    assert doc["timing_only"] == TIMING_NOTE and doc["source"]["timing_only"] == TIMING_NOTE
    assert manifest.count == N and manifest.config["n_routed_experts"] == N
    assert json.loads((tp / "config.json").read_text())["n_routed_experts"] == N
    assert manifest.record == source.record
    record = manifest.record.record_bytes
    for unit in manifest.units:
        st = (tp / unit.file).stat()
        assert st.st_size > N * record
        # the N records take no blocks: what is allocated is about the source file minus its records
        src_st = (src / unit.file).stat()
        assert st.st_blocks * 512 < src_st.st_size - source.count * record + 64 * 1024
        assert st.st_blocks * 512 < st.st_size - N * record + 64 * 1024  # st_blocks << st_size by the records
        assert manifest.files[unit.file]["records"] == [hashlib.sha256(bytes(record)).hexdigest()] * N
    assert (tp / "global.safetensors").stat().st_ino == (src / "global.safetensors").stat().st_ino  # linked
    size, used = disk_usage(tp)
    assert used < size - len(manifest.units) * N * record + (1 << 20)
    assert verify(tp) == []  # every file entry (sha256 pieces) matches the bytes as read


def test_routers_grow_and_other_tensors_are_copied(packs):
    src, tp = packs
    with TensorIndex.open(src) as a, TensorIndex.open(tp) as b:
        for name in a.names():
            if name.endswith(".ffn.experts"):
                assert b.info(name).shape == (N, a.info(name).shape[1])
            elif name.endswith((".ffn.gate.weight", ".ffn.gate.bias")):
                old, new = a.get(name), b.get(name)
                assert new.shape[0] == N and torch.equal(new[:old.shape[0]], old)
                if name.endswith("weight"):
                    assert torch.equal(new[old.shape[0] + 3], old[3].roll(1))
                    assert len({tuple(r.float().tolist()) for r in new}) == N  # distinct rows, distinct scores
            else:
                assert torch.equal(a.get(name).view(torch.uint8), b.get(name).view(torch.uint8)), name


def test_records_read_as_zeros_with_their_checksums_checked(packs, tmp_path):
    _, tp = packs
    store = ExpertStore(tp, layout.read_manifest(tp))
    assert store.checksums
    buf = aligned_empty(store.record_bytes)
    try:
        for layer in store.layers():
            for e in (0, 17, N - 1):
                buf.fill_(7)
                store.read_into(layer, e, memoryview(buf.numpy()))
                assert not buf.any()
    finally:
        store.close()
    # the digests are live: a pack whose manifest names another digest refuses the record
    bad = tmp_path / "bad"
    shutil.copytree(tp, bad)
    doc = json.loads((bad / "manifest.json").read_text())
    doc["files"]["layer_03.safetensors"]["records"][5] = "0" * 64
    (bad / "manifest.json").write_text(json.dumps(doc))
    store = ExpertStore(bad, layout.read_manifest(bad))
    try:
        store.read_into(3, 4, memoryview(buf.numpy()))
        with pytest.raises(ExpertChecksumError, match="expert 5 of layer 3"):
            store.read_into(3, 5, memoryview(buf.numpy()))
    finally:
        store.close()


def test_engine_runs_forced_routing_over_every_expert(packs, tmp_path):
    """Engine.load on the timing pack with a quarter of the pool cached and a trace whose tokens
    cover all N experts: a turn uses every expert of the forced layers, misses are read (zeros,
    checked) and the output is produced."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import TurnFinished
    from engine.sampling import SamplingParams
    from engine.weights import model_footprint

    _, tp = packs
    rng = random.Random(0)
    lines = [HEADER]
    for t in range(N // 4):  # token t: experts 4t..4t+3 weigh most, two decoys weigh less
        for layer in range(3, 43):
            ids = [4 * t, 4 * t + 1, 4 * t + 2, 4 * t + 3, rng.randrange(N), rng.randrange(N)]
            lines.append(",".join(map(str, [100 + t, layer, 6, *ids, .3, .3, .3, .3, .01, .01])) + "\n")
    trace = tmp_path / "all.csv"
    trace.write_text("".join(lines))
    pool = model_footprint(tp).pool
    config = EngineConfig(numerics="exact", cache_bytes=pool // 4, routing_trace=str(trace), max_seq_len=256)
    with Engine.load(tp, config, warmup=False) as eng:
        assert eng.plan.pool == pool and eng.plan.cache == pool // 4
        session = eng.new_session()
        prompt = " ".join(["word"] * 24)
        fin = list(eng.generate(session, prompt, SamplingParams(temperature=0.0, max_tokens=2)))[-1]
        assert isinstance(fin, TurnFinished)
        for layer in (3, 4):
            assert {e for (lay, e) in eng.experts.usage.uses if lay == layer} == set(range(N))
        stats = eng.experts.stats()
        assert stats.misses > 2 * N and stats.bytes_read >= 2 * N * stats.entry_bytes


def test_memory_plan_for_256_experts_sizes_cache_and_host_tier():
    """The H200 run: the real dimensions, 43 layers x 256 experts in the pool (the pack's MTP
    block's experts are not: the engine never routes them), caches of 25 % and 50 % of the pool
    on a discrete 139 GiB GPU with 128 GiB of host RAM: the device cache is the share asked for
    and a pinned host tier holds what is left of the host's RAM (less than the pool, so reads
    stay buffered)."""
    from engine.config import EngineConfig, ModelArgs
    from converter.synth_config import flash_config
    from engine.memory_plan import Machine, ModelFootprint, make_plan

    GiB = 2**30
    args = ModelArgs.from_dict(flash_config(43, n_routed_experts=256), "flash")
    record = args.expert_record_bytes()
    pool = args.n_layers * 256 * record  # 137.06 GiB (the pack, MTP included: 140.25 GiB, more than the H200 disk)
    assert record == int(12.75 * 2**20) and pool == 43 * 256 * record
    footprint = ModelFootprint(args, 10 * GiB, pool, record, args.n_activated_experts, streamed=True)
    h200 = Machine("cuda:0", False, 139 * GiB, 138 * GiB, 128 * GiB, 120 * GiB)
    plans = {}
    for share in (0.25, 0.5):
        plans[share] = plan = make_plan(footprint, EngineConfig(device="cuda", cache_bytes=int(pool * share)), h200)
        assert plan.cache == int(pool * share) and plan.cache // record == int(share * 43 * 256)
        host_left = 120 * GiB - int(0.15 * 128 * GiB)  # free RAM minus the plan's 15 % headroom
        assert plan.host_cache == min(pool, host_left) // record * record == host_left // record * record
        assert plan.host_cache > 70 * GiB and not plan.direct_reads
    # 25 %: the device cache and the tier together hold less than the pool; 50 %: more (the
    # tier is inclusive: it also holds records the device holds)
    assert plans[0.25].cache + plans[0.25].host_cache < pool < plans[0.5].cache + plans[0.5].host_cache
