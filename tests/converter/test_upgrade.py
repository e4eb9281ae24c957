"""`dsv4-convert --upgrade`: a version-1 pack rewritten as version 2 in place (converter/upgrade.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from converter.cli import main
from converter.convert import convert
from converter.synth import SynthOptions, tiny_config, write_checkpoint
from converter.upgrade import UpgradeCancelled, UpgradeError, _upgrade_file, upgrade
from converter.verify import verify
from engine import pack as layout
from engine.checkpoint import read_header
from engine.weights import open_model


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    src = write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", tiny_config(), SynthOptions(seed=1))
    return convert(src, tmp_path_factory.mktemp("out") / "pack")


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(root.iterdir())}


def as_version_1(pack: Path, dst: Path) -> Path:
    """What an older build wrote for the same source: FP4 weights in official order, version 1
    (entries rebuilt piece by piece as layout.PieceHasher does)."""
    shutil.copytree(pack, dst)
    m = layout.read_manifest(dst)
    doc = json.loads((dst / layout.MANIFEST).read_text())
    for unit in m.units:
        data = bytearray((dst / unit.file).read_bytes())
        hasher = layout.PieceHasher(bytes(data[:doc["files"][unit.file]["header"]["bytes"]]))
        for t in sorted(read_header(dst / unit.file).tensors, key=lambda t: t.offset):
            if t.name == unit.tensor:
                records = torch.frombuffer(data, dtype=torch.uint8)[t.offset:t.offset + t.nbytes]
                for rec in records.view(m.count, -1):  # [E, R]
                    m.record.to_official_order(rec)
                    hasher.add_record(hashlib.sha256(rec.numpy()).digest())
            else:
                hasher.add_tensor(t.name, hashlib.sha256(data[t.offset:t.offset + t.nbytes]).digest())
        (dst / unit.file).write_bytes(data)
        doc["files"][unit.file] = hasher.finish(len(data))
    (dst / layout.MANIFEST).write_text(json.dumps(doc | {"version": 1}, indent=1, sort_keys=True) + "\n")
    return dst


def test_upgrade_gives_the_pack_the_current_converter_writes(converted, tmp_path):
    old = as_version_1(converted, tmp_path / "old")
    assert tree_bytes(old) != tree_bytes(converted)
    with pytest.raises(layout.LayoutError, match="upgrade it in place with `dsv4-convert --upgrade DIR`"):
        layout.read_manifest(old)
    lines = []
    assert upgrade(old, progress=lines.append) == old
    assert tree_bytes(old) == tree_bytes(converted)  # byte for byte, manifest included
    assert verify(old) == []
    assert lines[-1].endswith(f"upgraded to layout version {layout.VERSION}")
    open_model(old).close()
    before = tree_bytes(old)
    upgrade(old, progress=lines.append)  # already current: nothing changes
    assert tree_bytes(old) == before and lines[-1].endswith("already at layout version 2")


def test_an_interrupted_upgrade_resumes(converted, tmp_path):
    old = as_version_1(converted, tmp_path / "old")
    cancel, seen = threading.Event(), []

    def progress(line: str) -> None:
        seen.append(line)
        if len(seen) == 3:  # two files done, the third about to start
            cancel.set()

    with pytest.raises(UpgradeCancelled, match="run it again to resume"):
        upgrade(old, progress=progress, cancel=cancel)
    state = json.loads((old / layout.UPGRADE_STATE).read_text())
    assert sorted(state["files"]) == ["layer_00.safetensors", "layer_01.safetensors"]
    assert json.loads((old / layout.MANIFEST).read_text())["version"] == 1  # still refused meanwhile
    assert not list(old.glob("*.tmp"))
    seen.clear()
    upgrade(old, progress=seen.append)
    assert not any("layer_00" in line or "layer_01" in line for line in seen)  # not redone
    assert tree_bytes(old) == tree_bytes(converted)


def test_a_file_renamed_before_its_entry_was_saved_is_recognised(converted, tmp_path):
    old = as_version_1(converted, tmp_path / "old")
    m = layout.parse_manifest(json.loads((old / layout.MANIFEST).read_text()) | {"version": layout.VERSION})
    _upgrade_file(old / "layer_02.safetensors", m.files["layer_02.safetensors"], m.record, None)
    assert not (old / layout.UPGRADE_STATE).exists()  # as if killed right after the rename
    upgrade(old)
    assert tree_bytes(old) == tree_bytes(converted)


def test_a_corrupt_record_stops_the_upgrade_and_changes_nothing_of_its_file(converted, tmp_path):
    old = as_version_1(converted, tmp_path / "old")
    m = layout.read_manifest(converted)
    f = old / "layer_03.safetensors"
    data = bytearray(f.read_bytes())
    hbytes = json.loads((old / layout.MANIFEST).read_text())["files"][f.name]["header"]["bytes"]
    data[hbytes + 5 * m.record.record_bytes + 7] ^= 0x10  # expert 5 of layer 3 (its records come first)
    f.write_bytes(data)
    with pytest.raises(UpgradeError, match="layer_03.safetensors: routed expert 5 of layers.3 does not "
                                           "match its checksum.*convert the checkpoint again"):
        upgrade(old)
    assert f.read_bytes() == data and not list(old.glob("*.tmp"))
    assert json.loads((old / layout.MANIFEST).read_text())["version"] == 1


def test_cli(converted, tmp_path, capsys):
    old = as_version_1(converted, tmp_path / "old")
    assert main(["--upgrade", str(old), "--verify"]) == 0
    assert "upgraded" in capsys.readouterr().err and tree_bytes(old) == tree_bytes(converted)
    with pytest.raises(SystemExit):
        main(["--upgrade", str(old), "--hf", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["--out", str(old)])
    (old / layout.MANIFEST).write_text(json.dumps({"version": 0}))
    assert main(["--upgrade", str(old)]) == 1
    assert "layout version 0 cannot be upgraded" in capsys.readouterr().err
