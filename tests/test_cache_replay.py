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
    "cache_replay", Path(__file__).resolve().parent.parent / "bench" / "cache_replay.py"
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
#   SLRU   prot 1: A promoted at 3; C, B, C each evict the probation key    -> 3/8
#   Belady m m h m(ev B, next 6 > A's 5) h m(ev A@8 or C@7) h|m m|h          -> 3/8
# T4 = A A B B C D D C C A, capacity 3
#   LRU    m h m h m m(ev A) h h h m                                         -> 5/10
#   LFU    m h(A2) m h(B2) m m(ev C1) h(D2) m(ev A: oldest at freq 2) h m(ev B) -> 4/10
#   SLRU   prot 2: A,B protected; D evicts C; D promoted demotes A; C evicts A;
#          C promoted demotes B; A evicts B                                  -> 4/10
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
    (T1, 2, {"lru": 2 / 8, "lfu": 3 / 8, "slru": 3 / 8, "belady": 3 / 8}),
    (T4, 3, {"lru": 5 / 10, "lfu": 4 / 10, "slru": 4 / 10, "belady": 6 / 10}),
    (T5, 3, {"lru": 9 / 13, "lfu": 7 / 13, "slru": 9 / 13, "belady": 9 / 13}),
]


@pytest.mark.parametrize("trace,capacity,expected", HAND)
def test_hit_rates_match_hand_computation(trace, capacity, expected):
    got = {p: replay(trace, p, capacity) for p in replay_mod.POLICY_NAMES}
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
    for policy in ("lru", "lfu", "slru"):
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
    assert rows[1][4:8] == ["50.0%"] * 4  # everything fits: 6 compulsory misses of 12
    assert replay_mod.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_main_synthetic_runs(capsys):
    assert replay_mod.main(["--synthetic", "--steps", "3", "--capacities", "0.5"]) == 0
    assert "synthetic Zipf" in capsys.readouterr().out
