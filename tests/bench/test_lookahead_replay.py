"""bench.lookahead_replay: a route trace through the engine's StreamingExperts in the layered
decode step's order, with stand-in lookahead hints of a given accuracy."""

from __future__ import annotations

import random

import pytest

from bench.cache_replay import ReplayError, read_route_csv
from bench.full_depth import build_pack
from bench.lookahead_replay import main, predict, route_steps, run

LAYERS = (3, 4)  # the tiny model's routed layers (0-2 are hash layers)
EXPERTS = 16


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return build_pack(tmp_path_factory.mktemp("lookahead_replay"), 5, EXPERTS, tiny=True)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """40 tokens over layers 3 and 4, 4 experts each, skewed towards low ids (some locality)."""
    rng = random.Random(7)
    lines = ["pos,layer,n,e0,e1,e2,e3,w0,w1,w2,w3"]
    for pos in range(40):
        for layer in LAYERS:
            ids = []
            while len(ids) < 4:
                e = min(int(rng.expovariate(0.25)), EXPERTS - 1)
                if e not in ids:
                    ids.append(e)
            lines.append(f"{pos},{layer},4," + ",".join(map(str, ids)) + ",0.25,0.25,0.25,0.25")
    path = tmp_path_factory.mktemp("trace") / "route.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _steps(trace):
    layers, steps = route_steps(read_route_csv(trace))
    assert layers == list(LAYERS) and len(steps) == 40
    return layers, steps


def test_a_perfect_hint_reads_only_what_is_routed_and_leaves_layer_4_no_miss(pack, trace):
    layers, steps = _steps(trace)
    off = run(pack, layers, steps, slots=2 * EXPERTS, accuracy=None)  # the whole pool fits
    hinted = run(pack, layers, steps, slots=2 * EXPERTS, accuracy=1.0)
    for c in (off, hinted):
        assert c.uses == c.hits + c.misses == 40 * 8
    first_uses = len({(layer, e) for route in steps for layer in layers for e in route[layer]})
    assert off.reads == off.misses == first_uses and off.hint_reads == 0
    assert hinted.reads == first_uses  # nothing read that the route did not use
    assert hinted.hint_used == hinted.hint_reads > 0 and hinted.hint_unused == 0
    first_layer3 = len({e for route in steps for e in route[3]})
    assert hinted.misses == first_layer3  # only the unhinted first layer waits
    assert hinted.hit_rate > off.hit_rate


def test_a_wrong_hint_reads_what_no_route_asks_for(pack, trace):
    layers, steps = _steps(trace)
    off = run(pack, layers, steps, slots=12, accuracy=None)
    wrong = run(pack, layers, steps, slots=12, accuracy=0.0)
    assert wrong.hint_reads > 0 and wrong.hint_used == 0
    assert wrong.reads == wrong.misses + wrong.hint_reads
    assert wrong.reads > off.reads
    assert off.gb_per_token() == pytest.approx(off.reads * 13_369_344 / 1e9 / 40)


def test_the_stand_in_predictor_keeps_each_routed_id_with_its_accuracy():
    rng = random.Random(0)
    route = [1, 5, 9, 12]
    kept = sum(e in route for _ in range(2000) for e in predict(route, 0.75, 16, rng))
    assert 0.72 < kept / 8000 < 0.78
    assert predict(route, 1.0, 16, rng) == route
    assert not set(predict(route, 0.0, 16, rng)) & set(route)


def test_a_token_missing_a_layer_is_refused(tmp_path):
    path = tmp_path / "gap.csv"
    path.write_text("pos,layer,n,e0,w0\n0,3,1,2,1.0\n0,4,1,3,1.0\n1,3,1,2,1.0\n")
    with pytest.raises(ReplayError, match="token position 1 routes layers \\[3\\], not every traced layer"):
        route_steps(read_route_csv(path))


def test_the_command_prints_its_table_and_refuses_bad_arguments(pack, trace, capsys):
    workdir = str(pack.parent)
    assert main([str(trace), "--slots", "12", "--accuracy", "off,0.5", "--workdir", workdir]) == 0
    out = capsys.readouterr().out
    assert "hash layers take no slots" in out and "40 tokens, layers 3..4" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("12 ")]
    assert [r[1] for r in rows] == ["off", "50%"]
    assert main([str(trace), "--accuracy", "1.5", "--workdir", workdir]) == 2
    assert "--accuracy takes 'off' or numbers in [0, 1], got '1.5'" in capsys.readouterr().err
    assert main([str(trace), "--slots", "0", "--workdir", workdir]) == 2
    assert "--slots takes positive integers" in capsys.readouterr().err
