"""bench/layered_host.py on a small model and a short trace: both orders are timed over every
layer of every token and leave the same cache statistics and usage."""

from __future__ import annotations

import re

import pytest

from bench import layered_host


def _trace(tmp_path):
    trace = tmp_path / "route.csv"
    rows = ["pos,layer,n,e0,e1,e2,e3,e4,e5,w0,w1,w2,w3,w4,w5"]
    for pos in range(10, 14):
        for layer in (3, 4):
            ids = [(pos * 7 + layer * 3 + j * 5) % 40 for j in range(6)]
            rows.append(",".join(map(str, [pos, layer, 6, *ids, *(0.5 - 0.01 * j for j in range(6))])))
    trace.write_text("\n".join(rows) + "\n")
    return trace


@pytest.mark.parametrize("share,resident", [(1.0, "40 of 40"), (0.5, None)])
def test_both_orders_are_timed_and_agree(tmp_path, capsys, share, resident):
    assert layered_host.main(["--trace", str(_trace(tmp_path)), "--layers", "5", "--experts", "16",
                              "--rounds", "2", "--share", str(share), "--workdir", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"acquire first: +[\d.]+ us per layer .*\(median of 40;", out)
    assert re.search(r"resident first: +[\d.]+ us per layer .*\(median of 40;", out)
    assert "same statistics and usage: True" in out
    layers = re.search(r"(\d+) of (\d+) layers resident at their turn", out)
    if resident:  # the whole pool cached: every layer resident once warm
        assert f"{layers[1]} of {layers[2]}" == resident
    else:  # half the pool: some layers miss
        assert int(layers[1]) < int(layers[2])


def test_a_share_outside_the_pool_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--share must be in"):
        layered_host.main(["--share", "1.5", "--workdir", str(tmp_path)])
