"""engine/cli_args.py: the engine's options declared once for its entry points, spelled as
dsv4-chat spells the same settings, turned into one EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from app.__main__ import parser as app_parser
from engine import cli_args
from engine.__main__ import parser as generate_parser
from engine.config import ConfigError, EngineConfig


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {s for action in p._actions for s in action.option_strings} - {"-h", "--help"}


def _engine_parser(**kwargs) -> argparse.ArgumentParser:
    p = cli_args.Parser(prog="t")
    cli_args.add_engine_args(p, **kwargs)
    return p


def test_the_engine_options_are_spelled_as_dsv4_chat_spells_them():
    engine = _options(_engine_parser())
    assert engine == {"--ckpt", "--model", "--numerics", "--device", "--backend", "--cache-gb", "--host-cache-gb",
                      "--memory-gb", "--max-seq-len", "--no-cuda-graphs"}
    # every engine option but --ckpt (dsv4-chat: --model) and --max-seq-len (a settings-file key there)
    assert engine - {"--ckpt", "--max-seq-len"} <= _options(app_parser())
    assert _options(_engine_parser(turns=False)) == engine - {"--max-seq-len", "--no-cuda-graphs"}


def test_defaults_give_the_default_engine_config():
    a = _engine_parser().parse_args(["--ckpt", "m"])
    assert a.ckpt == "m" and cli_args.engine_config_from_args(a) == EngineConfig()
    logits = _engine_parser(numerics="exact", turns=False).parse_args(["--model", "m"])
    assert cli_args.engine_config_from_args(logits) == EngineConfig(numerics="exact")


def test_every_option_reaches_the_engine_config_and_gib_become_bytes():
    a = _engine_parser().parse_args(["--model", "m", "--numerics", "exact", "--backend", "tilelang",
                                     "--cache-gb", "1.5", "--memory-gb", "3", "--max-seq-len", "128",
                                     "--no-cuda-graphs", "--host-cache-gb", "2"])
    with pytest.raises(ConfigError, match=r"the tilelang backend runs on a CUDA GPU, not on device 'cpu'"):
        cli_args.engine_config_from_args(a)  # the backend reached the config, which refuses it on the CPU
    a.backend = "torch"
    assert cli_args.engine_config_from_args(a) == EngineConfig(
        device="cpu", numerics="exact", backend="torch", cache_bytes=3 * 2**29, memory_bytes=3 * 2**30,
        host_cache_bytes=2 * 2**30, max_seq_len=128, cuda_graphs=False)


def test_python_m_engine_generate_uses_the_shared_options():
    a = generate_parser().parse_args(["generate", "--ckpt", "m", "--prompt", "hi", "--no-cuda-graphs",
                                      "--max-seq-len", "64"])
    assert cli_args.engine_config_from_args(a) == EngineConfig(max_seq_len=64, cuda_graphs=False)


@pytest.mark.parametrize("argv, problem", [
    (["--ckpt", "m", "--max-seq-len", "0"], "argument --max-seq-len: expected a whole number above 0, got '0'"),
    (["--ckpt", "m", "--memory-gb", "nan"], "argument --memory-gb: expected a number of GB above 0, got 'nan'"),
    (["--ckpt", "m", "--device", "meta"], "argument --device: 'meta': the engine runs on cpu or cuda"),
])
def test_a_bad_value_is_one_line(argv, problem, capsys):
    with pytest.raises(SystemExit) as exit_:
        _engine_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == f"t: error: {problem} (--help lists the options)\n"
