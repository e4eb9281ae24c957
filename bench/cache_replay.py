"""Replay routing traces through the expert cache's own policies, against LRU and Belady.

    python bench/cache_replay.py ../shared/traces/route_W130.csv ../shared/traces/route_W50.csv
    python bench/cache_replay.py TRACE.jsonl [--capacities 0.05,0.1,0.25,0.5] [--entry-bytes N]
    python bench/cache_replay.py --synthetic [--steps 200 --seed 0 --zipf 1.0]

A trace is either a real-model route CSV (header pos,layer,n,e0..,w0..; replayed ordered by
position, then layer) or an engine JSONL trace (engine/experts/trace.py). Capacities: a value
with a "." is a fraction of the distinct experts in the trace, an integer an absolute slot
count; route CSVs default to 256,512,1024,2048,4096,6304 slots. Every miss is admitted
(demand fetching) into one global cache, except "P/layer": one cache per layer, the slots
split evenly. Belady's MIN (evict the key whose next use is farthest) is the optimum.

A route CSV row is one engine call (one layer of one token) and is replayed in the engine's
order (StreamingExperts.experts): all its experts are looked up, hits held, then the misses
admitted, so an eviction never takes an expert of the call being served. JSONL and synthetic
traces replay one access at a time.

For route CSVs it also prints what the trace says about prefetching and warm starts (two or
more traces: each warmed by the previous one, the first by the last).
"""

from __future__ import annotations

import argparse
import csv
import heapq
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.experts.cache import CacheFullError, ExpertCache, ExpertCacheError, ExpertKey  # noqa: E402
from engine.experts.policy import DEFAULT_POLICY, POLICIES  # noqa: E402
from engine.experts.trace import TraceFormatError, read_trace  # noqa: E402

POLICY_NAMES = ("lru", "lfu", "slru", "arc", "lfu-aging", "next-use",
                "lru/layer", "arc/layer", "next-use/layer", "belady/layer", "belady")
ROUTE_SLOTS = "256,512,1024,2048,4096,6304"
HORIZON_SLOTS = (1024, 2048)  # --horizons replays only these (the Belady targets)
EXPERT_RECORD_BYTES = 13_369_344  # 12.75 MiB, one DeepSeek-V4-Flash routed expert

RouteRow = tuple[int, int, tuple[int, ...]]  # (position, layer, expert ids)


class ReplayError(Exception):
    """Bad replay arguments or input (capacity, policy name, empty or malformed trace)."""


def read_route_csv(path: str | Path) -> list[RouteRow]:
    """Rows of a route CSV (header pos,layer,n,e0..e{n-1},w0..), sorted by (pos, layer)."""
    p = Path(path)
    if not p.is_file():
        raise ReplayError(f"route trace {p} does not exist")
    rows: list[RouteRow] = []
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or header[:3] != ["pos", "layer", "n"] or "e0" not in header:
            raise ReplayError(f"{p}: expected a header starting pos,layer,n,e0,...; got {header}")
        first_e = header.index("e0")
        for lineno, fields in enumerate(reader, 2):
            try:
                pos, layer, n = int(fields[0]), int(fields[1]), int(fields[2])
                experts = tuple(int(x) for x in fields[first_e:first_e + n])
            except (ValueError, IndexError):
                raise ReplayError(f"{p}:{lineno}: pos, layer, n and n expert ids must be ints") from None
            if len(experts) != n or n < 1 or min(experts) < 0 or pos < 0 or layer < 0:
                raise ReplayError(f"{p}:{lineno}: needs n >= 1 non-negative expert ids, got {fields}")
            rows.append((pos, layer, experts))
    if not rows:
        raise ReplayError(f"{p} holds no routing rows")
    rows.sort(key=lambda r: (r[0], r[1]))
    return rows


Call = tuple[ExpertKey, ...]  # one layer's distinct experts of one step: what the engine looks up at once


def route_calls(rows: Sequence[RouteRow]) -> list[Call]:
    """One call per row: its layer's distinct experts, in row order."""
    return [tuple((layer, e) for e in dict.fromkeys(experts)) for _, layer, experts in rows]


def route_accesses(rows: Sequence[RouteRow]) -> list[ExpertKey]:
    """(layer, expert) accesses in row order, each row's distinct experts once."""
    return [key for call in route_calls(rows) for key in call]


def flatten(calls: Sequence[Call]) -> list[ExpertKey]:
    return [key for call in calls for key in call]


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


def _new_cache(policy: str, capacity: int, trace: Sequence[ExpertKey]) -> ExpertCache:
    return ExpertCache(
        capacity, 1,
        num_layers=1 + max(layer for layer, _ in trace),
        num_experts=1 + max(expert for _, expert in trace),
        policy=policy,
    )


def serve_calls(cache: ExpertCache, calls: Sequence[Call], on_miss: Callable[[ExpertKey], None] | None = None,
                on_evict: Callable[[ExpertKey], None] | None = None) -> int:
    """Demand-fetch `calls` through `cache` in the engine's order; returns the hits.

    As StreamingExperts.experts does for one call: every key is looked up first; hits are
    held (`ExpertCache.hold`) until used, misses held and admitted (an admission evicts only
    unheld keys); hits are used first, then the misses, and each key is released after its
    use. When the call needs more slots than can be held at once, the oldest held keys are
    used and released first to make room. `on_miss(key)` is told each miss before it is
    admitted (where its bytes come from), `on_evict(key)` each key an admission evicted."""
    hits = 0
    for call in calls:
        held: list[ExpertKey] = []
        waiting: list[ExpertKey] = []
        for key in call:
            if cache.lookup(key) is None:
                waiting.append(key)
            else:
                hits += 1
                try:
                    cache.hold(key)
                    held.append(key)
                except ExpertCacheError:  # every slot held: use it at once
                    pass
        for key in waiting:
            if on_miss is not None:
                on_miss(key)
            while True:
                try:
                    cache.hold(key)
                except ExpertCacheError:
                    cache.release(held.pop(0))
                    continue
                try:
                    _, evicted = cache.admit(key)
                except CacheFullError:
                    cache.release(key)
                    cache.release(held.pop(0))
                    continue
                if evicted is not None and on_evict is not None:
                    on_evict(evicted)
                held.append(key)
                break
        for key in held:
            cache.release(key)
    return hits


def policy_hits(calls: Sequence[Call], policy: str, capacity: int,
                warm: Sequence[Call] = (), keep: bool = True) -> int:
    """Hits of the ExpertCache policy `policy` (a POLICIES name) with `capacity` slots,
    replaying `calls` in the engine's order (`serve_calls`).

    `warm`: replayed first, uncounted; then the cache keeps its contents (keep=True) or is
    flushed, keeping only the policy's own usage history (keep=False).
    """
    cache = _new_cache(policy, capacity, flatten(calls) + flatten(warm))
    serve_calls(cache, warm)
    if not keep:
        cache.flush()
    return serve_calls(cache, calls)


def layer_split(trace: Sequence[ExpertKey], capacity: int) -> dict[int, int]:
    """Slots per layer for per-layer caches: `capacity` split evenly over the trace's layers
    (ascending), the remainder one slot each to the first layers."""
    layers = sorted({layer for layer, _ in trace})
    base, extra = divmod(capacity, len(layers))
    return {layer: base + (i < extra) for i, layer in enumerate(layers)}


def per_layer_hits(calls: Sequence[Call], policy: str, capacity: int) -> int:
    """Hits with one cache per layer (slots from `layer_split`); a 0-slot layer always misses.
    A call's keys are all of one layer."""
    by_layer: dict[int, list[Call]] = defaultdict(list)
    for call in calls:
        by_layer[call[0][0]].append(call)
    hits = 0
    for layer, slots in layer_split(flatten(calls), capacity).items():
        if slots:
            sub = by_layer[layer]
            hits += (belady_hits(flatten(sub), slots) if policy == "belady"
                     else policy_hits(sub, policy, slots))
    return hits


def replay(trace: Sequence[ExpertKey], policy: str, capacity: int,
           calls: Sequence[Call] | None = None) -> float:
    """Hit rate of `policy` (one of POLICY_NAMES) over `trace` with `capacity` slots.

    `calls`: the trace grouped into the engine's calls (route CSVs: `route_calls`); without
    it every access is a call of its own."""
    if policy not in POLICY_NAMES:
        raise ReplayError(f"unknown policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    if capacity < 1:
        raise ReplayError(f"capacity must be at least one slot, got {capacity}")
    if not trace:
        raise ReplayError("the trace is empty: nothing to replay")
    if calls is None:
        calls = [(key,) for key in trace]
    elif flatten(calls) != list(trace):
        raise ReplayError("calls do not add up to the trace")
    if policy.endswith("/layer"):
        hits = per_layer_hits(calls, policy.removesuffix("/layer"), capacity)
    elif policy == "belady":
        hits = belady_hits(trace, capacity)
    else:
        hits = policy_hits(calls, policy, capacity)
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


def format_table(trace: Sequence[ExpertKey], capacities: Sequence[int], entry_bytes: int,
                 policies: Sequence[str] = POLICY_NAMES, calls: Sequence[Call] | None = None) -> str:
    """Hit rate per policy (columns) at each capacity (rows); GiB = the cache's size.
    `calls`: as in `replay`."""
    distinct = len(set(trace))
    width = max(9, *(len(p) + 1 for p in policies))
    head = f"{'slots':>7} {'of keys':>8} {'GiB':>8} |" + "".join(f"{p:>{width}}" for p in policies)
    lines = [head, "-" * len(head)]
    for cap in capacities:
        rates = [replay(trace, p, cap, calls) for p in policies]
        lines.append(
            f"{cap:7d} {cap / distinct:8.1%} {cap * entry_bytes / 2**30:8.1f} |"
            + "".join(f"{r:>{width}.1%}" for r in rates)
        )
    return "\n".join(lines)


def temporal_reuse(rows: Sequence[RouteRow], lag: int = 1) -> float:
    """Fraction of selections (token t, layer L, expert e), t past the first `lag` tokens,
    where e was also selected at layer L by one of the `lag` previous tokens."""
    positions = sorted({pos for pos, _, _ in rows})
    index = {pos: i for i, pos in enumerate(positions)}
    chosen = {(index[pos], layer): set(experts) for pos, layer, experts in rows}
    reused = total = 0
    for (t, layer), experts in chosen.items():
        if t < lag:
            continue
        recent = set().union(*(chosen.get((t - j, layer), set()) for j in range(1, lag + 1)))
        reused += len(experts & recent)
        total += len(experts)
    return reused / total if total else 0.0


def prefetch_replay(rows: Sequence[RouteRow], policy: str, capacity: int, top: int) -> tuple[float, float]:
    """Demand replay plus a trace-only prefetcher; returns (hit rate, admissions per access).

    After each layer call, the `top` experts of the next layer that co-occurred most often
    (same token, this trace so far) with this call's experts are admitted if not resident.
    Learned online from the routing alone: no hidden states, so this is not router lookahead.
    Replays one access at a time (not in calls like `policy_hits`).
    """
    accesses = route_accesses(rows)
    cache = _new_cache(policy, capacity, accesses)
    cooc: dict[tuple[int, int], Counter[int]] = defaultdict(Counter)  # (layer, e) -> next-layer experts
    by_token: dict[int, dict[int, tuple[int, ...]]] = defaultdict(dict)
    for pos, layer, experts in rows:
        by_token[pos][layer] = experts
    hits = admissions = 0
    for i, (pos, layer, experts) in enumerate(rows):
        for e in dict.fromkeys(experts):
            if cache.lookup((layer, e)) is None:
                cache.admit((layer, e))
                admissions += 1
            else:
                hits += 1
        following = by_token[pos].get(layer + 1)
        if following is not None:
            votes: Counter[int] = Counter()
            for e in experts:
                votes.update(cooc[layer, e])
            for e, _ in votes.most_common(top):
                if not cache.contains((layer + 1, e)):
                    cache.admit((layer + 1, e))
                    admissions += 1
            for e in experts:  # learn after predicting
                cooc[layer, e].update(following)
    return hits / len(accesses), admissions / len(accesses)


def horizon_hits(calls: Sequence[Call], capacity: int, tokens: int,
                 gamma: float = 0.93, prior: float = 0.1) -> int:
    """Hits of next-use's score given an oracle: the exact experts of the next `tokens`
    tokens (tokens x layers calls). An oracle, not a policy: it shows how much of Belady's
    lead comes from knowing the near future.

    Keys the horizon says are needed are evicted last, farthest next use first (with every
    future known this is Belady's MIN); the others by next-use's expected next use (the
    NextUsePolicy formula with the same gamma and prior, re-computed by a scan of the
    resident keys: O(capacity) per eviction). Calls in the engine's order (`serve_calls`)."""
    cycle = len({call[0][0] for call in calls})
    horizon = tokens * cycle
    uses: dict[ExpertKey, list[int]] = defaultdict(list)  # key -> indices of its calls
    for i, call in enumerate(calls):
        for key in call:
            uses[key].append(i)
    nxt = {key: 0 for key in uses}  # key -> position in uses[key] of its next call
    window = 1.0 / (1.0 - gamma)
    visits: Counter[int] = Counter()  # layer -> its visits so far
    last_visit: dict[int, int] = {}  # layer -> index of its last call
    count: dict[ExpertKey, tuple[float, int]] = {}  # key -> (decayed uses, its layer's visit then)
    resident: set[ExpertKey] = set()
    hits = 0
    for i, call in enumerate(calls):
        layer = call[0][0]
        visits[layer] += 1
        last_visit[layer] = i
        for key in call:
            nxt[key] += 1
        for key in call:
            if key in resident:
                hits += 1
                continue
            if len(resident) >= capacity:
                best, victim = None, None
                for r in resident.difference(call):
                    future = uses[r][nxt[r]] if nxt[r] < len(uses[r]) else len(calls) + horizon + 1
                    if future - i <= horizon:  # known: Belady's order, after every unknown key
                        rank = (0, future)
                    else:
                        value, at = count[r]
                        c = value * gamma ** (visits[r[0]] - at)
                        d = max(1, cycle - (i - last_visit[r[0]]))
                        rank = (1, d + cycle * ((window + 1.0) / (c + prior) - 1.0))
                    if best is None or rank > best:
                        best, victim = rank, r
                resident.discard(victim)
            resident.add(key)
        for key in call:
            value, at = count.get(key, (0.0, visits[layer]))
            count[key] = (value * gamma ** (visits[layer] - at) + 1.0, visits[layer])
    return hits


def route_report(names: Sequence[str], traces: Sequence[Sequence[RouteRow]],
                 capacities: Sequence[int], horizons: Sequence[int] = ()) -> str:
    """Temporal reuse, trace-only prefetch and warm starts for route CSV traces; with
    `horizons`, next-use's hit rate given the next H tokens exactly (`horizon_hits`)."""
    out = ["", "temporal reuse: share of a layer's selections also chosen by the previous 1 / 2 / 4 tokens"]
    for name, rows in zip(names, traces):
        out.append(f"  {name}: " + " / ".join(f"{temporal_reuse(rows, lag):.1%}" for lag in (1, 2, 4)))
    out.append("")
    out.append(f"trace-only prefetch ({DEFAULT_POLICY}): co-occurrence with the previous layer's experts,"
               " top 0 / 3 / 6; hit rate, reads per access")
    for name, rows in zip(names, traces):
        for cap in capacities:
            cells = [prefetch_replay(rows, DEFAULT_POLICY, cap, top) for top in (0, 3, 6)]
            out.append(f"  {name} {cap:5d} slots: " + "   ".join(f"{h:5.1%} {r:.3f}" for h, r in cells))
    if len(traces) >= 2:
        out.append("")
        out.append("warm start (warmed by the previous trace): cold / history only (flushed) / contents kept")
        calls = [route_calls(rows) for rows in traces]
        for i, name in enumerate(names):
            warm_name, warm = names[i - 1], calls[i - 1]
            for policy in ("lru", DEFAULT_POLICY):
                cells = []
                for cap in capacities:
                    n = len(flatten(calls[i]))
                    cold = policy_hits(calls[i], policy, cap) / n
                    hist = policy_hits(calls[i], policy, cap, warm, keep=False) / n
                    kept = policy_hits(calls[i], policy, cap, warm, keep=True) / n
                    cells.append(f"{cap}: {cold:.1%} {hist:.1%} {kept:.1%}")
                out.append(f"  {name} after {warm_name}, {policy:>8}: " + " | ".join(cells))
    if horizons:
        out.append("")
        out.append("next-use told the next H tokens' experts exactly (an oracle): hit rate for H = "
                   + " / ".join(map(str, horizons)) + ", then Belady")
        for name, rows in zip(names, traces):
            calls = route_calls(rows)
            n = len(flatten(calls))
            for cap in [c for c in capacities if c in HORIZON_SLOTS]:
                cells = [f"{horizon_hits(calls, cap, h) / n:.1%}" for h in horizons]
                cells.append(f"{belady_hits(flatten(calls), cap) / n:.1%}")
                out.append(f"  {name} {cap:5d} slots: " + " / ".join(cells))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="*", help="route CSV(s) or one engine JSONL trace")
    ap.add_argument("--synthetic", action="store_true", help="replay a seeded Zipf trace instead")
    ap.add_argument("--capacities", default=None,
                    help=f"default: {ROUTE_SLOTS} for route CSVs, 0.05,0.1,0.25,0.5 otherwise")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--entry-bytes", type=int, default=EXPERT_RECORD_BYTES)
    ap.add_argument("--no-dedupe", action="store_true",
                    help="JSONL: one access per (token, expert) instead of per distinct expert per call")
    ap.add_argument("--no-report", action="store_true", help="route CSVs: only the hit-rate tables")
    ap.add_argument("--horizons", default="",
                    help="route CSVs: also replay next-use told the next H tokens exactly, for each H "
                         "in this list (e.g. 0,1,2,4; slow: a scan per eviction)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf", type=float, default=1.0)
    args = ap.parse_args(argv)
    if args.synthetic == bool(args.trace):
        ap.error("give TRACE file(s) or --synthetic")
    try:
        policies = [p for p in args.policies.split(",") if p]
        for p in policies:
            if p not in POLICY_NAMES:
                raise ReplayError(f"unknown policy {p!r}; choose from {', '.join(POLICY_NAMES)}")
        routes = all(t.endswith(".csv") for t in args.trace) and bool(args.trace)
        grouped: dict[str, list[Call]] = {}  # route CSVs: replayed call by call
        if args.synthetic:
            sources = {f"synthetic Zipf(s={args.zipf}) trace, {args.steps} steps, seed {args.seed}":
                       synthetic_trace(steps=args.steps, zipf=args.zipf, seed=args.seed)}
        elif routes:
            rows = [read_route_csv(t) for t in args.trace]
            sources = {t: route_accesses(r) for t, r in zip(args.trace, rows)}
            grouped = {t: route_calls(r) for t, r in zip(args.trace, rows)}
        elif len(args.trace) == 1:
            sources = {args.trace[0]: list(read_trace(args.trace[0], dedupe=not args.no_dedupe))}
        else:
            raise ReplayError("give one JSONL trace, or route CSV files only")
        default_caps = ROUTE_SLOTS if routes else "0.05,0.1,0.25,0.5"
        capacities = {}
        for source, trace in sources.items():
            if not trace:
                raise ReplayError(f"{source} holds no expert accesses")
            capacities[source] = parse_capacities(args.capacities or default_caps, len(set(trace)))
            print(f"{source}: {len(trace)} accesses, {len(set(trace))} distinct experts; "
                  f"hit rate (default policy: {DEFAULT_POLICY})")
            print(format_table(trace, capacities[source], args.entry_bytes, policies,
                               grouped.get(source)))
        if routes and not args.no_report:
            try:
                horizons = [int(h) for h in args.horizons.split(",") if h.strip()]
            except ValueError:
                raise ReplayError(f"--horizons {args.horizons!r} must be a list of token counts") from None
            print(route_report([Path(t).stem for t in args.trace], rows,
                               [c for c in capacities[args.trace[0]] if c <= 2048], horizons))
    except (ReplayError, TraceFormatError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
