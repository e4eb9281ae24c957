"""The host's work to count one whole-mode decode step's routes at full depth, on the CPU.

    python -m bench.host_routes [--trace ../shared/traces/route_W130.csv] [--policy next-use]
                                [--layers 43] [--experts 256] [--workdir /tmp/dsv4-host-routes]

Once a graphed step has run, the decode runner counts its routes (every layer's six experts) on the
host, beside the next step on the GPU: the expert cache's lookups and the usage counts
(engine/decode_graph.py, `DecodeRunner._count`; a cache holding every expert tells its eviction
policy nothing, engine/experts/cache.py). This times that accounting through
the engine's own provider (StreamingExperts over the tiny model's pack at `--layers` x `--experts`,
every expert resident, as in whole mode): layer by layer (`record`, a call per layer) and in one
call per step (`record_routes`, what the runner calls), alternating, over the trace's tokens
(layers 3.. from the route CSV, the hash layers 0-2 from the token's first recorded layer). Prints
the median host microseconds per step of each and checks that both leave the same statistics.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def step_routes(trace_path: Path, layers: int, experts: int) -> list[list[list[int]]]:
    """Per token of the trace, every layer's expert ids (modulo `experts`, duplicates moved on as
    the engine's forced routing does)."""
    from engine.routing_override import map_choice, read_route_csv

    trace = read_route_csv(trace_path)
    steps = []
    for token_experts, token_weights in zip(trace.experts, trace.weights):
        by_layer = dict(zip(trace.layers, (map_choice(e, w, 6, experts)
                                           for e, w in zip(token_experts, token_weights))))
        first = by_layer[trace.layers[0]]
        steps.append([by_layer.get(layer, first) for layer in range(layers)])
    return steps


def trace_pack_policy(prog: str, a: argparse.Namespace) -> tuple[list[list[list[int]]], Path, str]:
    """(`step_routes` of `a.trace`, the tiny model's pack at `a.layers` x `a.experts`, the cache
    policy: `a.policy` or the engine's) for the CPU host benches; a bad trace exits naming `prog`."""
    from bench.launch_count import tiny_pack
    from engine.config import EngineConfig
    from engine.routing_override import RoutingTraceError

    try:
        steps = step_routes(a.trace, a.layers, a.experts)
    except RoutingTraceError as err:
        raise SystemExit(f"{prog}: {err}") from None
    return steps, tiny_pack(a.workdir, a.layers, a.experts), a.policy or EngineConfig().cache_policy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_routes", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "route_W130.csv")
    p.add_argument("--policy", default=None, help="the cache policy (default: the engine's)")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="passes over the trace, each way")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/dsv4-host-routes"))
    a = p.parse_args(argv)

    from engine.weights import open_model

    steps, pack, policy = trace_pack_policy("bench.host_routes", a)
    providers = {}
    for way in ("record", "record_routes"):
        files = open_model(pack, policy=policy)
        if not files.experts.load_all():
            raise SystemExit("bench.host_routes: the pool did not fit its budget")
        providers[way] = files
    times: dict[str, list[float]] = {way: [] for way in providers}
    for _ in range(a.rounds):
        for routes in steps:
            for way, files in providers.items():
                provider = files.experts
                t = time.perf_counter()
                if way == "record":
                    for layer, ids in enumerate(routes):
                        provider.record(layer, ids)
                else:
                    provider.record_routes(routes)
                times[way].append(time.perf_counter() - t)
    one, many = (providers[way].experts for way in ("record", "record_routes"))
    same = (one.cache.stats() == many.cache.stats() and one.usage.uses == many.usage.uses
            and one.hottest(64) == many.hottest(64))
    print(f"{pack.name}, policy {policy}, {len(steps)} tokens of {a.trace.name} x {a.rounds} "
          f"({a.layers} layers, 6 experts each, every expert resident):")
    for way, ts in times.items():
        print(f"  {way:>14}: {1e6 * statistics.median(ts):7.0f} us per step (median of {len(ts)})")
    print(f"  same statistics, usage and hottest: {same}")
    for files in providers.values():
        files.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
