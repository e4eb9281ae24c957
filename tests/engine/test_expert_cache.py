"""ExpertCache policy: eviction orders, pinning, flush, stats, and invariants under random ops."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.experts.cache import (
    CacheFullError,
    CacheStats,
    ExpertCache,
    ExpertCacheError,
)
from engine.experts.policy import LFUPolicy

E = 1000  # entry bytes in these tests


def make(slots: int, policy: str = "lfu", *, extra_bytes: int = 0, **kw) -> ExpertCache:
    return ExpertCache(slots * E + extra_bytes, E, num_layers=4, num_experts=16, policy=policy, **kw)


def use(cache: ExpertCache, key) -> tuple[int | None, tuple | None]:
    """What the store does: lookup, admit on a miss. Returns (hit slot or None, evicted key)."""
    slot = cache.lookup(key)
    if slot is not None:
        return slot, None
    return None, cache.admit(key)[1]


# ---------------------------------------------------------------- construction and errors


def test_capacity_is_budget_floor_divided_by_entry_bytes():
    cache = make(3, extra_bytes=E - 1)
    assert cache.capacity_slots == 3
    assert [cache.admit((0, e))[0] for e in range(3)] == [0, 1, 2]
    s = cache.stats()
    assert (s.capacity_bytes, s.used_bytes, s.entries, s.capacity_entries) == (4 * E - 1, 3 * E, 3, 3)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ExpertCacheError, match="smaller than one expert record"):
        ExpertCache(E - 1, E, num_layers=1, num_experts=1)
    with pytest.raises(ExpertCacheError, match="unknown cache policy 'fifo'"):
        make(2, policy="fifo")
    cache = make(2)
    with pytest.raises(ExpertCacheError, match=r"layer must be in \[0, 4\)"):
        cache.lookup((4, 0))
    with pytest.raises(ExpertCacheError, match="out of range"):
        cache.pin((0, 16))
    cache.admit((0, 1))
    with pytest.raises(ExpertCacheError, match="already resident in slot 0"):
        cache.admit((0, 1))


# ---------------------------------------------------------------- eviction orders


def test_lru_evicts_least_recently_used():
    cache = make(3, "lru")
    for e in (1, 2, 3):
        use(cache, (0, e))
    use(cache, (0, 1))  # recency now 2 < 3 < 1
    assert use(cache, (0, 4)) == (None, (0, 2))
    assert use(cache, (0, 5)) == (None, (0, 3))
    assert use(cache, (0, 6)) == (None, (0, 1))


def test_touch_is_a_use_for_the_policy_but_not_a_lookup():
    cache = make(3, "lru")
    for e in (1, 2, 3):
        use(cache, (0, e))
    before = cache.stats()
    assert cache.touch((0, 1)) and not cache.touch((0, 9))  # (0, 9) is not resident
    after = cache.stats()
    assert (after.hits, after.misses) == (before.hits, before.misses)
    assert use(cache, (0, 4)) == (None, (0, 2))  # (0, 1) was touched: (0, 2) is the oldest now


def test_lfu_evicts_lowest_frequency_then_least_recent():
    cache = make(3, "lfu")
    for e in (1, 2, 3):
        use(cache, (0, e))
    use(cache, (0, 1))
    use(cache, (0, 1))  # uses: 1->3, 2->1, 3->1
    use(cache, (0, 3))  # 3->2
    assert use(cache, (0, 4)) == (None, (0, 2))  # lowest frequency
    use(cache, (0, 4))  # 4->2, now tied with 3 and more recent
    assert use(cache, (0, 5)) == (None, (0, 3))  # freq 2 tie -> least recent
    assert use(cache, (0, 6)) == (None, (0, 5))  # newcomer at freq 1
    assert sorted(cache.resident()) == [(0, 1), (0, 4), (0, 6)]


def test_slru_protects_keys_used_twice():
    cache = make(4, "slru")  # protected segment: int(4 * 0.8) = 3 slots
    for e in (1, 2, 3, 4):
        use(cache, (0, e))
    use(cache, (0, 1))  # 1 -> protected; probation LRU..MRU: 2 3 4
    assert use(cache, (0, 5)) == (None, (0, 2))
    for e in (3, 4, 5):
        use(cache, (0, e))  # protected 1 3 4 5 overflows: 1 demoted to probation
    assert use(cache, (0, 6)) == (None, (0, 1))
    assert use(cache, (0, 7)) == (None, (0, 6))


def test_lfu_policy_add_with_count_orders_by_count():
    pol = LFUPolicy(8)
    pol.add((0, 1), 3)
    pol.add((0, 2), 1)
    pol.add((0, 3), 2)
    order = []
    while (v := pol.victim()) is not None:
        order.append(v)
        pol.discard(v)
    assert order == [(0, 2), (0, 3), (0, 1)] and len(pol) == 0


def test_freed_slots_are_reused():
    cache = make(3, "lru")
    for e in (1, 2, 3):
        cache.admit((0, e))
    assert cache.discard((0, 2)) == 1
    assert cache.admit((1, 9)) == (1, None)
    assert cache.admit((1, 10)) == (0, (0, 1))  # evicted (0, 1) from slot 0


# ---------------------------------------------------------------- pinning and flush


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru"])
def test_pinned_never_evicted_and_full_of_pins_raises(policy):
    cache = make(2, policy)
    cache.admit((0, 1))
    assert cache.pin((0, 1)) is True
    for e in range(2, 8):
        use(cache, (0, e))
        assert (0, 1) in cache
    assert cache.pin((3, 3)) is False  # not resident: pending
    with pytest.raises(ExpertCacheError, match="already pinned"):
        cache.pin((3, 4))
    s = cache.stats()
    assert (s.pinned, s.pinned_pending) == (1, 1)
    _, evicted = use(cache, (3, 3))  # pending pin loads on next use, evicting the unpinned one
    assert evicted == (0, 7) and cache.pinned() == {(0, 1), (3, 3)}
    assert cache.stats().pinned == 2
    with pytest.raises(CacheFullError, match="all 2 slots hold pinned or held experts"):
        cache.admit((0, 9))
    assert cache.unpin((0, 1)) is True and cache.unpin((0, 1)) is False
    assert cache.admit((0, 9)) == (0, (0, 1))
    assert cache.unpin_all() == [(3, 3)] and cache.pinned() == frozenset()
    assert cache.admit((0, 10))[1] == (0, 9)  # unpinned (3, 3) re-entered as most recent


def test_a_hold_tells_the_lru_order_nothing():
    cache = make(2, "lru")
    use(cache, (0, 1)), use(cache, (0, 2))  # (0, 1) is the least recent
    cache.hold((0, 1))
    assert cache.held() == {(0, 1)} and cache.pinned() == frozenset() and cache.stats().pinned == 0
    assert cache.release((0, 1)) and not cache.release((0, 1))
    assert cache.admit((0, 3))[1] == (0, 1)  # still the least recent: the hold moved nothing


@pytest.mark.parametrize("policy", ["lru", "lfu", "next-use"])
def test_a_held_victim_is_set_aside_and_back_in_the_policy_once_released(policy):
    cache = make(2, policy)
    use(cache, (0, 1)), use(cache, (0, 2)), use(cache, (0, 2))  # (0, 1): least recent, least used
    cache.hold((0, 1))
    assert cache.admit((0, 3))[1] == (0, 2)  # the policy named (0, 1): held, so the next one goes
    assert cache.flush() == [(0, 3)] and (0, 1) in cache  # flush keeps held keys too
    assert cache.admit((0, 4))[1] is None
    with pytest.raises(CacheFullError, match="pinned or held"):
        cache.hold((0, 4)), cache.admit((0, 5))  # every slot held
    cache.release((0, 4))
    assert cache.admit((0, 5))[1] == (0, 4)
    cache.release((0, 1))  # back in the policy: evictable again
    cache.hold((0, 5))
    assert cache.admit((0, 6))[1] == (0, 1)


def test_holds_and_pins_share_the_slots_and_an_unpinned_held_key_waits_for_its_release():
    cache = make(2, "lru")
    use(cache, (0, 1)), use(cache, (0, 2))
    cache.pin((0, 1))
    cache.hold((0, 2))
    with pytest.raises(ExpertCacheError, match="all 2 slots are pinned or held"):
        cache.hold((0, 3))
    cache.hold((0, 1))  # pinned and held: released later, still pinned
    cache.unpin((0, 1))  # held: not evictable before its release
    with pytest.raises(CacheFullError):
        cache.admit((0, 3))
    cache.release((0, 1)), cache.release((0, 2))  # the failed admission set (0, 2) aside too
    assert cache.admit((0, 3))[1] == (0, 1) and cache.admit((0, 4))[1] == (0, 2)


def test_unpin_under_lfu_keeps_use_count():
    cache = make(3, "lfu")
    for e in (1, 2, 3):
        use(cache, (0, e))
    for _ in range(3):
        use(cache, (0, 1))  # (0,1) used 4 times
    cache.pin((0, 1))
    cache.unpin((0, 1))
    assert use(cache, (0, 4)) == (None, (0, 2))
    assert use(cache, (0, 5)) == (None, (0, 3))
    assert use(cache, (0, 6)) == (None, (0, 4))


def test_flush_evicts_exactly_the_unpinned_and_keeps_pins():
    cache = make(4, "lru")
    for e in (1, 2, 3):
        cache.admit((0, e))
    cache.pin((0, 2))
    cache.pin((2, 2))  # pending
    assert sorted(cache.flush()) == [(0, 1), (0, 3)]
    assert cache.resident() == {(0, 2): 1}
    assert cache.pinned() == {(0, 2), (2, 2)}
    assert cache.stats().evictions == 0  # flush is not a capacity eviction
    assert cache.admit((1, 1))[0] in (0, 2)


def test_discard_keeps_pin_pending():
    cache = make(2)
    cache.admit((0, 1))
    cache.pin((0, 1))
    assert cache.discard((0, 1)) == 0 and cache.discard((0, 1)) is None
    assert cache.pinned() == {(0, 1)} and cache.stats().pinned_pending == 1


# ---------------------------------------------------------------- stats


def test_stats_counts_hits_misses_bytes_layers_and_window():
    cache = make(2, "lru", window=4)
    # layer 0: miss 1, miss 2, hit 1, miss 3 (evicts 2), hit 1; layer 1: miss 5 (evicts 3)
    for key in [(0, 1), (0, 2), (0, 1), (0, 3), (0, 1), (1, 5)]:
        use(cache, key)
    s = cache.stats()
    assert isinstance(s, CacheStats)
    assert (s.hits, s.misses, s.lookups, s.evictions, s.admissions) == (2, 4, 6, 2, 4)
    assert s.hit_rate == pytest.approx(2 / 6)
    assert s.bytes_read == 4 * E
    assert s.layer_hits == (2, 0, 0, 0) and s.layer_misses == (3, 1, 0, 0)
    assert s.per_layer_hit_rate == (0.4, 0.0, 0.0, 0.0)
    assert (s.window_lookups, s.hit_rate_window) == (4, 0.5)  # last 4: hit miss hit miss
    with pytest.raises(AttributeError):
        s.hits = 0  # frozen snapshot
    cache.reset_stats()
    s = cache.stats()
    assert (s.hits, s.misses, s.hit_rate, s.window_lookups, s.entries) == (0, 0, 0.0, 0, 2)


def test_hottest_survives_eviction_and_reset_stats():
    cache = make(1, "lru")
    for key in [(0, 1)] * 3 + [(0, 2)] * 5 + [(1, 3)] * 2 + [(0, 1)]:
        use(cache, key)
    assert (0, 2) not in cache
    cache.reset_stats()
    assert cache.hottest(2) == [(0, 2), (0, 1)]
    cache.reset_stats(history=True)
    assert cache.hottest(2) == []


# ---------------------------------------------------------------- random operation sequences

KEYS = st.tuples(st.integers(0, 1), st.integers(0, 4))
OPS = st.lists(
    st.tuples(st.sampled_from(["use", "use", "use", "prefetch", "pin", "unpin", "hold", "release", "flush",
                               "discard"]), KEYS),
    max_size=60,
)


class Model:
    """Naive reference: O(n) victim choice from use counts and last-use times."""

    def __init__(self, policy: str):
        self.policy, self.time = policy, 0
        self.uses: dict = {}
        self.last: dict = {}

    def touch(self, key, uses: int):
        """key was used (or re-queued) now, with `uses` uses since admission."""
        self.time += 1
        self.last[key], self.uses[key] = self.time, uses

    def victim(self, candidates):
        rank = (lambda k: self.last[k]) if self.policy == "lru" else (lambda k: (self.uses[k], self.last[k]))
        return min(candidates, key=rank, default=None)


@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu", "slru"]), slots=st.integers(1, 4), ops=OPS)
def test_invariants_under_random_operations(policy, slots, ops):
    cache = make(slots, policy, extra_bytes=E // 2)
    model = Model(policy)
    lookups = 0
    suspended: set = set()  # held keys the policy named as victims: re-queued when released
    for op, key in ops:
        before = cache.resident()
        pinned_before, held_before = cache.pinned(), cache.held()
        candidates = [k for k in before if k not in pinned_before and k not in held_before]
        expected_victim = model.victim(candidates)
        evicted = None
        if op in ("use", "prefetch"):
            if op == "use":
                lookups += 1
                if cache.lookup(key) is not None:
                    model.touch(key, model.uses[key] + 1)
                    continue
            elif key in cache:
                continue
            try:
                slot, evicted = cache.admit(key)
            except CacheFullError:
                assert len(before) == slots and not candidates
                suspended |= set(before) - pinned_before  # every held key was named and set aside
                continue
            if evicted is not None and policy != "slru":  # held keys ranked before it were set aside
                suspended |= {k for k in before if k in held_before and k not in pinned_before
                              and model.victim([k, evicted]) == k}
            model.touch(key, 1)
            if key in held_before and key not in pinned_before:
                suspended.add(key)  # admitted while held: the policy hears of it at its release
            assert cache.resident()[key] == slot
            if len(before) < slots:
                assert evicted is None and slot not in before.values()
            else:
                assert evicted not in pinned_before and evicted not in held_before and before[evicted] == slot
                if policy != "slru":
                    assert evicted == expected_victim
        elif op == "pin":
            if len(pinned_before) >= slots and key not in pinned_before:
                with pytest.raises(ExpertCacheError):
                    cache.pin(key)
            else:
                assert cache.pin(key) == (key in before)
                suspended.discard(key)
        elif op == "unpin":
            assert cache.unpin(key) == (key in pinned_before)
            if key in pinned_before and key in before:
                if key in held_before:
                    suspended.add(key)  # re-enters when released
                else:
                    model.touch(key, model.uses[key])  # re-enters as most recent, uses kept
        elif op == "hold":
            if len(pinned_before) + len(held_before) >= slots and key not in held_before | pinned_before:
                with pytest.raises(ExpertCacheError, match="pinned or held"):
                    cache.hold(key)
            else:
                cache.hold(key)
                assert key in cache.held() and cache.resident() == before  # no policy work, no admission
        elif op == "release":
            assert cache.release(key) == (key in held_before)
            if key in suspended:
                suspended.discard(key)
                if key in before and key not in pinned_before:
                    model.touch(key, model.uses[key])  # back in the policy as most recent
        elif op == "flush":
            flushed = cache.flush()
            assert set(flushed) == set(before) - pinned_before - held_before
            assert set(cache.resident()) == set(before) & (pinned_before | held_before)
            suspended &= set(cache.resident())
        elif op == "discard":
            assert cache.discard(key) == before.get(key)
            suspended.discard(key)
        # invariants after every operation
        res = cache.resident()
        s = cache.stats()
        assert s.used_bytes == len(res) * E <= s.capacity_bytes
        assert len(set(res.values())) == len(res) and all(0 <= v < slots for v in res.values())
        assert pinned_before - {key} <= cache.pinned() and held_before - {key} <= cache.held()
        assert all(k in res for k in pinned_before & set(before) if op != "discard" or k != key)
        assert s.hits + s.misses == lookups == sum(s.layer_hits) + sum(s.layer_misses)
        assert s.pinned + s.pinned_pending == len(cache.pinned()) <= slots
        assert s.entries == len(res) and s.bytes_read == s.admissions * E


# ---------------------------------------------------------------------------- /pin (issue 28.6)
# Through the provider (engine.experts.streaming.StreamingExperts) on the tiny model's pack:
# user pins never take the slots a turn needs, fail whole, and count while still loading.

@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    """(official checkpoint with the real tokenizer, its conversion)."""
    from converter import synth
    from converter.convert import convert

    root = tmp_path_factory.mktemp("pins")
    ckpt = synth.write_checkpoint(root / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    return ckpt, convert(ckpt, root / "pack", resume=False)


def _streaming(pack, slots: int):
    from engine.weights import open_model

    full = open_model(pack)
    record = full.experts.store.record_bytes
    full.close()
    return open_model(pack, cache_bytes=slots * record)


def test_pins_leave_one_layers_top_k_free_and_count_while_loading(tiny_pack):
    files = _streaming(tiny_pack[1], 8)
    try:
        p, k = files.experts, files.args.n_activated_experts
        assert k == 4 and p.pin_limit == 8 - k
        assert p.pin([(0, 1), (0, 2), (1, 3), (1, 3)]) == [(0, 1), (0, 2), (1, 3)]
        s = p.stats()  # the reads started at once: counted as pinned before any use
        assert s.pinned == 3 and s.pinned_pending == 0 and len(p.cache) == 3
        p.pin([(2, 0)])
        with pytest.raises(ExpertCacheError, match=r"at most 4 pins"):
            p.pin([(2, 1)])
        assert p.pinned() == {(0, 1), (0, 2), (1, 3), (2, 0)} and p.stats().pinned == 4
        p.acquire(3, [5, 6, 7, 8])  # a whole layer's top-k at once still fits (the graph path)
        p.release(3)
        assert sorted(e for e, _ in p.experts(4, [9, 10, 11, 12, 13])) == [9, 10, 11, 12, 13]
        got = {e: w for e, w in p.experts(0, [1, 2])}  # pinned ones are served from their slots
        assert set(got) == {1, 2} and p.pinned() == {(0, 1), (0, 2), (1, 3), (2, 0)}
        assert p.unpin([(0, 1), (3, 3)]) == [(0, 1)]  # only what was pinned is reported
        assert p.unpin(None) == [(0, 2), (1, 3), (2, 0)] and p.pinned() == frozenset()
    finally:
        files.close()


def test_a_failed_pin_is_rolled_back_whole(tiny_pack):
    files = _streaming(tiny_pack[1], 8)
    try:
        p = files.experts
        p.pin([(0, 1)])
        resident = p.cache.resident()
        with pytest.raises(ExpertCacheError, match="cannot pin 5 more"):
            p.pin([(1, e) for e in range(5)])
        assert p.pinned() == {(0, 1)} and p.cache.resident() == resident  # nothing pinned or read
        with pytest.raises(ExpertCacheError, match="out of range"):  # fails on the third key
            p.pin([(1, 0), (1, 1), (99, 0)])
        assert p.pinned() == {(0, 1)} and p.stats().pinned == 1
        assert (1, 0) not in p.cache.pinned() and (1, 1) not in p.cache.pinned()
        assert p.cache.pinned() == {(0, 1)} and not p.cache.held()  # no hold left behind either
    finally:
        files.close()


def test_engine_pin_hot_over_the_limit_fails_whole_and_the_next_turn_runs(tiny_pack):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import TurnFinished
    from engine.sampling import SamplingParams

    ckpt, pack = tiny_pack
    full = Engine.load(pack, EngineConfig(numerics="exact"), warmup=False)
    record = full.experts.store.record_bytes
    full.close()
    eng = Engine.load(pack, EngineConfig(numerics="exact", cache_bytes=12 * record), warmup=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=2)
        sess = eng.new_session()
        assert isinstance(list(eng.generate(sess, "Hi there", params))[-1], TurnFinished)
        with pytest.raises(ExpertCacheError, match="at most 8 pins"):
            eng.pin_hot(100)
        assert eng.experts.pinned() == frozenset() and eng.stats().cache.pinned == 0
        hot = eng.pin_hot(8)
        assert len(hot) == 8 and eng.stats().cache.pinned == 8  # every pin counted at once
        fin = list(eng.generate(sess, "And again", params))[-1]
        assert isinstance(fin, TurnFinished)  # the turn still had a layer's top-k to stream through
        assert set(hot) <= eng.experts.pinned()
    finally:
        eng.close()


# ---------------------------------------------------------------- lookups in one call

KEYS = st.tuples(st.integers(0, 3), st.integers(0, 15))


@settings(max_examples=120, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu", "slru", "arc", "lfu-aging", "next-use"]),
       slots=st.sampled_from([10, 64]),
       resident=st.lists(KEYS, max_size=12, unique=True), pinned=st.lists(KEYS, max_size=3),
       held=st.lists(KEYS, max_size=3), calls=st.lists(st.lists(KEYS, max_size=20), max_size=6))
def test_lookup_many_is_the_lookups_one_by_one(policy, slots, resident, pinned, held, calls):
    """Same slots, statistics (the window wraps at 7), all-time counts and policy order as
    `lookup` key by key, with pinned, held and set-aside keys among them; in a cache that evicts
    (10 slots) and in one with a slot for every key (64: no policy is told)."""
    caches = [make(slots, policy, window=7) for _ in range(2)]
    for cache in caches:
        for key in pinned:
            cache.pin(key)
        for key in held:
            cache.hold(key)
        for key in resident:
            use(cache, key)  # a full cache evicts (held victims are set aside)
    one, many = caches
    for keys in calls:
        assert many.lookup_many(keys) == [one.lookup(key) for key in keys]
        assert many.stats() == one.stats()
    assert many.hottest(64) == one.hottest(64)
    assert many.resident() == one.resident()
    for key in held:  # set-aside keys go back to the policy
        assert many.release(key) == one.release(key)
    # the policies agree: the same victims for the same new keys
    for e in range(16):
        assert use(many, (3, e)) == use(one, (3, e))


def test_lookup_many_refuses_a_key_out_of_range_by_name():
    cache = make(4)
    with pytest.raises(ExpertCacheError, match=r"\(4, 0\) out of range"):
        cache.lookup_many([(0, 1), (4, 0)])
    assert cache.stats().lookups == 0


class _Told(LFUPolicy):
    """LFU that records what it is told."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.told: list[tuple[str, tuple]] = []

    def add(self, key, count: int = 1) -> None:
        self.told.append(("add", key))
        super().add(key, count)

    def touch(self, key) -> None:
        self.told.append(("touch", key))
        super().touch(key)


@pytest.mark.parametrize("slots", [63, 64, 80])
def test_a_cache_with_a_slot_for_every_key_tells_its_policy_nothing(slots):
    """It never evicts, so its policy never picks a victim and is told of no admission or use
    (a whole-mode decode step's lookups cost no policy work); its statistics count as before. With
    one slot fewer than the 64 keys the policy hears of admissions and uses again."""
    policies: list[_Told] = []

    def told(capacity: int) -> _Told:
        policies.append(_Told(capacity))
        return policies[-1]

    cache = ExpertCache(slots * E, E, num_layers=4, num_experts=16, policy=told)
    keys = [(layer, e) for layer in range(4) for e in range(16)]
    cache.pin((0, 0))
    cache.hold((1, 1))
    for key in keys + keys[::-1]:
        use(cache, key)
    assert cache.lookup_many(keys[:40]) == [cache.peek(key) for key in keys[:40]]
    cache.touch((2, 2))
    cache.release((1, 1))
    cache.unpin((0, 0))
    stats = cache.stats()
    lookups = 2 * len(keys) + 40
    if slots >= 64:
        assert policies[0].told == [] and len(policies[0]) == 0
        assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (lookups - 64, 64, 0, 64)
        assert stats.layer_hits == (32, 32, 24, 16) and stats.policy == "lfu"
    else:
        assert {what for what, _ in policies[0].told} == {"add", "touch"} and stats.evictions > 0
    assert cache.hottest(1) == [(0, 0)] and stats.hits + stats.misses == lookups


def test_a_cache_of_its_pool_tells_its_policy_nothing_and_counts_residents_per_layer():
    """`pool`: the keys its user routes (the engine's main layers: rows 0-2 here, row 3 standing
    for the MTP block's, in range but never routed). A cache of the pool's 48 slots runs without
    its policy, as a cache of every key does; `resident_in` follows admissions, discards and
    flushes per layer."""
    policies: list[_Told] = []

    def told(capacity: int) -> _Told:
        policies.append(_Told(capacity))
        return policies[-1]

    cache = ExpertCache(48 * E, E, num_layers=4, num_experts=16, policy=told, pool_layers=3)
    assert cache.pool == 48 and ExpertCache(48 * E, E, num_layers=4, num_experts=16).pool == 64
    keys = [(layer, e) for layer in range(3) for e in range(16)]
    for key in keys + keys[::-1]:
        use(cache, key)
    assert cache.lookup_many(keys) == [cache.peek(key) for key in keys]
    assert policies[0].told == [] and cache.stats().evictions == 0
    assert [cache.resident_in(layer) for layer in range(4)] == [16, 16, 16, 0]
    cache.discard((1, 3))
    assert [cache.resident_in(layer) for layer in range(4)] == [16, 15, 16, 0]
    with pytest.raises(ExpertCacheError, match=r"outside this cache's pool \(layers 0-2.*no spare slot.*more than 48 records"):
        cache.admit((3, 0))  # it could never be evicted: refused, and the free slot stays the pool's
    use(cache, (1, 3))
    assert [cache.resident_in(layer) for layer in range(4)] == [16, 16, 16, 0]
    cache.pin((0, 0))
    cache.flush()
    assert [cache.resident_in(layer) for layer in range(4)] == [1, 0, 0, 0] and len(cache) == 1
    ranked = ExpertCache(47 * E, E, num_layers=4, num_experts=16, pool_layers=3)  # evicts: takes any key
    use(ranked, (3, 0))
    assert ranked.peek((3, 0)) is not None
    spare = ExpertCache(49 * E, E, num_layers=4, num_experts=16, pool_layers=3)  # one slot beyond the pool
    use(spare, (3, 0))
    with pytest.raises(ExpertCacheError, match="more than 49 records"):
        spare.admit((3, 1))
