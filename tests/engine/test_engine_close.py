"""Engine.close releases the expert provider too: no part of the closed facade (its turn runner,
its gauges, its step meter) keeps the provider, and with it the experts, reachable."""

from __future__ import annotations

import gc
import weakref

import pytest

from converter import synth
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import TurnFinished
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    return synth.write_checkpoint(out, synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))


def test_a_closed_engine_keeps_no_expert_provider(ckpt):
    eng = Engine.load(ckpt, EngineConfig(numerics="exact", prefill_chunk=32), warmup=False)
    sess = eng.new_session()
    events = list(eng.generate(sess, "Hi", SamplingParams(temperature=0.0, max_tokens=3)))
    assert isinstance(events[-1], TurnFinished) and events[-1].stats.cache.hits > 0
    provider = weakref.ref(eng.experts)
    eng.close()
    gc.collect()
    assert provider() is None  # while `eng` itself is still referenced
    with pytest.raises(RuntimeError, match="closed"):
        eng.memory()


def test_turns_and_sessions_of_a_closed_engine_end_with_one_clear_line(ckpt):
    from engine.errors import EngineError
    from engine.events import EngineFailure

    eng = Engine.load(ckpt, EngineConfig(numerics="exact", prefill_chunk=32), warmup=False)
    sess = eng.new_session()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    made = eng.generate(sess, "Hi", params)  # made before the close, not started
    running = eng.generate(sess, "Hi", params)
    next(running)  # started: the close comes mid-turn
    eng.close()
    events = list(made)
    assert len(events) == 1 and isinstance(events[0], EngineFailure)
    assert events[0].message == "the engine is closed: load the model again to chat"
    last = list(running)[-1]
    assert isinstance(last, EngineFailure) and last.message == "the engine was closed during the turn"
    with pytest.raises(EngineError, match="the engine is closed"):
        eng.new_session()
