"""Model configuration (`ModelArgs`, read from the checkpoint) and runtime knobs (`EngineConfig`).

`ModelArgs` accepts the HF-style `config.json` (repo root) and the official
`inference/config.json` key names (spec §A.1), and validates that the checkpoint really is
DeepSeek-V4-Flash's architecture (§A.4): other checkpoints sharing `model_type` (V4-Pro, V4.1,
-0731/-DSpark) are refused with the reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from engine.experts.policy import DEFAULT_POLICY, POLICIES


class ConfigError(ValueError):
    """The checkpoint's configuration is not one this engine can run."""


# HF key -> ModelArgs field. Official (inference/config.json) keys equal the field names.
_HF_KEYS = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "sliding_window": "window_size",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "num_hash_layers": "n_hash_layers",
    "rms_norm_eps": "norm_eps",
    "num_nextn_predict_layers": "n_mtp_layers",
}


@dataclass(frozen=True)
class ModelArgs:
    """Architecture hyper-parameters of a DeepSeek-V4-Flash-style checkpoint (§A.1 names)."""

    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = ()
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    n_activated_experts: int = 6
    n_shared_experts: int = 1
    moe_inter_dim: int = 2048
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    n_hash_layers: int = 3
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_mtp_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    max_position_embeddings: int = 1048576  # the longest context the model supports (§A.1)

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> "ModelArgs":
        """Build from an HF-style or official config dict, then validate (§A.4).

        Every field is type-checked first: an int field takes a JSON integer only (not 512.0, not
        "512", not true), a float field a finite JSON number, a str field a string; a wrong type
        raises ConfigError naming the key, the value and the expected type. An HF-style config
        (one that uses HF key names) must name its `model_type`; the official
        `inference/config.json` has none. The fields that set the tensors' shapes (`_REQUIRED`)
        must be present: a missing one raises ConfigError naming it (no silent default)."""
        _check_types(cfg, source)
        _check_required(cfg, source)
        _refuse_other_models(cfg, source)
        values: dict = {}
        names = {f.name for f in fields(cls)}
        for key, value in cfg.items():
            target = _HF_KEYS.get(key, key)
            if target in names:
                values[target] = value
        rope = cfg.get("rope_scaling") or {}
        for src, dst in (("factor", "rope_factor"), ("original_max_position_embeddings", "original_seq_len"),
                         ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
            if src in rope:
                values[dst] = rope[src]
        if "compress_ratios" not in cfg:
            raise ConfigError(f"{source}: field 'compress_ratios' is missing; DeepSeek-V4-Flash's config lists "
                              "one ratio (0, 4 or 128) per layer plus one for the MTP block")
        if "compress_rope_theta" not in cfg:
            raise ConfigError(f"{source}: field 'compress_rope_theta' is missing (expected 160000); it must come "
                              "from the checkpoint, never from a library default (spec §E.5, §E.8)")
        values["compress_ratios"] = tuple(cfg["compress_ratios"])
        values = {k: float(v) if _FIELD_TYPES[k] is float else v for k, v in values.items()}
        _check_quantization(cfg, source)
        args = cls(**values)
        args.validate(source)
        return args

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArgs":
        """Read `config.json` (HF-style) or `inference/config.json` (official) from a checkpoint.

        Raises ConfigError (one line naming the file and the fix) when it is missing, unreadable,
        not UTF-8 JSON or not a JSON object, or fails `from_dict`'s checks."""
        path = Path(path)
        for candidate in (path / "config.json", path / "inference" / "config.json"):
            if candidate.is_file():
                try:
                    cfg = json.loads(candidate.read_text(encoding="utf-8"))
                except (OSError, ValueError) as exc:  # ValueError: also UnicodeDecodeError
                    raise ConfigError(f"{candidate}: not readable JSON ({exc}); re-download config.json") from None
                if not isinstance(cfg, dict):
                    raise ConfigError(f"{candidate}: expected a JSON object")
                return cls.from_dict(cfg, str(candidate))
        raise ConfigError(f"{path}: no config.json found; point at the checkpoint directory that holds "
                          "config.json and the model-*.safetensors shards")

    # ---------------------------------------------------------------------------- validation
    def validate(self, source: str = "config") -> None:
        """Raise ConfigError naming the field and the expected value (§A.4, §G.2)."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"{source}: {msg}")

        need(len(self.compress_ratios) == self.n_layers + self.n_mtp_layers,
             f"'compress_ratios' has {len(self.compress_ratios)} entries, expected n_layers + n_mtp_layers = "
             f"{self.n_layers + self.n_mtp_layers}")
        need(all(r in (0, 4, 128) for r in self.compress_ratios),
             f"'compress_ratios' values must be 0, 4 or 128, got {sorted(set(self.compress_ratios))}")
        need(self.n_mtp_layers in (0, 1), f"'num_nextn_predict_layers' must be 0 or 1, got {self.n_mtp_layers}")
        need(self.hc_mult == 4, f"'hc_mult' must be 4, got {self.hc_mult}")
        need(self.n_shared_experts == 1, f"'n_shared_experts' must be 1, got {self.n_shared_experts}")
        need(self.score_func == "sqrtsoftplus", f"'scoring_func' must be 'sqrtsoftplus', got {self.score_func!r}")
        need(0 < self.n_activated_experts <= self.n_routed_experts,
             f"'num_experts_per_tok' ({self.n_activated_experts}) must be in 1..n_routed_experts "
             f"({self.n_routed_experts})")
        need(0 <= self.n_hash_layers <= self.n_layers, f"'num_hash_layers' ({self.n_hash_layers}) out of range")
        need(self.n_heads % self.o_groups == 0,
             f"'num_attention_heads' ({self.n_heads}) must be divisible by 'o_groups' ({self.o_groups})")
        need(self.rope_head_dim % 2 == 0 and self.rope_head_dim <= min(self.head_dim, self.index_head_dim),
             f"'qk_rope_head_dim' ({self.rope_head_dim}) must be even and <= head_dim and index_head_dim")
        need((self.head_dim - self.rope_head_dim) % 64 == 0,
             f"head_dim - qk_rope_head_dim ({self.head_dim - self.rope_head_dim}) must be a multiple of 64")
        ihd = self.index_head_dim
        need(ihd & (ihd - 1) == 0 and ihd % 32 == 0,
             f"'index_head_dim' ({ihd}) must be a power of two and a multiple of 32")
        for name, value in (("hidden_size", self.dim), ("q_lora_rank", self.q_lora_rank),
                            ("moe_intermediate_size", self.moe_inter_dim),
                            ("o_groups*o_lora_rank", self.o_groups * self.o_lora_rank),
                            ("num_attention_heads*head_dim/o_groups", self.n_heads * self.head_dim // self.o_groups)):
            need(value % 128 == 0, f"'{name}' ({value}) must be a multiple of 128 (FP8 block size)")
        need(self.window_size > 0, f"'sliding_window' must be positive, got {self.window_size}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                     "moe_inter_dim", "original_seq_len", "max_position_embeddings"):
            value = getattr(self, name)
            need(value > 0, f"'{_CONFIG_KEYS.get(name, name)}' must be positive, got {value}")
        need(0 <= self.bos_token_id < self.vocab_size and 0 <= self.eos_token_id < self.vocab_size,
             f"'bos_token_id' ({self.bos_token_id}) and 'eos_token_id' ({self.eos_token_id}) must be "
             f"token ids below vocab_size ({self.vocab_size})")

    def check_seq_len(self, max_seq_len: int, source: str = "max_seq_len") -> None:
        """Raise ConfigError unless a context of `max_seq_len` tokens fits this model."""
        if not 0 < max_seq_len <= self.max_position_embeddings:
            raise ConfigError(f"{source} {max_seq_len:,} is outside 1..{self.max_position_embeddings:,}, "
                              "the model's longest context (max_position_embeddings): choose a value in it")

    # ------------------------------------------------------------------------------ derived
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def ratio(self, layer: int) -> int:
        """Compression ratio of a layer; the MTP block is logical layer `n_layers`."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def expert_record_bytes(self) -> int:
        """Bytes of one routed expert on disk: 3 FP4 matrices (two codes a byte) + e8m0 1×32 scales."""
        inter, dim = self.moe_inter_dim, self.dim
        return 3 * (inter * dim // 2 + inter * dim // 32)


_FIELD_TYPES: dict[str, type] = {f.name: (tuple if f.name == "compress_ratios" else
                                         {"int": int, "float": float, "str": str}[str(f.type)])
                                  for f in fields(ModelArgs)}
_CONFIG_KEYS = {v: k for k, v in _HF_KEYS.items()}  # ModelArgs field -> HF key (for messages)
_ROPE_KEYS = {"factor": float, "original_max_position_embeddings": int, "beta_fast": float,
              "beta_slow": float}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def _shown(value: object) -> str:
    """The JSON text of a value and, unless it is null, its JSON type: '"16" (a string)'."""
    return "null" if value is None else f"{json.dumps(value)} ({_json_type(value)})"


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def _check_value(value: object, want: type, key: str, source: str) -> None:
    if want is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, want)
    if not ok:
        raise ConfigError(f"{source}: field '{key}' is {_shown(value)}, expected "
                          f"{_TYPE_NAMES[want]}" + (" (a whole number without a decimal point)"
                                                    if want is int and isinstance(value, float) else "")
                          + ": fix config.json or download it again")


def _check_types(cfg: dict, source: str) -> None:
    """ConfigError on the first config key whose JSON type does not fit its ModelArgs field."""
    if "model_type" in cfg or any(key in cfg for key in _HF_KEYS):  # HF-style: names its model
        if "model_type" not in cfg:
            raise ConfigError(f"{source}: field 'model_type' is missing, expected \"deepseek_v4\"; this "
                              "config.json is incomplete: download it again")
        _check_value(cfg["model_type"], str, "model_type", source)
    for key, value in cfg.items():
        target = _HF_KEYS.get(key, key)
        if target == "compress_ratios":
            if not isinstance(value, list):
                raise ConfigError(f"{source}: field 'compress_ratios' is {_shown(value)}, "
                                  "expected a list of integers (0, 4 or 128), one "
                                  "per layer plus one for the MTP block: fix config.json or download it again")
            for i, r in enumerate(value):
                _check_value(r, int, f"compress_ratios[{i}]", source)
        elif target in _FIELD_TYPES:
            _check_value(value, _FIELD_TYPES[target], key, source)
    rope = cfg.get("rope_scaling")
    if rope is not None:
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: field 'rope_scaling' is {_shown(rope)}, "
                              "expected an object: fix config.json or download it again")
        for key, want in _ROPE_KEYS.items():
            if key in rope:
                _check_value(rope[key], want, f"rope_scaling.{key}", source)
    q = cfg.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise ConfigError(f"{source}: field 'quantization_config' is {_shown(q)}, "
                          "expected an object: fix config.json or download it again")


# Fields that set the tensors' shapes: a config without one is incomplete (their defaults are
# DeepSeek-V4-Flash's, which would silently describe another model than the checkpoint's).
_REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank",
             "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "n_routed_experts",
             "n_activated_experts", "moe_inter_dim")


def _check_required(cfg: dict, source: str) -> None:
    """ConfigError naming the first `_REQUIRED` field the config lacks (by its HF key in an
    HF-style config, by its own name in the official one)."""
    present = {_HF_KEYS.get(key, key) for key in cfg}
    hf = "model_type" in cfg
    for name in _REQUIRED:
        if name not in present:
            key = _CONFIG_KEYS.get(name, name) if hf else name
            raise ConfigError(f"{source}: field '{key}' is missing; it sets the model's tensor shapes "
                              "and has no default: this config.json is incomplete, download it again")


def _refuse_other_models(cfg: dict, source: str) -> None:
    model_type = cfg.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"{source}: 'model_type' is {model_type!r}, expected 'deepseek_v4' "
                          "(this engine runs DeepSeek-V4-Flash only)")
    extra = sorted(k for k in cfg if k.startswith("dspark"))
    if extra:
        raise ConfigError(f"{source}: keys {extra} belong to DeepSeek-V4-Flash-0731/-DSpark, a different "
                          "architecture; download deepseek-ai/DeepSeek-V4-Flash")
    for key in ("engram_vocab_size", "engram_layers", "kv_source_layers", "index_source_layers"):
        if key in cfg:
            raise ConfigError(f"{source}: key {key!r} belongs to DeepSeek-V4.1, a different architecture; "
                              "download deepseek-ai/DeepSeek-V4-Flash")
    dim = cfg.get("hidden_size", cfg.get("dim"))
    layers = cfg.get("num_hidden_layers", cfg.get("n_layers"))
    experts = cfg.get("n_routed_experts")
    if (dim, layers, experts) == (7168, 61, 384):
        raise ConfigError(f"{source}: this is DeepSeek-V4-Pro (61 layers, hidden 7168, 384 experts); "
                          "this engine runs DeepSeek-V4-Flash only")
    ratios = cfg.get("compress_ratios")
    if isinstance(ratios, list) and len(ratios) >= 2 and ratios[0] == 128:
        raise ConfigError(f"{source}: 'compress_ratios' starts with 128 (the V4-Pro schedule); "
                          "DeepSeek-V4-Flash's first two layers have ratio 0")
    if cfg.get("hc_mult", 4) != 4:
        raise ConfigError(f"{source}: 'hc_mult' is {cfg.get('hc_mult')}, expected 4")


def _check_quantization(cfg: dict, source: str) -> None:
    q = cfg.get("quantization_config")
    expert_dtype = cfg.get("expert_dtype", (q or {}).get("expert_dtype", "fp4"))
    if expert_dtype != "fp4":
        raise ConfigError(f"{source}: 'expert_dtype' is {expert_dtype!r}, expected 'fp4' (the released "
                          "checkpoint's FP4 routed experts)")
    if q is None:
        if cfg.get("dtype", "fp8") != "fp8" or cfg.get("scale_fmt", "ue8m0") != "ue8m0":
            raise ConfigError(f"{source}: expected dtype 'fp8' with scale_fmt 'ue8m0'")
        return
    expected = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    for key, want in expected.items():
        if q.get(key, want) != want:
            raise ConfigError(f"{source}: quantization_config.{key} is {q.get(key)!r}, expected {want!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Runtime knobs of the engine (not properties of the checkpoint)."""

    device: str = "cpu"
    numerics: str = "native"  # "native" (official serving numerics) or "exact" (fp32 reference)
    backend: str = "torch"  # kernel backend: "torch" reference or "tilelang" (CUDA only)
    cache_bytes: int | None = None  # expert cache budget; None = sized by the memory plan (engine/memory_plan.py)
    memory_bytes: int | None = None  # cap on the whole memory plan; None = what the machine has free
    host_cache_bytes: int | None = None  # pinned host-RAM expert tier (discrete GPU); None = sized by the plan
    fill_host_tier: bool = True  # read the records the host tier lacks in the background after load
    cache_policy: str = DEFAULT_POLICY  # a name in engine/experts/policy.py POLICIES
    io_threads: int = 8  # expert reads in flight at once (bench.decode_engine --io-threads 2,8: 8 streamed 1.7x faster)
    o_direct: bool = False
    max_seq_len: int = 4096
    # every chunk pays a fixed dequantisation of the weights: 2,048-token prefill on the H200 ran at
    # 1,693 tok/s in one chunk against 717 in chunks of 512 (docs/performance-log.md, 2026-12-02)
    prefill_chunk: int = 2048
    trace_path: str | None = None  # record routing decisions as JSONL
    routing_trace: str | None = None  # TIMING ONLY: force layers >= n_hash_layers' experts from this route CSV
    routing_lookahead: float | None = None  # with routing_trace: a stand-in lookahead right this share of the time
    cuda_graphs: bool = True  # on CUDA, native numerics, converted model: replay decode steps from graphs
    lookahead_prefetch: bool = True  # streaming: prefetch layer L+1's experts predicted by its gate on layer L's state
    # streaming, graphs: run a step as one graph when its experts look resident, redo it layer by
    # layer when one was not (engine/step_guess.py)
    guess_whole_steps: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.numerics not in ("native", "exact"):
            raise ConfigError(f"numerics must be 'native' or 'exact', got {self.numerics!r}")
        if self.backend not in ("torch", "tilelang"):
            raise ConfigError(f"backend must be 'torch' or 'tilelang', got {self.backend!r}")
        if self.backend == "tilelang" and not str(self.device).startswith("cuda"):
            raise ConfigError(f"the tilelang backend runs on a CUDA GPU, not on device {self.device!r}: "
                              "use backend torch (--backend torch), or a CUDA device")
        if self.cache_policy not in POLICIES:
            names = ", ".join(sorted(POLICIES))
            raise ConfigError(f"cache_policy must be one of {names}, got {self.cache_policy!r}")
        if self.prefill_chunk < 1 or self.max_seq_len < 1:
            raise ConfigError("prefill_chunk and max_seq_len must be positive")
        if self.routing_lookahead is not None and (self.routing_trace is None
                                                   or not 0.0 <= self.routing_lookahead <= 1.0):
            raise ConfigError("routing_lookahead (a stand-in lookahead's accuracy, timing only) needs a "
                              f"routing_trace and a value in [0, 1], got {self.routing_lookahead!r}")
        for name, value in (("cache_bytes", self.cache_bytes), ("memory_bytes", self.memory_bytes),
                            ("host_cache_bytes", self.host_cache_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be a non-negative integer number of bytes, got {value!r}")

