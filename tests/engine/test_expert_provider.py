"""The one expert-provider interface through `Engine`: the model gets the provider itself, so a
fully resident arena, or a cache that holds a call's experts, takes the one-launch MoE path (counted on the CPU reference backend, which
runs the same dispatch as CUDA), and every use is counted once, by the provider."""

from __future__ import annotations

import pytest

from converter import synth
from converter.convert import convert
from engine.chat import ChatTokenizer
from engine.config import EngineConfig
from engine.engine import Engine
from engine.experts.cache import ExpertCacheError
from engine.events import TextDelta, TurnFinished
from engine.model import Transformer
from engine.numerics import Numerics
from engine.sampling import SamplingParams
from engine.weights import open_model
from kernels.backend import OPS, Backend


class CountingBackend(Backend):
    """The reference backend, counting the routed-expert entry points."""

    def __init__(self) -> None:
        self.calls = {"fp4_moe": 0, "fp4_gemm": 0}
        ops = {op.name: op.reference for op in OPS}
        ops.update({name: self._counted(name, ops[name]) for name in self.calls})
        super().__init__("counting", ops, tuple(ops))

    def _counted(self, name, fn):
        def op(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return op


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(official checkpoint, its conversion) of the tiny model with the real tokenizer."""
    root = tmp_path_factory.mktemp("provider")
    ckpt = synth.write_checkpoint(root / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    return ckpt, convert(ckpt, root / "pack", resume=False)


def _engine(path, tokenizer_dir, backend, chunk: int) -> Engine:
    files = open_model(path)
    try:
        model = Transformer(files.get, files.args, Numerics.named("native", backend))
        return Engine(files, model, ChatTokenizer.from_dir(tokenizer_dir),
                      EngineConfig(numerics="native", prefill_chunk=chunk))
    except BaseException:
        files.close()
        raise


def test_engine_native_prefill_on_a_resident_arena_is_one_launch_per_layer(tiny):
    ckpt, pack = tiny
    backend = CountingBackend()
    eng = _engine(pack, ckpt, backend, chunk=8)
    try:
        assert eng.experts.load_all() and eng.experts.all_resident()
        assert eng.experts.arena is not None and eng.model.blocks[0].ffn._batched(eng.experts)
        before = eng.experts.stats()
        sess = eng.new_session()
        fin = list(eng.generate(sess, "Hello there, how are you today?", SamplingParams(temperature=0, max_tokens=3)))[-1]
        assert isinstance(fin, TurnFinished)
        s, n = fin.stats, eng.args.n_layers
        chunks = -(-s.prefill_tokens // 8)
        assert chunks >= 2  # the prompt spans several prefill chunks
        steps = s.completion_tokens - 1  # every sampled token but the last is run
        assert backend.calls["fp4_gemm"] == 0  # never the per-expert loop
        assert backend.calls["fp4_moe"] == n * (chunks + steps)  # one launch per layer and call
        # usage: counted once per (call, layer, distinct expert), by the provider, and the cache
        # saw the same uses as hits (all resident: no miss)
        after = eng.experts.stats()
        uses = sum(eng.experts.usage.layer_uses)
        assert uses > 0 and after.misses == before.misses  # load_all read them; the turn missed none
        main_hits = sum(after.layer_hits[:n]) - sum(before.layer_hits[:n])
        assert main_hits == uses
        assert eng.stats().cache.hits == after.hits
    finally:
        eng.close()


def _greedy_text(eng: Engine, prompt: str, tokens: int) -> tuple[str, TurnFinished]:
    events = list(eng.generate(eng.new_session(), prompt, SamplingParams(temperature=0, max_tokens=tokens)))
    assert isinstance(events[-1], TurnFinished)
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events[-1]


def test_bounded_cache_holding_a_layer_streams_prefill_through_one_call_per_layer(tiny):
    """Below the pool, but with room for one layer's experts: each MoE call holds the experts it
    needs (`acquire`, each read once per call, prefill's whole chunk included) and runs all its
    cells in one fp4_moe call, like the resident arena, with the same text as a resident engine."""
    ckpt, pack = tiny
    resident = _engine(pack, ckpt, CountingBackend(), chunk=8)
    try:
        assert resident.experts.load_all()
        want, _ = _greedy_text(resident, "Hello there, how are you today?", 3)
    finally:
        resident.close()
    backend = CountingBackend()
    full = open_model(pack)
    record, per_layer = full.experts.store.record_bytes, full.args.n_routed_experts
    full.close()
    files = open_model(pack, cache_bytes=(per_layer + 2) * record)
    model = Transformer(files.get, files.args, Numerics.named("native", backend))
    eng = Engine(files, model, ChatTokenizer.from_dir(ckpt), EngineConfig(numerics="native", prefill_chunk=8))
    try:
        assert not eng.experts.all_resident()
        got, fin = _greedy_text(eng, "Hello there, how are you today?", 3)
        assert got == want
        s, n = fin.stats, eng.args.n_layers
        chunks, steps = -(-s.prefill_tokens // 8), s.completion_tokens - 1
        assert backend.calls["fp4_gemm"] == 0  # never the per-expert loop
        assert backend.calls["fp4_moe"] == n * (chunks + steps)
        st = eng.experts.stats()
        assert st.misses > 0 and sum(eng.experts.usage.layer_uses) == sum(st.layer_hits[:n]) + sum(st.layer_misses[:n])
        assert st.misses <= sum(eng.experts.usage.layer_uses)  # each use read at most once
    finally:
        eng.close()


def test_bounded_cache_smaller_than_a_call_takes_the_per_expert_loop_and_counts_the_same_uses(tiny):
    """A cache smaller than a call's experts streams them one at a time (the per-expert loop);
    calls that fit take the one-call path; the uses the provider counts equal the cache's
    lookups of the main layers."""
    ckpt, pack = tiny
    backend = CountingBackend()
    full = open_model(pack)
    record = full.experts.store.record_bytes
    full.close()
    files = open_model(pack, cache_bytes=8 * record)
    model = Transformer(files.get, files.args, Numerics.named("native", backend))
    eng = Engine(files, model, ChatTokenizer.from_dir(ckpt), EngineConfig(numerics="native", prefill_chunk=16))
    try:
        sess = eng.new_session()
        fin = list(eng.generate(sess, "Hi", SamplingParams(temperature=0, max_tokens=2)))[-1]
        assert isinstance(fin, TurnFinished)
        assert backend.calls["fp4_gemm"] > 0  # a prefill chunk's experts outnumber the 8 slots
        st, n = eng.experts.stats(), eng.args.n_layers
        assert sum(eng.experts.usage.layer_uses) == sum(st.layer_hits[:n]) + sum(st.layer_misses[:n]) > 0
        assert st.misses > 0
    finally:
        eng.close()


def test_resident_official_experts_have_no_arena_and_nothing_to_pin(tiny):
    ckpt, _ = tiny
    files = open_model(ckpt)
    try:
        p = files.experts
        assert p.arena is None and p.cache is None and p.all_resident() and p.load_all()
        with pytest.raises(ExpertCacheError, match="nothing to pin: this model has no expert cache"):
            p.pin([(0, 1)])  # said, not silently ignored (the user's /pin)
        assert p.pinned() == frozenset() and p.flush() == []
        assert [e for e, _ in p.experts(1, [3, 3, 2])] == [3, 2]
        assert p.usage.uses[(1, 3)] == 1 and p.usage.layer_uses[1] == 2
        p.record(2, [4, 4, 5])
        assert p.usage.layer_uses[2] == 2 and p.hottest(1) in ([(1, 3)], [(1, 2)], [(2, 4)], [(2, 5)])
        assert len(p.contents()) == files.args.n_layers * files.args.n_routed_experts
    finally:
        files.close()
