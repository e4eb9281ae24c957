"""Conversion to the expert-pack layout: lossless round trip, alignment, checksums, verify,
resume after kills, cancellation, preflight errors, CLI (converter/convert.py, converter/cli.py, engine/pack.py)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from converter import cli
from converter import mapping
from converter.convert import ConvertCancelled, ConvertProgress, convert
from converter.preflight import PreflightError, check_source
from converter.synth import SynthOptions, tiny_config, write_checkpoint
from converter.verify import main as verify_main
from converter.verify import verify
from engine import pack as layout
from engine.checkpoint import CheckpointError, TensorIndex, read_header
from engine.config import ModelArgs
from engine.weights import open_model
from kernels import reference as ref


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tiny checkpoint with a tokenizer that fits its 512-token vocabulary (dsv4-convert
    refuses the real 129,280-token one for it: preflight.check_tokenizer)."""
    root = write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", tiny_config(),
                            SynthOptions(seed=0, n_shards=2))
    small = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    small.save(str(root / "tokenizer.json"))
    return root


@pytest.fixture(scope="module")
def converted(source: Path, tmp_path_factory) -> Path:
    return convert(source, tmp_path_factory.mktemp("out") / "pack")


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(root.iterdir())}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# ----------------------------------------------------------------------------- layout

def test_every_source_tensor_recoverable_byte_for_byte(source: Path, converted: Path):
    args = ModelArgs.from_dir(source)
    record = layout.read_manifest(converted).record
    with TensorIndex.open(source) as src, TensorIndex.open(converted) as dst:
        expected_out = set()
        for name in src.names():
            t = mapping.classify(name, args)
            if t.is_expert:
                rec = dst.get(mapping.experts_tensor(t.unit, args))[t.expert]
                got = record.unpack(rec)[t.field]
                if t.field.endswith(".weight"):  # FP4 codes in record order: back to official order
                    assert raw(got) != raw(src.get(name)), name
                    got = ref.fp4_official_order(got).view(got.dtype)
                assert dst.info(mapping.experts_tensor(t.unit, args)).file.name == t.file
                expected_out.add(mapping.experts_tensor(t.unit, args))
            else:
                got = dst.get(name)
                assert dst.info(name).file.name == t.file
                expected_out.add(name)
            want = src.get(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert raw(got) == raw(want), name
        assert set(dst.names()) == expected_out
        assert len(src.names()) == len(mapping.expected_inventory(args))


def test_files_are_valid_safetensors_with_aligned_records(converted: Path):
    m = layout.read_manifest(converted)
    assert m.record.record_bytes % 4096 == 0 and m.record.alignment == 4096
    fields = list(m.record.fields.values())
    assert [f.offset for f in fields] == [0] + [sum(f.nbytes for f in fields[:i]) for i in range(1, 6)]
    used = fields[-1].offset + fields[-1].nbytes
    assert m.record.record_bytes - 4096 < used <= m.record.record_bytes  # padded to the next 4 KiB
    names = sorted(f.name for f in converted.glob("*.safetensors"))
    assert names == ["global.safetensors"] + [f"layer_{i:02d}.safetensors" for i in range(5)] + [
        "mtp.safetensors"]
    for f in names:
        with safe_open(converted / f, "pt") as st:  # the reference library accepts every file
            assert len(list(st.keys())) > 0
        header = read_header(converted / f)
        data_start = min(t.offset for t in header.tensors)
        assert data_start % 4096 == 0, f
    assert [(u.layer, u.file, u.tensor) for u in m.units] == [
        (i, f"layer_{i:02d}.safetensors", f"layers.{i}.ffn.experts") for i in range(5)] + [
        (5, "mtp.safetensors", "mtp.0.ffn.experts")]
    with TensorIndex.open(converted) as idx:
        for u in m.units:
            info = idx.info(u.tensor)
            assert info.offset % 4096 == 0 and info.shape == (16, m.record.record_bytes)
            pad = idx.get(u.tensor)[:, used:]
            assert int(pad.count_nonzero()) == 0  # record padding is zeros


def test_a_version_1_pack_is_refused_and_converted_again(source: Path, converted: Path, tmp_path: Path):
    old = tmp_path / "pack"
    shutil.copytree(converted, old)
    doc = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps(doc | {"version": 1}))  # FP4 in official order
    with pytest.raises(layout.LayoutError, match="layout version 1 is not supported .*version 2.*"
                                                 "convert the checkpoint again"):
        layout.read_manifest(old)
    with pytest.raises(CheckpointError, match="layout version 1 is not supported"):
        open_model(old)
    points = []
    convert(source, old, fault_hook=points.append)  # nothing of version 1 is resumed from
    assert sum(p.startswith("record:") for p in points) == 6 * 16
    assert tree_bytes(old) == tree_bytes(converted)


def test_manifest_contents_and_checksums(source: Path, converted: Path):
    doc = json.loads((converted / "manifest.json").read_text())
    assert doc["format"] == "dsv4-expert-pack" and doc["version"] == 2
    assert doc["config"] == json.loads((source / "config.json").read_text())
    shards = sorted(source.glob("model-*.safetensors"))
    assert doc["source"]["shards"] == [{"name": s.name, "size": s.stat().st_size} for s in shards]
    assert doc["experts"]["fields"]["w1.weight"] == {"offset": 0, "nbytes": 128 * 64, "dtype": "I8",
                                                     "shape": [128, 64]}
    assert doc["experts"]["fields"]["w2.scale"]["dtype"] == "F8_E8M0"
    on_disk = {f.name for f in converted.iterdir()} - {"manifest.json"}
    assert set(doc["files"]) == on_disk
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (converted / name).read_bytes() == (source / name).read_bytes()
    for name, entry in doc["files"].items():
        data = (converted / name).read_bytes()
        assert entry["size"] == len(data)
        if entry["checksum"].startswith("sha256:"):
            assert entry["checksum"] == "sha256:" + hashlib.sha256(data).hexdigest()
            continue
        # independent recomputation of the piece checksum (layout docstring, "File entries")
        n = int.from_bytes(data[:8], "little")
        hdr = json.loads(data[8:8 + n])
        hdr.pop("__metadata__")
        start = entry["header"]["bytes"]
        tree = [hashlib.sha256(data[:start]).digest()]
        for tname, t in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            b, e = (start + o for o in t["data_offsets"])
            if tname.endswith(".ffn.experts"):
                r = t["shape"][1]
                digests = [hashlib.sha256(data[i:i + r]).digest() for i in range(b, e, r)]
                assert [d.hex() for d in digests] == entry["records"]
                tree += digests
            else:
                tree.append(hashlib.sha256(data[b:e]).digest())
                assert tree[-1].hex() == entry["tensors"][tname]
        assert entry["checksum"] == "sha256-pieces:" + hashlib.sha256(b"".join(tree)).hexdigest()
    assert verify(converted) == []


def test_conversion_is_deterministic(source: Path, converted: Path, tmp_path: Path):
    again = convert(source, tmp_path / "again", resume=False)
    assert tree_bytes(again) == tree_bytes(converted)


# ----------------------------------------------------------------------------- verify

def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_verify_names_corrupt_record_and_tensor_and_rerun_repairs(source, converted, tmp_path, capsys):
    broken = Path(shutil.copytree(converted, tmp_path / "broken"))
    m = layout.read_manifest(broken)
    idx = TensorIndex.open(broken)
    rec_off = idx.info("layers.3.ffn.experts").offset + 7 * m.record.record_bytes + 100
    norm_off = idx.info("layers.1.attn_norm.weight").offset
    idx.close()
    _flip(broken / "layer_03.safetensors", rec_off)
    _flip(broken / "layer_01.safetensors", norm_off)
    problems = verify(broken)
    assert len(problems) == 2
    assert "layer_01.safetensors: tensor layers.1.attn_norm.weight does not match" in problems[0]
    assert "layer_03.safetensors: routed expert 7 of layers.3" in problems[1]
    assert verify_main([str(broken)]) == 1
    assert "routed expert 7 of layers.3" in capsys.readouterr().out
    layout.read_manifest(broken)  # sizes still fine: only checksums catch a flipped byte
    convert(source, broken)  # resume re-verifies and rewrites only what is corrupt
    assert tree_bytes(broken) == tree_bytes(converted)
    assert verify_main([str(broken)]) == 0


def test_verify_reports_size_and_missing_file(converted, tmp_path):
    broken = Path(shutil.copytree(converted, tmp_path / "b"))
    with open(broken / "layer_02.safetensors", "r+b") as f:
        f.truncate(5000)
    (broken / "tokenizer.json").unlink()
    problems = verify(broken)
    assert any("layer_02.safetensors is 5,000 bytes, the manifest says" in p for p in problems)
    assert "tokenizer.json is missing" in problems
    with pytest.raises(layout.LayoutError, match="layer_02.safetensors: 5000 bytes"):
        layout.read_manifest(broken)


def test_verify_names_every_corrupt_tensor_and_record_of_one_file(source, converted, tmp_path):
    broken = Path(shutil.copytree(converted, tmp_path / "broken"))
    record = layout.read_manifest(broken).record.record_bytes
    with TensorIndex.open(broken) as idx:
        base = idx.info("layers.2.ffn.experts").offset
        for name in ("layers.2.attn_norm.weight", "layers.2.attn.attn_sink"):
            _flip(broken / "layer_02.safetensors", idx.info(name).offset)
    for e in (3, 11):
        _flip(broken / "layer_02.safetensors", base + e * record + 50)
    problems = verify(broken)
    assert len(problems) == 3, problems
    assert any("tensor layers.2.attn_norm.weight does not match" in p for p in problems)
    assert any("tensor layers.2.attn.attn_sink does not match" in p for p in problems)
    assert any("layer_02.safetensors: 2 routed experts of layers.2 do not match their checksums: 3, 11"
               in p for p in problems)
    convert(source, broken)
    assert tree_bytes(broken) == tree_bytes(converted)


def _edit_manifest(root: Path, edit) -> None:
    doc = json.loads((root / "manifest.json").read_text())
    edit(doc)
    (root / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _set(path: tuple, value):
    def edit(doc):
        *parents, last = path
        for key in parents:
            doc = doc[key]
        doc[last] = value
    return edit


@pytest.mark.parametrize("edit,message", [
    (_set(("files", "layer_01.safetensors", "size"), "abc"), "the entry of layer_01.safetensors has no 'size'"),
    (_set(("files", "layer_01.safetensors", "size"), None), "the entry of layer_01.safetensors has no 'size'"),
    (_set(("files", "config.json"), [1]), "the entry of config.json is not a JSON object"),
    (_set(("files", "config.json", "checksum"), 5), "the entry of config.json has no 'checksum'"),
    (_set(("files", "layer_01.safetensors", "tensors"), None), "has no 'tensors' object"),
    (_set(("files", "../pack/config.json"), {"size": 1, "checksum": "sha256:"}),
     "it lists '../pack/config.json', not a file of a converted model"),
])
def test_a_malformed_manifest_entry_is_one_line_exit_1_and_a_rerun_repairs_it(source, converted, tmp_path,
                                                                             capsys, edit, message):
    broken = Path(shutil.copytree(converted, tmp_path / "broken"))
    _edit_manifest(broken, edit)
    assert cli.main(["--verify", str(broken)]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert verify_main([str(broken)]) == 1
    assert message in capsys.readouterr().out
    with pytest.raises(layout.LayoutError, match="convert again"):  # the engine says the same
        layout.read_manifest(broken)
    convert(source, broken)
    assert tree_bytes(broken) == tree_bytes(converted)


@pytest.mark.parametrize("hbytes", [10**12, 3, -1])
def test_a_header_size_beyond_the_file_is_that_files_problem_and_a_rerun_rewrites_it(source, converted,
                                                                                   tmp_path, hbytes):
    broken = Path(shutil.copytree(converted, tmp_path / "broken"))
    _edit_manifest(broken, _set(("files", "layer_01.safetensors", "header", "bytes"), hbytes))
    (problem,) = verify(broken)
    assert problem.startswith(f"layer_01.safetensors: the manifest says its header is {hbytes:,} bytes, "
                              "outside 8..")
    written: list[str] = []
    convert(source, broken, fault_hook=lambda p: written.append(p[6:]) if p.startswith("begin:") else None)
    assert written == ["layer_01.safetensors"] and tree_bytes(broken) == tree_bytes(converted)


@pytest.mark.parametrize("damage,message", [
    (lambda d, m: (m["files"].pop("global.safetensors"), _flip(d / "global.safetensors", 5000)),
     "does not list global.safetensors, which the model needs"),
    (lambda d, m: m["experts"].__setitem__("count", 8), "experts count is 8, its config says n_routed_experts = 16"),
    (lambda d, m: m["experts"]["units"].pop(), "the experts' units do not match its config's layers"),
    (lambda d, m: m["experts"].__setitem__("record_bytes", 2 * m["experts"]["record_bytes"]),
     "the experts' record layout does not match its config"),
    (lambda d, m: m["config"].__setitem__("vocab_size", 256), "its config differs from config.json"),
    (lambda d, m: (m["files"].pop("tokenizer.json"), _flip(d / "tokenizer.json", 100)),
     "does not list tokenizer.json"),
])
def test_verify_checks_the_manifest_against_its_config_and_the_directory(source, converted, tmp_path,
                                                                        capsys, damage, message):
    """What the engine relies on: every file it needs listed (and checked), the experts as its
    config says; no file of the model left unlisted (unchecked)."""
    broken = Path(shutil.copytree(converted, tmp_path / "broken"))
    _edit_manifest(broken, lambda m: damage(broken, m))
    problems = verify(broken)
    assert any(message in p for p in problems), problems
    assert cli.main(["--verify", str(broken)]) == 1
    err = capsys.readouterr().err
    assert f"{broken}: its manifest.json is corrupt:" in err and message in err
    convert(source, broken)
    assert tree_bytes(broken) == tree_bytes(converted)


def test_verify_reports_an_unreadable_file_as_unreadable_not_corrupt(converted, tmp_path, monkeypatch):
    import errno

    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if str(path).endswith("layer_02.safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    (problem,) = verify(converted)
    assert problem == ("layer_02.safetensors: cannot read it (Permission denied, EACCES): make it readable "
                       "(or check the disk: dmesg), then verify again")


def test_verify_cli_exit_status_and_advice_for_what_is_no_intact_model(source, converted, tmp_path, capsys):
    assert cli.main(["--verify", str(source)]) == 2  # an HF download
    err = capsys.readouterr().err
    assert "it is a downloaded checkpoint, not a converted model" in err
    assert f"dsv4-convert --hf {source} --out DIR" in err and "did not finish" not in err
    old = Path(shutil.copytree(converted, tmp_path / "old"))
    _edit_manifest(old, _set(("version",), 1))
    assert cli.main(["--verify", str(old)]) == 1  # one fix: the layout error's own
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "layout version 1 is not supported" in line and "dsv4-convert --upgrade DIR" in line
    assert "unreadable" not in line
    (old / "manifest.json").write_text("{")  # corrupt: exit 1 as the README says, with the fix
    assert cli.main(["--verify", str(old)]) == 1
    assert "not readable JSON" in capsys.readouterr().err
    assert verify_main([str(source)]) == 2


# ----------------------------------------------------------------------------- resume

def _killed_run(source: Path, out: Path, point: str) -> int:
    """Run convert in a forked child that SIGKILLs itself at fault point `point`."""

    def hook(p: str) -> None:
        if p == point:
            os.kill(os.getpid(), signal.SIGKILL)

    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=convert, args=(source, out), kwargs={"fault_hook": hook})
    child.start()
    child.join(60)
    return child.exitcode


@pytest.mark.parametrize("point", [
    "record:layer_01.safetensors:5",  # mid-file: only a .tmp exists
    "written:layer_02.safetensors",  # complete and fsynced, not yet renamed
    "renamed:layer_03.safetensors",  # renamed, not yet recorded in the state file
    "saved:mtp.safetensors",  # recorded; copies and manifest missing
    "manifest",  # every file done, manifest not written
])
def test_resume_after_kill_is_byte_identical(source, converted, tmp_path, point):
    out = tmp_path / "pack"
    assert _killed_run(source, out, point) == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    name = point.split(":")[1] if ":" in point else None
    if point.startswith(("record", "written")):
        assert (out / f"{name}.tmp").exists() and not (out / name).exists()
    with pytest.raises(CheckpointError, match="did not finish"):
        open_model(out)
    written: list[str] = []
    convert(source, out, fault_hook=lambda p: written.append(p[6:]) if p.startswith("begin:") else None)
    assert tree_bytes(out) == tree_bytes(converted)
    assert "global.safetensors" not in written  # finished files were verified, not rewritten
    if point.startswith("record"):
        assert written[0] == "layer_01.safetensors"


def test_resume_rewrites_a_damaged_finished_file(source, converted, tmp_path):
    out = tmp_path / "pack"
    assert _killed_run(source, out, "saved:layer_02.safetensors") == -signal.SIGKILL
    with open(out / "layer_01.safetensors", "r+b") as f:
        f.truncate(10000)
    _flip(out / "layer_00.safetensors", 9000)
    written: list[str] = []
    convert(source, out, fault_hook=lambda p: written.append(p[6:]) if p.startswith("begin:") else None)
    assert written[:3] == ["layer_00.safetensors", "layer_01.safetensors", "layer_03.safetensors"]
    assert tree_bytes(out) == tree_bytes(converted)


def test_cancel_then_resume(source, converted, tmp_path):
    cancel = threading.Event()
    seen: list[ConvertProgress] = []

    def progress(p: ConvertProgress) -> None:
        seen.append(p)
        if p.bytes_done > p.bytes_total // 3:
            cancel.set()

    out = tmp_path / "pack"
    with pytest.raises(ConvertCancelled, match="run it again"):
        convert(source, out, progress=progress, cancel=cancel)
    assert not (out / "manifest.json").exists() and not list(out.glob("*.tmp"))
    seen.clear()
    convert(source, out, progress=seen.append, verify=True)
    assert tree_bytes(out) == tree_bytes(converted)
    done = [p.bytes_done for p in seen]
    assert done == sorted(done) and seen[-1].bytes_done == seen[-1].bytes_total > 0
    assert {p.current for p in seen} >= {"checking global.safetensors", "writing mtp.safetensors",
                                         "done", "verifying"}


def test_no_resume_starts_over_and_foreign_files_refused(source, converted, tmp_path):
    out = tmp_path / "pack"
    assert _killed_run(source, out, "saved:layer_00.safetensors") == -signal.SIGKILL
    written: list[str] = []
    convert(source, out, resume=False,
            fault_hook=lambda p: written.append(p[6:]) if p.startswith("begin:") else None)
    assert written[0] == "global.safetensors" and tree_bytes(out) == tree_bytes(converted)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(PreflightError, match="notes.txt"):
        convert(source, out)
    (out / "notes.txt").unlink()
    (out / "layer_04.safetensors").unlink()
    (out / "layer_04.safetensors").mkdir()  # a converter name, but not a file it could replace
    with pytest.raises(PreflightError, match="not conversion output.*layer_04.safetensors"):
        convert(source, out)


def test_files_with_converter_names_in_a_directory_without_a_conversion_are_refused(source, tmp_path, capsys):
    """Only a directory holding an earlier conversion (manifest.json or the state file) has files
    the converter may replace: in any other one, config.json or layer_00.safetensors is the user's."""
    out = tmp_path / "own"
    out.mkdir()
    mine = {"config.json": b'{"mine": 1}', "tokenizer.json": b"precious", "layer_07.safetensors": b"x"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    assert cli.main(["--hf", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds files that are not conversion output" in err
    assert "config.json, layer_07.safetensors, tokenizer.json" in err
    with pytest.raises(PreflightError, match="not conversion output"):
        convert(source, out, resume=False)
    assert tree_bytes(out) == mine  # nothing replaced, nothing deleted


def test_an_interrupted_first_file_leaves_a_directory_that_resumes(source, converted, tmp_path):
    """The state file is written before the first output file: a run killed in its first file
    leaves a directory the next run recognises as its own (and resumes)."""
    out = tmp_path / "pack"
    assert _killed_run(source, out, "begin:global.safetensors") == -signal.SIGKILL
    assert (out / "global.safetensors.tmp").exists() and (out / layout.STATE).exists()
    convert(source, out)
    assert tree_bytes(out) == tree_bytes(converted)


def test_a_copied_file_removed_from_the_source_is_removed_from_the_output(src_copy, tmp_path):
    out = convert(src_copy, tmp_path / "pack")
    (src_copy / "generation_config.json").unlink()
    convert(src_copy, out)
    assert not (out / "generation_config.json").exists()
    assert set(json.loads((out / "manifest.json").read_text())["files"]) == {
        f.name for f in out.iterdir()} - {"manifest.json"}
    assert verify(out) == []


def test_out_below_a_file_or_equal_to_the_source_by_another_path(source, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert cli.main(["--hf", str(source), "--out", str(tmp_path / "afile" / "pack")]) == 2
    err = capsys.readouterr().err
    assert f"lies below {tmp_path / 'afile'}, which is a file, not a directory" in err
    assert "Traceback" not in err and (tmp_path / "afile").read_text() == "x"
    (tmp_path / "link").symlink_to(source)
    before = tree_bytes(source)
    for same in (source / ".." / source.name, tmp_path / "link"):
        assert cli.main(["--hf", str(source), "--out", str(same)]) == 2
        assert "is the source directory; choose a new directory" in capsys.readouterr().err
    assert tree_bytes(source) == before


# ----------------------------------------------------------------------------- preflight

@pytest.fixture
def src_copy(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


def _shard_of(root: Path, name: str) -> Path:
    return root / json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][name]


def _replace_tensor(root: Path, name: str, new: torch.Tensor) -> None:
    shard = _shard_of(root, name)
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = new
    save_file(tensors, shard, metadata={"format": "pt"})


def test_preflight_accepts_the_good_source(source):
    assert check_source(source) == []


def test_preflight_missing_shard(src_copy, tmp_path):
    (src_copy / "model-00002-of-00002.safetensors").unlink()
    problems = check_source(src_copy)
    assert any("1 of 2 shards named in model.safetensors.index.json are missing" in p
               and "model-00002-of-00002.safetensors" in p for p in problems)
    with pytest.raises(PreflightError, match="are missing"):
        convert(src_copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_preflight_truncated_shard(src_copy):
    shard = src_copy / "model-00001-of-00002.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    problems = check_source(src_copy)
    assert len(problems) == 1 and "model-00001-of-00002.safetensors is unreadable" in problems[0]
    assert "truncated" in problems[0]
    with open(shard, "ab") as f:  # longer than its header says
        f.write(b"\0" * 3000)
    assert any("is" in p and "bytes but its header describes" in p for p in check_source(src_copy))


def test_preflight_wrong_dtype_and_shape(src_copy):
    _replace_tensor(src_copy, "norm.weight", torch.ones(128, dtype=torch.float32))
    _replace_tensor(src_copy, "layers.0.attn.attn_sink", torch.zeros(5))
    (problem,) = check_source(src_copy)
    assert "2 tensors have the wrong dtype or shape" in problem
    assert "norm.weight is F32 [128], expected BF16 [128]" in problem
    assert "layers.0.attn.attn_sink is F32 [5], expected F32 [4]" in problem


def test_preflight_not_enough_disk(source, tmp_path):
    with pytest.raises(PreflightError, match=r"not enough free disk space .* needs 0\.01 GB more, "
                                             r"0\.00 GB are free"):
        convert(source, tmp_path / "out", disk_free=lambda p: 1000)
    assert not (tmp_path / "out").exists()


def test_preflight_wrong_model_type(src_copy):
    cfg = json.loads((src_copy / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (src_copy / "config.json").write_text(json.dumps(cfg))
    (problem,) = check_source(src_copy)
    assert "'model_type' is 'deepseek_v3', expected 'deepseek_v4'" in problem


def test_preflight_missing_index_and_extra_tensor(src_copy):
    _replace_tensor(src_copy, "norm.weight", torch.ones(128, dtype=torch.bfloat16))
    shard = _shard_of(src_copy, "norm.weight")
    with safe_open(shard, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors | {"layers.0.extra.weight": torch.zeros(2)}, shard)
    assert any("1 tensors are not part of DeepSeek-V4-Flash" in p and "layers.0.extra.weight" in p
               for p in check_source(src_copy))
    (src_copy / "model.safetensors.index.json").unlink()
    assert any("model.safetensors.index.json is missing" in p for p in check_source(src_copy))
    assert "not a directory" in check_source(src_copy / "nope")[0]


@pytest.mark.parametrize("value", [5, ["model-00001-of-00002.safetensors"], None])
def test_preflight_index_with_a_non_string_shard_name(src_copy, tmp_path, capsys, value):
    index = src_copy / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["norm.weight"] = value
    index.write_text(json.dumps(doc))
    (problem,) = check_source(src_copy)
    assert f"{index} is not a valid safetensors index" in problem
    assert "the value of 'norm.weight' in 'weight_map' is not a shard file name" in problem
    assert cli.main(["--hf", str(src_copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a valid safetensors index" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,text", [
    ("tokenizer_config.json", "{not json"),
    ("tokenizer_config.json", "[1, 2]"),
    ("generation_config.json", '{"bos_token_id": 0'),
])
def test_preflight_refuses_a_tokenizer_or_generation_config_that_is_not_json(src_copy, tmp_path, capsys,
                                                                           name, text):
    """The engine reads tokenizer_config.json to chat: a broken one is refused before converting,
    not after (issue: it converted with exit 0 and the engine then refused the model)."""
    (src_copy / name).write_text(text)
    assert cli.main(["--hf", str(src_copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(src_copy / name) in err and "download it again" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    (src_copy / name).write_bytes(b'{"chat_template": "\xff"}')  # not UTF-8
    assert any(str(src_copy / name) in p and "not readable JSON" in p for p in check_source(src_copy))
    assert check_source(src_copy, tokenizer=False) == []  # --logits-only does not chat


# ----------------------------------------------------------------------------- CLI

def test_cli_plain_progress_and_errors(source, converted, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["--hf", str(source), "--out", str(out), "--verify"]) == 0
    err = capsys.readouterr().err
    assert "writing layer_00.safetensors" in err and "\r" not in err  # plain lines, not a TTY
    assert "converted" in err and "verified" in err
    assert tree_bytes(out) == tree_bytes(converted)
    assert cli.main(["--hf", str(tmp_path / "none"), "--out", str(tmp_path / "x")]) == 2
    assert "is not a directory" in capsys.readouterr().err
