"""`/flush` moves the "evicted" figure users see (issue 28, item 10).

The expert cache keeps capacity evictions (`evictions`, the policy's pressure) and flushed keys
(`flushed`) apart; the snapshot the app shows (pane, /stats, --plain) reports their sum as
"evicted", since `/flush` itself answers "flushed: evicted N expert(s)".
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from converter import synth
from converter.convert import convert
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import TurnFinished
from engine.experts.cache import ExpertCache
from engine.sampling import SamplingParams
from engine.stats import cache_snapshot

E = 1000  # entry bytes in the cache-level tests


def filled(slots: int, keys) -> ExpertCache:
    cache = ExpertCache(slots * E, E, num_layers=4, num_experts=16, policy="lru")
    for key in keys:
        if cache.lookup(key) is None:
            cache.admit(key)
    return cache


def test_flush_counts_flushed_keys_apart_from_capacity_evictions():
    cache = filled(3, [(0, 1), (0, 2), (0, 3), (0, 4)])  # (0, 4) evicts (0, 1) for capacity
    cache.pin((0, 3))
    assert (cache.stats().evictions, cache.stats().flushed) == (1, 0)
    assert sorted(cache.flush()) == [(0, 2), (0, 4)]
    s = cache.stats()
    assert (s.evictions, s.flushed, s.entries) == (1, 2, 1)
    assert cache.flush() == [] and cache.stats().flushed == 2  # the pinned key stays, nothing more
    cache.admit((1, 1))
    cache.discard((1, 1))  # a failed load gives its slot back: not an eviction
    assert (cache.stats().evictions, cache.stats().flushed) == (1, 2)
    cache.reset_stats()
    assert (cache.stats().evictions, cache.stats().flushed) == (0, 0)


def test_snapshot_evicted_is_capacity_evictions_plus_flushed():
    cache = filled(2, [(0, 1), (0, 2), (1, 3)])  # one capacity eviction
    args = SimpleNamespace(n_layers=4)
    assert cache_snapshot(cache, args, []).evictions == 1
    cache.flush()
    snap = cache_snapshot(cache, args, [])
    assert (snap.evictions, snap.entries) == (3, 0)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("flush")
    ckpt = synth.write_checkpoint(root / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    return convert(ckpt, root / "converted", resume=False)


def test_engine_flush_moves_the_evicted_counter(converted):
    eng = Engine.load(converted, EngineConfig(numerics="exact"), warmup=False)
    try:
        assert eng.info["experts"] == "streaming"
        session = eng.new_session()
        *_, fin = eng.generate(session, "Explain why the sky is blue.", SamplingParams(temperature=0.0, max_tokens=3))
        assert isinstance(fin, TurnFinished)
        before = eng.stats().cache
        assert before.entries > 0
        flushed = eng.flush_cache()
        after = eng.stats().cache
        assert flushed == before.entries
        assert after.evictions == before.evictions + flushed and after.entries == 0
        assert eng.flush_cache() == 0 and eng.stats().cache.evictions == after.evictions
    finally:
        eng.close()
