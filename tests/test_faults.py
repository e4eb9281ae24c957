"""Faults and bad input (issue 30): a broken config, a changed or corrupt source, a full disk,
a corrupt converted model and bad CLI arguments each give one clear line and the right exit
status, and nothing is lost (converter/, engine/__main__.py, engine/logits.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from converter import convert as convert_mod
from converter.convert import convert
from converter.synth import SynthOptions, tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", tiny_config(),
                            SynthOptions(seed=3, n_shards=2))


@pytest.fixture
def src_copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


def _edit_config(root: Path, change: dict, drop: tuple[str, ...] = ()) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(change)
    for key in drop:
        del cfg[key]
    (root / "config.json").write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------- config types

@pytest.mark.parametrize("change,drop,message", [
    ({"n_routed_experts": "16"}, (), "field 'n_routed_experts' is \"16\" (a string), expected an integer"),
    ({"hidden_size": "128"}, (), "field 'hidden_size' is \"128\" (a string), expected an integer"),
    ({"num_hidden_layers": None}, (), "field 'num_hidden_layers' is null, expected an integer"),
    ({"compress_ratios": None}, (), "field 'compress_ratios' is null, expected a list of integers"),
    ({"vocab_size": 512.0}, (), "field 'vocab_size' is 512.0 (a number), expected an integer"),
    ({}, ("model_type",), "field 'model_type' is missing"),
])
def test_convert_refuses_a_wrong_config_type_in_one_line(src_copy, tmp_path, capsys, change, drop, message):
    _edit_config(src_copy, change, drop)
    assert convert_mod.main(["--hf", str(src_copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(src_copy / "config.json") in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
