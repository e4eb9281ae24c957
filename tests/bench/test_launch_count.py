"""bench/launch_count.py: the torch ops a prefill chunk issues, attributed to the engine's lines
and the backend's ops (on the CPU, the torch reference)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bench import launch_count
from bench.launch_count import OpCounts, count_ops, report
from converter import synth
from converter.convert import convert
from kernels import reference as ref

HERE = Path(__file__).resolve().parent


def _toy() -> None:
    x = torch.arange(12.0)
    y = (x * 2).view(3, 4).t()  # one op; the views are free
    ref.rms_norm(y.contiguous(), None, 1e-6)  # a backend op: its torch ops go to its name
    y.sum().item()  # a reduction, then a read on the host


def test_ops_are_attributed_to_their_line_or_backend_op_and_views_are_free():
    counts = count_ops(_toy, own=HERE)
    lines = {where.split(" ", 1)[1]: n for where, n in counts.own.items()}
    assert lines["x = torch.arange(12.0)"] == 1
    assert lines["y = (x * 2).view(3, 4).t()  # one op; the views are free"] == 1
    assert lines["y.sum().item()  # a reduction, then a read on the host"] == 2  # sum, then the scalar read
    assert lines["ref.rms_norm(y.contiguous(), None, 1e-6)  # a backend op: its torch ops go to its name"] == 1
    assert set(counts.backend) == {"rms_norm"} and counts.backend["rms_norm"] >= 3
    # each backend op also by its aten op and the innermost kernels/ line that issued it
    assert sum(counts.backend_lines.values()) == counts.backend["rms_norm"]
    assert all(re.fullmatch(r"\w+ @ reference\.py:\d+ .+", k) for k in counts.backend_lines)
    assert sum(counts.syncs.values()) == 1
    assert counts.total == sum(counts.own.values()) + counts.backend["rms_norm"]


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_count")
    ckpt = synth.write_checkpoint(root / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    return convert(ckpt, root / "pack", resume=False)


def test_a_chunk_of_the_tiny_model_counted_per_layer(pack, capsys):
    assert launch_count.main(["--pack", str(pack), "--tokens", "20", "--device", "cpu", "--top", "5"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"torch ops: (\d+) \(([\d.]+) a layer\): (\d+) issued by engine code", out)
    assert m and int(m.group(3)) > 0 and int(m.group(1)) > int(m.group(3))
    sites = [line.split()[1] for line in out.split("engine ops by line")[1].splitlines()[1:6]]
    assert all(re.fullmatch(r"\w+\.py:\d+", s) for s in sites)  # engine source lines
    assert "fp4_moe" in out  # the routed experts, one backend op a layer


def test_report_per_layer():
    counts = OpCounts()
    counts.own["attention.py:1 x"] = 10
    counts.backend["hc_pre"] = 6
    lines: list[str] = []

    class Out:
        def write(self, s):
            lines.append(s)

    report(counts, 2, 3, Out())
    assert "torch ops: 16 (8.0 a layer): 10 issued by engine code (5.0 a layer), 6 inside backend ops" in "".join(lines)
