"""bench/host_routes.py on a small model and a short trace: both ways of counting a step's routes
run over every token and leave the same statistics."""

from __future__ import annotations

import re

import pytest

from bench import host_routes


def test_both_ways_are_timed_and_agree(tmp_path, capsys):
    trace = tmp_path / "route.csv"
    rows = ["pos,layer,n,e0,e1,e2,e3,e4,e5,w0,w1,w2,w3,w4,w5"]
    for pos in range(10, 14):
        for layer in (3, 4):
            ids = [(pos * 7 + layer * 3 + j * 5) % 40 for j in range(6)]  # ids past 16 wrap as the engine maps them
            rows.append(",".join(map(str, [pos, layer, 6, *ids, *(0.5 - 0.01 * j for j in range(6))])))
    trace.write_text("\n".join(rows) + "\n")
    steps = host_routes.step_routes(trace, 5, 16)
    assert len(steps) == 4 and all(len(routes) == 5 for routes in steps)
    assert all(len(set(ids)) == 6 and max(ids) < 16 for routes in steps for ids in routes)
    assert steps[0][0] == steps[0][3]  # the hash layers take the first recorded layer's ids
    assert host_routes.main(["--trace", str(trace), "--layers", "5", "--experts", "16", "--rounds", "2",
                             "--workdir", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"record: +\d+ us per step \(median of 8\)", out)
    assert re.search(r"record_routes: +\d+ us per step \(median of 8\)", out)
    assert "same statistics, usage and hottest: True" in out


def test_a_missing_trace_is_named_with_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="does not exist: pass a route CSV"):
        host_routes.main(["--trace", str(tmp_path / "none.csv"), "--workdir", str(tmp_path)])
