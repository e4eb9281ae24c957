"""Forced routing from a trace (engine/routing_override.py, timing only): the expert ids the
provider is asked for on the router-routed layers (>= n_hash_layers) are the trace's, mapped
onto the model (top-k by weight, mod E, repeats moved on), in prefill and in the decode step;
replaying the model's own routes reproduces its logits bitwise; bad traces get one clear line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from converter.convert import convert
from engine.decode_graph import DecodeRunner
from engine.model import Transformer
from engine.numerics import Numerics
from engine.routing_override import ForcedRouting, RoutingTraceError, map_choice, read_route_csv
from engine.weights import open_model

PROMPT = [0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3, 77]
HEADER = "pos,layer,n,e0,e1,e2,e3,e4,e5,w0,w1,w2,w3,w4,w5\n"


@pytest.fixture(scope="module")
def packed(separated_ckpt, tmp_path_factory) -> Path:
    """The no-flip tiny model (conftest: 5 layers, 3 hash layers, 16 experts, top-4), converted."""
    return convert(separated_ckpt, tmp_path_factory.mktemp("out") / "pack")


def _write_trace(path: Path, tokens: int, layers=range(3, 43), seed: int = 0) -> Path:
    """A Flash-like trace (ids 0..255, six a row, unsorted weights); the first row collides mod 16."""
    rng = random.Random(seed)
    lines = [HEADER]
    for t in range(tokens):
        for layer in layers:
            ids = [5, 21, 37, 2, 200, 9] if (t, layer) == (0, 3) else rng.sample(range(256), 6)
            ws = [round(rng.uniform(0.05, 0.5), 6) for _ in range(6)]
            lines.append(",".join(map(str, [218 + t, layer, 6, *ids, *ws])) + "\n")
    path.write_text("".join(lines))
    return path


def _expected(path: Path, layer: int, pos: int, k: int, n_experts: int) -> list[int]:
    """The spec, written out independently: the run's position p takes the trace's token p mod T;
    the model's layer 3 + j the trace's j-th layer; the k largest weights in column order;
    ids mod E, a repeat moved to the next free id."""
    rows = [line.split(",") for line in path.read_text().splitlines()[1:]]
    positions = sorted({int(r[0]) for r in rows})
    layers = sorted({int(r[1]) for r in rows})
    want_pos, want_layer = positions[pos % len(positions)], layers[(layer - 3) % len(layers)]
    row = next(r for r in rows if int(r[0]) == want_pos and int(r[1]) == want_layer)
    ids, ws = [int(x) for x in row[3:9]], [float(x) for x in row[9:15]]
    kept = sorted(sorted(range(6), key=lambda j: -ws[j])[:k])
    out = []
    for j in kept:
        e = ids[j] % n_experts
        while e in out:
            e = (e + 1) % n_experts
        out.append(e)
    return out


class _Spy:
    """Records which expert ids the model and the decode runner ask the provider for."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.arena, self.n_experts = inner.arena, inner.n_experts

    def experts(self, layer, ids):
        ids = list(ids)
        self.calls.append(("experts", layer, sorted(set(ids))))
        return self.inner.experts(layer, ids)

    def fence(self):
        return self.inner.fence()

    def resident(self, layer, ids):
        return self.inner.resident(layer, ids)

    def acquire(self, layer, ids):
        self.calls.append(("acquire", layer, list(ids)))
        self.inner.acquire(layer, ids)

    def can_acquire(self, n):
        return self.inner.can_acquire(n)

    def record(self, layer, ids):
        self.calls.append(("record", layer, list(ids)))
        self.inner.record(layer, ids)

    def record_routes(self, routes):
        for layer, ids in enumerate(routes):
            self.calls.append(("record", layer, list(ids)))
        self.inner.record_routes(routes)

    def record_later(self, layer, counts):
        self.calls.append(("record", layer, [e for e, c in enumerate(counts.tolist()) if c]))
        self.inner.record_later(layer, counts)

    def release(self, layer):
        self.inner.release(layer)

    def prefetch(self, layer, ids, fence=None):
        self.inner.prefetch(layer, ids, fence)

    def all_resident(self):
        return self.inner.all_resident()


def test_map_choice_keeps_top_k_by_weight_mod_e_and_moves_repeats():
    ids, ws = (229, 177, 96, 150, 243, 64), (0.453, 0.393, 0.165, 0.160, 0.151, 0.177)
    # top 4 weights: columns 0, 1, 5, 2 -> column order 229, 177, 96, 64 -> mod 16: 5, 1, 0, 0 -> 0 taken: 2
    assert map_choice(ids, ws, 4, 16) == [5, 1, 0, 2]
    assert map_choice(ids, ws, 6, 256) == list(ids)  # the real model: the trace as it is
    assert map_choice((3, 3 + 8, 3 + 16), (1.0, 1.0, 1.0), 3, 8) == [3, 4, 5]  # repeats walk on


def test_bad_traces_get_one_line(tmp_path, packed):
    files = open_model(packed)
    args = files.args
    files.close()  # its I/O threads with it
    with pytest.raises(RoutingTraceError, match="does not exist"):
        read_route_csv(tmp_path / "none.csv")
    (tmp_path / "h.csv").write_text("a,b\n1,2\n")
    with pytest.raises(RoutingTraceError, match="expected a header"):
        read_route_csv(tmp_path / "h.csv")
    (tmp_path / "gap.csv").write_text(HEADER + "0,3,6,1,2,3,4,5,6,1,1,1,1,1,1\n0,4,6,1,2,3,4,5,6,1,1,1,1,1,1\n"
                                      "1,3,6,1,2,3,4,5,6,1,1,1,1,1,1\n")
    with pytest.raises(RoutingTraceError, match="every token needs the same layers"):
        read_route_csv(tmp_path / "gap.csv")
    (tmp_path / "bad.csv").write_text(HEADER + "0,3,6,1,2,x,4,5,6,1,1,1,1,1,1\n")
    with pytest.raises(RoutingTraceError, match=r"bad.csv:2:"):
        read_route_csv(tmp_path / "bad.csv")
    (tmp_path / "two.csv").write_text("pos,layer,n,e0,e1,w0,w1\n0,3,2,1,2,0.5,0.5\n")
    with pytest.raises(RoutingTraceError, match="routes 2 experts a token but the model routes 4"):
        ForcedRouting.from_csv(tmp_path / "two.csv", args, "cpu")


@pytest.mark.parametrize("numerics", ["native", "exact"])
def test_prefill_and_decode_read_the_traces_experts(packed, tmp_path, numerics):
    """Layers 3 and 4 ask the provider for exactly the mapped trace ids: the prefill (one chunk,
    then a second chunk past the trace's end: cycling) and whole- and layered-mode decode steps;
    the hash layers keep their token-id routing."""
    trace = _write_trace(tmp_path / "t.csv", tokens=5)  # 13-token prompt: cycles the 5 tokens
    files = open_model(packed)
    try:
        args = files.args
        k, n_experts = args.n_activated_experts, args.n_routed_experts
        routing = ForcedRouting.from_csv(trace, args, "cpu")
        assert [b.routing is not None for b in Transformer(files.get, args, Numerics.named(numerics),
                                                           routing=routing).blocks] == [False] * 3 + [True] * 2
        assert "timing only" in routing.note and "mod 16" in routing.note
        model = Transformer(files.get, args, Numerics.named(numerics), routing=routing)
        spy, state, seen = _Spy(files.experts), model.new_state(), {}

        def log(kind, layer, start, t):
            if kind == "experts":
                for i, row in enumerate(t.tolist()):
                    seen[layer, start + i] = row

        model.forward(torch.tensor(PROMPT[:8]), state, spy, log=log)
        model.forward(torch.tensor(PROMPT[8:]), state, spy, log=log)
        for pos in range(len(PROMPT)):
            for layer in (3, 4):
                assert seen[layer, pos] == _expected(trace, layer, pos, k, n_experts)
            for layer in range(3):  # hash layers: untouched
                assert seen[layer, pos] == model.blocks[layer].ffn.gate.tid2eid_host[PROMPT[pos]].tolist()
        asked = [c for c in spy.calls if c[1] in (3, 4)]
        assert len(asked) == 4  # two chunks x two forced layers
        for (_, layer, ids), start, n in zip(asked, (0, 0, 8, 8), (8, 8, 5, 5)):
            want = set().union(*(_expected(trace, layer, p, k, n_experts) for p in range(start, start + n)))
            assert ids == sorted(want)
        assert files.experts.load_all()
        for whole in (True, False):
            spy.calls.clear()
            runner = DecodeRunner(model, spy, whole=whole)
            steps = []
            for tok in (7, 400, 33):
                steps.append(state.pos)
                runner.step(state, tok)
            runner.settle()
            kind = "record" if whole else "acquire"
            for layer in (3, 4):
                got = [ids for c, lay, ids in spy.calls if c == kind and lay == layer]
                assert got == [_expected(trace, layer, p, k, n_experts) for p in steps]
    finally:
        files.close()


def test_a_chunk_step_reads_the_traces_experts(packed, tmp_path):
    """A graphed chunk step under forced routing (`set_chunk`): each real token's forced ids are
    its position's, counted as an eager chunk counts them (each layer's distinct experts), and
    the logits and state are the eager prefill's; a second chunk refills the same buffer (made
    with the routing, outside any inference mode, so steps in or out of one can write it)."""
    trace = _write_trace(tmp_path / "t.csv", tokens=5)
    files = open_model(packed)
    try:
        args = files.args
        k, n_experts = args.n_activated_experts, args.n_routed_experts
        routing = ForcedRouting.from_csv(trace, args, "cpu")
        model = Transformer(files.get, args, Numerics.named("native"), routing=routing)
        assert files.experts.load_all()
        spy = _Spy(files.experts)
        runner = DecodeRunner(model, spy, whole=True)
        assert runner.can_chunk()
        ref, state = model.new_state(), model.new_state()
        for start, end in ((0, 8), (8, 13)):
            want = model.forward(torch.tensor(PROMPT[start:end]), ref, files.experts, last_only=True)
            spy.calls.clear()
            buffer = routing.chunk.data_ptr()
            got = runner.chunk(state, PROMPT[start:end])
            runner.settle()
            assert torch.equal(want, got)
            assert routing.chunk.data_ptr() == buffer  # one buffer: a captured step reads it
            for layer in (3, 4):
                asked = [ids for c, lay, ids in spy.calls if c == "record" and lay == layer]
                assert asked == [sorted(set().union(*(_expected(trace, layer, p, k, n_experts)
                                                      for p in range(start, end))))]
        assert all(torch.equal(x.window, y.window) for x, y in zip(ref.layers, state.layers))
        with torch.inference_mode():  # as the runtime fills it
            routing.set_chunk(3)
        routing.set_chunk(3)  # and outside
        assert routing.chunk_ids(4)[0].tolist() == _expected(trace, 4, 3, k, n_experts)
    finally:
        files.close()


def test_replaying_the_models_own_routes_reproduces_its_logits(packed, tmp_path):
    """Record the router's choices (prefill then decode), write them as a trace, force them: the
    same ids and (the router's own) weights, so the same logits bit for bit, prefill and decode."""
    files = open_model(packed)
    try:
        args = files.args
        assert files.experts.load_all()
        numerics = Numerics.named("native")
        model = Transformer(files.get, args, numerics)
        routes: dict[tuple[int, int], list[int]] = {}

        def log(kind, layer, start, t):
            if kind == "experts":
                for i, row in enumerate(t.tolist()):
                    routes[start + i, layer] = row

        state = model.new_state()
        ref = [model.forward(torch.tensor(PROMPT), state, files.experts, log=log)]
        runner = DecodeRunner(model, files.experts, whole=True)
        tokens = [int(ref[0][-1].argmax())]
        for _ in range(4):  # the step's routes logged by forward on a copy of the state
            model.forward(torch.tensor(tokens[-1:]), state.clone(), files.experts, log=log)
            ref.append(runner.step(state, tokens[-1]))
            tokens.append(int(ref[-1].argmax()))
        n = len(PROMPT) + 4
        lines = ["pos,layer,n,e0,e1,e2,e3,w0,w1,w2,w3\n"]
        for pos in range(n):
            for layer in (3, 4):
                lines.append(",".join(map(str, [pos, layer, 4, *routes[pos, layer], 0.4, 0.3, 0.2, 0.1])) + "\n")
        (tmp_path / "own.csv").write_text("".join(lines))
        forced = Transformer(files.get, args, numerics, routing=ForcedRouting.from_csv(tmp_path / "own.csv", args,
                                                                                       "cpu"))
        state = forced.new_state()
        out = [forced.forward(torch.tensor(PROMPT), state, files.experts)]
        runner = DecodeRunner(forced, files.experts, whole=True)
        for tok in tokens[:-1]:
            out.append(runner.step(state, tok))
        for a, b in zip(ref, out):
            assert torch.equal(a, b)
    finally:
        files.close()


def test_a_stand_in_lookahead_guesses_forced_layers_with_its_accuracy(packed, tmp_path):
    """Forced layers have no router to look ahead with: `lookahead_accuracy` names each forced id
    with that probability, else an id the token does not route (no repeats), the same every run;
    the model hands the guesses out as its lookahead (decode step: the current position's;
    prefill: by position), and without a stand-in a forced layer gets no hint."""
    trace = _write_trace(tmp_path / "t.csv", tokens=40)
    files = open_model(packed)
    args = files.args
    exact = ForcedRouting.from_csv(trace, args, "cpu", lookahead_accuracy=1.0)
    assert torch.equal(exact.guess, exact.table)
    wrong = ForcedRouting.from_csv(trace, args, "cpu", lookahead_accuracy=0.0)
    for layer in (3, 4):
        for t in range(40):
            guess, route = wrong.guess[layer, t].tolist(), wrong.table[layer, t].tolist()
            assert not set(guess) & set(route) and len(set(guess)) == len(guess) == 4
    half = ForcedRouting.from_csv(trace, args, "cpu", lookahead_accuracy=0.5)
    pairs = zip(half.guess[3:5].flatten().tolist(), half.table[3:5].flatten().tolist())
    assert 0.35 < sum(a == b for a, b in pairs) / (2 * 40 * 4) < 0.65
    assert torch.equal(ForcedRouting.from_csv(trace, args, "cpu", lookahead_accuracy=0.5).guess, half.guess)
    half.set_position(41)  # token 41 mod 40
    assert half.lookahead_ids(4).tolist() == [half.guess[4, 1].tolist()]
    assert half.lookahead_ids(4, 38, 3).tolist() == [half.guess[4, t].tolist() for t in (38, 39, 0)]
    model = Transformer(files.get, args, Numerics.named("exact"), routing=half, lookahead=True)
    hidden, ids = torch.zeros(3, args.dim), torch.tensor([1, 2, 3])
    assert torch.equal(model.predict_next(3, hidden, ids, start=38), half.lookahead_ids(4, 38, 3))
    assert torch.equal(model.predict_next(2, hidden[:1], ids[:1]), half.lookahead_ids(3))  # layer 3: forced
    assert model.predict_next(4, hidden, ids, start=0) is None  # the last layer: nothing after it
    bare = ForcedRouting.from_csv(trace, args, "cpu")
    plain = Transformer(files.get, args, Numerics.named("exact"), routing=bare, lookahead=True)
    assert plain.predict_next(3, hidden, ids, start=0) is None and bare.lookahead_ids(4) is None
    assert "a stand-in right 50% of the time" in half.note and "no router lookahead on forced layers" in bare.note
    with pytest.raises(RoutingTraceError, match="accuracy must be in \\[0, 1\\], got 1.5"):
        ForcedRouting.from_csv(trace, args, "cpu", lookahead_accuracy=1.5)
    files.close()


def test_engine_forces_routing_from_its_config(tmp_path):
    """EngineConfig.routing_trace reaches the model through Engine.load: a chat turn uses exactly
    the forced experts on layers 3 and 4; without it the model has no forced routing."""
    from converter import synth
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import TurnFinished
    from engine.sampling import SamplingParams

    ckpt = synth.write_checkpoint(tmp_path / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    trace = _write_trace(tmp_path / "t.csv", tokens=3)
    with Engine.load(ckpt, EngineConfig(numerics="exact"), warmup=False) as eng:
        assert eng.model.routing is None and all(b.routing is None for b in eng.model.blocks)
    with Engine.load(ckpt, EngineConfig(numerics="exact", routing_trace=str(trace)), warmup=False) as eng:
        routing = eng.model.routing
        session = eng.new_session()
        fin = list(eng.generate(session, "Hi", SamplingParams(temperature=0.0, max_tokens=3)))[-1]
        assert isinstance(fin, TurnFinished)
        for layer in (3, 4):
            used = {e for (lay, e) in eng.experts.usage.uses if lay == layer}
            assert used == set().union(*(routing.host_ids(layer, p) for p in range(3)))
            assert routing.host_ids(layer, 4) == _expected(trace, layer, 4, 4, 16)


def test_full_depth_flag_says_timing_only(tmp_path, capsys):
    from bench import full_depth

    trace = _write_trace(tmp_path / "t.csv", tokens=2)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            full_depth.main(["--routing-trace", str(trace), "--workdir", str(tmp_path / "w")])
        assert f"routing forced from {trace}: timing only" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="bench.full_depth: routing trace .*none.csv does not exist"):
        full_depth.main(["--routing-trace", str(tmp_path / "none.csv")])
    with pytest.raises(SystemExit, match="--lookahead-accuracy takes a share in \\[0, 1\\] and needs --routing-trace"):
        full_depth.main(["--lookahead-accuracy", "0.5"])


def test_routing_lookahead_needs_a_trace_and_a_share():
    from engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="routing_lookahead .* needs a routing_trace"):
        EngineConfig(routing_lookahead=0.5)
    with pytest.raises(ConfigError, match="in \\[0, 1\\], got 2"):
        EngineConfig(routing_trace="t.csv", routing_lookahead=2)
    assert EngineConfig(routing_trace="t.csv", routing_lookahead=0.87).routing_lookahead == 0.87
