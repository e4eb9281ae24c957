"""Routing traces (engine/experts/trace.py) and the policy replay bench (bench/cache_replay.py)."""

from __future__ import annotations

import importlib.util
import json
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.experts.trace import TraceFormatError, TraceRecord, TraceWriter, read_records, read_trace

_SPEC = importlib.util.spec_from_file_location(
    "cache_replay", Path(__file__).resolve().parents[2] / "bench" / "cache_replay.py"
)
replay_mod = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(replay_mod)
replay = replay_mod.replay

A, B, C, D = (0, 0), (0, 1), (1, 0), (1, 1)

# Hand computations (m = miss, h = hit; SLRU protected segment = int(0.8 * capacity)).
#
# T1 = A B A C A B C A, capacity 2
#   LRU    m m h m(ev B) h m(ev C) m(ev A) m(ev B)                          -> 2/8
#   LFU    m m h(A2) m(ev B1) h(A3) m(ev C1) m(ev B1) h                      -> 3/8
#   SLRU   prot 1, ghost 2: A promoted at 3; C evicts B (ghost B); B evicts C (ghost C) and,
#          remembered, is protected, demoting A; C evicts A and is protected, demoting B;
#          A evicts B: hits at 3 and 5                                       -> 2/8
#   Belady m m h m(ev B, next 6 > A's 5) h m(ev A@8 or C@7) h|m m|h          -> 3/8
# T4 = A A B B C D D C C A, capacity 3
#   LRU    m h m h m m(ev A) h h h m                                         -> 5/10
#   LFU    m h(A2) m h(B2) m m(ev C1) h(D2) m(ev A: oldest at freq 2) h m(ev B) -> 4/10
#   SLRU   prot 2: A,B protected; D evicts C (ghost C); D promoted demotes A; C evicts A,
#          remembered: protected, demotes B; A evicts B, remembered           -> 4/10
#   Belady m h m h m m(ev B, never used again) h h h h                       -> 6/10
# T5 = A A A B B C C D D B B C C, capacity 3
#   LRU    only the 4 first uses miss (D evicts A, never used again)         -> 9/13
#   LFU    A3 B2 C2; D evicts B (freq 2, older than C); B evicts C; C evicts D;
#          hits at 2 3 5 7 9 11 13                                           -> 7/13
#   SLRU   promotions demote A, then B, C, D in turn to probation, where they hit
#          again before any eviction; only A is evicted (by D)               -> 9/13
#   Belady only compulsory misses                                            -> 9/13
T1 = [A, B, A, C, A, B, C, A]
T4 = [A, A, B, B, C, D, D, C, C, A]
T5 = [A, A, A, B, B, C, C, D, D, B, B, C, C]
HAND = [
    (T1, 2, {"lru": 2 / 8, "lfu": 3 / 8, "slru": 2 / 8, "belady": 3 / 8}),
    (T4, 3, {"lru": 5 / 10, "lfu": 4 / 10, "slru": 4 / 10, "belady": 6 / 10}),
    (T5, 3, {"lru": 9 / 13, "lfu": 7 / 13, "slru": 9 / 13, "belady": 9 / 13}),
]


@pytest.mark.parametrize("trace,capacity,expected", HAND)
def test_hit_rates_match_hand_computation(trace, capacity, expected):
    got = {p: replay(trace, p, capacity) for p in expected}
    assert got == pytest.approx(expected)


def optimal_hits(trace, capacity) -> int:
    """Exhaustive optimum over every demand-paging eviction choice (tiny traces only)."""

    @lru_cache(maxsize=None)
    def best(i: int, resident: frozenset) -> int:
        if i == len(trace):
            return 0
        key = trace[i]
        if key in resident:
            return 1 + best(i + 1, resident)
        if len(resident) < capacity:
            return best(i + 1, resident | {key})
        return max(best(i + 1, (resident - {v}) | {key}) for v in resident)

    return best(0, frozenset())


small_traces = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(trace=small_traces, capacity=st.integers(1, 4))
def test_belady_equals_exhaustive_optimum(trace, capacity):
    assert replay_mod.belady_hits(trace, capacity) == optimal_hits(trace, capacity)


@settings(max_examples=80, deadline=None)
@given(
    trace=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7)), min_size=1, max_size=150),
    capacity=st.integers(1, 12),
)
def test_belady_at_least_every_policy(trace, capacity):
    best = replay(trace, "belady", capacity)
    layers = len({layer for layer, _ in trace})
    for policy in replay_mod.POLICY_NAMES:  # per-layer caches too: a restricted demand pager ...
        if policy.endswith("/layer") and capacity < layers:
            continue  # ... unless a layer gets no slot: its keys then bypass the cache (no eviction)
        assert replay(trace, policy, capacity) <= best
    if capacity >= len(set(trace)):  # everything fits: only compulsory misses
        assert best == pytest.approx(1 - len(set(trace)) / len(trace))


def test_synthetic_trace_is_seeded_and_decode_shaped():
    t = replay_mod.synthetic_trace(steps=5, layers=3, experts=16, top_k=4, zipf=1.0, seed=7)
    assert t == replay_mod.synthetic_trace(steps=5, layers=3, experts=16, top_k=4, zipf=1.0, seed=7)
    assert t != replay_mod.synthetic_trace(steps=5, layers=3, experts=16, top_k=4, zipf=1.0, seed=8)
    assert len(t) == 5 * 3 * 4
    for i in range(0, len(t), 4):  # one (step, layer) call: 4 distinct experts of one layer
        call = t[i:i + 4]
        assert len(set(call)) == 4 and {k[0] for k in call} == {(i // 4) % 3}
        assert all(0 <= e < 16 for _, e in call)


def test_parse_capacities_and_replay_errors():
    assert replay_mod.parse_capacities("0.1, 64,1.0", 1000) == [100, 64, 1000]
    assert replay_mod.parse_capacities("0.0001", 1000) == [1]
    for bad, msg in [("x", "neither"), ("1.5", r"\(0, 1\]"), ("0", "at least one"), ("", "empty")]:
        with pytest.raises(replay_mod.ReplayError, match=msg):
            replay_mod.parse_capacities(bad, 1000)
    with pytest.raises(replay_mod.ReplayError, match="unknown policy 'mru'"):
        replay(T1, "mru", 2)
    with pytest.raises(replay_mod.ReplayError, match="empty"):
        replay([], "lru", 2)


# ---------------------------------------------------------------- trace files


def test_trace_roundtrip_dedupe_and_atomic_publish(tmp_path):
    path = tmp_path / "route.jsonl"
    with TraceWriter(path) as w:
        w.record(0, 2, [[5, 1], [1, 7], [5, 1]])  # prefill call, 3 tokens
        assert not path.exists() and (tmp_path / "route.jsonl.partial").exists()
        w.record(1, 0, [[3, 4]])
    assert path.exists() and not (tmp_path / "route.jsonl.partial").exists()
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"step": 0, "layer": 2, "tokens": 3, "experts": [[5, 1], [1, 7], [5, 1]]}
    assert list(read_records(path)) == [
        TraceRecord(0, 2, ((5, 1), (1, 7), (5, 1))), TraceRecord(1, 0, ((3, 4),))
    ]
    assert list(read_trace(path)) == [(2, 5), (2, 1), (2, 7), (0, 3), (0, 4)]
    assert list(read_trace(path, dedupe=False)) == [
        (2, 5), (2, 1), (2, 1), (2, 7), (2, 5), (2, 1), (0, 3), (0, 4)
    ]


def test_interrupted_recording_stays_partial(tmp_path):
    path = tmp_path / "t.jsonl"
    with pytest.raises(RuntimeError):
        with TraceWriter(path) as w:
            w.record(0, 0, [[1]])
            raise RuntimeError("engine crashed")
    assert not path.exists()
    assert list(read_trace(tmp_path / "t.jsonl.partial")) == [(0, 1)]


def test_bad_trace_input_raises_format_errors(tmp_path):
    with TraceWriter(tmp_path / "ok.jsonl") as w:
        with pytest.raises(TraceFormatError, match="ints"):
            w.record(0, 0, [["a"]])
        with pytest.raises(TraceFormatError, match=">= 0"):
            w.record(0, -1, [[1]])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step":0,"layer":0,"tokens":1,"experts":[[1]]}\n'
                   '{"step":0,"layer":1,"tokens":2,"experts":[[1]]}\n')
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:2: tokens=2 but experts has 1 rows"):
        list(read_trace(bad))
    bad.write_text("not json\n")
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:1: not valid JSON"):
        list(read_trace(bad))
    with pytest.raises(TraceFormatError, match="does not exist"):
        list(read_trace(tmp_path / "missing.jsonl"))


def test_main_prints_a_table_for_a_recorded_trace(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    with TraceWriter(path) as w:
        for step, layer, experts in [(0, 0, [[0, 1]]), (0, 1, [[0, 1]]), (1, 0, [[0, 2]]),
                                     (1, 1, [[1, 2]]), (2, 0, [[0, 1]]), (2, 1, [[0, 1]])]:
            w.record(step, layer, experts)
    assert replay_mod.main([str(path), "--capacities", "3,1.0", "--entry-bytes", "1048576"]) == 0
    out = capsys.readouterr().out
    assert "12 accesses, 6 distinct experts" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["3", "6"]
    assert rows[1][4:] == ["50.0%"] * len(replay_mod.POLICY_NAMES)  # 6 compulsory misses of 12
    assert replay_mod.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_main_synthetic_runs(capsys):
    assert replay_mod.main(["--synthetic", "--steps", "3", "--capacities", "0.5"]) == 0
    assert "synthetic Zipf" in capsys.readouterr().out


# ---------------------------------------------------------------- real routing traces

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"  # ../shared beside the repo
needs_traces = pytest.mark.skipif(
    not (TRACES / "route_W130.csv").is_file(),
    reason=f"real routing traces not found at {TRACES} (CI has shared/ beside the checkout)",
)


@lru_cache(maxsize=None)
def route(name: str) -> tuple:
    return tuple(replay_mod.route_accesses(replay_mod.read_route_csv(TRACES / f"route_{name}.csv")))


@lru_cache(maxsize=None)
def calls(name: str) -> tuple:
    return tuple(replay_mod.route_calls(replay_mod.read_route_csv(TRACES / f"route_{name}.csv")))


@lru_cache(maxsize=None)
def real_hits(name: str, policy: str, slots: int) -> int:
    """Hits of one replay of a shipped trace, in the engine's call order (cached per module)."""
    if policy == "belady":
        return replay_mod.belady_hits(route(name), slots)
    return replay_mod.policy_hits(calls(name), policy, slots)


@needs_traces
def test_route_csv_is_read_in_position_then_layer_order():
    rows = replay_mod.read_route_csv(TRACES / "route_W130.csv")
    assert len(rows) == 5160 and rows == sorted(rows, key=lambda r: (r[0], r[1]))
    assert rows[0] == (218, 3, (229, 177, 96, 150, 243, 64))
    assert rows[-1] == (346, 42, (229, 38, 52, 33, 126, 100))
    assert {layer for _, layer, _ in rows} == set(range(3, 43))  # hash layers 0-2 absent
    for name, accesses, distinct in [("W130", 30960, 4457), ("W50", 11760, 2997)]:
        assert (len(route(name)), len(set(route(name)))) == (accesses, distinct)
        assert len(calls(name)) == accesses // 6 and replay_mod.flatten(calls(name)) == list(route(name))


# Exact hits of the deterministic replay (global cache, every miss admitted, cold start, each
# route row one engine call: looked up, hits held, misses admitted, then released). Holds are
# `ExpertCache.hold`: the same hits as when they were pins, without a pin's policy work per hit.
REAL_SLOTS = [256, 512, 1024, 2048, 4096, 6304]
REAL_HITS = {
    "W130": {"lru": [12645, 16035, 20377, 24272, 26477, 26503],
             "next-use": [13148, 17371, 21439, 24550, 26477, 26503],
             "belady": [18240, 21826, 24673, 26417, 26503, 26503]},
    "W50": {"lru": [3275, 4899, 6770, 8457, 8763, 8763],
            "next-use": [4215, 5751, 7250, 8479, 8763, 8763],
            "belady": [6088, 7482, 8501, 8763, 8763, 8763]},
}
SLRU_HITS = {"W130": [11671, 16032, 21045, 24696], "W50": [3630, 5182, 7007, 8500]}  # 256 .. 2048


@needs_traces
@pytest.mark.parametrize("name", ["W130", "W50"])
def test_default_policy_on_real_traces(name):
    from engine.config import EngineConfig

    assert EngineConfig().cache_policy == replay_mod.DEFAULT_POLICY == "next-use"
    got = {p: [real_hits(name, p, s) for s in REAL_SLOTS] for p in REAL_HITS[name]}
    assert got == REAL_HITS[name]
    slru = [real_hits(name, "slru", s) for s in REAL_SLOTS[:4]]
    assert slru == SLRU_HITS[name]
    # the ghost list keeps SLRU off its old collapse (13.6 % on W130 at 256 slots: 4211 hits)
    assert slru[0] > 0.85 * got["lru"][0]


@needs_traces
@pytest.mark.parametrize("name", ["W130", "W50"])
def test_default_against_the_issue_targets(name):
    """Never below LRU from 256 to 6,304 slots; within 8 points of Belady at 2,048 slots. Not
    met: 10.4 / 10.6 points from Belady at 1,024 slots (Belady knows the future: see the
    closing note of issue 27)."""
    n = len(route(name))
    for slots in REAL_SLOTS:
        assert real_hits(name, "next-use", slots) >= real_hits(name, "lru", slots)
    gap = {s: (real_hits(name, "belady", s) - real_hits(name, "next-use", s)) / n * 100 for s in (1024, 2048)}
    assert gap[2048] < 8
    assert gap[1024] == pytest.approx({"W130": 10.45, "W50": 10.64}[name], abs=0.01)


@needs_traces
def test_engine_call_order_never_evicts_an_expert_of_the_call():
    trace = calls("W50")[:400]
    cache = replay_mod._new_cache("next-use", 8, replay_mod.flatten(trace))
    orig = cache.admit
    current: list = []

    def admit(key):
        slot, evicted = orig(key)
        assert evicted not in current  # the call's experts are held until used
        return slot, evicted

    cache.admit = admit
    for call in trace:
        current[:] = call
        replay_mod.serve_calls(cache, [call])
    assert not cache.pinned() and not cache.held()  # every hold released
    # a call needing more slots than the cache has runs in waves: (0, 1) is used and released
    # to make room for (0, 3); the second call finds (0, 2) and (0, 3)
    assert replay_mod.policy_hits([((0, 1), (0, 2), (0, 3))] * 2, "lru", 2) == 2
    assert replay_mod.replay(route("W50")[:12], "lru", 3, calls("W50")[:2]) == 0.0


@settings(max_examples=40, deadline=None)
@given(trace=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=60),
       capacity=st.integers(1, 8))
def test_horizon_oracle_knowing_everything_is_belady(trace, capacity):
    calls = [(key,) for key in trace]
    assert replay_mod.horizon_hits(calls, capacity, 10**6) == replay_mod.belady_hits(trace, capacity)


@needs_traces
def test_horizon_oracle_on_a_real_trace_prefix():
    part = calls("W50")[:400]  # 10 tokens, 2,400 accesses; 64 slots
    hits = {h: replay_mod.horizon_hits(part, 64, h) for h in (0, 1, 10**6)}
    # told nothing it is next-use; told the next token it is as good as told everything here
    assert hits == {0: 385, 1: 534, 10**6: 534}
    assert replay_mod.policy_hits(part, "next-use", 64) == 385
    assert replay_mod.belady_hits(replay_mod.flatten(part), 64) == 562  # may evict within a call


@needs_traces
def test_main_prints_the_route_tables(capsys):
    path = str(TRACES / "route_W50.csv")
    assert replay_mod.main([path, "--capacities", "256,6304", "--policies", "lru,next-use,belady",
                            "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "11760 accesses, 2997 distinct experts" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["256", "6304"]
    assert rows[0][4:] == ["27.8%", "35.8%", "51.8%"]
    assert rows[1][4:] == ["74.5%"] * 3  # everything fits: only compulsory misses


@needs_traces
def test_temporal_reuse_on_real_traces():
    rows = replay_mod.read_route_csv(TRACES / "route_W130.csv")
    # the published figure for this model: 39.5-40.7 % re-selected by the next token
    assert replay_mod.temporal_reuse(rows, 1) == pytest.approx(0.412, abs=5e-4)
    assert replay_mod.temporal_reuse(rows, 4) == pytest.approx(0.575, abs=5e-4)


def test_route_csv_errors(tmp_path):
    bad = tmp_path / "r.csv"
    bad.write_text("pos,layer,n,e0,e1\n5,3,2,1,x\n")
    with pytest.raises(replay_mod.ReplayError, match=r"r.csv:2: pos, layer, n and n expert ids must be ints"):
        replay_mod.read_route_csv(bad)
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(replay_mod.ReplayError, match="expected a header"):
        replay_mod.read_route_csv(bad)
    bad.write_text("pos,layer,n,e0,e1\n5,3,3,1,2\n")
    with pytest.raises(replay_mod.ReplayError, match="r.csv:2: needs n >= 1"):
        replay_mod.read_route_csv(bad)
    assert replay_mod.main([str(tmp_path / "missing.csv")]) == 2


def test_route_rows_replay_by_position_then_layer(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("pos,layer,n,e0,e1,w0,w1\n1,4,2,7,8,0.5,0.5\n0,4,2,7,9,0.5,0.5\n0,3,2,1,1,0.5,0.5\n")
    rows = replay_mod.read_route_csv(path)
    assert rows == [(0, 3, (1, 1)), (0, 4, (7, 9)), (1, 4, (7, 8))]
    assert replay_mod.route_accesses(rows) == [(3, 1), (4, 7), (4, 9), (4, 7), (4, 8)]
    assert replay_mod.layer_split(replay_mod.route_accesses(rows), 3) == {3: 2, 4: 1}
