"""One table: official tensor name -> where it goes in the converted layout (the pack: engine/pack.py).

Roles:
  * global    `embed.weight`, `head.weight`, `norm.weight`, `hc_head_*` -> global.safetensors
  * resident  every other `layers.L.*` / `mtp.0.*` tensor -> layer_LL.safetensors / mtp.safetensors,
              same name, same bytes
  * expert    `{prefix}.ffn.experts.{e}.{w1,w3,w2}.{weight,scale}` -> record e of the unit's packed
              `{prefix}.ffn.experts` tensor, at the field offset of the record layout

A "unit" is a decoder layer index 0..n_layers-1, or n_layers for the MTP block (the layer index
the engine uses for `mtp.0`). `expected_inventory` writes out the §B.3 tensor table (names,
safetensors dtypes, shapes) implied by a `ModelArgs`; preflight compares the source against it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from engine.config import ModelArgs
from engine.pack import GLOBAL_FILE, expert_fields, unit_file
# The pack's other names, used beside this table by converter/convert.py (mapping.units, ...):
from engine.pack import MTP_FILE, experts_tensor, layer_file, unit_prefix, units  # noqa: F401

GLOBAL_NAMES = ("embed.weight", "head.weight", "norm.weight",
                "hc_head_fn", "hc_head_base", "hc_head_scale")

_UNIT = re.compile(r"^(layers\.(\d+)|mtp\.0)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123]\.(?:weight|scale))$")

Inventory = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


class MappingError(ValueError):
    """A tensor name has no place in the converted layout (not a DeepSeek-V4-Flash tensor)."""


@dataclass(frozen=True)
class Target:
    """Where one source tensor goes. `unit` is None for global tensors; `expert`/`field` are set
    for routed-expert tensors (which live inside the unit's packed experts tensor)."""

    file: str
    unit: int | None
    expert: int | None = None
    field: str | None = None

    @property
    def is_expert(self) -> bool:
        return self.expert is not None


def classify(name: str, args: ModelArgs) -> Target:
    """Place one official tensor name; raises MappingError for a name of no known role."""
    if name in GLOBAL_NAMES:
        return Target(GLOBAL_FILE, None)
    m = _UNIT.match(name)
    if m is None:
        raise MappingError(f"tensor {name!r} is not a DeepSeek-V4-Flash tensor name (spec §B.3)")
    unit = args.n_layers if m.group(1) == "mtp.0" else int(m.group(2))
    if unit > args.n_layers or (unit == args.n_layers and m.group(1) != "mtp.0"):
        raise MappingError(f"tensor {name!r} belongs to layer {unit}, but the config has "
                           f"{args.n_layers} layers")
    if m.group(1) == "mtp.0" and not args.n_mtp_layers:
        raise MappingError(f"tensor {name!r} is an MTP tensor but the config has no MTP layer")
    e = _EXPERT.match(m.group(3))
    if e is None:
        return Target(unit_file(unit, args), unit)
    expert = int(e.group(1))
    if expert >= args.n_routed_experts:
        raise MappingError(f"tensor {name!r}: expert {expert} >= n_routed_experts "
                           f"({args.n_routed_experts})")
    return Target(unit_file(unit, args), unit, expert, e.group(2))


def expected_inventory(args: ModelArgs) -> Inventory:
    """Every tensor of the official checkpoint for `args`: name -> (dtype, shape) (§B.3)."""
    d, h, dh, e, ql = args.dim, args.n_heads, args.head_dim, args.n_routed_experts, args.q_lora_rank
    g, ol, v, ih, idh = args.o_groups, args.o_lora_rank, args.vocab_size, args.index_n_heads, \
        args.index_head_dim
    hc, mix = args.hc_mult, (2 + args.hc_mult) * args.hc_mult
    inv: Inventory = {}

    def fp8(n: str, out: int, inp: int) -> None:
        inv[n + ".weight"] = ("F8_E4M3", (out, inp))
        inv[n + ".scale"] = ("F8_E8M0", (math.ceil(out / 128), math.ceil(inp / 128)))

    def hc_head(p: str) -> None:
        inv.update({p + "hc_head_fn": ("F32", (hc, hc * d)), p + "hc_head_base": ("F32", (hc,)),
                    p + "hc_head_scale": ("F32", (1,))})

    def layer(p: str, unit: int, ratio: int, hashed: bool) -> None:
        for s in ("attn", "ffn"):
            inv.update({f"{p}hc_{s}_fn": ("F32", (mix, hc * d)), f"{p}hc_{s}_base": ("F32", (mix,)),
                        f"{p}hc_{s}_scale": ("F32", (3,)), f"{p}{s}_norm.weight": ("BF16", (d,))})
        inv[p + "attn.attn_sink"] = ("F32", (h,))
        fp8(p + "attn.wq_a", ql, d)
        fp8(p + "attn.wq_b", h * dh, ql)
        fp8(p + "attn.wkv", dh, d)
        fp8(p + "attn.wo_a", g * ol, h * dh // g)
        fp8(p + "attn.wo_b", d, g * ol)
        inv[p + "attn.q_norm.weight"] = ("BF16", (ql,))
        inv[p + "attn.kv_norm.weight"] = ("BF16", (dh,))
        comps = ([("attn.compressor.", dh)] if ratio else []) + (
            [("attn.indexer.compressor.", idh)] if ratio == 4 else [])
        for cp, hd in comps:
            w = 2 * hd if ratio == 4 else hd  # the overlapping r=4 compressor is twice as wide
            inv.update({p + cp + "ape": ("F32", (ratio, w)), p + cp + "wkv.weight": ("BF16", (w, d)),
                        p + cp + "wgate.weight": ("BF16", (w, d)),
                        p + cp + "norm.weight": ("BF16", (hd,))})
        if ratio == 4:
            fp8(p + "attn.indexer.wq_b", ih * idh, ql)
            inv[p + "attn.indexer.weights_proj.weight"] = ("BF16", (ih, d))
        inv[p + "ffn.gate.weight"] = ("BF16", (e, d))
        if hashed:
            inv[p + "ffn.gate.tid2eid"] = ("I64", (v, args.n_activated_experts))
        else:
            inv[p + "ffn.gate.bias"] = ("F32", (e,))
        for x in range(e):
            for f, spec in expert_fields(args).items():
                inv[f"{p}ffn.experts.{x}.{f}"] = spec
        fp8(p + "ffn.shared_experts.w1", args.moe_inter_dim, d)
        fp8(p + "ffn.shared_experts.w3", args.moe_inter_dim, d)
        fp8(p + "ffn.shared_experts.w2", d, args.moe_inter_dim)

    inv.update({"embed.weight": ("BF16", (v, d)), "head.weight": ("BF16", (v, d)),
                "norm.weight": ("BF16", (d,))})
    hc_head("")
    for n in range(args.n_layers):
        layer(f"layers.{n}.", n, args.ratio(n), args.is_hash_layer(n))
    if args.n_mtp_layers:
        layer("mtp.0.", args.n_layers, args.ratio(args.n_layers), False)
        fp8("mtp.0.e_proj", d, d)
        fp8("mtp.0.h_proj", d, d)
        for n in ("enorm", "hnorm", "norm"):
            inv[f"mtp.0.{n}.weight"] = ("BF16", (d,))
        hc_head("mtp.0.")
    return inv
