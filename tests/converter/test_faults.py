"""Faults and bad input (issue 30): a broken config, a changed or corrupt source, a full disk,
a corrupt converted model and bad CLI arguments each give one clear line and the right exit
status, and nothing is lost (converter/, engine/__main__.py, engine/logits.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from converter import cli
from converter.convert import convert
from converter.preflight import PreflightError
from converter.verify import verify as verify_dir
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
    ({}, ("hidden_size",), "field 'hidden_size' is missing; it sets the model's tensor shapes"),
    ({}, ("n_routed_experts",), "field 'n_routed_experts' is missing"),
])
def test_convert_refuses_a_wrong_config_type_in_one_line(src_copy, tmp_path, capsys, change, drop, message):
    _edit_config(src_copy, change, drop)
    assert cli.main(["--hf", str(src_copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(src_copy / "config.json") in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_an_experts_count_the_shards_do_not_have_is_refused_before_listing_their_names(src_copy, tmp_path,
                                                                                      capsys):
    """The expected inventory holds 6 names per expert and layer: an absurd n_routed_experts is
    checked against the gate's rows first (1024 here; 10**8 would take minutes and gigabytes)."""
    _edit_config(src_copy, {"n_routed_experts": 1024})
    assert cli.main(["--hf", str(src_copy), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (f"{src_copy / 'config.json'}: n_routed_experts is 1,024 but layers.0.ffn.gate.weight (one row "
            "per expert) is [16, 128]: the config does not belong to these shards") in err
    assert len(err.strip().splitlines()) == 2 and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- resume integrity

def tree_bytes(root: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(root.iterdir())}


def _poke(path: Path, offset: int, value: int) -> int:
    """Set one byte in place; returns the old value."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value]))
    return old


def _offset(root: Path, name: str) -> tuple[Path, int]:
    from engine.checkpoint import TensorIndex

    with TensorIndex.open(root) as idx:
        info = idx.info(name)
        return info.file, info.offset


SCALE = "layers.2.ffn.experts.3.w1.scale"  # an e8m0 scale: 0xFF is NaN


def test_resume_converts_again_what_came_from_a_changed_shard(src_copy, tmp_path):
    shard, at = _offset(src_copy, SCALE)
    good = _poke(shard, at, 0xFF)  # a corrupt source...
    out = convert(src_copy, tmp_path / "pack")
    _poke(shard, at, good)  # ...repaired (e.g. downloaded again)
    notes: list[str] = []
    written: list[str] = []
    convert(src_copy, out, notice=notes.append,
            fault_hook=lambda p: written.append(p[6:]) if p.startswith("begin:") else None)
    fresh = convert(src_copy, tmp_path / "fresh", resume=False)
    assert tree_bytes(out) == tree_bytes(fresh)  # the stale corrupt output is not kept
    (note,) = notes
    assert f"source shard {shard.name} changed since the earlier conversion (modification time)" in note
    assert "layer_02.safetensors" in note
    assert "layer_02.safetensors" in written
    listed = note.split(": converting ")[1].removesuffix(" again").split(", ")
    assert sorted(written) == listed and len(written) < 7  # only the files read from that shard


def test_resume_copies_a_changed_tokenizer_again(src_copy, tmp_path):
    out = convert(src_copy, tmp_path / "pack")
    (src_copy / "generation_config.json").write_text('{"bos_token_id": 0, "eos_token_id": 1}\n')
    notes: list[str] = []
    convert(src_copy, out, notice=notes.append)
    assert notes == ["source file generation_config.json changed since the earlier conversion: copying "
                     "it again"]
    assert (out / "generation_config.json").read_bytes() == (src_copy / "generation_config.json").read_bytes()


def test_resume_of_an_unchanged_source_says_nothing_and_rewrites_nothing(source, tmp_path):
    out = convert(source, tmp_path / "pack")
    notes: list[str] = []
    written: list[str] = []
    convert(source, out, notice=notes.append,
            fault_hook=lambda p: written.append(p) if p.startswith("begin:") else None)
    assert notes == [] and written == []


def test_a_second_conversion_into_the_same_directory_is_refused_while_the_first_runs(source, tmp_path, capsys):
    out = tmp_path / "pack"
    seen: list[str] = []

    def second(point: str) -> None:  # the first conversion is writing: start another into the same --out
        if point.startswith("begin:") and not seen:
            with pytest.raises(PreflightError, match="another conversion is writing into --out") as info:
                convert(source, out)
            seen.append(str(info.value))
            assert cli.main(["--hf", str(source), "--out", str(out), "--logits-only"]) == 2
            assert "another conversion is writing into --out" in capsys.readouterr().err

    convert(source, out, fault_hook=second)
    assert seen  # the second one ran, and was refused
    assert verify_dir(out) == []  # the first finished unharmed
    convert(source, out)  # once the first is done, the directory is free again


def test_a_refused_conversion_leaves_no_new_directory(src_copy, tmp_path):
    out = tmp_path / "new" / "pack"
    with pytest.raises(PreflightError):
        convert(src_copy, out, disk_free=lambda path: 0)  # no room: refused before writing
    assert not out.exists()


# ----------------------------------------------------------------------------- I/O errors

def test_enospc_while_writing_names_the_file_the_space_and_that_a_rerun_resumes(source, tmp_path, capsys):
    import errno

    from converter.convert import ConvertError

    fresh = convert(source, tmp_path / "fresh")
    sizes = {k: v["size"] for k, v in json.loads((fresh / "manifest.json").read_text())["files"].items()}

    def full(point: str) -> None:
        if point == "record:layer_02.safetensors:3":
            raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "pack"
    with pytest.raises(ConvertError) as err:
        convert(source, out, fault_hook=full, disk_free=lambda p: 10**12)
    done = {"global.safetensors", "layer_00.safetensors", "layer_01.safetensors"}
    remaining = sum(n for k, n in sizes.items() if k not in done) + (1 << 20)
    assert str(err.value) == (
        f"writing {out / 'layer_02.safetensors.tmp'}: no space left on the device: free "
        f"{remaining / 1e9:.2f} GB at {out} (what the rest of the conversion writes; 1000.00 GB are free "
        "now) and run the same command again: it resumes")
    assert not (out / "layer_02.safetensors.tmp").exists()  # the torn file is gone
    written: list[str] = []
    convert(source, out, fault_hook=lambda p: written.append(p[6:]) if p.startswith("begin:") else None)
    assert written[0] == "layer_02.safetensors" and tree_bytes(out) == tree_bytes(fresh)


def test_io_errors_name_operation_file_and_fix(source, tmp_path):
    import errno

    from converter.convert import ConvertError

    def failing(code: int, at: str):
        def hook(point: str) -> None:
            if point == at:
                raise OSError(code, os.strerror(code))
        return hook

    out = tmp_path / "pack"
    with pytest.raises(ConvertError, match=r"^writing .*global.safetensors.tmp: Input/output error \(EIO\): "
                                           r"check the disk \(dmesg, free space\) and run the same command "
                                           r"again: it resumes$"):
        convert(source, out, fault_hook=failing(errno.EIO, "begin:global.safetensors"))
    with pytest.raises(ConvertError, match=rf"^writing {out / 'layer_00.safetensors.tmp'}: Permission denied "
                                           rf"\(EACCES\): make {out} writable \(or choose another --out\) and run "
                                           "the same command again: it resumes$"):
        convert(source, out, fault_hook=failing(errno.EACCES, "tensor:layer_00.safetensors:layers.0.attn_norm.weight"))


def test_an_unreadable_source_file_is_to_be_made_readable(src_copy, tmp_path, monkeypatch):
    """EACCES reading a source (a shard, a copied file) is about that file, not about --out."""
    import errno

    from converter.convert import ConvertError

    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if str(path).endswith("model-00002-of-00002.safetensors") and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr("converter.convert.os.open", refusing)
    shard = src_copy / "model-00002-of-00002.safetensors"
    with pytest.raises(ConvertError, match=rf"^reading {shard}: Permission denied \(EACCES\): make it "
                                           "readable and run the same command again: it resumes$"):
        convert(src_copy, tmp_path / "pack")
    monkeypatch.undo()

    real_read = Path.read_bytes

    def unreadable_tokenizer(self):
        if self.name == "tokenizer_config.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", unreadable_tokenizer)
    with pytest.raises(ConvertError, match=rf"^reading {src_copy / 'tokenizer_config.json'}: Permission "
                                           r"denied \(EACCES\): make it readable"):
        convert(src_copy, tmp_path / "pack")


# ----------------------------------------------------------------------------- non-finite logits

@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory) -> Path:
    """A tiny checkpoint the engine can chat with (the real tokenizer's vocabulary)."""
    return write_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", tiny_config(vocab_size=129280),
                            SynthOptions(seed=0))


@pytest.fixture(scope="module")
def nan_pack(chat_ckpt, tmp_path_factory) -> Path:
    """chat_ckpt with one element of the final norm's weight NaN, converted (and verified: the
    corruption is in the source, so the converted files match their manifest)."""
    src = Path(shutil.copytree(chat_ckpt, tmp_path_factory.mktemp("nan") / "src"))
    shard, at = _offset(src, "norm.weight")
    _poke(shard, at, 0xC0)  # bf16 0x7FC0 = NaN (little endian: low byte first)
    _poke(shard, at + 1, 0x7F)
    return convert(src, tmp_path_factory.mktemp("nanpack") / "pack", verify=True)


def test_non_finite_logits_stop_the_turn_with_the_cause(nan_pack):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import EngineFailure, TurnFinished
    from engine.sampling import SamplingParams

    engine = Engine.load(nan_pack, EngineConfig(numerics="exact"))
    try:
        session = engine.new_session()
        events = list(engine.generate(session, "hello", SamplingParams(temperature=0.0, max_tokens=4)))
        assert not any(isinstance(e, TurnFinished) for e in events)
        (failure,) = [e for e in events if isinstance(e, EngineFailure)]
        assert "the logits after 0 generated tokens are not finite (NaN or inf)" in failure.message
        assert f"dsv4-convert --verify {nan_pack}" in failure.message
        assert session.messages == []  # the turn left the conversation as it was
    finally:
        engine.close()


def test_generate_cli_exits_1_on_non_finite_logits(nan_pack, capsys):
    from engine.__main__ import main

    rc = main(["generate", "--ckpt", str(nan_pack), "--prompt", "hello", "--max-tokens", "4",
               "--temperature", "0", "--numerics", "exact"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert "error: the turn failed: CorruptModelError: the logits after 0 generated tokens are not finite" in err
    assert f"dsv4-convert --verify {nan_pack}" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- dsv4-convert --verify

def test_verify_cli_names_a_zeroed_expert_record(source, tmp_path, capsys):
    from engine import pack as layout
    from engine.checkpoint import TensorIndex

    out = convert(source, tmp_path / "pack")
    assert cli.main(["--verify", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"dsv4-convert: {out}: OK, 11 files" in err and "match the manifest" in err
    record = layout.read_manifest(out).record.record_bytes
    with TensorIndex.open(out) as idx:
        at = idx.info("layers.1.ffn.experts").offset + 5 * record
    with open(out / "layer_01.safetensors", "r+b") as f:  # zeroed in place: the size is unchanged
        f.seek(at)
        f.write(bytes(record))
    layout.read_manifest(out)  # the sizes still match: only the checksums see it
    assert cli.main(["--verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"dsv4-convert: {out}: 1 of 11 files are corrupt:" in err
    assert "layer_01.safetensors: routed expert 5 of layers.1" in err
    assert "run the conversion (dsv4-convert --hf SRC --out DIR) again: it rewrites only the corrupt files" in err
    (out / "manifest.json").unlink()
    assert cli.main(["--verify", str(out)]) == 2
    assert "has no manifest.json: the conversion did not finish" in capsys.readouterr().err
    assert cli.main(["--verify", str(tmp_path / "nope")]) == 2
    assert "not a converted model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--verify", str(out), "--hf", str(source)])
    assert exit_.value.code == 2
    assert "--verify DIR checks a converted model and takes no --hf" in capsys.readouterr().err


def test_convert_refuses_a_tokenizer_larger_than_the_vocabulary(source, tmp_path, capsys):
    """issue 28 item 2: the tiny synthetic checkpoint carries the real 129,280-token tokenizer."""
    out = tmp_path / "pack"
    assert cli.main(["--hf", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (f"{source / 'tokenizer.json'} has 129,280 tokens but the model's vocab_size is 512: a model "
            "converted with it cannot chat") in err
    assert "--logits-only" in err and "Traceback" not in err and not out.exists()
    assert cli.main(["--hf", str(source), "--out", str(out), "--logits-only"]) == 0
    assert (out / "manifest.json").is_file()


# ----------------------------------------------------------------------------- python -m engine generate

@pytest.mark.parametrize("flag,value,message", [
    ("--cache-gb", "nan", "argument --cache-gb: expected a number of GB above 0, got 'nan'"),
    ("--cache-gb", "inf", "argument --cache-gb: expected a number of GB above 0, got 'inf'"),
    ("--cache-gb", "0", "argument --cache-gb: expected a number of GB above 0, got '0'"),
    ("--cache-gb", "-1", "argument --cache-gb: expected a number of GB above 0, got '-1'"),
    ("--max-seq-len", "0", "argument --max-seq-len: expected a whole number above 0, got '0'"),
    ("--device", "gpu0", "argument --device: 'gpu0' is not a device (cpu, cuda or cuda:N)"),
])
def test_generate_refuses_bad_arguments_at_parse_time(chat_ckpt, capsys, flag, value, message):
    from engine.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--ckpt", str(chat_ckpt), "--prompt", "hi", flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == f"python -m engine generate: error: {message} (--help lists the options)\n"


def test_generate_refuses_a_context_above_the_models(chat_ckpt, nan_pack, capsys):
    from engine.__main__ import main

    for ckpt in (chat_ckpt, nan_pack):  # official layout (config.json) and converted (manifest)
        assert main(["generate", "--ckpt", str(ckpt), "--prompt", "hi", "--max-seq-len", "1048577"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ")
        assert ("--max-seq-len 1,048,577 is outside 1..1,048,576, the model's longest context "
                "(max_position_embeddings)") in err


def test_generate_refuses_a_prompt_over_its_context_naming_the_flag(chat_ckpt, capsys):
    from engine.__main__ import main

    assert main(["generate", "--ckpt", str(chat_ckpt), "--prompt", "word " * 300, "--max-seq-len", "64",
                 "--numerics", "exact", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: the prompt is ") and err.endswith(
        " tokens, over the context limit of 64: shorten it or raise --max-seq-len")


def test_generate_on_cuda_without_a_gpu_is_one_line(chat_ckpt, capsys):
    import torch

    from engine.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--ckpt", str(chat_ckpt), "--prompt", "hi", "--device", "cuda"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'cuda': this machine has no usable CUDA GPU" in err
    assert err.count("\n") == 1


def test_loading_a_model_with_a_wrong_config_type_is_one_line(nan_pack, tmp_path, capsys):
    """The engine reads a converted model's config from its manifest: the same checks apply."""
    from engine.__main__ import main
    from engine.config import ConfigError
    from engine.weights import open_model

    pack = Path(shutil.copytree(nan_pack, tmp_path / "pack"))
    doc = json.loads((pack / "manifest.json").read_text())
    doc["config"]["num_hidden_layers"] = None
    (pack / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"manifest.json: field 'num_hidden_layers' is null, expected an "
                                          r"integer"):
        open_model(pack)
    assert main(["generate", "--ckpt", str(pack), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "field 'num_hidden_layers' is null, expected an integer" in err


def test_a_source_shard_truncated_during_conversion_is_named(src_copy, tmp_path):
    from converter.convert import ConvertError

    shard, _ = _offset(src_copy, "layers.1.attn_norm.weight")

    def truncate(point: str) -> None:
        if point == "begin:layer_01.safetensors":
            with open(shard, "r+b") as f:
                f.truncate(4096)

    with pytest.raises(ConvertError, match=rf"^reading layers\.1\.\S+ from {shard}: source file ended early at "
                                           r"byte \d+; the shard changed since the preflight check: download "
                                           r"it again, then run the same command again: it resumes$"):
        convert(src_copy, tmp_path / "pack", fault_hook=truncate)
