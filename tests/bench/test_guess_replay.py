"""bench.guess_replay: a route trace through the engine's StreamingExperts and StepGuess, as the
decode runner guesses streamed steps whole."""

from __future__ import annotations

import pytest

from bench.full_depth import build_pack
from bench.guess_replay import GuessCounts, main, run
from engine.step_guess import StepGuess

LAYERS = (3, 4)  # the tiny model's routed layers (0-2 are hash layers)
EXPERTS = 16


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return build_pack(tmp_path_factory.mktemp("guess_replay"), 5, EXPERTS, tiny=True)


def _steps(routes: list[tuple[list[int], list[int]]]) -> list[dict[int, list[int]]]:
    return [{3: a, 4: b} for a, b in routes]


# 20 tokens on experts 0..5 of both layers, then 10 on 8..13: a working set, then a move
STEADY = _steps([([0, 1, 2], [3, 4, 5]), ([3, 4, 5], [0, 1, 2])] * 10 + [([8, 9, 10], [11, 12, 13])] * 10)


def test_a_cache_holding_the_working_set_guesses_right_after_one_layered_step(pack):
    c = run(pack, LAYERS, STEADY[:20], slots=24, guess=StepGuess, warm=1)
    assert (c.tokens, c.resident, c.right, c.wrong, c.layered, c.misses) == (20, 20, 19, 0, 1, 0)


def test_a_move_to_new_experts_costs_one_wrong_guess_then_layered_steps(pack):
    c = run(pack, LAYERS, STEADY, slots=24, guess=StepGuess)
    # cold: the first two tokens miss (layered), then all resident until token 20 moves to 8..13
    assert c.resident == 18 + 9 and c.layered + c.right + c.wrong == 30
    assert c.wrong == 1  # token 20, guessed on the streak before it; redone layered
    assert c.right == 30 - c.layered - 1 and c.misses == 3 * 6


def test_never_guessing_runs_every_step_layered(pack):
    c = run(pack, LAYERS, STEADY, slots=24, guess=None)
    assert (c.right, c.wrong, c.layered) == (0, 0, 30)


def test_the_model_charges_a_wrong_guess_a_whole_and_a_layered_step():
    c = GuessCounts(tokens=4, resident=2, right=2, wrong=1, layered=1, misses=0)
    assert c.model_ms(whole_ms=5.0, layered_ms=9.0) == pytest.approx((2 * 5 + (5 + 9) + 9) / 4)


def test_the_command_prints_its_table_and_refuses_bad_arguments(pack, tmp_path, capsys):
    trace = tmp_path / "route.csv"
    lines = ["pos,layer,n,e0,e1,e2,w0,w1,w2"] + [f"{p},{layer},3," + ",".join(map(str, ids)) + ",0.3,0.3,0.4"
                                                for p, route in enumerate(STEADY) for layer, ids in route.items()]
    trace.write_text("\n".join(lines) + "\n")
    workdir = str(pack.parent)
    assert main([str(trace), "--slots", "24", "--whole-ms", "5", "--layered-ms", "9", "--workdir", workdir]) == 0
    out = capsys.readouterr().out
    assert "steps counted, not timed" in out and "30 tokens, layers 3..4" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("24 ")]
    assert [r[1] for r in rows] == ["never", "default", "every"]
    assert float(rows[0][-1]) == 9.0  # never guessing: every step a layered one
    assert main([str(trace), "--slots", "0", "--workdir", workdir]) == 2
    assert "--slots takes positive integers" in capsys.readouterr().err
    assert main([str(trace), "--guesses", "sometimes", "--workdir", workdir]) == 2
    assert "--guesses takes names of never, default, every, got sometimes" in capsys.readouterr().err
    assert main([str(trace), "--whole-ms", "5", "--workdir", workdir]) == 2
    assert "give both or neither" in capsys.readouterr().err
    assert main([str(trace), "--chunk", "17", "--workdir", workdir]) == 2
    assert "--chunk takes 1..16 tokens" in capsys.readouterr().err
    assert main([str(trace), "--chunk", "8", "--whole-ms", "5", "--layered-ms", "9", "--workdir", workdir]) == 2
    assert "model decode steps; leave them out with --chunk" in capsys.readouterr().err


def test_prefill_chunks_guessed_whole_on_their_tokens_union(pack):
    """`chunk`: a warm working set's chunks all stand once the policy is ready; a chunk reaching
    experts the cache lacks is wrong once and its tokens run as decode steps."""
    c = run(pack, LAYERS, STEADY[:20], slots=24, guess=StepGuess, warm=1, chunk=8)
    # chunk 0: the policy not ready, decode steps (one layered, seven guessed); chunks 1 and 2 stand
    assert (c.chunks, c.chunks_wrong, c.right, c.wrong, c.layered, c.resident, c.misses) == (2, 0, 7, 0, 1, 20, 0)
    c = run(pack, LAYERS, STEADY, slots=24, guess=StepGuess, chunk=8)
    # chunk 0 (cold): decode steps; chunk 1 stands; chunk 2 (tokens 16..23) reaches 8..13 from token
    # 20: redone as decode steps; chunk 3 (the last 6 tokens) stands. A guess reads nothing, so the
    # misses are the decode steps' (cold 0..5, then 8..13)
    assert (c.chunks, c.chunks_wrong) == (3, 1)
    assert c.right + c.wrong + c.layered == c.tokens - 8 - 6 == 16
    assert c.misses == run(pack, LAYERS, STEADY, slots=24, guess=StepGuess).misses == 3 * 6
