"""Synthetic checkpoints (converter/synth.py), their writer and quantiser: §B.3, §B.4, §G.1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from converter.quant import QuantError, e2m1_codes, quantize_fp4_rows, quantize_fp8_block
from converter.stwriter import SafetensorsWriteError, SafetensorsWriter, TensorSpec, aligned_first
from converter.synth import (
    TOKENIZER_VOCAB, SynthError, SynthOptions, flash_config, plan_tensors, tiny_config, write_checkpoint,
)
from converter.synth_cli import main
from kernels import reference as ref

F8, E8, I8, I64 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.int64
BF16, F32 = torch.bfloat16, torch.float32

# The HF config.json key set of §G.1.
G1_KEYS = {
    "architectures", "model_type", "attention_bias", "attention_dropout", "bos_token_id",
    "eos_token_id", "expert_dtype", "hc_eps", "hc_mult", "hc_sinkhorn_iters", "head_dim",
    "hidden_act", "hidden_size", "index_head_dim", "index_n_heads", "index_topk",
    "initializer_range", "max_position_embeddings", "moe_intermediate_size", "n_routed_experts",
    "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok",
    "num_hidden_layers", "num_hash_layers", "num_key_value_heads", "num_nextn_predict_layers",
    "o_groups", "o_lora_rank", "q_lora_rank", "qk_rope_head_dim", "quantization_config",
    "rms_norm_eps", "rope_scaling", "rope_theta", "routed_scaling_factor", "scoring_func",
    "sliding_window", "swiglu_limit", "tie_word_embeddings", "topk_method", "torch_dtype",
    "use_cache", "vocab_size", "compress_rope_theta", "compress_ratios",
}


def expected_inventory(c: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The §B.3 tensor table written out for config c (independent of synth's planner)."""
    d, h, dh, e, i = (c["hidden_size"], c["num_attention_heads"], c["head_dim"],
                      c["n_routed_experts"], c["moe_intermediate_size"])
    ql, g, ol, v, ih, idh = (c["q_lora_rank"], c["o_groups"], c["o_lora_rank"], c["vocab_size"],
                             c["index_n_heads"], c["index_head_dim"])
    inv: dict = {}

    def fp8(n, out, inp):
        inv[n + ".weight"] = (F8, (out, inp))
        inv[n + ".scale"] = (E8, (math.ceil(out / 128), math.ceil(inp / 128)))

    def fp4(n, out, inp):
        inv[n + ".weight"] = (I8, (out, inp // 2))
        inv[n + ".scale"] = (E8, (out, inp // 32))

    def hc_head(p):
        inv.update({p + "hc_head_fn": (F32, (4, 4 * d)), p + "hc_head_base": (F32, (4,)),
                    p + "hc_head_scale": (F32, (1,))})

    def layer(p, ratio, hashed):
        for s in ("attn", "ffn"):
            inv.update({f"{p}hc_{s}_fn": (F32, (24, 4 * d)), f"{p}hc_{s}_base": (F32, (24,)),
                        f"{p}hc_{s}_scale": (F32, (3,)), f"{p}{s}_norm.weight": (BF16, (d,))})
        inv[p + "attn.attn_sink"] = (F32, (h,))
        fp8(p + "attn.wq_a", ql, d); fp8(p + "attn.wq_b", h * dh, ql); fp8(p + "attn.wkv", dh, d)
        fp8(p + "attn.wo_a", g * ol, h * dh // g); fp8(p + "attn.wo_b", d, g * ol)
        inv[p + "attn.q_norm.weight"] = (BF16, (ql,))
        inv[p + "attn.kv_norm.weight"] = (BF16, (dh,))
        comps = ([("attn.compressor.", dh)] if ratio else []) + (
            [("attn.indexer.compressor.", idh)] if ratio == 4 else [])
        for cp, hd in comps:
            w = 2 * hd if ratio == 4 else hd
            inv.update({p + cp + "ape": (F32, (ratio, w)), p + cp + "wkv.weight": (BF16, (w, d)),
                        p + cp + "wgate.weight": (BF16, (w, d)),
                        p + cp + "norm.weight": (BF16, (hd,))})
        if ratio == 4:
            fp8(p + "attn.indexer.wq_b", ih * idh, ql)
            inv[p + "attn.indexer.weights_proj.weight"] = (BF16, (ih, d))
        inv[p + "ffn.gate.weight"] = (BF16, (e, d))
        if hashed:
            inv[p + "ffn.gate.tid2eid"] = (I64, (v, c["num_experts_per_tok"]))
        else:
            inv[p + "ffn.gate.bias"] = (F32, (e,))
        for x in range(e):
            fp4(f"{p}ffn.experts.{x}.w1", i, d); fp4(f"{p}ffn.experts.{x}.w3", i, d)
            fp4(f"{p}ffn.experts.{x}.w2", d, i)
        fp8(p + "ffn.shared_experts.w1", i, d); fp8(p + "ffn.shared_experts.w3", i, d)
        fp8(p + "ffn.shared_experts.w2", d, i)

    inv.update({"embed.weight": (BF16, (v, d)), "head.weight": (BF16, (v, d)),
                "norm.weight": (BF16, (d,))})
    hc_head("")
    for n in range(c["num_hidden_layers"]):
        layer(f"layers.{n}.", c["compress_ratios"][n], n < c["num_hash_layers"])
    if c["num_nextn_predict_layers"]:
        layer("mtp.0.", 0, False)
        fp8("mtp.0.e_proj", d, d); fp8("mtp.0.h_proj", d, d)
        for n in ("enorm", "hnorm", "norm"):
            inv[f"mtp.0.{n}.weight"] = (BF16, (d,))
        hc_head("mtp.0.")
    return inv


def dequant_official_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An FP4 weight as the official checkpoint stores it (low nibble first) -> float32."""
    return ref.dequant_fp4(ref.fp4_record_order(packed), scale)


def read_all(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(ckpt.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", tiny_config(),
                            SynthOptions(seed=0, n_shards=2))


# ----------------------------------------------------------------------------- configs and plans

def test_tiny_config_is_g1():
    c = tiny_config()
    assert set(c) == G1_KEYS
    assert c["compress_ratios"] == [0, 0, 4, 128, 4, 0]
    assert (c["hidden_size"], c["vocab_size"], c["n_routed_experts"], c["num_hash_layers"]) == (
        128, 512, 16, 3)
    assert c["quantization_config"]["weight_block_size"] == [128, 128]
    assert tiny_config(index_topk=512, rope_scaling={"factor": 8})["rope_scaling"] == {
        "beta_fast": 32, "beta_slow": 1, "factor": 8,
        "original_max_position_embeddings": 65536, "type": "yarn"}
    with pytest.raises(SynthError, match="multiple of 128"):
        tiny_config(hidden_size=192)
    with pytest.raises(SynthError, match="compress_ratios"):
        tiny_config(compress_ratios=[0, 0, 4, 128, 4])


def test_flash_config_dims():
    c = flash_config()
    assert set(c) == G1_KEYS
    assert (c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["vocab_size"]) == (
        4096, 64, 512, 129280)
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (
        256, 6, 2048)
    assert (c["o_groups"], c["o_lora_rank"], c["q_lora_rank"], c["sliding_window"]) == (
        8, 1024, 1024, 128)
    assert c["compress_ratios"] == [0, 0, 4, 128, 0] and c["num_hidden_layers"] == 4
    assert flash_config(1)["compress_ratios"] == [0, 0]
    assert flash_config(1)["num_hash_layers"] == 1
    full = flash_config(43)["compress_ratios"]
    assert len(full) == 44 and full[:6] == [0, 0, 4, 128, 4, 128] and full[-3:] == [128, 4, 0]


def test_flash_full_plan_matches_published_totals():
    plan = plan_tensors(flash_config(43), SynthOptions())
    assert len(plan) == 69_187
    assert sum(t.nbytes for t in plan) == 159_609_485_896
    assert sum(t.name.startswith("mtp.0.") for t in plan) == 1_575
    assert len({t.shard for t in plan}) == 45


def test_flash_one_layer_plan():
    cfg = flash_config(1)
    plan = plan_tensors(cfg, SynthOptions())
    assert {t.name: (t.dtype, t.shape) for t in plan} == expected_inventory(cfg)
    expert = [t for t in plan if t.name.startswith("layers.0.ffn.experts.7.")]
    assert sum(t.nbytes for t in expert) == 13_369_344
    by_name = {t.name: t for t in plan}
    assert by_name["layers.0.ffn.experts.7.w1.weight"].shape == (2048, 2048)
    assert by_name["layers.0.ffn.experts.7.w2.scale"].shape == (4096, 64)
    assert by_name["layers.0.attn.wq_b.scale"].shape == (256, 8)
    assert by_name["layers.0.ffn.gate.tid2eid"].dtype == I64
    shards = sorted({t.shard for t in plan})
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert by_name["embed.weight"].shard == shards[0]
    assert {t.shard for t in plan if t.name.startswith("layers.0.")} == {shards[1]}
    assert {t.shard for t in plan if t.name.startswith("mtp.0.")} == {shards[2]}


def test_plan_options():
    cfg = tiny_config()
    assert len({t.shard for t in plan_tensors(cfg, SynthOptions())}) == 7  # globals, 5 layers, MTP
    no_mtp = plan_tensors(cfg, SynthOptions(with_mtp=False, n_shards=2))
    assert not any(t.name.startswith("mtp.") for t in no_mtp)
    with pytest.raises(SynthError, match="n_shards"):
        plan_tensors(cfg, SynthOptions(n_shards=1))
    with pytest.raises(SynthError, match="clamp_stress_expert"):
        plan_tensors(cfg, SynthOptions(clamp_stress_expert=16))


# ----------------------------------------------------------------------------- tiny checkpoint

def test_tiny_checkpoint_tensor_set(tiny: Path):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg == tiny_config()
    tensors = read_all(tiny)
    assert len(tensors) == 792
    assert {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()} == expected_inventory(cfg)
    for layer in range(3):
        tid = tensors[f"layers.{layer}.ffn.gate.tid2eid"]
        assert int(tid.min()) >= 0 and int(tid.max()) < 16
        assert all(len(set(row)) == 4 for row in tid.tolist())  # distinct experts per token
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tiny / name).stat().st_size > 0
    assert not list(tiny.glob("*.tmp"))


def test_tiny_index_consistent(tiny: Path):
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tiny.glob("model-*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    seen, total = {}, 0
    for shard in shards:
        with safe_open(tiny / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                seen[k] = shard
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == total == 5_476_266


def test_tiny_weight_statistics(tiny: Path):
    t = read_all(tiny)
    assert abs(t["embed.weight"].float().std().item() - 1.0) < 0.02
    assert abs(t["layers.1.attn_norm.weight"].float().mean().item() - 1.0) < 0.05
    assert abs(t["layers.3.hc_attn_fn"].std().item() - 0.05) < 0.002
    assert abs(t["layers.3.hc_attn_base"].std().item() - 0.5) < 0.25
    assert abs(t["layers.2.attn.compressor.ape"].std().item() - 0.5) < 0.02
    wq_b = ref.dequant_fp8_block(t["layers.0.attn.wq_b.weight"], t["layers.0.attn.wq_b.scale"])
    assert abs(wq_b.std().item() * math.sqrt(128) - 1.0) < 0.05  # N(0, fan_in^-1/2)
    w2 = dequant_official_fp4(t["layers.4.ffn.experts.3.w2.weight"],
                              t["layers.4.ffn.experts.3.w2.scale"])
    assert abs(w2.std().item() * math.sqrt(128) - 1.0) < 0.1


def test_deterministic_per_seed(tiny: Path, tmp_path: Path):
    again = write_checkpoint(tmp_path / "a", tiny_config(), SynthOptions(seed=0, n_shards=2))
    other = write_checkpoint(tmp_path / "b", tiny_config(), SynthOptions(seed=1, n_shards=2))
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (again / shard).read_bytes() == (tiny / shard).read_bytes()
        assert (other / shard).read_bytes() != (tiny / shard).read_bytes()


def test_clamp_stress_expert(tmp_path: Path):
    out = write_checkpoint(tmp_path / "s", tiny_config(), SynthOptions(
        clamp_stress_gain=30.0, clamp_stress_expert=5, n_shards=2, tokenizer=False))
    t = read_all(out)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))  # unit-RMS input
    for p in ("layers.0.ffn.experts.5.w1", "layers.4.ffn.experts.5.w3", "mtp.0.ffn.experts.5.w1"):
        pre = x @ dequant_official_fp4(t[p + ".weight"], t[p + ".scale"]).T
        assert pre.abs().max() > 10 and pre.std() > 10
    shared = ref.dequant_fp8_block(t["layers.2.ffn.shared_experts.w1.weight"],
                                  t["layers.2.ffn.shared_experts.w1.scale"])
    assert (x @ shared.T).std() > 10
    normal = dequant_official_fp4(t["layers.0.ffn.experts.4.w1.weight"],
                                  t["layers.0.ffn.experts.4.w1.scale"])
    assert (x @ normal.T).std() < 2


def test_hf_oracle_loads_and_dequantises_equal(tiny: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        tiny, dtype=torch.float32, attn_implementation="eager", device_map="cpu",
        output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    sd, t = model.state_dict(), read_all(tiny)

    def fp4(n):
        return dequant_official_fp4(t[n + ".weight"], t[n + ".scale"])

    p = "layers.3.ffn.experts.9."
    gate_up = sd["model.layers.3.mlp.experts.gate_up_proj"][9]  # [2I, D]: w1 rows, then w3
    assert torch.equal(gate_up, torch.cat([fp4(p + "w1"), fp4(p + "w3")]))
    assert torch.equal(sd["model.layers.3.mlp.experts.down_proj"][9], fp4(p + "w2"))
    wq_b = ref.dequant_fp8_block(t["layers.2.attn.wq_b.weight"], t["layers.2.attn.wq_b.scale"])
    assert torch.equal(sd["model.layers.2.self_attn.q_b_proj.weight"], wq_b)
    assert torch.equal(sd["model.layers.1.mlp.gate.tid2eid"], t["layers.1.ffn.gate.tid2eid"])
    logits = model(torch.tensor([[0, 17, 300, 5]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()


# ----------------------------------------------------------------------------- CLI and out dir

def test_cli(tmp_path: Path, capsys):
    override = tmp_path / "o.json"
    override.write_text(json.dumps({"index_topk": 512, "rope_scaling": {"factor": 8}}))
    assert main(["--out", str(tmp_path / "c"), "--layers", "2", "--config", str(override)]) == 0
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 0, 0] and cfg["index_topk"] == 512
    assert cfg["rope_scaling"]["factor"] == 8 and cfg["rope_scaling"]["type"] == "yarn"
    assert "wrote" in capsys.readouterr().out

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["--out", str(tmp_path / "d"), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cannot read --config" in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()
    bad.write_text(json.dumps({"hidden_size": 100}))
    assert main(["--out", str(tmp_path / "d"), "--config", str(bad)]) == 2
    assert "hidden_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "d"), "--preset", "huge"])
    assert exc.value.code == 2


def test_out_dir_rules(tmp_path: Path):
    out = tmp_path / "x"
    opts = SynthOptions(n_shards=3, tokenizer=False)
    write_checkpoint(out, tiny_config(), SynthOptions(n_shards=2, tokenizer=False))
    write_checkpoint(out, tiny_config(), opts)  # replaces a previous synth output
    assert sorted(p.name for p in out.glob("model-*")) == [
        f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SynthError, match="notes.txt"):
        write_checkpoint(out, tiny_config(), opts)


# ----------------------------------------------------------------------------- quantisation

def test_e2m1_codes_ties_to_even():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 7.0,
                      -0.25, -0.75, -2.5, -5.0, -6.0, 0.74, 2.49, 2.51])
    assert e2m1_codes(x).tolist() == [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7,
                                      8, 10, 12, 14, 15, 1, 4, 5]


def test_fp4_pack_order_scales_and_round_trip():
    row = torch.tensor([0.5, 1.0, -6.0, 3.0] + [0.0] * 28)  # amax 6 -> scale exactly 1
    packed, scale = quantize_fp4_rows(row[None])
    assert packed.dtype == I8 and packed.shape == (1, 16) and scale.shape == (1, 1)
    assert packed.view(torch.uint8)[0, :2].tolist() == [0x21, 0x5F]  # low nibble = even element
    assert ref.e8m0_to_float(scale).item() == 1.0
    assert torch.equal(dequant_official_fp4(packed, scale), row[None])
    for amax, want in [(6.0, 1.0), (6.01, 2.0), (3.0, 0.5), (12.0, 2.0), (0.0, 2.0 ** -42)]:
        _, s = quantize_fp4_rows(torch.full((1, 32), amax))
        assert ref.e8m0_to_float(s).item() == want, amax  # 2^ceil(log2(amax/6)), floored amax
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 3
    packed, scale = quantize_fp4_rows(w)
    err = (dequant_official_fp4(packed, scale) - w).abs()
    step = ref.e8m0_to_float(scale).repeat_interleave(32, 1)  # largest gap is 2 * scale
    assert (err <= step + 1e-7).all()
    with pytest.raises(QuantError, match="K % 32"):
        quantize_fp4_rows(torch.zeros(4, 48))
    with pytest.raises(QuantError, match="NaN"):
        quantize_fp4_rows(torch.full((2, 32), float("nan")))


def test_fp8_block_scales_and_round_trip():
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(2))
    w[:128, :128] *= 0
    w[0, 0] = 448.0 * 4  # amax exactly 448 * 2^2 -> scale 4, not rounded up
    w[128, 128] = 448.0 * 4 * 1.01  # just above -> scale 8
    q, s = quantize_fp8_block(w)
    assert q.dtype == F8 and s.dtype == E8 and s.shape == (3, 3)
    sf = ref.e8m0_to_float(s)
    assert sf[0, 0].item() == 4.0 and sf[1, 1].item() == 8.0
    deq = ref.dequant_fp8_block(q, s)
    assert deq[0, 0].item() == 1792.0 and (deq[1:128, :128] == 0).all()
    scale = sf.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert ((deq - w).abs() <= w.abs() / 16 + scale * 2.0 ** -10).all()  # e4m3 half-ulp
    exact = torch.tensor([[1.0, -0.5, 448.0, 0.015625]])
    assert torch.equal(ref.dequant_fp8_block(*quantize_fp8_block(exact)), exact)


# ----------------------------------------------------------------------------- safetensors writer

def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a.f32": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).to(BF16),
        "c.big": torch.randint(-128, 127, (4096,), generator=g, dtype=torch.int8),
        "d.f8": torch.randn(2, 3, generator=g).to(F8),
        "e.e8m0": torch.randint(100, 140, (4, 2), generator=g, dtype=torch.uint8).view(E8),
        "f.i64": torch.arange(6).reshape(2, 3),
        "g.u8": torch.randint(0, 255, (2, 2048), generator=g, dtype=torch.uint8),
    }


@pytest.mark.parametrize("alignment", [8, 4096])
def test_writer_round_trip_and_alignment(tmp_path: Path, alignment: int):
    tensors = _sample_tensors()
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    if alignment > 8:
        specs = aligned_first(specs, alignment)
    path = tmp_path / "x.safetensors"
    with SafetensorsWriter(path, specs, metadata={"format": "pt"}, alignment=alignment) as w:
        assert w.tmp_path.exists() and not path.exists()
        for s in specs:
            w.write(s.name, tensors[s.name])
    assert path.exists() and not w.tmp_path.exists()
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert (8 + header_len) % alignment == 0 and w.data_start == 8 + header_len
    assert len(raw) == w.file_size
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    if alignment > 8:  # 4096-multiple tensors placed first start on 4 KiB boundaries
        assert [s.name for s in specs[:2]] == ["c.big", "g.u8"]
        assert w.offsets["c.big"] % 4096 == 0 and w.offsets["g.u8"] % 4096 == 0


def test_writer_failure_leaves_no_file(tmp_path: Path):
    specs = [TensorSpec("a", F32, (2,)), TensorSpec("b", BF16, (3,))]
    path = tmp_path / "y.safetensors"
    with pytest.raises(RuntimeError, match="boom"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a", torch.zeros(2))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    for name, tensor, msg in [("b", torch.zeros(3, dtype=BF16), "expected tensor #0 'a'"),
                              ("a", torch.zeros(2, dtype=BF16), "declared torch.float32"),
                              ("a", torch.zeros(3), r"\(3,\)")]:
        with pytest.raises(SafetensorsWriteError, match=msg):
            with SafetensorsWriter(path, specs) as w:
                w.write(name, tensor)
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(SafetensorsWriteError, match="closed after 1 of 2"):
        with SafetensorsWriter(path, specs) as w:
            w.write("a", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SafetensorsWriteError, match="unsupported dtype"):
        SafetensorsWriter(path, [TensorSpec("c", torch.float16, (1,))])


def test_cli_tiny_preset_is_chattable_or_says_logits_only(tmp_path: Path, capsys):
    """`dsv4-synth --preset tiny` (the README's command) writes a vocabulary the real tokenizer
    fits in; a smaller vocab_size is written without a tokenizer and says it is logits-only."""
    from engine.chat import ChatTokenizer

    assert main(["--out", str(tmp_path / "chat"), "--layers", "1"]) == 0
    cfg = json.loads((tmp_path / "chat" / "config.json").read_text())
    tok = ChatTokenizer.from_dir(tmp_path / "chat")
    assert cfg["vocab_size"] == TOKENIZER_VOCAB == tok.vocab_size == 129280
    assert "logits-only" not in capsys.readouterr().out

    small = tmp_path / "small.json"
    small.write_text(json.dumps({"vocab_size": 512}))
    assert main(["--out", str(tmp_path / "logits"), "--layers", "1", "--config", str(small)]) == 0
    out = capsys.readouterr().out
    assert "vocab_size 512 is smaller than the tokenizer's 129280 tokens" in out
    assert "logits-only" in out and "cannot chat" in out
    assert not list((tmp_path / "logits").glob("tokenizer*"))
    assert json.loads((tmp_path / "logits" / "config.json").read_text())["vocab_size"] == 512
