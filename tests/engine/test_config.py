"""ModelArgs: reading HF-style and official configs, and refusing other architectures (§A.4)."""

from __future__ import annotations

import json

import pytest

from converter.synth import flash_config, tiny_config
from engine.config import ConfigError, EngineConfig, ModelArgs


def test_tiny_hf_config_fields():
    a = ModelArgs.from_dict(tiny_config())
    assert (a.dim, a.n_layers, a.n_heads, a.head_dim, a.window_size) == (128, 5, 4, 128, 16)
    assert a.compress_ratios == (0, 0, 4, 128, 4, 0)
    assert (a.rope_factor, a.original_seq_len, a.compress_rope_theta) == (16, 65536, 160000)
    assert a.n_hash_layers == 3 and a.n_activated_experts == 4 and a.index_topk == 4


def test_flash_config_and_expert_record_size():
    a = ModelArgs.from_dict(flash_config(4))
    assert (a.dim, a.n_routed_experts, a.moe_inter_dim) == (4096, 256, 2048)
    assert a.expert_record_bytes() == 13_369_344


def test_official_key_names_accepted(tmp_path):
    hf = ModelArgs.from_dict(tiny_config())
    official = {"dim": 128, "n_layers": 5, "n_heads": 4, "head_dim": 128, "rope_head_dim": 64,
                "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "window_size": 16,
                "compress_ratios": [0, 0, 4, 128, 4, 0], "index_n_heads": 4, "index_head_dim": 128,
                "index_topk": 4, "n_routed_experts": 16, "n_activated_experts": 4, "n_shared_experts": 1,
                "moe_inter_dim": 128, "score_func": "sqrtsoftplus", "route_scale": 1.5, "n_hash_layers": 3,
                "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "rope_theta": 10000,
                "compress_rope_theta": 160000, "rope_factor": 16, "original_seq_len": 65536, "beta_fast": 32,
                "beta_slow": 1, "vocab_size": 512, "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
                "max_seq_len": 512, "max_batch_size": 1}
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "config.json").write_text(json.dumps(official))
    assert ModelArgs.from_dir(tmp_path) == hf
    del official["moe_inter_dim"]  # a shape-setting field has no silent (Flash) default
    (tmp_path / "inference" / "config.json").write_text(json.dumps(official))
    with pytest.raises(ConfigError, match="field 'moe_inter_dim' is missing"):
        ModelArgs.from_dir(tmp_path)
    with pytest.raises(ConfigError, match="field 'moe_intermediate_size' is missing"):
        ModelArgs.from_dict({k: v for k, v in tiny_config().items() if k != "moe_intermediate_size"})


@pytest.mark.parametrize("change,message", [
    ({"model_type": "deepseek_v3"}, "'model_type' is 'deepseek_v3', expected 'deepseek_v4'"),
    ({"dspark_num_layers": 3}, "DeepSeek-V4-Flash-0731/-DSpark"),
    ({"engram_vocab_size": 10}, "DeepSeek-V4.1"),
    ({"hidden_size": 7168, "num_hidden_layers": 61, "n_routed_experts": 384}, "DeepSeek-V4-Pro"),
    ({"compress_ratios": [128, 128, 4, 128, 4, 0]}, "V4-Pro schedule"),
    ({"compress_ratios": [0, 0, 4, 128, 0]}, "'compress_ratios' has 5 entries, expected"),
    ({"compress_ratios": [0, 0, 8, 128, 4, 0]}, "values must be 0, 4 or 128"),
    ({"hc_mult": 2}, "'hc_mult' is 2, expected 4"),
    ({"expert_dtype": "fp8"}, "'expert_dtype' is 'fp8', expected 'fp4'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                              "weight_block_size": [64, 64]}}, "weight_block_size is [64, 64]"),
    ({"num_attention_heads": 3}, "must be divisible by 'o_groups'"),
    ({"hidden_size": 96}, "'hidden_size' (96) must be a multiple of 128"),
    ({"index_head_dim": 96}, "'index_head_dim' (96) must be a power of two"),
    ({"scoring_func": "softmax"}, "'scoring_func' must be 'sqrtsoftplus'"),
])
def test_refusals_name_field_and_expectation(change, message):
    cfg = tiny_config()
    cfg.update(change)
    with pytest.raises(ConfigError) as err:
        ModelArgs.from_dict(cfg, "ckpt/config.json")
    assert message in str(err.value)
    assert str(err.value).startswith("ckpt/config.json")


def test_missing_compress_rope_theta_is_refused():
    cfg = tiny_config()
    del cfg["compress_rope_theta"]
    with pytest.raises(ConfigError, match="compress_rope_theta' is missing"):
        ModelArgs.from_dict(cfg)


def test_unreadable_and_absent_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json found"):
        ModelArgs.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        ModelArgs.from_dir(tmp_path)


def test_a_config_that_is_not_utf8_is_one_config_error(tmp_path):
    """A byte that is not UTF-8 (a Latin-1 file, a damaged download) is the JSON error, not a
    UnicodeDecodeError traceback, whatever the locale's default encoding."""
    (tmp_path / "config.json").write_bytes(b'{"model_type": "deepseek_v4", "note": "\xff"}')
    with pytest.raises(ConfigError, match=r"config.json: not readable JSON \(.*utf-8.*\); re-download"):
        ModelArgs.from_dir(tmp_path)


def test_engine_config_validation():
    with pytest.raises(ConfigError, match="numerics must be"):
        EngineConfig(numerics="fast")
    with pytest.raises(ConfigError, match="cache_policy"):
        EngineConfig(cache_policy="fifo")
    assert EngineConfig().numerics == "native"


@pytest.mark.parametrize("change,message", [
    ({"n_routed_experts": "16"}, "field 'n_routed_experts' is \"16\" (a string), expected an integer"),
    ({"hidden_size": "128"}, "field 'hidden_size' is \"128\" (a string), expected an integer"),
    ({"num_hidden_layers": None}, "field 'num_hidden_layers' is null, expected an integer"),
    ({"compress_ratios": None}, "field 'compress_ratios' is null, expected a list of integers"),
    ({"compress_ratios": [0, 0, "4", 128, 4, 0]}, "field 'compress_ratios[2]' is \"4\" (a string)"),
    ({"vocab_size": 512.0}, "field 'vocab_size' is 512.0 (a number), expected an integer (a whole number"),
    ({"hc_mult": True}, "field 'hc_mult' is true (a boolean), expected an integer"),
    ({"rms_norm_eps": "1e-6"}, "field 'rms_norm_eps' is \"1e-6\" (a string), expected a number"),
    ({"scoring_func": 3}, "field 'scoring_func' is 3 (an integer), expected a string"),
    ({"rope_scaling": {"factor": None}}, "field 'rope_scaling.factor' is null, expected a number"),
    ({"rope_scaling": [16]}, "field 'rope_scaling' is [16] (a list), expected an object"),
    ({"model_type": None}, "field 'model_type' is null, expected a string"),
    ({"vocab_size": 0}, "'vocab_size' must be positive, got 0"),
    ({"eos_token_id": 512}, "'eos_token_id' (512) must be token ids below vocab_size (512)"),
])
def test_wrong_json_types_name_field_value_and_type(change, message):
    cfg = tiny_config()
    cfg.update(change)
    with pytest.raises(ConfigError) as err:
        ModelArgs.from_dict(cfg, "ckpt/config.json")
    assert str(err.value).startswith("ckpt/config.json: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_model_type_is_refused_in_an_hf_config():
    cfg = tiny_config()
    del cfg["model_type"]
    with pytest.raises(ConfigError, match="field 'model_type' is missing, expected \"deepseek_v4\""):
        ModelArgs.from_dict(cfg, "ckpt/config.json")


def test_numbers_are_kept_as_their_field_types():
    a = ModelArgs.from_dict(tiny_config(rope_theta=10000, routed_scaling_factor=2))
    assert type(a.rope_theta) is float and a.rope_theta == 10000.0 and a.route_scale == 2.0
    assert a.max_position_embeddings == 1048576 and type(a.vocab_size) is int


def test_check_seq_len_against_the_model():
    a = ModelArgs.from_dict(tiny_config(max_position_embeddings=4096))
    a.check_seq_len(4096)
    with pytest.raises(ConfigError, match=r"--max-seq-len 4,097 is outside 1..4,096, the model's longest "
                                          r"context \(max_position_embeddings\)"):
        a.check_seq_len(4097, "--max-seq-len")
    with pytest.raises(ConfigError, match="is outside"):
        a.check_seq_len(0)
