"""Settings precedence: flags > DSV4_* environment > TOML file > defaults."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from app.__main__ import config_from_args, main
from app.settings import (
    AppConfig,
    SettingsError,
    build_config,
    default_data_dir,
    with_gen,
)
from engine.config import EngineConfig
from engine.sampling import SamplingParams

GiB = 2**30

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
    cfg = build_config({}, {}, tmp_path / "absent.toml", cuda_available=False)
    assert cfg.gen == SamplingParams()
    assert cfg.engine == EngineConfig()  # cpu (no CUDA), native, budgets sized by the memory plan
    assert cfg.engine.numerics == "native" and cfg.engine.device == "cpu" and cfg.engine.cache_bytes is None
    assert cfg.data_dir == default_data_dir()
    assert cfg.transcripts_dir == cfg.data_dir / "transcripts"


def test_file_overrides_defaults(toml_file, tmp_path):
    cfg = build_config({}, {}, toml_file)
    assert cfg.engine.cache_bytes == 10 * GiB and cfg.engine.numerics == "exact" and cfg.engine.device == "cpu"
    assert cfg.data_dir == tmp_path / "data"
    assert cfg.gen == SamplingParams(temperature=0.3, max_tokens=64, thinking=True)
    assert cfg.system == "be terse"


def test_env_overrides_file_and_flags_override_env(toml_file):
    env = {"DSV4_CACHE_GB": "20", "DSV4_TEMPERATURE": "0.9", "DSV4_NUMERICS": "native"}
    cfg = build_config({}, env, toml_file)
    assert cfg.engine.cache_bytes == 20 * GiB and cfg.gen.temperature == 0.9 and cfg.engine.numerics == "native"
    assert cfg.gen.max_tokens == 64  # still from the file
    cfg = build_config({"cache_gb": 30.0, "numerics": "exact", "model": None}, env, toml_file)
    assert cfg.engine.cache_bytes == 30 * GiB and cfg.engine.numerics == "exact"  # flags win; None = not given


def test_dsv4_config_names_the_file(toml_file):
    cfg = build_config({}, {"DSV4_CONFIG": str(toml_file)})
    assert cfg.config_file == toml_file and cfg.engine.cache_bytes == 10 * GiB


def test_argv_end_to_end(toml_file, tmp_path):
    cfg = config_from_args(
        ["--config", str(toml_file), "--cache-gb", "5", "--numerics", "native", "--demo",
         "--device", "cuda", "--model", str(tmp_path / "m")],
        {"DSV4_CACHE_GB": "20"})
    assert (cfg.engine.cache_bytes, cfg.engine.numerics, cfg.demo, cfg.engine.device) == (5 * GiB, "native", True, "cuda")
    assert cfg.model == tmp_path / "m" and not cfg.plain
    assert config_from_args(["--plain", "--config", str(toml_file)], {}).plain
    gpu = config_from_args(["--config", str(toml_file), "--backend", "torch", "--no-cuda-graphs"], {})
    assert (gpu.engine.backend, gpu.engine.cuda_graphs) == ("torch", False)
    plain = config_from_args(["--config", str(toml_file)], {})
    assert (plain.engine.backend, plain.engine.cuda_graphs) == ("torch", True)  # the file's device is cpu


def test_argv_missing_config_file(tmp_path):
    with pytest.raises(SettingsError, match="no such file"):
        config_from_args(["--config", str(tmp_path / "nope.toml")], {})


@pytest.mark.parametrize("env, fragment", [
    ({"DSV4_CACHE_GB": "lots"}, "environment DSV4_CACHE_GB: bad value for 'cache_gb'"),
    ({"DSV4_CACHE_GB": "-1"}, "must be > 0"),
    ({"DSV4_NUMERICS": "fast"}, "expected one of native, exact"),
    ({"DSV4_THINK": "perhaps"}, "expected true/false"),
    ({"DSV4_TOP_P": "1.5"}, "environment DSV4_TOP_P: bad value for 'top_p': must be in (0, 1]"),
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
    with pytest.raises(SettingsError, match=r"max_tokens must be in \[1, "):
        with_gen(cfg, max_tokens=0)


def test_the_engine_config_is_built_once_from_the_settings(toml_file):
    cfg = build_config({"device": None}, {"DSV4_DEVICE": "cuda"}, toml_file, cuda_available=False)
    assert cfg.engine == EngineConfig(device="cuda", backend="torch", cuda_graphs=True, numerics="exact",
                                      cache_policy="next-use", io_threads=8, max_seq_len=4096,
                                      cache_bytes=10 * 2**30, memory_bytes=None)
    on_gpu = build_config({"device": None}, {"DSV4_DEVICE": "cuda"}, toml_file, cuda_available=True,
                          tilelang_available=True)
    assert on_gpu.engine.backend == "tilelang"
    cpu = build_config({"device": "cpu"}, {"DSV4_CUDA_GRAPHS": "off"}, Path("/nonexistent.toml"),
                       cuda_available=True, tilelang_available=True)
    assert (cpu.engine.device, cpu.engine.backend, cpu.engine.cuda_graphs) == ("cpu", "torch", False)
    pinned = build_config({}, {"DSV4_BACKEND": "torch"}, Path("/nonexistent.toml"), cuda_available=True,
                          tilelang_available=True)
    assert pinned.engine.backend == "torch"
    with pytest.raises(SettingsError, match="tilelang"):
        build_config({}, {"DSV4_BACKEND": "triton"}, Path("/nonexistent.toml"))
    assert build_config({}, {}, Path("/nonexistent.toml"), cuda_available=True).engine.device == "cuda"
    auto = build_config({}, {}, Path("/nonexistent.toml"), cuda_available=False)
    assert auto.engine.device == "cpu" and auto.engine.cache_bytes is None


def test_the_app_config_holds_the_engine_config_whole(toml_file):
    cfg = build_config({}, {}, toml_file)
    assert isinstance(cfg.engine, EngineConfig) and isinstance(cfg.gen, SamplingParams)
    assert cfg.engine.cache_bytes == 10 * 2**30 and cfg.engine.numerics == "exact"
    assert not any(hasattr(cfg, name) for name in ("cache_gb", "memory_gb", "numerics", "device", "backend"))


def test_an_engine_setting_the_engine_refuses_is_one_settings_line(tmp_path):
    with pytest.raises(SettingsError) as info:
        build_config({}, {"DSV4_CACHE_POLICY": "fifo"}, tmp_path / "absent.toml")
    assert str(info.value).startswith("engine settings: cache_policy must be one of ")
    assert str(info.value).endswith("got 'fifo'")


def test_a_directly_built_app_config_chooses_the_device_like_the_settings():
    import torch

    assert AppConfig(data_dir=Path("/d")).engine.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_main_reports_bad_settings_in_one_line(capsys, tmp_path, toml_file):
    assert main(["--cache-gb", "-1", "--config", str(tmp_path / "absent.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4-chat: --config ") and err.count("\n") == 1
    assert main(["--cache-gb", "-1", "--config", str(toml_file)]) == 2
    assert capsys.readouterr().err == (
        "dsv4-chat: --cache-gb: bad value for 'cache_gb': must be > 0, got -1.0; "
        "give --cache-gb a valid value or leave it out\n")


def test_unknown_dsv4_variables_are_warned_about_not_fatal(tmp_path):
    cfg = build_config({}, {"DSV4_COLOUR": "red", "DSV4_DEBUG": "1", "DSV4_CACHEGB": "3",
                            "DSV4_TEMPERATURE": "0.1"}, tmp_path / "absent.toml")
    assert cfg.gen.temperature == 0.1
    assert cfg.warnings == (
        "warning: environment DSV4_CACHEGB is not a dsv4-chat setting (ignored; did you mean DSV4_CACHE_GB?)",
        "warning: environment DSV4_COLOUR is not a dsv4-chat setting (ignored)",
        "warning: environment DSV4_DEBUG is not a dsv4-chat setting (ignored)")


def test_dsv4_debug_does_not_stop_startup(monkeypatch, capsys, tmp_path):
    """main goes on past the warning (here to `run`'s own check of its prompt)."""
    monkeypatch.setenv("DSV4_DEBUG", "1")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["run"]) == 2
    assert capsys.readouterr().err == (
        "dsv4-chat: warning: environment DSV4_DEBUG is not a dsv4-chat setting (ignored)\n"
        "dsv4-chat run: no prompt: give it as an argument or on stdin\n")


def test_missing_config_file_is_named_from_every_source(capsys, monkeypatch, tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(SettingsError) as info:
        build_config({}, {"DSV4_CONFIG": str(missing)})
    assert str(info.value) == f"DSV4_CONFIG {missing}: no such file"
    monkeypatch.setenv("DSV4_CONFIG", str(missing))
    assert main([]) == 2
    assert capsys.readouterr().err == f"dsv4-chat: DSV4_CONFIG {missing}: no such file\n"
    monkeypatch.delenv("DSV4_CONFIG")
    assert main(["--config", str(missing)]) == 2
    assert capsys.readouterr().err == f"dsv4-chat: --config {missing}: no such file\n"


@pytest.mark.parametrize("line, message", [
    ('cache_gb = "10"', "bad value for 'cache_gb': expected a number, got '10' (a string)"),
    ("cache_gb = nan", "bad value for 'cache_gb': must be a finite number > 0, got nan"),
    ("cache_gb = inf", "bad value for 'cache_gb': must be a finite number > 0, got inf"),
    ("cache_gb = 0", "bad value for 'cache_gb': must be > 0, got 0.0"),
    ("memory_gb = 1e300", "bad value for 'memory_gb': must be a number of GiB that fits in bytes, got 1e+300"),
    ("cache_gb = true", "bad value for 'cache_gb': expected a number, got True (a boolean)"),
    ("io_threads = 2.5", "bad value for 'io_threads': expected an integer, got 2.5 (a number)"),
    ("max_seq_len = -4", "bad value for 'max_seq_len': must be > 0, got -4"),
    ("numerics = 1", "bad value for 'numerics': expected a string, got 1 (an integer)"),
    ("cuda_graphs = 1", "bad value for 'cuda_graphs': expected true or false, got 1 (an integer)"),
    ("model = [1]", "bad value for 'model': expected a path (string), got [1] (an array)"),
    ('[generation]\ntemperature = "hot"', "bad value for 'temperature': expected a number, got 'hot' (a string)"),
    ("[generation]\nmax_tokens = 10.0", "bad value for 'max_tokens': expected an integer, got 10.0 (a number)"),
    ('[generation]\nthink = "yes"', "bad value for 'think': expected true or false, got 'yes' (a string)"),
    ("[generation]\nsystem = {a = 1}", "bad value for 'system': expected a string, got {'a': 1} (a table)"),
])
def test_file_values_are_type_checked(tmp_path, line, message):
    path = tmp_path / "config.toml"
    path.write_text(line + "\n")
    with pytest.raises(SettingsError) as info:
        build_config({}, {}, path)
    key = message.split("'")[1]
    assert str(info.value) == f"{path}: {message}; correct {key!r} in this file or remove it"


@pytest.mark.parametrize("env, message", [
    ({"DSV4_CACHE_GB": "nan"}, "must be a finite number > 0, got nan"),
    ({"DSV4_CACHE_GB": "inf"}, "must be a finite number > 0, got inf"),
    ({"DSV4_CACHE_GB": "0"}, "must be > 0, got 0.0"),
    ({"DSV4_HOST_CACHE_GB": "1e300"}, "must be a number of GiB that fits in bytes, got 1e+300"),
    ({"DSV4_IO_THREADS": "2.5"}, "expected an integer, got '2.5'"),
    ({"DSV4_MAX_TOKENS": "many"}, "expected an integer, got 'many'"),
    ({"DSV4_TEMPERATURE": "hot"}, "expected a number, got 'hot'"),
])
def test_environment_values_are_type_checked(tmp_path, env, message):
    (name, value), = env.items()
    key = name[5:].lower()
    with pytest.raises(SettingsError) as info:
        build_config({}, env, tmp_path / "absent.toml")
    assert str(info.value) == (f"environment {name}: bad value for {key!r}: {message}; "
                               f"set {name} to a valid value or unset it")


@pytest.mark.parametrize("argv, line", [
    (["--cache-gb", "nan"], "dsv4-chat: --cache-gb: bad value for 'cache_gb': must be a finite number > 0, got nan"),
    (["--cache-gb", "inf"], "dsv4-chat: --cache-gb: bad value for 'cache_gb': must be a finite number > 0, got inf"),
    (["--cache-gb", "0"], "dsv4-chat: --cache-gb: bad value for 'cache_gb': must be > 0, got 0.0"),
    (["--cache-gb", "-1"], "dsv4-chat: --cache-gb: bad value for 'cache_gb': must be > 0, got -1.0"),
    (["--max-tokens", "0"], "dsv4-chat: --max-tokens: bad value for 'max_tokens': must be in [1, 1048576], got 0"),
    (["--temperature", "nan"], "dsv4-chat: --temperature: bad value for 'temperature': must be in [0, 2], got nan"),
    (["run", "--cache-gb", "inf", "hi"],
     "dsv4-chat: --cache-gb: bad value for 'cache_gb': must be a finite number > 0, got inf"),
])
def test_bad_flags_refused_at_parse_time_in_one_line(capsys, tmp_path, monkeypatch, argv, line):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert main(argv) == 2
    flag = line.split(": ")[1]
    assert capsys.readouterr().err == f"{line}; give {flag} a valid value or leave it out\n"


@pytest.mark.parametrize("argv, line", [
    (["--cache-gb", "lots"], "dsv4-chat: error: argument --cache-gb: invalid float value: 'lots' (see dsv4-chat --help)"),
    (["--max-tokens", "1.5"], "dsv4-chat: error: argument --max-tokens: invalid int value: '1.5' (see dsv4-chat --help)"),
])
def test_flag_type_errors_are_one_line(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_run_subcommand_and_generation_flags(toml_file):
    cfg = config_from_args(["--config", str(toml_file), "--max-tokens", "7", "--temperature", "0",
                            "--system", "be kind"], {})
    assert (cfg.gen.max_tokens, cfg.gen.temperature, cfg.system) == (7, 0.0, "be kind")
    assert cfg.gen.thinking and not cfg.plain  # the rest still from the file
    # options before and after `run` both count; `run` is line mode
    cfg = config_from_args(["--demo", "--max-tokens", "3", "run", "--temperature", "0.5",
                            "--config", str(toml_file), "hello", "world"], {})
    assert cfg.demo and cfg.plain and (cfg.gen.max_tokens, cfg.gen.temperature) == (3, 0.5)


def test_memory_gb_reaches_the_engine_from_flag_env_and_file(tmp_path):
    from app.__main__ import config_from_args
    flag = config_from_args(["--memory-gb", "48", "--cache-gb", "20"], {"XDG_CONFIG_HOME": str(tmp_path)})
    assert flag.engine.memory_bytes == 48 * 2**30 and flag.engine.cache_bytes == 20 * 2**30
    env = config_from_args([], {"DSV4_MEMORY_GB": "12.5", "XDG_CONFIG_HOME": str(tmp_path)})
    assert env.engine.memory_bytes == int(12.5 * 2**30)
    toml = tmp_path / "c.toml"
    toml.write_text("memory_gb = 64\n")
    assert config_from_args(["--config", str(toml)], {}).engine.memory_bytes == 64 * 2**30
    with pytest.raises(Exception, match="memory_gb"):
        config_from_args([], {"DSV4_MEMORY_GB": "nan", "XDG_CONFIG_HOME": str(tmp_path)})


def test_host_cache_gb_caps_the_host_tier_from_flag_env_and_file(tmp_path):
    from app.__main__ import config_from_args
    home = {"XDG_CONFIG_HOME": str(tmp_path)}
    assert config_from_args([], home).engine.host_cache_bytes is None  # the plan sizes it
    assert config_from_args(["--host-cache-gb", "24"], home).engine.host_cache_bytes == 24 * 2**30
    assert config_from_args([], {**home, "DSV4_HOST_CACHE_GB": "8.5"}).engine.host_cache_bytes == int(8.5 * 2**30)
    toml = tmp_path / "c.toml"
    toml.write_text("host_cache_gb = 64\n")
    assert config_from_args(["--config", str(toml)], {}).engine.host_cache_bytes == 64 * 2**30
    with pytest.raises(Exception, match="host_cache_gb"):
        config_from_args(["--host-cache-gb", "-1"], home)
