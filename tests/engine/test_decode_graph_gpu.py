"""CUDA-graph decode on the GPU: graph replays equal the eager step on the same device and backend
(whole graph and per-layer graphs through a small cache), including the capture after the
compressed caches grow, and other sequence states of one capacity replaying the same graphs
(engine/graph_homes.py); steps guessed whole equal layered ones bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from converter.convert import convert
from converter.synth import SynthOptions, tiny_config, write_checkpoint
from engine.decode_graph import DecodeRunner
from engine.model import Transformer
from engine.numerics import Numerics
from engine.step_guess import StepGuess
from engine.weights import open_model
from kernels.backend import make_backend

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = torch.randint(0, 129280, (40,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """The no-flip tiny model (index_topk 512, router bias std 2) with the real vocabulary, so
    the engine test can use the real tokenizer."""
    src = write_checkpoint(tmp_path_factory.mktemp("gsrc") / "ckpt", tiny_config(index_topk=512, vocab_size=129280),
                           SynthOptions(seed=1, gate_bias_std=2.0))
    return convert(src, tmp_path_factory.mktemp("gpack") / "pack")


def _run(packed: Path, backend: str, cache_records: int | None, steps: int):
    """Greedy decode through graphs; each step is also run eagerly on a copy of the state (same
    token, same position): returns the per-step max relative difference and the captures."""
    dev = torch.device("cuda")
    probe = open_model(packed)
    record = probe.experts.store.record_bytes
    probe.close()
    files = open_model(packed, cache_bytes=None if cache_records is None else cache_records * record,
                       device="cuda")
    whole = files.experts.load_all()
    model = Transformer(lambda n: files.get(n).to(dev), files.args,
                        Numerics.named("native", make_backend(backend, dev)))
    runner = DecodeRunner(model, files.experts, whole=whole, graphs=True)
    errs, agree = [], 0
    with torch.inference_mode():
        state = model.new_state()
        tok = model.forward(PROMPT.to(dev), state, files.experts, last_only=True).argmax(-1)
        for i in range(steps):
            if i == steps // 2:  # another sequence state object: it moves into the graphs' home
                state = state.clone()
            eager_state = state.clone()
            want = model.forward(tok, eager_state, files.experts, last_only=True)
            got = runner.step(state, tok)
            errs.append(((got - want).abs().max() / want.abs().max()).item())
            agree += int(torch.equal(got.argmax(-1), want.argmax(-1)))
            tok = got.argmax(-1)
    captures = runner.captures
    files.close()
    print(f"{backend} cache={cache_records}: max rel diff per step {max(errs):.2e}, "
          f"{sum(e == 0 for e in errs)}/{steps} bitwise, argmax agree {agree}/{steps}, captures {captures}")
    return errs, agree, captures


@pytest.mark.parametrize("backend", ["torch", "tilelang"])
def test_whole_graph_equals_eager(packed, backend):
    errs, agree, captures = _run(packed, backend, None, 100)  # positions 40..139: growth, ratio 128
    assert captures >= 3  # the step's control flows, again after the capacity grows
    assert max(errs) <= 1e-2 and agree >= 98


def test_layered_graphs_through_a_small_cache_equal_eager(packed):
    errs, agree, captures = _run(packed, "tilelang", 12, 24)
    assert max(errs) <= 1e-2 and agree >= 23


def _guessed_run(packed: Path, cache_records: int, steps: int, guesses: StepGuess | None,
                 chunks: tuple[int, ...] = (), reference=None) -> tuple[list[torch.Tensor], list[bool]]:
    """Through a bounded cache on graphs, on a provider of its own (no eager reference reading
    experts in between): prefill PROMPT, then `chunks` of seeded token ids as chunk steps guessed
    whole (`guesses`) or, where no chunk step runs, as decode steps (layered graphs), then
    `steps` greedy decode steps, layered or guessed whole -> (the logits of each chunk's last
    token and of each step, whether each chunk was redone). `reference(state, tokens)`, when
    given, is called before each chunk with a copy of the state (the chunk's eager reference);
    its results follow the chunks' in the first list."""
    dev = torch.device("cuda")
    probe = open_model(packed)
    record = probe.experts.store.record_bytes
    probe.close()
    files = open_model(packed, cache_bytes=cache_records * record, device="cuda")
    try:
        assert not files.experts.load_all()
        model = Transformer(lambda n: files.get(n).to(dev), files.args,
                            Numerics.named("native", make_backend("tilelang", dev)))
        runner = DecodeRunner(model, files.experts, whole=False, graphs=True, guesses=guesses)
        ids = torch.randint(0, 129280, (sum(chunks),), generator=torch.Generator().manual_seed(11)).tolist()
        out, redone, pos, refs = [], [], 0, []
        with torch.inference_mode():
            state = model.new_state()
            tok = model.forward(PROMPT.to(dev), state, files.experts, last_only=True).argmax(-1)
            for n in chunks:
                wrong = guesses.chunks_wrong if guesses is not None else 0
                part = ids[pos:pos + n]
                pos += n
                if reference is not None:
                    refs.append(reference(state.clone(), part))
                if runner.can_chunk(part):
                    out.append(runner.chunk(state, part))
                else:
                    for i, t in enumerate(part):
                        last = runner.step(state, t, logits=i == n - 1)
                    out.append(last)
                redone.append(guesses is not None and guesses.chunks_wrong > wrong)
                tok = out[-1].argmax(-1)
            for _ in range(steps):
                out.append(runner.step(state, tok))
                tok = out[-1].argmax(-1)
            runner.settle()
        assert runner.capture_error is None
        return out + refs, redone
    finally:
        files.close()


def test_guessed_whole_graphs_equal_layered_graphs(packed):
    """Steps through a bounded cache, every one guessed whole (engine/step_guess.py): through most of
    the pool the guesses are right, through a few layers' experts most are redone layer by layer
    (the prev halves restored); the logits bit for bit those of layered graphs in both."""
    probe = open_model(packed)
    pool = probe.args.n_layers * probe.experts.store.count
    k = probe.args.n_activated_experts
    probe.close()
    right = wrong = 0
    for cache in (pool - 2 * k, 3 * k):
        layered, _ = _guessed_run(packed, cache, 24, None)
        guesses = StepGuess(least=0, most=0)
        guessed, _ = _guessed_run(packed, cache, 24, guesses)
        print(f"cache {cache}: {guesses.guesses} guessed, {guesses.wrong} redone")  # none while a read is pending
        right, wrong = right + guesses.guesses - guesses.wrong, wrong + guesses.wrong
        assert all(torch.equal(a, b) for a, b in zip(layered, guessed))
    assert right > 0 and wrong > 0  # both outcomes, on graphs


def test_guessed_chunk_graphs_through_a_bounded_cache(packed):
    """Prefill chunks through a cache of most of the pool, every one guessed whole on graphs (a
    chunk whose hash-layer experts are missing is not guessed): each chunk's logits, stood or
    redone (what it wrote restored, its tokens run as decode steps), against the eager forward of
    its tokens from a copy of the same state on a provider of its own holding every expert: a
    chunk step within 1e-2 (the eager chunk's kernels), decode steps within 5e-2 (a token at a
    time), and the same greedy token."""
    dev = torch.device("cuda")
    probe = open_model(packed)
    pool = probe.args.n_layers * probe.experts.store.count
    k = probe.args.n_activated_experts
    probe.close()
    ref_files = open_model(packed, device="cuda")
    try:
        assert ref_files.experts.load_all()
        ref_model = Transformer(lambda n: ref_files.get(n).to(dev), ref_files.args,
                                Numerics.named("native", make_backend("tilelang", dev)))

        def eager(state, tokens):
            return ref_model.forward(torch.tensor(tokens, device=dev), state, ref_files.experts, last_only=True)
        chunks = (16, 16, 9, 16, 16, 5, 16, 16, 16)  # from 40 to 166: ratio-4 and ratio-128 windows, growth
        guesses = StepGuess(least=0, most=0)
        got, redone = _guessed_run(packed, pool - k, 8, guesses, chunks, eager)
    finally:
        ref_files.close()
    print(f"guessed chunks: {guesses.chunks} ({guesses.chunks_wrong} redone), redone {redone}")
    assert guesses.chunks >= 1 and sum(redone) == guesses.chunks_wrong
    mine, want = got[:len(chunks)], got[-len(chunks):]
    errs = [((b - a).abs().max() / a.abs().max()).item() for a, b in zip(want, mine)]
    print(f"chunk logits against eager: {[f'{e:.1e}' for e in errs]}")
    agree = sum(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(want, mine))
    assert all(e <= (5e-2 if r else 1e-2) for e, r in zip(errs, redone)) and agree >= len(chunks) - 1


def test_conversations_of_one_capacity_take_turns_in_the_same_graphs_and_stay_exact(packed):
    """Two sequence states of one capacity decode alternately through one runner: after each has
    stepped through every control flow, no capture happens, and every replay equals the eager step."""
    dev = torch.device("cuda")
    files = open_model(packed, device="cuda")
    whole = files.experts.load_all()
    model = Transformer(lambda n: files.get(n).to(dev), files.args,
                        Numerics.named("native", make_backend("tilelang", dev)))
    runner = DecodeRunner(model, files.experts, whole=whole, graphs=True)
    errs, captures = [], []
    with torch.inference_mode():
        states, toks = [], []
        for start in (0, 7):  # two conversations, prompts of 40 and 33 tokens
            state = model.new_state()
            model.reserve(state, 120)
            toks.append(model.forward(PROMPT[start:].to(dev), state, files.experts, last_only=True).argmax(-1))
            states.append(state)
        for i in range(48):
            which = i % 2
            eager_state = states[which].clone()
            want = model.forward(toks[which], eager_state, files.experts, last_only=True)
            got = runner.step(states[which], toks[which])
            errs.append(((got - want).abs().max() / want.abs().max()).item())
            toks[which] = got.argmax(-1)
            captures.append(runner.captures)
    moves = runner.homes.moves
    files.close()
    print(f"alternating states: max rel diff {max(errs):.2e}, captures {captures[-1]}, moves {moves}")
    assert max(errs) <= 1e-2
    assert captures[16] == captures[-1] <= 3  # none, ratio 4: captured once for both states
    assert moves >= 40  # every step after the first moved the other state in


@pytest.mark.parametrize("backend", ["torch", "tilelang"])
def test_chunk_step_graphs_equal_the_eager_forward(packed, backend):
    """Graphed chunk steps (`DecodeRunner.chunk`) of 2..16 tokens against `Transformer.forward`
    of the same tokens on a copy of the state: one capture per home (the first chunk, and again
    after the caches grow), every replay within the native paths' rounding of the eager chunk,
    and the same greedy token."""
    dev = torch.device("cuda")
    files = open_model(packed, device="cuda")
    assert files.experts.load_all()
    model = Transformer(lambda n: files.get(n).to(dev), files.args,
                        Numerics.named("native", make_backend(backend, dev)))
    runner = DecodeRunner(model, files.experts, whole=True, graphs=True)
    assert runner.can_chunk()
    ids = torch.randint(0, 129280, (400,), generator=torch.Generator().manual_seed(7)).tolist()
    errs, agree, captures, bitwise = [], 0, [], 0
    with torch.inference_mode():
        state = model.new_state()
        model.forward(torch.tensor(ids[:40], device=dev), state, files.experts)
        pos = 40
        for n in [16, 5, 16, 3, 16, 16, 9, 16, 2, 16, 16, 16, 13, 16, 16, 16, 16, 16, 7]:  # to 274: growth, ratio 128
            eager_state = state.clone()
            want = model.forward(torch.tensor(ids[pos:pos + n], device=dev), eager_state, files.experts, last_only=True)
            got = runner.chunk(state, ids[pos:pos + n])
            pos += n
            errs.append(((got - want).abs().max() / want.abs().max()).item())
            bitwise += int(torch.equal(got, want))
            agree += int(torch.equal(got.argmax(-1), want.argmax(-1)))
            captures.append(runner.captures)
            assert state.pos == eager_state.pos == pos
        runner.settle()
    files.close()
    print(f"{backend} chunk steps: max rel diff {max(errs):.2e}, {bitwise}/{len(errs)} bitwise, argmax agree "
          f"{agree}/{len(errs)}, captures {captures}")
    # the torch backend's GEMMs (cuBLAS) round differently at the chunk's 16 rows and the eager n
    assert max(errs) <= (1e-2 if backend == "tilelang" else 5e-2) and agree >= len(errs) - 1
    assert captures[0] == captures[1] == 1 and captures[-1] == 4  # once per capacity: 16, 32, 64, 128 entries


def test_engine_turns_replay_graphs_and_match_the_eager_engine(packed):
    """A real engine on CUDA: multi-turn greedy chat through graphs gives the eager engine's text."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import TurnFinished
    from engine.sampling import SamplingParams

    texts = {}
    for graphs in (False, True):
        eng = Engine.load(packed, EngineConfig(device="cuda", backend="tilelang", cuda_graphs=graphs))
        try:
            assert (eng.runtime.runner is not None) == graphs
            sess, out = eng.new_session(), []
            for user in ("hello there", "and again, longer this time"):
                events = list(eng.generate(sess, user, SamplingParams(temperature=0.0, max_tokens=40)))
                fin = events[-1]
                assert isinstance(fin, TurnFinished), fin
                out.append(sess.ids[fin.stats.prompt_tokens:])
            assert eng.stats().phase == ("graph replay" if graphs else "eager")
            texts[graphs] = out
        finally:
            eng.close()
    assert texts[True] == texts[False]


def test_a_long_resident_prefill_skips_host_syncs_and_counts_its_uses_once_run(packed):
    """Every expert resident and enough cells per expert (engine.moe.Cells.all_groups): the MoE
    groups the cells on the device with no host sync and counts its uses later
    (`record_later`); `settle_records(most=2)` counts the first two layers' only, and once
    `settle_records` has waited, each layer counted each of its distinct experts once, and the
    logits are those of the same prompt prefilled in chunks too short for the tensor cores (the
    grouped GEMV), within the native GPU paths' rounding."""
    from engine.moe import Cells

    dev = torch.device("cuda")
    files = open_model(packed, device="cuda")
    assert files.experts.load_all()
    model = Transformer(lambda n: files.get(n).to(dev), files.args, Numerics.named("native", make_backend("tilelang", dev)))
    ids = torch.randint(0, 129280, (96,), generator=torch.Generator().manual_seed(5)).to(dev)
    routes: dict[int, set[int]] = {}

    def log(kind, layer, start, t):
        if kind == "experts":
            routes.setdefault(layer, set()).update(t.flatten().tolist())

    with torch.inference_mode():
        before = list(files.experts.usage.layer_uses)
        state = model.new_state()
        whole = model.forward(ids, state, files.experts, log=log)
        cells = Cells(torch.zeros(96, files.args.n_activated_experts, dtype=torch.long, device=dev),
                      files.experts.n_experts)
        assert cells.one_group and cells.all_groups(files.experts.arena.table[0])
        files.experts.settle_records(most=2)
        first = [a - b for a, b in zip(files.experts.usage.layer_uses, before)]
        assert all(first[:2]) and not any(first[2:]) and files.args.n_layers > 2
        files.experts.settle_records()
        counted = [a - b for a, b in zip(files.experts.usage.layer_uses, before)]
        assert counted == [len(routes[layer]) for layer in range(files.args.n_layers)]
        chunked_state, parts = model.new_state(), []
        for c in range(0, 96, 24):  # 96 cells a chunk: the grouped GEMV
            parts.append(model.forward(ids[c:c + 24], chunked_state, files.experts))
        chunked = torch.cat(parts)
        files.experts.settle_records()
    files.close()
    err = ((whole - chunked).norm(dim=-1) / chunked.norm(dim=-1)).float()
    assert err.median() <= 0.1, f"median {err.median():.3e}"
    assert (whole.argmax(-1) == chunked.argmax(-1)).float().mean() >= 0.8


def test_prefill_chunks_queued_ahead_equal_one_at_a_time(packed):
    """On CUDA `Runtime.prefill` queues each chunk before waiting for the one before it: the same
    kernels in the same order as chunks run one at a time, so the same logits bit for bit and the
    same uses counted once settled (each launch counts at most SETTLED_PER_LAUNCH layers' uses
    of the earlier calls; the rest wait for the runtime's settle, off the first token's path);
    the chunks' seconds add up to no more than the prefill's wall time."""
    import threading
    import time

    from engine.runtime import Runtime

    dev = torch.device("cuda")
    files = open_model(packed, device="cuda")
    assert files.experts.load_all()
    model = Transformer(lambda n: files.get(n).to(dev), files.args, Numerics.named("native", make_backend("tilelang", dev)))
    runtime = Runtime(model, files.experts, dev, threading.RLock())
    ids = torch.randint(0, 129280, (96,), generator=torch.Generator().manual_seed(6)).tolist()
    usage = files.experts.usage
    with torch.inference_mode():
        state, before = model.new_state(), list(usage.layer_uses)
        t0 = time.perf_counter()
        results = list(runtime.prefill(state, ids, 24))
        wall = time.perf_counter() - t0
        unsettled = [a - b for a, b in zip(usage.layer_uses, before)]
        runtime.settle()
        ahead = [a - b for a, b in zip(usage.layer_uses, before)]
        assert sum(unsettled) < sum(ahead)  # the last chunk's uses: not counted on its way out
        one_state, one, before = model.new_state(), [], list(usage.layer_uses)
        for c in range(0, 96, 24):
            one.append(runtime.step(one_state, ids[c:c + 24]))
        runtime.settle()
        assert ahead == [a - b for a, b in zip(usage.layer_uses, before)] and sum(ahead) > 0
    files.close()
    assert [r.tokens for r in results] == [24] * 4 and state.pos == one_state.pos == 96
    for got, want in zip(results, one):
        assert torch.equal(got.logits, want.logits)
    assert sum(r.seconds for r in results) <= wall


def _lane_steps(packed: Path, forked: bool) -> list[torch.Tensor]:
    """Graphed chunk steps, then graphed decode steps, with the side work on the side streams or
    in place (engine/lanes.py): every step's logits."""
    from engine.lanes import Lanes

    dev = torch.device("cuda")
    files = open_model(packed, device="cuda")
    assert files.experts.load_all()
    model = Transformer(lambda n: files.get(n).to(dev), files.args,
                        Numerics.named("native", make_backend("tilelang", dev)))
    runner = DecodeRunner(model, files.experts, whole=True, graphs=True, lanes=None if forked else Lanes(None))
    assert runner.lanes.forks == forked
    ids = torch.randint(0, 129280, (200,), generator=torch.Generator().manual_seed(11)).tolist()
    out = []
    with torch.inference_mode():
        state = model.new_state()
        model.forward(torch.tensor(ids[:40], device=dev), state, files.experts)
        for n in (16, 16, 7, 16):  # the chunk graphs captured, then replayed
            out.append(runner.chunk(state, ids[state.pos:state.pos + n]))
        tok = out[-1].argmax(-1)
        for _ in range(60):  # positions 95..154: ratio 4 and ratio 128 windows completed, capacity growth
            out.append(runner.step(state, tok))
            tok = out[-1].argmax(-1)
        runner.settle()
    assert runner.capture_error is None and runner.captures >= 4
    files.close()
    return out


def test_the_side_lane_changes_no_bit_of_a_step(packed):
    """The compressors, the indexer and the shared expert on side streams (a CSA layer's two
    compressors on two), forked and joined inside the captured graphs (engine/lanes.py): every
    chunk and decode step's logits equal the one-stream runner's bitwise (a missing join, a read
    across side lanes or an early read racing a fork would not)."""
    forked, inline = _lane_steps(packed, True), _lane_steps(packed, False)
    assert len(forked) == len(inline) == 64
    for i, (a, b) in enumerate(zip(forked, inline)):
        assert torch.equal(a, b), f"step {i}"
