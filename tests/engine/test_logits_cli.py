"""`python -m engine.logits`: the stable contract other tools drive."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from converter.convert import convert
from engine.logits import main
from oracle import load_ours, run_ours

IDS = [0, 17, 5, 300, 42, 7, 7, 7, 99, 511, 1, 2, 3, 250, 128, 64, 33, 8, 19, 200, 401, 11]


def _read(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_prefill_logits_and_experts_match_the_model(tiny_ckpt, tmp_path):
    out = tmp_path / "l.safetensors"
    assert main(["--ckpt", str(tiny_ckpt), "--ids", ",".join(map(str, IDS)), "--out", str(out)]) == 0
    got = _read(out)
    model, files = load_ours(tiny_ckpt, "exact")
    want = run_ours(model, files, torch.tensor(IDS))
    assert got["logits"].dtype == torch.float32 and got["logits"].shape == (len(IDS), 512)
    assert torch.equal(got["logits"], want.logits)
    assert torch.equal(got["experts.3"], want.experts[3])
    assert got["ids"].tolist() == IDS


def test_decode_from_and_converted_dir_bitwise(tiny_ckpt, tmp_path):
    """Prefill of K then token-by-token; the converted directory with a small expert cache gives
    bitwise the same logits as the official checkpoint."""
    packed = convert(tiny_ckpt, tmp_path / "pack")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ids = ",".join(map(str, IDS))
    assert main(["--ckpt", str(tiny_ckpt), "--ids", ids, "--decode-from", "9", "--out", str(a)]) == 0
    assert main(["--ckpt", str(packed), "--ids", ids, "--decode-from", "9", "--cache-gb", "0.0003",
                 "--out", str(b)]) == 0
    la, lb = _read(a)["logits"], _read(b)["logits"]
    assert torch.equal(la, lb)
    model, files = load_ours(tiny_ckpt, "exact")
    want = run_ours(model, files, torch.tensor(IDS), [9] + [1] * (len(IDS) - 9)).logits
    assert torch.equal(la, want)


def test_bad_input_is_a_message_not_a_traceback(tiny_ckpt, tmp_path):
    run = [sys.executable, "-m", "engine.logits", "--ckpt", str(tiny_ckpt), "--out", str(tmp_path / "x")]
    r = subprocess.run(run + ["--ids", "1,2,9999"], capture_output=True, text=True)
    assert r.returncode == 2 and "token ids must be in 0..511" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(run + ["--ids", "1,a"], capture_output=True, text=True)
    assert r.returncode == 2 and "argument --ids: expected comma-separated integers" in r.stderr
    r = subprocess.run([sys.executable, "-m", "engine.logits", "--ckpt", str(tmp_path), "--ids", "1",
                        "--out", str(tmp_path / "y")], capture_output=True, text=True)
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("budget", ["nan", "inf", "0", "-1", "lots", "1e300"])
def test_cache_gb_refused_at_parse_time_in_one_line(tiny_ckpt, tmp_path, capsys, budget):
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(tiny_ckpt), "--ids", "1,2", "--cache-gb", budget, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("python -m engine.logits: error: argument --cache-gb: expected a number of GB")
    assert repr(budget) in err


def test_huge_token_id_missing_out_folder_and_absent_gpu_are_one_line(tiny_ckpt, tmp_path, capsys):
    assert main(["--ckpt", str(tiny_ckpt), "--ids", f"1,{10**30}", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == f"error: token ids must be in 0..511, got {10**30}\n"
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(tiny_ckpt), "--ids", "1", "--out", str(tmp_path / "no" / "x.safetensors")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert f"argument --out: the folder '{tmp_path / 'no'}' does not exist; create it" in err
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(tiny_ckpt), "--ids", "1", "--device", "tpu", "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2 and "argument --device: 'tpu'" in capsys.readouterr().err
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(tiny_ckpt), "--ids", "1", "--device", "cuda", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "argument --device: 'cuda': this machine has no usable CUDA GPU" in err and "--device cpu" in err


def test_cache_gb_nan_in_a_subprocess_is_no_traceback(tiny_ckpt, tmp_path):
    r = subprocess.run([sys.executable, "-m", "engine.logits", "--ckpt", str(tiny_ckpt), "--ids", "1",
                        "--cache-gb", "nan", "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("ids, message", [("", "expected at least one token id, got none"),
                                          ("1,a", "expected comma-separated integers, got '1,a'")])
def test_bad_ids_and_a_gpu_backend_on_the_cpu_are_one_line_and_status_2(tiny_ckpt, tmp_path, capsys, ids, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--ckpt", str(tiny_ckpt), "--ids", ids, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and f"argument --ids: {message}" in err
    assert main(["--ckpt", str(tiny_ckpt), "--ids", "1", "--backend", "tilelang", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err == ("error: the tilelang backend runs on a CUDA GPU, not on device 'cpu': use "
                                       "backend torch (--backend torch), or a CUDA device\n")
