"""Router lookahead prefetch (issue 27 item 3): once layer L routes, layer L+1's gate on layer L's
MoE input predicts L+1's experts and the streaming provider starts reading them. A hint only:
results stay bitwise, the current layer's experts are never evicted for it, and the provider
counts it (accuracy, reads issued, used in time or still in flight)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.lookahead import run_lookahead
from converter.convert import convert
from engine import pack as layout
from engine.decode_graph import DecodeRunner
from engine.model import Transformer
from engine.numerics import Numerics
from engine.weights import open_model, open_official

PROMPT = torch.tensor([0, 17, 300, 5, 5, 99, 511, 42, 8, 250, 17, 3])
DECODE = [7, 123, 400, 9]


@pytest.fixture(scope="module")
def packed(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny model (conftest: 5 layers, 3 hash layers, 16 experts, top-4), converted."""
    return convert(tiny_ckpt, tmp_path_factory.mktemp("out") / "pack")


@pytest.fixture(scope="module")
def record(packed) -> int:
    return layout.read_manifest(packed).record.record_bytes


def _run(files, lookahead: bool, numerics: str = "exact") -> list[torch.Tensor]:
    """Prefill PROMPT, then decode DECODE one token a call; the logits of every call."""
    model = Transformer(files.get, files.args, Numerics.named(numerics), lookahead=lookahead)
    state = model.new_state()
    outs = [model.forward(PROMPT, state, files.experts)]
    outs += [model.forward(torch.tensor([t]), state, files.experts) for t in DECODE]
    return outs


def _check_counters(s) -> None:
    assert s.used == s.in_time + s.in_flight
    assert s.used + s.unused <= s.issued <= s.hinted
    assert 0 <= s.predicted <= s.routed


def _layered_run(files, logits: list, before):
    """A layered decode run's (logits, experts routed, of them predicted) since `before` (the
    lookahead counters then), after checking the counters and that no hold is left."""
    look = files.experts.prefetch_stats()["lookahead"]
    _check_counters(look)
    assert files.experts.cache.pinned() == files.experts.cache.held() == frozenset()
    return logits, look.routed - before.routed, look.predicted - before.predicted


def _assert_same_steps_and_hints(out: dict, steps: int) -> None:
    """Runs without (False) and with (True) lookahead: bitwise the same steps; only the latter
    hinted, for each of the 2 router-routed layers' 4 experts a step, most of them right."""
    for a, b in zip(out[False][0], out[True][0]):
        assert torch.equal(a, b)
    assert out[False][1] == 0 and out[True][1] == steps * 2 * 4 and out[True][2] > 0.5 * out[True][1]


@pytest.mark.parametrize("slots", [20, 16, 4])  # a quarter of the pool, one layer, one decode call's k
def test_lookahead_is_bitwise_and_counted(tiny_ckpt, packed, record, slots):
    official = open_official(tiny_ckpt)
    want = _run(official, lookahead=True)  # every expert resident: lookahead does nothing
    official.close()
    files = open_model(packed, cache_bytes=slots * record)
    try:
        plain = _run(files, lookahead=False)
        assert files.experts.prefetch_stats()["lookahead"].hinted == 0
        got = _run(files, lookahead=True)
        for a, b, c in zip(got, want, plain):
            assert torch.equal(a, b) and torch.equal(a, c)
        stats = files.experts.prefetch_stats()
        look = stats["lookahead"]
        _check_counters(look)
        _check_counters(stats["hash"])
        # layers 3 and 4 are router-routed: each call hints them from layers 2 and 3
        assert look.routed >= 2 * (1 + len(DECODE)) * 4 and look.hinted > 0
        if slots > 4:
            assert look.issued > 0
        else:  # the current layer holds every slot while its call runs: no room for a guess
            assert look.issued == 0
        assert stats["hash"].accuracy == 1.0  # hash layers are known exactly from the token ids
        assert files.experts.cache.pinned() == files.experts.cache.held() == frozenset()  # no hold leaks
    finally:
        files.close()


def test_lookahead_accuracy_on_the_engine_equals_the_bench(packed, record):
    """One-token calls: the provider's count of predicted experts is bench/lookahead.py's
    `moe_input` figure on the same tokens, and it is far above chance (k/E = 25 %)."""
    files = open_model(packed, cache_bytes=20 * record)
    try:
        model = Transformer(files.get, files.args, Numerics.named("exact"), lookahead=True)
        bench = run_lookahead(Transformer(files.get, files.args, Numerics.named("exact")), files.experts, [5], 24)
        before = files.experts.prefetch_stats()["lookahead"]
        state, tok = model.new_state(), torch.tensor([5])
        for _ in range(25):
            tok = model.forward(tok, state, files.experts, last_only=True).argmax(-1)
        look = files.experts.prefetch_stats()["lookahead"]
        hits = sum(v for (layer, var), v in bench.hit.items() if var == "moe_input")
        total = sum(v for (layer, var), v in bench.total.items() if var == "moe_input")
        assert (look.predicted - before.predicted, look.routed - before.routed) == (hits, total) == (hits, 25 * 2 * 4)
        assert look.accuracy > 0.5
        assert look.used > 0 and look.in_time + look.in_flight == look.used
    finally:
        files.close()


class _SubmitLog:
    """An IOPool stand-in that records which expert each read is for, in submission order."""

    def __init__(self, pool):
        self.pool, self.keys = pool, []

    def submit(self, fn, key, *args):
        self.keys.append(key)
        return self.pool.submit(fn, key, *args)

    def close(self):
        self.pool.close()


def test_predicted_prefetch_never_evicts_the_current_layers_experts(packed, record):
    files = open_model(packed, cache_bytes=4 * record)
    try:
        p = files.experts
        list(p.experts(3, [0, 1, 2, 3]))  # the cache holds exactly layer 3's route
        keep = [(3, e) for e in range(4)]
        p.prefetch_predicted(4, [5, 6, 7, 8], keep=keep)
        hits = p.stats().hits
        list(p.experts(3, [0, 1, 2, 3]))  # the hint is issued during this call: no slot is free
        assert p.stats().hits == hits + 4 and all(p.cache.peek(k) is not None for k in keep)
        assert p.prefetch_stats()["lookahead"].issued == 0
        # without a keep set (the decode runner, once the layer is held) the hint is issued at
        # once and takes up to its share (half) of the slots
        p.prefetch_predicted(4, [5, 6, 7, 8])
        assert p.prefetch_stats()["lookahead"].issued == 2
        assert sum(p.cache.peek(k) is None for k in keep) == 2
        list(p.experts(4, [5, 9]))
        s = p.prefetch_stats()["lookahead"]
        assert (s.used, s.unused, s.predicted, s.routed) == (1, 1, 1, 2)
        assert p.cache.pinned() == p.cache.held() == frozenset()
    finally:
        files.close()


def test_a_hint_before_a_call_queues_after_its_misses(packed, record):
    """The eager model hints layer L+1 before layer L's call: the guesses are read after L's own
    misses (the I/O queue is FIFO), and L's resident experts stay."""
    files = open_model(packed, cache_bytes=8 * record)
    try:
        p = files.experts
        list(p.experts(3, [0, 1]))
        p.pool = log = _SubmitLog(p.pool)
        p.prefetch_predicted(4, [5, 6, 7, 8], keep=[(3, e) for e in range(4)])
        assert log.keys == []  # waits for layer 3's call
        assert sorted(e for e, _ in p.experts(3, [0, 1, 2, 3])) == [0, 1, 2, 3]
        assert log.keys == [(3, 2), (3, 3), (4, 5), (4, 6), (4, 7), (4, 8)]  # own misses first, then the guesses
        assert all(p.cache.peek((3, e)) is not None for e in range(4))
        assert p.stats().hits >= 2
        list(p.experts(4, [5, 6, 7]))
        s = p.prefetch_stats()["lookahead"]
        assert (s.issued, s.used, s.unused, s.predicted, s.routed) == (4, 3, 1, 3, 3)
        assert p.cache.pinned() == p.cache.held() == frozenset() and not p._loads
    finally:
        files.close()


def test_layered_decode_steps_prefetch_the_next_layer(packed, record):
    """The decode runner's layered mode (eager on the CPU): the prediction is computed inside the
    step and handed over once a layer's experts are held; steps are bitwise those without it."""
    out = {}
    for lookahead in (False, True):
        files = open_model(packed, cache_bytes=6 * record)
        try:
            model = Transformer(files.get, files.args, Numerics.named("exact"), lookahead=lookahead)
            state = model.new_state()
            model.forward(PROMPT, state, files.experts)
            runner = DecodeRunner(model, files.experts, whole=False, graphs=False)
            before = files.experts.prefetch_stats()["lookahead"]
            tok, logits = 5, []
            for _ in range(6):
                logits.append(runner.step(state, tok))
                tok = int(logits[-1].argmax())
            out[lookahead] = _layered_run(files, logits, before)
        finally:
            files.close()
    _assert_same_steps_and_hints(out, steps=6)


def test_engine_config_knob(tmp_path):
    """EngineConfig.lookahead_prefetch (default on) reaches the model through Engine.load; on or
    off, a turn streams the same tokens."""
    from converter import synth
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    assert EngineConfig().lookahead_prefetch is True
    ckpt = synth.write_checkpoint(tmp_path / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    pack = convert(ckpt, tmp_path / "pack")
    rec = layout.read_manifest(pack).record.record_bytes
    texts, routed = {}, {}
    for on in (True, False):
        config = EngineConfig(numerics="exact", cache_bytes=8 * rec, lookahead_prefetch=on)
        with Engine.load(pack, config, warmup=False) as eng:
            assert eng.model.lookahead is on
            events = list(eng.generate(eng.new_session(), "Hi there", SamplingParams(temperature=0.0, max_tokens=4)))
            texts[on] = "".join(getattr(e, "text", "") for e in events)
            routed[on] = eng.experts.prefetch_stats()["lookahead"].routed
    assert texts[True] == texts[False] and routed[True] > 0 and routed[False] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch", "tilelang"])
def test_layered_cuda_graphs_with_lookahead_equal_those_without(packed, record, backend):
    """On CUDA the prediction is captured in the layered graphs: replayed steps are bitwise the
    steps without lookahead, and the provider counts its hints."""
    from kernels.backend import make_backend

    dev = torch.device("cuda")
    out = {}
    for lookahead in (False, True):
        files = open_model(packed, cache_bytes=6 * record, device="cuda")
        try:
            model = Transformer(lambda n: files.get(n).to(dev), files.args,
                                Numerics.named("native", make_backend(backend, dev)), lookahead=lookahead)
            runner = DecodeRunner(model, files.experts, whole=False, graphs=True)
            with torch.inference_mode():
                state = model.new_state()
                tok = model.forward(PROMPT.to(dev), state, files.experts, last_only=True).argmax(-1)
                before = files.experts.prefetch_stats()["lookahead"]
                logits = []
                for _ in range(12):
                    logits.append(runner.step(state, tok))
                    tok = logits[-1].argmax(-1)
            assert runner.captures >= 1 and runner.capture_error is None
            out[lookahead] = _layered_run(files, logits, before)
        finally:
            files.close()
    _assert_same_steps_and_hints(out, steps=12)


class _OrderSpy:
    """A provider passing calls on to `inner` and logging the runner's, with the segments the runner ran."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log
        self.arena, self.cache = inner.arena, inner.cache

    def resident(self, layer, ids):
        answer = self.inner.resident(layer, ids)
        self.log.append(("resident", layer, answer))
        return answer

    def acquire(self, layer, ids):
        self.log.append(("acquire", layer))
        self.inner.acquire(layer, ids)

    def release(self, layer):
        self.log.append(("release", layer))
        self.inner.release(layer)

    def fence(self):
        self.log.append(("fence",))
        return "the fence"

    def prefetch_predicted(self, layer, ids, keep=(), fence=None):
        self.log.append(("hint", layer, fence))
        self.inner.prefetch_predicted(layer, ids, keep)

    def prefetch(self, layer, ids, fence=None):
        self.log.append(("hash", layer, fence))
        self.inner.prefetch(layer, ids, fence)

    def record(self, layer, ids):
        self.inner.record(layer, ids)

    def all_resident(self):
        return self.inner.all_resident()


class _SegmentLog(DecodeRunner):
    def __init__(self, *args, log: list, **kw):
        super().__init__(*args, **kw)
        self.log = log

    def _segment(self, i, state, emitting, out):
        self.log.append(("segment", i))
        super()._segment(i, state, emitting, out)


def test_the_hint_follows_the_launch_of_the_segment_with_a_fence_taken_before_it(packed, record):
    """Layered steps: layer i-1's experts are acquired (after segment i's launch when they were
    all resident already), a fence is taken before segment i is launched, then layer i's
    predicted experts are hinted with that fence, and only then layer i-1's experts are released
    (the fenced reads never go to a slot that segment i reads). A 6-record cache misses; one of
    every record holds each layer's experts."""
    paths = set()
    for records in (6, 10_000):
        files = open_model(packed, cache_bytes=records * record)
        try:
            model = Transformer(files.get, files.args, Numerics.named("exact"), lookahead=True)
            state = model.new_state()
            model.forward(PROMPT, state, files.experts)
            log: list = []
            runner = _SegmentLog(model, _OrderSpy(files.experts, log), whole=False, graphs=False, log=log)
            runner.step(state, 5)
            hinted = [entry[1] for entry in log if entry[0] == "hint"]
            assert hinted and all(entry[2] == "the fence" for entry in log if entry[0] == "hint")
            for layer in hinted:
                at = log.index(("segment", layer))
                if log[at - 2] == ("resident", layer - 1, True):  # acquired after the launch
                    assert log[at - 2:at + 4] == [("resident", layer - 1, True), ("fence",), ("segment", layer),
                                                  ("acquire", layer - 1), ("hint", layer, "the fence"),
                                                  ("release", layer - 1)]
                else:
                    assert log[at - 3:at + 3] == [("resident", layer - 1, False), ("acquire", layer - 1),
                                                  ("fence",), ("segment", layer), ("hint", layer, "the fence"),
                                                  ("release", layer - 1)]
                paths.add(log[at - 2][0])
            assert files.experts.cache.pinned() == files.experts.cache.held() == frozenset()
        finally:
            files.close()
    assert paths == {"resident", "acquire"}  # both orders happened


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_fenced_hint_reads_while_later_device_work_runs(packed, record):
    """A hint with a fence taken before a long kernel has its experts on the device while that
    kernel still runs; without the fence its reads wait for the kernel."""
    for fenced in (True, False):
        files = open_model(packed, cache_bytes=6 * record, device="cuda")
        try:
            p, stream = files.experts, torch.cuda.current_stream()
            fence = p.fence() if fenced else None
            torch.cuda._sleep(4_000_000_000)  # seconds of device work queued after the fence
            p.prefetch_predicted(3, [0, 1], fence=fence)
            p.acquire(3, [0, 1])  # joins the hint's reads
            busy = not stream.query()
            p.release(3)
            torch.cuda.synchronize()
            assert busy is fenced
        finally:
            files.close()


def test_hash_layers_are_hinted_once_segment_0_is_launched_with_a_fence_taken_before_it(packed, record):
    """A layered step hints the hash layers' experts (known from the token id) right after
    segment 0 (embedding and block 0's attention: no routed expert) is launched, with a fence
    taken before that launch, so that their reads overlap segment 0 and need not wait for it;
    a sampled token (a device tensor) is read on the host only then, so segment 0 is queued
    while the host waits for it; all before layer 0's experts are acquired."""
    files = open_model(packed, cache_bytes=6 * record)
    try:
        model = Transformer(files.get, files.args, Numerics.named("exact"))
        hashed = [b.layer for b in model.blocks if b.ffn.gate.hash]
        assert hashed  # the synthetic model routes its first layers by token id
        state = model.new_state()
        model.forward(PROMPT, state, files.experts)
        log: list = []
        runner = _SegmentLog(model, _OrderSpy(files.experts, log), whole=False, graphs=False, log=log)

        class Sampled(torch.Tensor):  # a sampled token on the device: the host's read is logged
            def __int__(self):
                log.append(("read the token",))
                return super().__int__()

        runner.step(state, torch.tensor([5]).as_subclass(Sampled))
        assert log[:3 + len(hashed)] == [("fence",), ("segment", 0), ("read the token",)] + [
            ("hash", layer, "the fence") for layer in hashed]
        assert log[3 + len(hashed)][:2] == ("resident", 0)
        assert [e for e in log if e[0] == "hash"] == [("hash", layer, "the fence") for layer in hashed]
    finally:
        files.close()
