"""bench/step_trace.py on a hand-made Chrome trace: per-step device busy, copy, overlap and idle
times, the host's calls and a call's direct callees, gzip and clear errors."""

from __future__ import annotations

import gzip
import json

import pytest

from bench import step_trace


def _x(name, ts, dur, cat, tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "args": args}


def _trace() -> dict:
    """Two steps of 1,000 us on thread 1. Step 1: kernels 100-300 and 250-400 (300 us busy), an
    expert copy 350-650 (overlapping the kernels for 50 us), a 4 us table copy (not an expert).
    Step 2 (at 2,000): one kernel of 100 us, no copy. Host: acquire (with a _hold callee holding a
    pin callee) and a hint per step, and a call on another thread (not the engine's)."""
    ev = [
        _x("engine/runtime.py(92): step", 0, 1000, "python_function"),
        _x("engine/runtime.py(92): step", 2000, 1000, "python_function"),
        _x("fp8_gemv_kernel", 100, 200, "kernel"),
        _x("fp4_mma1_kernel", 250, 150, "kernel"),
        _x("Memcpy HtoD (Pinned -> Device)", 350, 300, "gpu_memcpy", bytes=13_369_344),
        _x("Memcpy HtoD (Pinned -> Device)", 700, 4, "gpu_memcpy", bytes=4096),
        _x("hc_mix_kernel", 2100, 100, "kernel"),
        _x("engine/experts/provider.py(111): acquire", 10, 80, "python_function"),
        _x("engine/experts/streaming.py(148): _hold", 20, 30, "python_function"),
        _x("engine/experts/cache.py(211): pin", 25, 10, "python_function"),
        _x("engine/experts/streaming.py(148): _hold", 60, 20, "python_function"),
        _x("engine/experts/provider.py(111): acquire", 2010, 40, "python_function"),
        _x("engine/experts/streaming.py(450): prefetch_predicted", 500, 200, "python_function"),
        _x("engine/experts/provider.py(111): acquire", 10, 500, "python_function", tid=7),
    ]
    return {"traceEvents": ev + [{"ph": "M", "name": "process_name"}]}


def test_steps_are_split_into_compute_copy_overlap_and_idle(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace()))
    first, second = step_trace.summarise(step_trace.read_events(path), 5)
    assert (first.wall, first.compute, first.copy, first.both, first.copies) == (1.0, 0.3, 0.3, 0.05, 1)
    assert first.neither == pytest.approx(0.45)
    assert (second.compute, second.copy, second.neither) == (0.1, 0.0, 0.9)


def test_host_calls_and_direct_callees_per_step_on_the_engine_thread(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    events = step_trace.read_events(path)
    calls = step_trace.host_calls(events, 2)
    assert calls["engine/experts/provider.py: acquire"] == (0.06, 1.0)  # (80 + 40) us over 2 steps
    assert calls["engine/experts/streaming.py: prefetch_predicted"] == (0.1, 0.5)
    callees = step_trace.children(events, 2, "provider.py: acquire")
    assert callees == {"engine/experts/streaming.py: _hold": (0.025, 1.0)}  # pin is _hold's, not acquire's


def test_a_file_that_is_not_a_trace_of_steps_says_how_to_make_one(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="is not a Chrome trace.*bench.full_depth --trace"):
        step_trace.main([str(bad)])
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": [_x("fp8_gemv_kernel", 0, 5, "kernel")]}))
    with pytest.raises(SystemExit, match="no runner step"):
        step_trace.main([str(empty)])
    with pytest.raises(SystemExit, match="does not exist"):
        step_trace.main([str(tmp_path / "missing.json")])


def test_the_command_prints_the_table(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace()))
    assert step_trace.main([str(path), "--steps", "1", "--children", "acquire"]) == 0
    out = capsys.readouterr().out
    assert "1.00 |     0.30 |     0.30 (1) |   0.05 |     0.45" in out
    assert "direct callees of 'acquire'" in out and "_hold" in out
