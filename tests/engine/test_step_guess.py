"""Streamed decode steps guessed whole (engine/step_guess.py, `DecodeRunner._guessed`): the policy
of when to guess, and the runner on the CPU (eagerly, as the GPU replays it) against the layered
steps it replaces: the same logits bit for bit, the same state, the same cache, whether the guess
was right or the step was redone layer by layer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.decode_graph import DecodeRunner
from engine.model import Transformer
from engine.numerics import Numerics
from engine.step_guess import StepGuess
from engine.weights import open_model

PROMPT = [0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3, 77]
STEPS = 12  # positions 13..24: windows of ratio 4 complete at 15, 19, 23 (the prev halves rewritten)


# ---------------------------------------------------------------------------- the policy
def test_a_guess_needs_a_streak_of_resident_steps():
    g = StepGuess(least=2, most=8)
    assert not g.ready()
    g.observed(True)
    assert not g.ready()
    g.observed(True)
    assert g.ready()
    g.observed(False)  # a step that missed breaks the streak
    assert not g.ready() and g.streak == 0


def test_wrong_guesses_double_the_streak_needed_and_right_ones_halve_it():
    g = StepGuess(least=1, most=8)
    needed = []
    for _ in range(5):
        g.missed()
        needed.append(g.needed)
    assert needed == [2, 4, 8, 8, 8]  # at most `most`
    assert not g.ready()
    for _ in range(8):
        g.observed(True)
    assert g.ready()
    g.right()
    assert g.needed == 4 and g.ready()  # the streak goes on through right guesses
    for _ in range(4):
        g.right()
    assert g.needed == 1  # not below `least`
    assert (g.guesses, g.wrong) == (10, 5)


def test_least_zero_guesses_every_step():
    g = StepGuess(least=0, most=0)
    assert g.ready()
    g.missed()
    assert g.ready() and g.needed == 0
    g.observed(False)
    assert g.ready()


@pytest.mark.parametrize("least, most", [(-1, 4), (3, 2)])
def test_a_policy_out_of_range_is_refused(least, most):
    with pytest.raises(ValueError, match="0 <= least <= most"):
        StepGuess(least=least, most=most)


# ---------------------------------------------------------------------------- the runner
def _decode(packed, slots: int | None, guesses: StepGuess | None, numerics: str = "native"):
    """Prefill PROMPT, then STEPS greedy steps through a cache of `slots` records (None: every
    expert resident, the runner still preferring layers) -> (logits, state, cache figures, runner)."""
    files = open_model(packed) if slots is None else open_model(packed, cache_bytes=slots * _pool(packed)[2])
    try:
        if slots is None:
            assert files.experts.load_all()
        model = Transformer(files.get, files.args, Numerics.named(numerics))
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        runner = DecodeRunner(model, files.experts, whole=False, guesses=guesses)
        tok, logits = 5, []
        for _ in range(STEPS):
            out = runner.step(state, tok)
            logits.append(out)
            tok = int(out.argmax())
        runner.settle()
        cache, usage = files.experts.cache, files.experts.usage
        # the resident keys, not their slots: which slot a prefill's miss takes follows the order its
        # reads complete in (engine/experts/streaming.py), which differs from run to run
        figures = (files.experts.stats(), set(cache.resident()), cache.hottest(10 ** 6), dict(usage.uses),
                   list(usage.layer_uses))
        assert cache.pinned() == cache.held() == frozenset()  # every hold released
        return logits, state, figures, runner
    finally:
        files.close()


def _same_state(a, b) -> None:
    assert a.pos == b.pos
    for la, lb in zip(a.layers, b.layers):
        for ta, tb in zip(la.tensors(), lb.tensors()):
            assert torch.equal(ta, tb)


def _pool(packed) -> tuple[int, int, int]:
    """(experts of the main layers, experts routed per token, bytes of a record)."""
    files = open_model(packed)
    try:
        return (files.args.n_layers * files.experts.store.count, files.args.n_activated_experts,
                files.experts.store.record_bytes)
    finally:
        files.close()


@pytest.mark.parametrize("numerics", ["native", "exact"])
def test_right_guesses_equal_layered_steps(packed, numerics):
    """Every expert resident (the runner preferring layers): each step guessed whole and right;
    logits, state and the cache's statistics, contents, order and usage those of layered steps."""
    want, want_state, want_figures, _ = _decode(packed, None, None, numerics)
    got, state, figures, runner = _decode(packed, None, StepGuess(least=0, most=0), numerics)
    assert (runner.guesses.guesses, runner.guesses.wrong) == (STEPS, 0)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    _same_state(want_state, state)
    assert figures == want_figures


def test_wrong_guesses_are_redone_layer_by_layer(packed):
    """A cache of a few layers' experts: most guesses miss and their steps are redone layered;
    the state the wrong guesses wrote (the prev halves of emitting steps included) is the
    layered steps' own, the logits bit for bit."""
    pool, k, _ = _pool(packed)
    want, want_state, want_figures, _ = _decode(packed, 3 * k, None)
    got, state, figures, runner = _decode(packed, 3 * k, StepGuess(least=0, most=0))
    assert runner.guesses.guesses == STEPS and runner.guesses.wrong >= STEPS // 2
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    _same_state(want_state, state)
    assert figures == want_figures  # a wrong guess counts nothing: its redo does


def test_guesses_right_and_wrong_in_one_conversation(packed):
    """A cache of most of the pool: some steps' experts are all resident, some are not; every
    step guessed, both outcomes seen, the logits and state those of layered steps."""
    pool, k, _ = _pool(packed)
    slots = pool - 2 * k
    want, want_state, _, _ = _decode(packed, slots, None)
    got, state, _, runner = _decode(packed, slots, StepGuess(least=0, most=0))
    assert 0 < runner.guesses.wrong < runner.guesses.guesses == STEPS
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    _same_state(want_state, state)


def test_the_default_policy_guesses_after_a_resident_layered_step(packed):
    got, _, _, runner = _decode(packed, None, StepGuess())
    assert runner.guesses.guesses == STEPS - 1 and runner.guesses.wrong == 0  # the first step went layered


def test_no_guess_until_a_pending_read_lands(packed, monkeypatch):
    """A user pin of an expert that is not resident starts its read: until its bytes are in the
    slot the next step goes layer by layer; once they are (the read done, not joined: the expert
    is not used), steps are guessed again."""
    pool, k, record = _pool(packed)
    files = open_model(packed, cache_bytes=(pool - 2 * k) * record)
    try:
        model = Transformer(files.get, files.args, Numerics.named("native"))
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        experts = files.experts
        runner = DecodeRunner(model, experts, whole=False, guesses=StepGuess(least=0, most=0))
        tok = int(runner.step(state, 5).argmax())
        assert runner.guesses.guesses == 1 and not experts.reading()
        landed = threading.Event()
        real = experts.store.read_into
        monkeypatch.setattr(experts.store, "read_into", lambda *a: (landed.wait(10), real(*a))[1])
        missing = next((layer, e) for layer in reversed(range(experts.n_layers))  # not a hash layer's
                       for e in reversed(range(experts.n_experts)) if not experts.cache.contains((layer, e)))
        experts.pin([missing])
        assert experts.reading()
        release = threading.Timer(0.5, landed.set)  # lets the read finish if the step needs it
        release.start()
        tok = int(runner.step(state, tok).argmax())
        assert runner.guesses.guesses == 1  # that step went layer by layer
        release.join()
        deadline = time.monotonic() + 10
        while experts.reading() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not experts.reading() and experts.cache.contains(missing)
        runner.step(state, tok)
        assert runner.guesses.guesses == 2  # its bytes landed: guessed again
        runner.settle()
        experts.unpin([missing])
    finally:
        files.close()


def test_a_right_guess_is_counted_by_the_next_step_or_settle(packed):
    """A right guess's routes are pending as a whole step's: the next step counts them while its
    own blocks run, or `settle()` does, which anything that evicts calls first (Engine.pin and
    flush_cache do): after it, a flush strands nothing and the next step runs."""
    pool, k, record = _pool(packed)
    files = open_model(packed, cache_bytes=(pool - 2 * k) * record)
    try:
        experts = files.experts
        model = Transformer(files.get, files.args, Numerics.named("native"))
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        runner = DecodeRunner(model, experts, whole=False, guesses=StepGuess(least=0, most=0))
        tok = 5
        while runner.guesses.guesses == runner.guesses.wrong:  # until a guess is right
            uses = sum(experts.usage.uses.values())
            tok = int(runner.step(state, tok).argmax())
            assert runner.guesses.guesses < STEPS
        assert sum(experts.usage.uses.values()) == uses  # pending
        runner.settle()
        counted = sum(experts.usage.uses.values())
        assert files.args.n_layers <= counted - uses <= files.args.n_layers * k
        experts.flush()  # every expert the guess used is gone
        runner.step(state, tok)
        assert sum(experts.usage.uses.values()) > counted
    finally:
        files.close()


def test_the_slot_table_check_agrees_with_the_cache(packed):
    """`first_missing` of a step's routes as an array (one lookup in the slot table) names the
    same layer as over lists (the cache, key by key), on routes with and without misses."""
    import numpy as np

    pool, k, record = _pool(packed)
    files = open_model(packed, cache_bytes=(pool // 2) * record)
    try:
        experts = files.experts
        n = files.args.n_layers
        gen = torch.Generator().manual_seed(0)
        for layer in range(n):  # about half of each layer's experts resident
            ids = torch.randperm(experts.n_experts, generator=gen)[:experts.n_experts // 2 - 1].tolist()
            experts.acquire(layer, ids)
            experts.release(layer)
        resident = [[e for e in range(experts.n_experts) if experts.cache.contains((layer, e))] for layer in range(n)]
        rng = np.random.default_rng(0)
        answers = set()
        for _ in range(200):  # each id resident with probability 0.95: about a third of the steps miss nothing
            routes = np.array([[rng.choice(resident[layer]) if rng.random() < 0.9 else rng.integers(experts.n_experts)
                                for _ in range(k)] for layer in range(n)])
            want = experts.first_missing(routes.tolist())
            assert experts.first_missing(routes) == want
            answers.add(want)
        assert None in answers and len(answers) > 2
    finally:
        files.close()
