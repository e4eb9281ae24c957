"""Streamed decode steps guessed whole (engine/step_guess.py, `DecodeRunner._guessed`): the policy
of when to guess, and the runner on the CPU (eagerly, as the GPU replays it) against the layered
steps it replaces: the same logits bit for bit, the same state, the same cache, whether the guess
was right or the step was redone layer by layer."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from converter.convert import convert
from converter.synth import SynthOptions, tiny_config, write_checkpoint
from engine.chunk_position import CHUNK_SLOTS
from engine.decode_graph import DecodeRunner
from engine.model import Transformer
from engine.numerics import Numerics
from engine.runtime import Runtime
from engine.step_guess import StepGuess
from engine.weights import open_model
from oracle import assert_same_live_state

PROMPT = [0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3, 77]
STEPS = 12  # positions 13..24: windows of ratio 4 complete at 15, 19, 23 (the prev halves rewritten)
# From position 13: chunks ending at 29, 34, 45 and 61 complete ratio-4 windows inside them and leave
# entries open (the entry a chunk's unused window slots write), then STEPS decode steps read them.
CHUNKS = (16, 5, 11, 16)
CHUNK_IDS = [(37 * i + 11) % 512 for i in range(sum(CHUNKS))]


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
def _decode(packed, slots: int | None, guesses: StepGuess | None, numerics: str = "native", whole: bool = False,
            chunks: tuple[int, ...] = ()):
    """Prefill PROMPT, then CHUNK_IDS in `chunks` as chunk steps when the runner runs them (else as
    decode steps, the last one's logits kept), then STEPS greedy decode steps, through a cache of
    `slots` records beside the hash layers' pinned experts (`_streamed`; None: every expert
    resident; `whole`: the runner then prefers one graph a step, else layers) -> (logits, state,
    cache figures, runner)."""
    files = open_model(packed) if slots is None else _streamed(packed, slots)
    try:
        if slots is None:
            assert files.experts.load_all()
        model = Transformer(files.get, files.args, Numerics.named(numerics))
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        runner = DecodeRunner(model, files.experts, whole=whole, guesses=guesses)
        logits, at = [], 0
        for n in chunks:
            ids = CHUNK_IDS[at:at + n]
            at += n
            if runner.can_chunk(ids):
                logits.append(runner.chunk(state, ids))
            else:
                for i, t in enumerate(ids):
                    out = runner.step(state, t, logits=i == n - 1)
                logits.append(out)
        tok = int(logits[-1].argmax()) if logits else 5
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
        assert cache.held() == frozenset() and cache.pinned() == (frozenset() if slots is None else _hashed(files))
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


def _hashed(files) -> frozenset:
    """Every expert of the hash layers (0..n_hash_layers-1)."""
    return frozenset((layer, e) for layer in range(files.args.n_hash_layers) for e in range(files.experts.n_experts))


def _routed_pool(packed) -> int:
    """Experts of the router-routed main layers (the pool less the hash layers')."""
    files = open_model(packed)
    try:
        return (files.args.n_layers - files.args.n_hash_layers) * files.experts.n_experts
    finally:
        files.close()


def _streamed(packed, slots: int):
    """The pack through a cache of `slots` records beside the hash layers' experts, pinned: a step
    on a host token is guessed only with its hash-layer experts resident (`DecodeRunner._guessing`),
    so that the guesses these tests count go right or wrong on the routed layers."""
    probe = open_model(packed)
    hashed, record = len(_hashed(probe)), probe.experts.store.record_bytes
    probe.close()
    files = open_model(packed, cache_bytes=(slots + hashed) * record)
    files.experts.pin(sorted(_hashed(files)))
    return files


def _prefills(files, guesses: StepGuess):
    """(runner, its Runtime, a Runtime without a runner) on `files` in native numerics, one lock;
    the policy ready (as after a decode step that found its experts resident)."""
    model = Transformer(files.get, files.args, Numerics.named("native"))
    lock = threading.RLock()
    runner = DecodeRunner(model, files.experts, whole=False, guesses=guesses)
    runner.guesses.observed(True)
    return (runner, Runtime(model, files.experts, torch.device("cpu"), lock, None, runner),
            Runtime(model, files.experts, torch.device("cpu"), lock))


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
    """A cache of one layer's experts (beside the hash layers', pinned): most guesses miss and
    their steps are redone layered;
    the state the wrong guesses wrote (the prev halves of emitting steps included) is the
    layered steps' own, the logits bit for bit."""
    k = _pool(packed)[1]
    want, want_state, want_figures, _ = _decode(packed, k, None)
    got, state, figures, runner = _decode(packed, k, StepGuess(least=0, most=0))
    assert runner.guesses.guesses == STEPS and runner.guesses.wrong >= STEPS // 2
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    _same_state(want_state, state)
    assert figures == want_figures  # a wrong guess counts nothing: its redo does


def test_guesses_right_and_wrong_in_one_conversation(packed):
    """A cache of most of the routed layers' experts: some steps' experts are all resident, some
    are not; every
    step guessed, both outcomes seen, the logits and state those of layered steps."""
    k = _pool(packed)[1]
    slots = _routed_pool(packed) - 2 * k
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
    k = _pool(packed)[1]
    files = _streamed(packed, _routed_pool(packed) - 2 * k)
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


# ---------------------------------------------------------------------------- chunk steps guessed whole


def test_right_chunk_guesses_equal_chunk_steps_of_the_whole_pool(packed):
    """Every expert resident, the runner preferring layers: each chunk is guessed whole and right,
    and equals the chunk step of a runner of the whole pool bit for bit (logits, state, the cache's
    statistics, contents, order and usage)."""
    want, want_state, want_figures, whole = _decode(packed, None, None, whole=True, chunks=CHUNKS)
    got, state, figures, runner = _decode(packed, None, StepGuess(least=0, most=0), chunks=CHUNKS)
    assert (runner.guesses.chunks, runner.guesses.chunks_wrong) == (len(CHUNKS), 0)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    _same_state(want_state, state)
    assert figures == want_figures


def test_wrong_chunk_guesses_are_redone_as_decode_steps(packed):
    """A cache of one layer's experts (beside the hash layers', pinned): every chunk guessed,
    every guess wrong, its tokens redone
    as decode steps: the logits, the state (the prev halves and the entries the chunk left open
    restored) and the cache's figures those of a runner that never chunks."""
    k = _pool(packed)[1]
    want, want_state, want_figures, plain = _decode(packed, k, None, chunks=CHUNKS)
    assert plain.guesses is None
    got, state, figures, runner = _decode(packed, k, StepGuess(least=0, most=0), chunks=CHUNKS)
    assert runner.guesses.chunks == runner.guesses.chunks_wrong == len(CHUNKS)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    _same_state(want_state, state)
    assert figures == want_figures


def test_chunk_guesses_right_and_wrong_in_one_conversation(packed):
    """A cache of most of the routed layers' experts: some chunks' experts all resident, some not;
    the logits and
    the state (wherever a later step reads) bit for bit those of a runner that never chunks (on
    the CPU a chunk step rounds as the decode steps of its tokens do)."""
    k = _pool(packed)[1]
    slots = _routed_pool(packed) - k
    want, want_state, _, _ = _decode(packed, slots, None, chunks=CHUNKS)
    got, state, _, runner = _decode(packed, slots, StepGuess(least=0, most=0), chunks=CHUNKS)
    assert 0 < runner.guesses.chunks_wrong < runner.guesses.chunks == len(CHUNKS)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    files = open_model(packed)
    args = files.args
    files.close()
    assert_same_live_state(want_state, state, args)


def test_a_chunk_is_not_guessed_while_the_policy_waits(packed):
    """The default policy: no chunk is guessed before a decode step found every expert resident;
    `can_chunk` is then false and the runtime prefills by decode steps."""
    pool, k, record = _pool(packed)
    files = open_model(packed, cache_bytes=(pool - k) * record)
    try:
        model = Transformer(files.get, files.args, Numerics.named("native"))
        runner = DecodeRunner(model, files.experts, whole=False, guesses=StepGuess())
        assert not runner.can_chunk()
        with pytest.raises(RuntimeError, match="step guess ready"):
            runner.chunk(model.new_state(), [1, 2])
        exact = DecodeRunner(Transformer(files.get, files.args, Numerics.named("exact")), files.experts, whole=False,
                             guesses=StepGuess(least=0, most=0))
        assert not exact.can_chunk()  # exact numerics never chunk
    finally:
        files.close()


def test_runtime_prefills_a_follow_up_in_guessed_chunk_steps(packed):
    """`Runtime.prefill` through a bounded cache whose runner guesses: a prompt of at most
    GRAPHED_PREFILL tokens runs as guessed chunk steps of CHUNK_SLOTS tokens (graphed), equal bit
    for bit to the eager prefill; a policy not ready yet prefills without them."""
    pool, k, record = _pool(packed)
    for guesses, chunked in ((StepGuess(least=0, most=0), True), (StepGuess(), False)):
        files = open_model(packed, cache_bytes=pool * record)  # every expert fits; the runner still streams
        try:
            model = Transformer(files.get, files.args, Numerics.named("native"))
            lock = threading.RLock()
            runner = DecodeRunner(model, files.experts, whole=False, guesses=guesses)
            graphed = Runtime(model, files.experts, torch.device("cpu"), lock, None, runner)
            plain = Runtime(model, files.experts, torch.device("cpu"), lock)
            ids = CHUNK_IDS[:CHUNK_SLOTS * 2 + 8]
            want = list(plain.prefill(model.new_state(), ids, 64))
            state = model.new_state()
            got = list(graphed.prefill(state, ids, 64))
            graphed.settle()
            assert state.pos == len(ids) and torch.equal(want[-1].logits, got[-1].logits)
            if chunked:
                assert [r.tokens for r in got] == [CHUNK_SLOTS, CHUNK_SLOTS, 8] and all(r.graphed for r in got)
                assert (runner.guesses.chunks, runner.guesses.chunks_wrong) == (3, 0)
            else:
                assert runner.guesses.chunks == 0 and [r.tokens for r in got] == [len(ids)]
        finally:
            files.close()


def test_the_warm_up_chunk_step_runs_whatever_the_policy_says(packed):
    """`Runtime.warm_chunk` (the warm-up's chunk step, which compiles and captures it before the
    first turn) guesses a chunk through a bounded cache before the policy is ready; without
    guesses no chunk step runs."""
    pool, k, record = _pool(packed)
    files = open_model(packed, cache_bytes=(pool - k) * record)
    try:
        model = Transformer(files.get, files.args, Numerics.named("native"))
        lock = threading.RLock()
        runner = DecodeRunner(model, files.experts, whole=False, guesses=StepGuess())
        runtime = Runtime(model, files.experts, torch.device("cpu"), lock, None, runner)
        assert not runner.can_chunk() and runner.can_force_chunk() and runtime.chunk_tokens() == 0
        state = model.new_state()
        assert runtime.warm_chunk(state, 7)
        assert state.pos == CHUNK_SLOTS and runner.guesses.chunks == 1
        runtime.settle()
        plain = DecodeRunner(model, files.experts, whole=False)
        assert not plain.can_force_chunk()
        assert not Runtime(model, files.experts, torch.device("cpu"), lock, None, plain).warm_chunk(model.new_state(), 7)
    finally:
        files.close()


def test_the_warm_up_runs_each_decode_step_layered_and_guessed(packed):
    """Through a bounded cache whose steps are guessed, the warm-up's decode steps of a capacity run
    twice from the same state, layer by layer and then guessed whole whatever the policy says (on
    CUDA each emission pattern's two graph sets are captured before the first turn), then the
    chunk step, guessed."""
    from engine.config import EngineConfig
    from engine.warmup import DECODE_BASE, DECODE_STEPS, plan_warmup, run_warmup

    pool, k, record = _pool(packed)
    files = open_model(packed, cache_bytes=(pool - k) * record)
    try:
        args = files.args
        model = Transformer(files.get, args, Numerics.named("native"))
        runner = DecodeRunner(model, files.experts, whole=False, guesses=StepGuess(least=4, most=8))
        runtime = Runtime(model, files.experts, torch.device("cpu"), threading.RLock(), None, runner)
        assert runtime.guesses_steps()
        whole = DecodeRunner(model, files.experts, whole=True, guesses=StepGuess())  # a whole pool: one mode
        assert not Runtime(model, files.experts, torch.device("cpu"), threading.RLock(), None, whole).guesses_steps()
        step = next(s for s in plan_warmup(args, EngineConfig(max_seq_len=512), full=True)
                    if s.kind == "decode" and s.base == DECODE_BASE)
        modes = []
        real = runner.step

        def spy(state, token, logits=True, guess=None):  # which mode each warm-up decode step asked for
            modes.append(guess)
            return real(state, token, logits, guess)
        runner.step = spy
        run_warmup([step], runtime, model, 7, 512, lambda *a: None)
        assert modes == [False] * DECODE_STEPS + [True] * DECODE_STEPS
        # the policy (a streak of 4 needed) never guessed: every guess was the warm-up's own
        assert runner.guesses.guesses == DECODE_STEPS + 1 and runner.guesses.chunks == 1
        runtime.reset_guesses()  # as Engine.warm_up does after it
        g = runner.guesses
        assert (g.needed, g.streak, g.guesses, g.wrong, g.chunks, g.chunks_wrong) == (4, 0, 0, 0, 0, 0)
    finally:
        files.close()


def test_waiting_for_pending_reads_joins_none(packed, monkeypatch):
    """`wait_reads` returns once a pinned expert's slow read has landed: `reading()` is then False,
    and the read is still to be joined by its first use (`resident` says so). While it is pending
    `first_missing` names its layer, over an array (the slot table) as over lists; once landed,
    none."""
    import numpy as np

    pool, k, record = _pool(packed)
    files = open_model(packed, cache_bytes=(pool - 2 * k) * record)
    try:
        experts, n = files.experts, files.args.n_layers
        for layer in range(n):  # experts 1..k of every layer resident
            experts.acquire(layer, range(1, k + 1))
            experts.release(layer)
        landed = threading.Event()
        real = experts.store.read_into
        monkeypatch.setattr(experts.store, "read_into", lambda *a: (landed.wait(10), real(*a))[1])
        missing = (n - 2, 0)
        assert not experts.cache.contains(missing)
        experts.pin([missing])
        assert experts.reading()
        routes = [list(range(1, k + 1)) for _ in range(n)]
        routes[n - 2] = [0] + routes[n - 2][1:]
        assert experts.first_missing(np.array(routes)) == experts.first_missing(routes) == n - 2
        release = threading.Timer(0.3, landed.set)
        release.start()
        t0 = time.monotonic()
        experts.wait_reads()
        assert time.monotonic() - t0 >= 0.2 and not experts.reading()
        assert not experts.resident(missing[0], [missing[1]])  # landed, not joined yet
        assert experts.first_missing(np.array(routes)) is experts.first_missing(routes) is None
        release.join()
        experts.unpin([missing])
    finally:
        files.close()


def test_after_a_wrong_chunk_guess_the_rest_of_the_prompt_goes_in_an_eager_chunk(packed):
    """`Runtime.prefill` plans each chunk when it comes: a 60-token prompt through a cache of one
    layer's experts (beside the hash layers', pinned), the policy ready, starts with a chunk step
    of 16 guessed whole; the guess is wrong (its tokens redone as decode steps), the policy no
    longer ready, and the other 44 tokens go in one eager chunk, not 44 more decode steps; the
    logits those of the eager prefill."""
    k = _pool(packed)[1]
    files = _streamed(packed, k)
    try:
        runner, graphed, plain = _prefills(files, StepGuess())
        model = runner.model
        ids = [(37 * i + 11) % 512 for i in range(60)]
        want = list(plain.prefill(model.new_state(), ids, 64))
        got = list(graphed.prefill(model.new_state(), ids, 64))
        assert (runner.guesses.chunks, runner.guesses.chunks_wrong) == (1, 1)
        assert [r.tokens for r in got] == [CHUNK_SLOTS, 60 - CHUNK_SLOTS] and [r.graphed for r in got] == [True, False]
        assert torch.equal(want[-1].logits, got[-1].logits)
    finally:
        files.close()


def test_a_host_tokens_missing_hash_experts_skip_the_guess(packed):
    """A step or a chunk on tokens the host knows, whose hash-layer experts (from the token ids) are
    not all resident, is not guessed: the guess would be wrong for certain, and the policy does not
    back off. A sampled token still on the device is guessed as before."""
    k = _pool(packed)[1]
    files = open_model(packed, cache_bytes=(_routed_pool(packed) + 4 * k) * _pool(packed)[2])
    try:
        experts = files.experts
        model = Transformer(files.get, files.args, Numerics.named("native"))
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, experts)
        tables = [b.ffn.gate.tid2eid_host for b in model.blocks[:files.args.n_hash_layers]]
        cold = [t for t in range(files.args.vocab_size)
                if not all(experts.cache.contains((layer, int(e))) for layer, table in enumerate(tables)
                           for e in table[t])]
        runner = DecodeRunner(model, experts, whole=False, guesses=StepGuess(least=1, most=8))
        runner.guesses.observed(True)  # the policy ready
        assert runner.can_chunk() and not runner.can_chunk([cold[0], 7]) and not runner.can_chunk(torch.tensor(cold[:2]))
        runner.step(state, cold[0])
        g = runner.guesses
        assert (g.guesses, g.wrong, g.needed) == (0, 0, 1)  # layered, no backoff (a wrong guess doubles needed)
        cold = [t for t in cold if not all(experts.cache.contains((layer, int(e))) for layer, table in enumerate(tables)
                                           for e in table[t])]  # still cold after that step's reads
        every = DecodeRunner(model, experts, whole=False, guesses=StepGuess(least=0, most=0))
        every.step(state, torch.tensor([cold[0]]))  # the host does not read a sampled token to decide
        assert every.guesses.guesses == every.guesses.wrong == 1
        runner.settle()
        every.settle()
    finally:
        files.close()


def test_chunk_steps_are_planned_for_a_short_prompt_on_its_own_tokens(packed):
    """Through a bounded cache with the policy ready: a prompt longer than GRAPHED_PREFILL goes in
    eager chunks to its end (its last 36 tokens are no short prompt); a short one whose first
    tokens' hash-layer experts are missing goes in one eager chunk, not in decode steps; both as
    the eager prefill, with nothing guessed."""
    k = _pool(packed)[1]
    ids = [(37 * i + 11) % 512 for i in range(100)]
    for n, files, want_lengths in ((100, _streamed(packed, k), [64, 36]),
                                   (60, open_model(packed, cache_bytes=(_routed_pool(packed) + 4 * k) * _pool(packed)[2]),
                                    [60])):
        try:
            runner, graphed, plain = _prefills(files, StepGuess())
            model = runner.model
            got = list(graphed.prefill(model.new_state(), ids[:n], 64))
            want = list(plain.prefill(model.new_state(), ids[:n], 64))
            assert [r.tokens for r in got] == want_lengths and not any(r.graphed for r in got)
            assert runner.guesses.guesses == 0 and torch.equal(want[-1].logits, got[-1].logits)
        finally:
            files.close()


# ---------------------------------------------------------------------------- steps returned unchecked
def _deferred(packed, slots: int, guesses: StepGuess | None, settle_between: bool = False):
    """`_decode`'s STEPS greedy steps after PROMPT through a cache of `slots` records, each step
    returned unchecked (`defer=True`) and confirmed only after the host has drawn its token from
    the logits it returned, as a chat turn does; a redo's logits replace them and the token is
    drawn again. `settle_between`: `settle()` checks each step first (a flush or pin between two
    steps), `confirm` then hands its redo over. The state is an inference tensor's, as an engine's;
    the checks run outside inference mode. -> (logits, state, runner, per redone step whether it
    emitted)."""
    files = _streamed(packed, slots)
    try:
        model = Transformer(files.get, files.args, Numerics.named("native"))
        with torch.inference_mode():  # the state is made and stepped as `Runtime.launch` does it
            state = model.new_state()
            model.forward(torch.tensor(PROMPT), state, files.experts)
        runner = DecodeRunner(model, files.experts, whole=False, guesses=guesses)
        logits, tok, emitted = [], torch.tensor([5]), []  # emitted: per redone step, whether it emitted
        for _ in range(STEPS):
            with torch.inference_mode():
                out = runner.step(state, tok, defer=True)
            tok = out.argmax().reshape(1)  # drawn before the verdict, which comes outside inference mode
            if settle_between:
                runner.settle()
            redone = runner.confirm()
            if redone is not None:
                out, tok = redone, redone.argmax().reshape(1)
                emitted.append(bool(model.emitting(state.pos - 1)))
            logits.append(out)
        runner.settle()
        return logits, state, runner, emitted
    finally:
        files.close()


@pytest.mark.parametrize("settle_between", [False, True])
def test_steps_returned_unchecked_are_redone_on_confirm(packed, settle_between):
    """A cache of the routed layers' experts less six steps' worth, every step guessed and returned
    unchecked: the wrong guesses (emitting steps among them) are found by `confirm`, or by a
    `settle` before it, after the host has drawn from their logits; they are redone layer by layer
    and their logits handed over. The conversation's logits and state are the layered steps' bit
    for bit."""
    k = _pool(packed)[1]
    slots = _routed_pool(packed) - 6 * k  # wrong guesses at emitting steps among them
    want, want_state, _, _ = _decode(packed, slots, None)
    got, state, runner, emitted = _deferred(packed, slots, StepGuess(least=0, most=0), settle_between)
    assert 0 < runner.guesses.wrong < runner.guesses.guesses == STEPS
    assert any(emitted)  # a redone step that had rewritten the previous halves in place, restored
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    _same_state(want_state, state)


def test_a_step_returned_unchecked_is_confirmed_before_the_next(packed):
    """After a step returned unchecked, the next step and a chunk step are refused until `confirm`,
    which hands a wrong guess's redo over once; a runner without a policy guesses nothing, so its
    steps need no `confirm`."""
    k = _pool(packed)[1]
    files = _streamed(packed, k)
    try:
        model = Transformer(files.get, files.args, Numerics.named("native"))
        state = model.new_state()
        model.forward(torch.tensor(PROMPT), state, files.experts)
        runner = DecodeRunner(model, files.experts, whole=False, guesses=StepGuess(least=0, most=0))
        runner.step(state, torch.tensor([5]), defer=True)
        for refused in (lambda: runner.step(state, torch.tensor([6])), lambda: runner.chunk(state, [6, 7])):
            with pytest.raises(RuntimeError, match="confirm"):
                refused()
        pos = state.pos
        redone = runner.confirm()  # a cache of one layer's experts: the guess was wrong
        assert runner.guesses.wrong == 1 and redone is not None and state.pos == pos
        assert runner.confirm() is None  # handed over once
        plain = DecodeRunner(model, files.experts, whole=False)
        plain.step(state, torch.tensor([6]), defer=True)  # no policy: layered, nothing unchecked
        assert plain.confirm() is None
        plain.step(state, torch.tensor([7]))
    finally:
        files.close()


@pytest.fixture(scope="module")
def chat_pack(tmp_path_factory) -> Path:
    """The no-flip tiny model (tests/conftest.py's `separated_ckpt`) with the bundled tokenizer's
    vocabulary, converted: an `Engine` chats on it."""
    root = tmp_path_factory.mktemp("chat")
    ckpt = write_checkpoint(root / "ckpt", tiny_config(index_topk=512, vocab_size=129280),
                            SynthOptions(seed=1, gate_bias_std=2.0))
    return convert(ckpt, root / "pack")


def test_a_chat_turn_through_unchecked_steps_draws_what_layered_steps_draw(chat_pack):
    """`Engine.generate` with seeded sampling through a cache of the pool less six steps' worth of
    experts, its runner guessing every step (on the GPU the runner is the engine's own; here one
    is given to its runtime): the turn launches its decode steps unchecked, redoes the wrong
    guesses and draws their tokens again (`Sampler.undo`), so both turns' ids, text and live state
    are those of a runner that never guesses."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import TurnFinished
    from engine.sampling import SamplingParams

    pool, k, record = _pool(chat_pack)
    cache = (pool - 6 * k) * record  # 11 of the 26 decode steps' guesses wrong
    params = SamplingParams(temperature=1.0, seed=20261205, max_tokens=12)
    runs = []
    for guesses in (None, StepGuess(least=0, most=0)):
        eng = Engine.load(chat_pack, EngineConfig(cache_bytes=cache, max_seq_len=256), warmup=False)
        try:
            eng.runtime.runner = DecodeRunner(eng.model, eng.experts, whole=False, guesses=guesses)
            session = eng.new_session()
            texts = [[e for e in eng.generate(session, text, params)][-1] for text in ("Tell me a story.", "And?")]
            assert all(isinstance(t, TurnFinished) for t in texts), texts
            runs.append(([t.content for t in texts], session.ids, eng.runtime.runner.guesses, session.state.clone()))
            args = eng.args
        finally:
            eng.close()
    (want_text, want_ids, _, want_state), (text, ids, guessed, state) = runs
    assert 0 < guessed.wrong < guessed.guesses - guessed.chunks  # decode steps guessed both ways
    assert (text, ids) == (want_text, want_ids)
    assert_same_live_state(want_state, state, args)  # chunk steps (the guessing runner's prefill) write unused slots
