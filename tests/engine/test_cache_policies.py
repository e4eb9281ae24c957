"""Eviction policies (engine/experts/policy.py): each one's defining choice, and every policy
keeping ExpertCache's contract (pinning, flush, discard, capacity) under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import ConfigError, EngineConfig
from engine.experts.cache import CacheFullError, ExpertCache, ExpertCacheError
from engine.experts.policy import (
    DEFAULT_POLICY, POLICIES, ARCPolicy, LFUAgingPolicy, LFUPolicy, NextUsePolicy, PolicyError,
    SLRUPolicy,
)

A, B, C, D = (0, 0), (0, 1), (0, 2), (0, 3)


def test_config_accepts_every_policy_and_defaults_to_next_use():
    assert EngineConfig().cache_policy == DEFAULT_POLICY == "next-use"
    for name in POLICIES:
        assert EngineConfig(cache_policy=name).cache_policy == name
    names = "arc, lfu, lfu-aging, lru, next-use, slru"
    with pytest.raises(ConfigError, match=f"cache_policy must be one of {names}, got 'fifo'"):
        EngineConfig(cache_policy="fifo")


def test_slru_ghost_promotes_a_key_reused_after_eviction():
    p = SLRUPolicy(4)  # protected 3, ghost 4
    for k in (A, B, C, D):
        p.add(k)
    assert p.victim() == A
    p.discard(A)  # evicted: remembered
    p.add((1, 0))
    p.discard(p.victim())  # B evicted
    p.add(A)  # A is back: a second use, straight to protected
    assert p.victim() == C  # probation C, D, (1, 0) go first; A is protected
    p.discard(C)
    p.discard(D)
    p.discard((1, 0))
    assert p.victim() == A
    q = SLRUPolicy(4)  # flushed or dropped keys are not remembered
    q.add(A)
    q.discard(A)
    q.add(A)
    q.add(B)
    assert q.victim() == A
    with pytest.raises(PolicyError, match="ghost_fraction"):
        SLRUPolicy(4, ghost_fraction=-1)


def test_arc_adapts_toward_recency_on_a_b1_ghost_hit():
    p = ARCPolicy(2)
    p.add(A)
    p.add(B)
    assert p.victim() == A
    p.discard(A)  # -> B1
    p.add(C)
    assert p.victim() == B  # T1 = [B, C], target p = 0
    p.discard(B)  # -> B1
    p.add(A)  # B1 hit: p = 1, A enters T2
    assert p.victim() == A  # T1 = [C] is within its target now: evict from T2
    p.touch(C)  # C moves to T2 as well
    assert p.victim() == A and len(p) == 2 and C in p and B not in p


def test_lfu_aging_forgets_old_uses():
    lfu, aged = LFUPolicy(8), LFUAgingPolicy(8, half_life=2)
    for policy in (lfu, aged):
        policy.add(A)
        policy.touch(A)
        policy.touch(A)  # A: 3 old uses
        for _ in range(10):  # 10 uses of other keys: A's weight halves 5 times
            policy.add(C)
            policy.discard(C)
        policy.add(B)  # B: one recent use
    assert lfu.victim() == B
    assert aged.victim() == A
    with pytest.raises(PolicyError, match="count must be >= 1"):
        aged.add(D, 0)


def test_next_use_evicts_from_the_layer_whose_turn_is_farthest():
    p = NextUsePolicy(16)
    for layer in (0, 1, 2):  # token 1: one expert per layer, all with one use
        p.add((layer, 5))
    p.add((3, 5))  # now at layer 3: next come 0 (1 visit away), 1, 2
    p.discard((3, 5))
    assert p.victim() == (2, 5)  # layer 2 is needed last
    p.add((0, 6))  # layer 0 again: a new cycle; next come 1, 2, 3
    p.discard((0, 6))
    assert p.victim() == (0, 5)  # layer 0 now comes round last
    # frequency: within a layer, the expert used more often (with decay) stays
    q = NextUsePolicy(16)
    for token in range(3):
        q.touch((0, 1)) if token else q.add((0, 1))
        if token == 2:
            q.add((0, 2))
        q.add((1, 9)) if token == 0 else q.touch((1, 9))
    assert q.victim() == (0, 2)
    with pytest.raises(PolicyError, match="gamma"):
        NextUsePolicy(4, gamma=1.0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_engine_holds_do_not_change_the_eviction_order(policy):
    """The engine holds every expert of a call (pin: the policy discards it) and gives it back
    after use (unpin: added with its uses since admission). That is no new use and no new
    visit of the layer: the victims are those of the same lookups without holds."""
    import random

    def victims(hold: bool) -> list:
        rng = random.Random(0)
        cache = ExpertCache(64, 1, num_layers=3, num_experts=6, policy=policy)
        out = []
        for _ in range(12):
            for layer in range(3):
                call = [(layer, e) for e in rng.sample(range(6), 2)]
                for key in call:
                    hit = cache.lookup(key) is not None
                    if hold:
                        cache.pin(key)
                    if not hit:
                        cache.admit(key)
                if hold:
                    for key in call:
                        cache.unpin(key)
                out.append(cache._policy.victim())
        return out

    assert victims(hold=True) == victims(hold=False)


def test_next_use_never_evicts_the_layer_being_served_before_the_others():
    p = NextUsePolicy(16)
    for layer in (0, 1, 2):
        p.add((layer, 5))
    p.add((2, 6))  # still layer 2's call: (2, 5) is not needed before layer 2 comes round again
    p.discard((2, 6))  # held by the engine
    assert p.victim() == (2, 5)
    with pytest.raises(PolicyError, match="prior"):
        NextUsePolicy(4, prior=0.0)


def test_next_use_evicts_dead_keys_least_recent_first():
    def victim(dead: float):
        p = NextUsePolicy(16, gamma=0.5, dead=dead)
        p.add((0, 0))
        p.add((1, 0))  # both used once, (0, 0) first
        for _ in range(4):  # four tokens later both counts are 0.5**4 = 0.0625
            for layer in (0, 1):
                (p.touch if (layer, 1) in p else p.add)((layer, 1))
        return p.victim()

    assert victim(dead=0.0) == (1, 0)  # equal counts: the layer needed last (layer 1, served now)
    assert victim(dead=0.2) == (0, 0)  # both dead: the least recently used
    with pytest.raises(PolicyError, match="dead"):
        NextUsePolicy(4, dead=-1.0)


KEYS = st.tuples(st.integers(0, 2), st.integers(0, 3))
OPS = st.lists(st.tuples(st.sampled_from(["use"] * 5 + ["prefetch", "pin", "unpin", "flush", "discard"]),
                         KEYS), max_size=80)


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(sorted(POLICIES)), slots=st.integers(1, 5), ops=OPS)
def test_every_policy_keeps_the_cache_contract(policy, slots, ops):
    cache = ExpertCache(slots, 1, num_layers=3, num_experts=4, policy=policy)
    for op, key in ops:
        before, pinned = cache.resident(), cache.pinned()
        if op in ("use", "prefetch"):
            if (op == "use" and cache.lookup(key) is not None) or (op == "prefetch" and key in cache):
                continue
            try:
                slot, evicted = cache.admit(key)
            except CacheFullError:
                assert len(before) == slots and set(before) <= pinned
                continue
            assert cache.resident()[key] == slot
            if len(before) < slots:
                assert evicted is None
            else:
                assert evicted in before and evicted not in pinned and before[evicted] == slot
        elif op == "pin":
            if len(pinned) >= slots and key not in pinned:
                with pytest.raises(ExpertCacheError):
                    cache.pin(key)
            else:
                assert cache.pin(key) == (key in before)
        elif op == "unpin":
            assert cache.unpin(key) == (key in pinned)
        elif op == "flush":
            assert set(cache.flush()) == set(before) - pinned
        else:
            assert cache.discard(key) == before.get(key)
        res = cache.resident()
        assert len(res) <= slots and len(set(res.values())) == len(res)
        unpinned = set(res) - cache.pinned()
        assert len(cache._policy) == len(unpinned) and all(k in cache._policy for k in unpinned)
        victim = cache._policy.victim()
        assert (victim is None) == (not unpinned) and (victim is None or victim in unpinned)
