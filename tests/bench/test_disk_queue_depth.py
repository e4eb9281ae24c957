"""The disk queue-depth bench (bench/disk_queue_depth.py) on a small file: O_DIRECT and
buffered reads at several depths, every byte asked for read, and a table plus a chosen depth."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "disk_queue_depth", Path(__file__).resolve().parents[2] / "bench" / "disk_queue_depth.py"
)
qd = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = qd  # its dataclasses look their module up
_SPEC.loader.exec_module(qd)

BLOCK = 256 * 1024


def _direct_dir(tmp_path: Path) -> Path:
    """tmp_path when its filesystem takes O_DIRECT (not tmpfs), else skip."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    return tmp_path


def test_measure_reads_every_byte_asked_in_both_modes(tmp_path):
    path = _direct_dir(tmp_path) / "data.bin"
    qd.write_file(path, 16 * BLOCK, chunk=3 * BLOCK, seed=1)
    assert os.path.getsize(path) == 16 * BLOCK
    for mode in qd.MODES:
        for depth in (1, 4):
            run = qd.measure(path, BLOCK, depth, mode, blocks=12, seed=2)
            assert (run.mode, run.depth, run.blocks) == (mode, depth, 12)
            assert run.bytes_read == run.bytes_asked == 12 * BLOCK
            assert run.seconds > 0 and run.gb_per_s == pytest.approx(run.bytes_read / run.seconds / 1e9)
    assert not [t for t in threading.enumerate() if t.name.startswith("dsv4-qd")]  # pool joined
    with pytest.raises(qd.QueueDepthError, match="holds 16 blocks"):
        qd.measure(path, BLOCK, 1, "direct", blocks=17)


def test_choose_depth_takes_the_knee_of_the_direct_rates():
    def run(depth, gbps, mode="direct"):
        return qd.Run(mode, depth, 1, 10**9, 10**9, 1 / gbps)

    runs = [run(1, 1.0), run(2, 1.9), run(4, 2.9), run(8, 3.0), run(16, 2.95), run(4, 9.0, "buffered")]
    assert qd.choose_depth(runs) == 4  # 2.9 is within 5 % of the best, 3.0
    assert qd.choose_depth(runs, knee=0.0) == 8
    with pytest.raises(qd.QueueDepthError, match="no O_DIRECT run"):
        qd.choose_depth([run(1, 1.0, "buffered")])


def test_main_prints_the_table_and_the_chosen_depth(tmp_path, capsys):
    d = _direct_dir(tmp_path)
    assert qd.main(["--dir", str(d), "--size", "2M", "--block", "256K", "--depths", "1,2,4"]) == 0
    out = capsys.readouterr().out
    assert "8 random blocks of 262144 bytes per run" in out
    rows = [line.split("|") for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 4]
    for r in rows:
        direct, buffered = r[1].split(), r[2].split()
        assert int(direct[1]) == int(buffered[1]) == 8 * BLOCK  # bytes read == bytes asked
        assert float(direct[0]) > 0 and float(buffered[0]) > 0
    assert "chosen depth: " in out and "faster: " in out
    assert list(d.glob("dsv4-qd-*")) == []  # the temp file is removed


def test_bad_arguments_give_one_error_line(tmp_path, capsys):
    assert qd.main(["--block", "1000", "--size", "1M"]) == 2
    assert "must be a multiple of 4096" in capsys.readouterr().err
    assert qd.main(["--depths", "0,2", "--size", "1M"]) == 2
    assert "each >= 1" in capsys.readouterr().err
    assert qd.main(["--file", str(tmp_path / "missing.bin")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert qd.main(["--size", "lots"]) == 2
    assert "not a byte count" in capsys.readouterr().err
    assert qd.parse_size("4G") == 4 * 2**30 and qd.parse_size("64MiB") == 64 * 2**20
