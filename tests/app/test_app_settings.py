"""Settings precedence: flags > DSV4_* environment > TOML file > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.__main__ import config_from_args, main
from app.settings import (
    GenParams,
    SettingsError,
    build_config,
    default_data_dir,
    engine_config_kwargs,
    with_gen,
)

TOML = """
cache_gb = 10
numerics = "exact"
device = "cpu"
data_dir = "{data}"

[generation]
temperature = 0.3
max_tokens = 64
think = true
system = "be terse"
"""


@pytest.fixture
def toml_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(TOML.format(data=tmp_path / "data"))
    return path


def test_defaults_when_nothing_is_set(tmp_path):
    cfg = build_config({}, {}, tmp_path / "absent.toml")
    assert cfg.gen == GenParams()
    assert cfg.numerics == "native" and cfg.device is None and cfg.cache_gb is None
    assert cfg.data_dir == default_data_dir()
    assert cfg.transcripts_dir == cfg.data_dir / "transcripts"


def test_file_overrides_defaults(toml_file, tmp_path):
    cfg = build_config({}, {}, toml_file)
    assert cfg.cache_gb == 10.0 and cfg.numerics == "exact" and cfg.device == "cpu"
    assert cfg.data_dir == tmp_path / "data"
    assert cfg.gen == GenParams(temperature=0.3, max_tokens=64, think=True)
    assert cfg.system == "be terse"


def test_env_overrides_file_and_flags_override_env(toml_file):
    env = {"DSV4_CACHE_GB": "20", "DSV4_TEMPERATURE": "0.9", "DSV4_NUMERICS": "native"}
    cfg = build_config({}, env, toml_file)
    assert cfg.cache_gb == 20.0 and cfg.gen.temperature == 0.9 and cfg.numerics == "native"
    assert cfg.gen.max_tokens == 64  # still from the file
    cfg = build_config({"cache_gb": 30.0, "numerics": "exact", "model": None}, env, toml_file)
    assert cfg.cache_gb == 30.0 and cfg.numerics == "exact"  # flags win; None = not given


def test_dsv4_config_names_the_file(toml_file):
    cfg = build_config({}, {"DSV4_CONFIG": str(toml_file)})
    assert cfg.config_file == toml_file and cfg.cache_gb == 10.0


def test_argv_end_to_end(toml_file, tmp_path):
    cfg = config_from_args(
        ["--config", str(toml_file), "--cache-gb", "5", "--numerics", "native", "--demo",
         "--device", "cuda", "--model", str(tmp_path / "m")],
        {"DSV4_CACHE_GB": "20"})
    assert (cfg.cache_gb, cfg.numerics, cfg.demo, cfg.device) == (5.0, "native", True, "cuda")
    assert cfg.model == tmp_path / "m" and not cfg.plain
    assert config_from_args(["--plain", "--config", str(toml_file)], {}).plain
    gpu = config_from_args(["--config", str(toml_file), "--backend", "torch", "--no-cuda-graphs"], {})
    assert (gpu.backend, gpu.cuda_graphs) == ("torch", False)
    plain = config_from_args(["--config", str(toml_file)], {})
    assert (plain.backend, plain.cuda_graphs) == (None, True)


def test_argv_missing_config_file(tmp_path):
    with pytest.raises(SettingsError, match="no such file"):
        config_from_args(["--config", str(tmp_path / "nope.toml")], {})


@pytest.mark.parametrize("env, fragment", [
    ({"DSV4_CACHE_GB": "lots"}, "environment DSV4_CACHE_GB: bad value for 'cache_gb'"),
    ({"DSV4_CACHE_GB": "-1"}, "must be > 0"),
    ({"DSV4_NUMERICS": "fast"}, "expected one of native, exact"),
    ({"DSV4_THINK": "perhaps"}, "expected true/false"),
    ({"DSV4_COLOUR": "red"}, "unknown setting 'colour'"),
    ({"DSV4_TOP_P": "1.5"}, "top_p must be in (0, 1]"),
])
def test_bad_environment_values(tmp_path, env, fragment):
    with pytest.raises(SettingsError) as info:
        build_config({}, env, tmp_path / "absent.toml")
    assert fragment in str(info.value)


def test_bad_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("cache_gb = [")
    with pytest.raises(SettingsError, match="not valid TOML"):
        build_config({}, {}, path)
    path.write_text('speed = "max"\n')
    with pytest.raises(SettingsError, match=r"config.toml: unknown setting 'speed'"):
        build_config({}, {}, path)


def test_with_gen_validates():
    cfg = build_config({}, {}, Path("/nonexistent/config.toml"))
    assert with_gen(cfg, temperature=0.2).gen.temperature == 0.2
    with pytest.raises(SettingsError, match="temperature must be in"):
        with_gen(cfg, temperature=3.0)
    with pytest.raises(SettingsError, match="max_tokens must be >= 1"):
        with_gen(cfg, max_tokens=0)


def test_engine_config_kwargs(toml_file):
    cfg = build_config({"device": None}, {"DSV4_DEVICE": "cuda"}, toml_file)
    kw = engine_config_kwargs(cfg, cuda_available=False)
    assert kw == {"device": "cuda", "backend": "torch", "cuda_graphs": True, "numerics": "exact",
                  "cache_policy": "lfu", "io_threads": 8, "max_seq_len": 4096, "cache_bytes": 10 * 2**30}
    assert engine_config_kwargs(cfg, cuda_available=True, tilelang_available=True)["backend"] == "tilelang"
    cpu = build_config({"device": "cpu"}, {"DSV4_CUDA_GRAPHS": "off"}, Path("/nonexistent.toml"))
    kw = engine_config_kwargs(cpu, cuda_available=True, tilelang_available=True)
    assert (kw["device"], kw["backend"], kw["cuda_graphs"]) == ("cpu", "torch", False)
    pinned = build_config({}, {"DSV4_BACKEND": "torch"}, Path("/nonexistent.toml"))
    assert engine_config_kwargs(pinned, cuda_available=True, tilelang_available=True)["backend"] == "torch"
    with pytest.raises(SettingsError, match="tilelang"):
        build_config({}, {"DSV4_BACKEND": "triton"}, Path("/nonexistent.toml"))
    auto = build_config({}, {}, Path("/nonexistent.toml"))
    assert engine_config_kwargs(auto, cuda_available=True)["device"] == "cuda"
    assert engine_config_kwargs(auto, cuda_available=False)["device"] == "cpu"
    assert engine_config_kwargs(auto, cuda_available=False)["cache_bytes"] is None


def test_engine_config_accepts_the_kwargs(toml_file):
    from engine.config import EngineConfig

    cfg = build_config({}, {}, toml_file)
    ec = EngineConfig(**engine_config_kwargs(cfg, cuda_available=False))
    assert ec.cache_bytes == 10 * 2**30 and ec.numerics == "exact"


def test_main_reports_bad_settings_in_one_line(capsys, tmp_path, toml_file):
    assert main(["--cache-gb", "-1", "--config", str(tmp_path / "absent.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4-chat: --config ") and err.count("\n") == 1
    assert main(["--cache-gb", "-1", "--config", str(toml_file)]) == 2
    assert capsys.readouterr().err == (
        "dsv4-chat: --cache-gb: bad value for 'cache_gb': must be > 0, got -1.0\n")
