"""Replay a routing trace through the expert-cache policies and Belady's optimum.

    python bench/cache_replay.py TRACE.jsonl [--capacities 0.05,0.1,0.25,0.5] [--entry-bytes N]
    python bench/cache_replay.py --synthetic [--steps 200 --seed 0 --zipf 1.0]

Capacities: a value with a "." is a fraction of the distinct experts in the trace, an integer
is an absolute slot count. Every miss is admitted (demand fetching), so Belady's MIN (evict
the key whose next use is farthest) is the optimum the LRU/LFU/SLRU hit rates are held to.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.experts.cache import ExpertCache, ExpertKey  # noqa: E402
from engine.experts.trace import TraceFormatError, read_trace  # noqa: E402

POLICY_NAMES = ("lru", "lfu", "slru", "belady")
EXPERT_RECORD_BYTES = 13_369_344  # 12.75 MiB, one DeepSeek-V4-Flash routed expert


class ReplayError(Exception):
    """Bad replay arguments (capacity, policy name, empty trace)."""


def belady_hits(trace: Sequence[ExpertKey], capacity: int) -> int:
    """Hits of Belady's MIN with `capacity` slots; O(n log n) via precomputed next uses."""
    n = len(trace)
    next_use = [n] * n  # next_use[i]: index of the next access to trace[i], n if none
    last: dict[ExpertKey, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = last.get(trace[i], n)
        last[trace[i]] = i
    resident: dict[ExpertKey, int] = {}  # key -> its next use
    heap: list[tuple[int, ExpertKey]] = []  # (-next use, key), stale entries skipped
    hits = 0
    for i, key in enumerate(trace):
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            while True:
                neg_next, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg_next:
                    del resident[victim]
                    break
        resident[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return hits


def policy_hits(trace: Sequence[ExpertKey], policy: str, capacity: int) -> int:
    """Hits of an ExpertCache policy ("lru", "lfu", "slru") with `capacity` slots."""
    cache = ExpertCache(
        capacity, 1,
        num_layers=1 + max(layer for layer, _ in trace),
        num_experts=1 + max(expert for _, expert in trace),
        policy=policy,
    )
    for key in trace:
        if cache.lookup(key) is None:
            cache.admit(key)
    return cache.stats().hits


def replay(trace: Sequence[ExpertKey], policy: str, capacity: int) -> float:
    """Hit rate of `policy` (one of POLICY_NAMES) over `trace` with `capacity` slots."""
    if policy not in POLICY_NAMES:
        raise ReplayError(f"unknown policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    if capacity < 1:
        raise ReplayError(f"capacity must be at least one slot, got {capacity}")
    if not trace:
        raise ReplayError("the trace is empty: nothing to replay")
    hits = belady_hits(trace, capacity) if policy == "belady" else policy_hits(trace, policy, capacity)
    return hits / len(trace)


def synthetic_trace(
    steps: int = 200, layers: int = 43, experts: int = 256, top_k: int = 6,
    zipf: float = 1.0, seed: int = 0,
) -> list[ExpertKey]:
    """Decode-like trace: per step, each layer picks top_k distinct experts, Zipf-weighted
    (weight 1/rank**zipf) over a per-layer random ranking of its experts. Deterministic."""
    if top_k > experts:
        raise ReplayError(f"top_k ({top_k}) cannot exceed the number of experts ({experts})")
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** zipf for rank in range(experts)]
    rankings = [rng.sample(range(experts), experts) for _ in range(layers)]
    trace: list[ExpertKey] = []
    for _ in range(steps):
        for layer in range(layers):
            chosen: dict[int, None] = {}
            while len(chosen) < top_k:
                chosen[rankings[layer][rng.choices(range(experts), weights)[0]]] = None
            trace.extend((layer, e) for e in chosen)
    return trace


def parse_capacities(text: str, distinct: int) -> list[int]:
    """"0.1,64" -> slot counts: "." values are fractions of `distinct`, others slot counts."""
    slots = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            value = float(item) if "." in item else int(item)
        except ValueError:
            raise ReplayError(f"capacity {item!r} is neither a fraction nor a slot count") from None
        if "." in item and not 0.0 < value <= 1.0:
            raise ReplayError(f"capacity fraction {item} must be in (0, 1]")
        count = max(1, round(value * distinct)) if "." in item else int(value)
        if count < 1:
            raise ReplayError(f"capacity {item} must be at least one slot")
        slots.append(count)
    if not slots:
        raise ReplayError("--capacities is empty")
    return slots


def format_table(trace: Sequence[ExpertKey], capacities: Sequence[int], entry_bytes: int) -> str:
    """Hit rates per policy at each capacity, and the GiB each policy streams in."""
    distinct = len(set(trace))
    head = f"{'slots':>7} {'of keys':>8} {'GiB':>8} | " + " ".join(f"{p:>7}" for p in POLICY_NAMES)
    lines = [head, "-" * len(head)]
    for cap in capacities:
        rates = [replay(trace, p, cap) for p in POLICY_NAMES]
        read = " ".join(f"{(1 - r) * len(trace) * entry_bytes / 2**30:7.1f}" for r in rates)
        lines.append(
            f"{cap:7d} {cap / distinct:8.1%} {cap * entry_bytes / 2**30:8.1f} | "
            + " ".join(f"{r:7.1%}" for r in rates)
            + f"   read GiB: {read}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", help="routing trace (JSONL, engine/experts/trace.py)")
    ap.add_argument("--synthetic", action="store_true", help="replay a seeded Zipf trace instead")
    ap.add_argument("--capacities", default="0.05,0.1,0.25,0.5")
    ap.add_argument("--entry-bytes", type=int, default=EXPERT_RECORD_BYTES)
    ap.add_argument("--no-dedupe", action="store_true",
                    help="one access per (token, expert) instead of per distinct expert per call")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf", type=float, default=1.0)
    args = ap.parse_args(argv)
    if args.synthetic == (args.trace is not None):
        ap.error("give exactly one of TRACE or --synthetic")
    try:
        if args.synthetic:
            trace = synthetic_trace(steps=args.steps, zipf=args.zipf, seed=args.seed)
            source = f"synthetic Zipf(s={args.zipf}) trace, {args.steps} steps, seed {args.seed}"
        else:
            trace = list(read_trace(args.trace, dedupe=not args.no_dedupe))
            source = args.trace
        if not trace:
            raise ReplayError(f"{source} holds no expert accesses")
        capacities = parse_capacities(args.capacities, len(set(trace)))
        print(f"{source}: {len(trace)} accesses, {len(set(trace))} distinct experts")
        print(format_table(trace, capacities, args.entry_bytes))
    except (ReplayError, TraceFormatError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
