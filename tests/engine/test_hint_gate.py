"""The lookahead hints' gate (engine/experts/hint_gate.py): hint reads stop while recent ones
went unused, the skipped ones keep being settled, and reads resume once guesses would pay."""

from __future__ import annotations

from pathlib import Path

import pytest

from converter.convert import convert
from engine import pack as layout
from engine.experts.hint_gate import HintGate
from engine.weights import open_model


def test_the_gate_decides_nothing_before_least_outcomes():
    gate = HintGate(window=8, low=0.25, high=0.5, least=4)
    for _ in range(3):
        gate.outcome(False)
    assert gate.open
    gate.outcome(False)
    assert not gate.open


def test_the_gate_closes_below_low_and_reopens_at_high_with_hysteresis_between():
    gate = HintGate(window=8, low=0.25, high=0.5, least=8)
    for used in [True] + [False] * 7:  # 1/8 used < low
        gate.outcome(used)
    assert not gate.open
    states = []
    for used in [True] * 4 + [False] * 8:  # the window slides by one outcome each
        gate.outcome(used)
        states.append((round(gate.used_share * 8), gate.open))
    assert states == [(1, False), (2, False), (3, False), (4, True),  # reopens at high, not before
                      (4, True), (4, True), (4, True), (4, True), (3, True), (2, True),  # >= low: open
                      (1, False), (0, False)]


def test_a_reset_forgets_the_outcomes_and_opens():
    gate = HintGate(window=4, least=4)
    for _ in range(4):
        gate.outcome(False)
    assert not gate.open
    gate.reset()
    assert gate.open and gate.used_share != gate.used_share  # nan: no outcome
    gate.outcome(False)
    assert gate.open  # fewer than least again


@pytest.mark.parametrize("kwargs", [dict(window=4, least=5), dict(least=0), dict(low=0.5, high=0.4),
                                    dict(low=-0.1), dict(high=1.5)])
def test_bad_gate_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="hint gate"):
        HintGate(**kwargs)


@pytest.fixture(scope="module")
def packed(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny model (conftest: 5 layers, 16 experts, top-4), converted."""
    return convert(tiny_ckpt, tmp_path_factory.mktemp("out") / "pack")


def test_unused_hint_reads_close_the_gate_then_right_guesses_reopen_it(packed):
    """Through the engine's StreamingExperts: wrong guesses' reads go unused until the gate
    closes; then hints start no read (skipped, settled by the route); once the skipped guesses
    would have been used, the gate opens and hints read again. A flush opens it too."""
    record = layout.read_manifest(packed).record.record_bytes
    files = open_model(packed, cache_bytes=8 * record, hint_gate=HintGate(window=8, low=0.25, high=0.5, least=4))
    try:
        p = files.experts

        def token(route: list[int], guess: list[int]) -> None:  # layer 1 then 2, as a layered step
            p.acquire(1, [0, 1, 2, 3])
            p.prefetch_predicted(2, guess)
            p.release(1)
            p.acquire(2, route)
            p.release(2)

        def lookahead():
            return p.prefetch_stats()["lookahead"]

        for guess in ([12, 13], [14, 15]):  # 2 wrong reads a token: 4 unused outcomes close the gate
            token([4, 5], guess)
        s = lookahead()
        assert (s.issued, s.used, s.unused, s.skipped) == (4, 0, 4, 0) and not p.prefetches.gate.open
        token([4, 5], [10, 11])  # closed: nothing read, both skipped and settled as unused
        s = lookahead()
        assert (s.issued, s.skipped, s.skipped_used) == (4, 2, 0)
        assert p.cache.peek((2, 10)) is None and p.cache.peek((2, 11)) is None
        for guess in ([6, 7], [8, 9]):  # right guesses of experts not resident: would have been used
            token(guess, guess)
        s = lookahead()
        assert (s.issued, s.skipped, s.skipped_used) == (4, 6, 4)
        assert p.prefetches.gate.open  # 4 used of the last 8 outcomes
        token([10, 11], [10, 11])  # reads again: used
        s = lookahead()
        assert (s.issued, s.used, s.skipped) == (6, 2, 6)
        for _ in range(8):
            p.prefetches.gate.outcome(False)
        assert not p.prefetches.gate.open
        p.flush()  # the cache starts over: guesses pay again
        assert p.prefetches.gate.open
    finally:
        files.close()


def test_a_never_closing_gate_lets_every_hint_read(packed):
    """The comparison's gate (bench.lookahead_replay --gate off): unused reads do not close it."""
    gate = HintGate.never_closing()
    for _ in range(2 * gate.window):
        gate.outcome(False)
    assert gate.open
