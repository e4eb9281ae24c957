"""bench/kernel_hints.py: manifests recorded on a GPU -> a hints file the engine reads for the
real model's shapes."""

from __future__ import annotations

import json

import pytest

from bench.kernel_hints import main
from converter.synth import flash_config
from engine.config import EngineConfig, ModelArgs
from engine.kernel_manifest import KernelCall, read_hints, shape_key, write_manifest


def test_the_hints_file_lists_the_manifests_kernels_once_under_flashs_shape_key(tmp_path, capsys):
    a = [KernelCall("k.gemv", (1, 4096, (9, 0))), KernelCall("k.norm", (4096, 1e-6))]
    b = [KernelCall("k.norm", (4096, 1e-6)), KernelCall("k.gemv", (2, 4096, (9, 0)))]
    write_manifest(tmp_path / "a.json", "key-a", a)
    write_manifest(tmp_path / "b.json", "key-b", b)
    out = tmp_path / "hints" / "flash.json"
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out)]) == 0
    flash = ModelArgs.from_dict(flash_config(43), "flash")
    shape = shape_key(flash, EngineConfig(), True, (9, 0), "0.1.15")
    assert json.loads(out.read_text())["shape"] == shape and "3 kernels" in capsys.readouterr().out
    factories = {"k.gemv": lambda m, n, arch: None, "k.norm": lambda d, eps: None}  # stand-ins: their signatures
    assert read_hints([out], shape, factories) == [a[0], a[1], b[1]]
    # the 256-expert model, any depth, another max_seq_len: the same shapes
    real = ModelArgs.from_dict(flash_config(43, n_routed_experts=256), "flash")
    assert shape_key(real, EngineConfig(max_seq_len=65536), True, (9, 0), "0.1.15") == shape


def test_a_file_that_is_no_manifest_is_refused(tmp_path):
    (tmp_path / "x.json").write_text('{"kernels": 3}')
    with pytest.raises(SystemExit, match="not a format-1 kernel manifest"):
        main([str(tmp_path / "x.json"), "--out", str(tmp_path / "o.json")])
