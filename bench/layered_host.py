"""The host's work between two segments of a layered decode step, on the CPU.

    python -m bench.layered_host [--trace ../shared/traces/route_W130.csv] [--share 0.78]
                                 [--layers 43] [--experts 256] [--workdir /tmp/dsv4-host-routes]

With a bounded expert cache the decode runner replays one graph per layer and, between two of
them, the host reads the layer's routes and makes its experts resident (engine/decode_graph.py,
`DecodeRunner._run`); the device idles meanwhile. When every expert of the layer is resident
already with no read pending (`provider.resident`), the runner launches the segment first and
lets `acquire` do its bookkeeping while the device runs it. This times, through the engine's own
provider (StreamingExperts over the tiny model's pack at `--layers` x `--experts`, a cache of
`--share` of the pool, warmed by one pass over the trace), the host work that stands between a
layer's routes and its segment's launch: `acquire` (the order that acquires first) against
`resident` plus the slot table's sync (the order for resident layers; `acquire` then runs off that
path), alternating two providers over the trace's tokens (layers 3.. from the route CSV, the hash
layers 0-2 from the token's first recorded layer). Prints the median microseconds per layer and
checks that both leave the same cache statistics and usage.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.host_routes import ROOT, trace_pack_policy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.layered_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=ROOT.parent / "shared" / "traces" / "route_W130.csv")
    p.add_argument("--policy", default=None, help="the cache policy (default: the engine's)")
    p.add_argument("--share", type=float, default=0.78, help="the expert cache's share of the pool")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="passes over the trace after the warming one")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/dsv4-host-routes"))
    a = p.parse_args(argv)
    if not 0 < a.share <= 1:
        raise SystemExit("bench.layered_host: --share must be in (0, 1]")

    from engine.weights import open_model

    steps, pack, policy = trace_pack_policy("bench.layered_host", a)
    providers = {}
    for way in ("acquire first", "resident first"):
        probe = open_model(pack)
        record, pool = probe.experts.store.record_bytes, len(probe.experts.main_layers) * probe.experts.store.count
        probe.close()
        files = open_model(pack, cache_bytes=int(a.share * pool) * record, policy=policy)
        for routes in steps:  # warm: the trace's working set, as a conversation's earlier turns leave it
            for layer, ids in enumerate(routes):
                files.experts.acquire(layer, ids)
                files.experts.release(layer)
        providers[way] = files
    path: dict[str, list[float]] = {way: [] for way in providers}  # µs between routes and launch
    off: list[float] = []  # resident first: acquire after the launch
    resident_layers = layers = 0
    for _ in range(a.rounds):
        for routes in steps:
            for layer, ids in enumerate(routes):
                layers += 1
                first = providers["acquire first"].experts
                t = time.perf_counter()
                first.acquire(layer, ids)
                path["acquire first"].append(time.perf_counter() - t)
                first.release(layer)
                later = providers["resident first"].experts
                t = time.perf_counter()
                ready = later.resident(layer, ids)
                if ready:
                    later.arena.sync_table()
                else:
                    later.acquire(layer, ids)
                path["resident first"].append(time.perf_counter() - t)
                if ready:
                    resident_layers += 1
                    t = time.perf_counter()
                    later.acquire(layer, ids)
                    off.append(time.perf_counter() - t)
                later.release(layer)
    one, two = (providers[way].experts for way in providers)
    same = one.cache.stats() == two.cache.stats() and one.usage.uses == two.usage.uses
    hit_rate = one.cache.stats().hit_rate
    print(f"{pack.name}, policy {policy}, cache {a.share:.0%} of the pool, {len(steps)} tokens of "
          f"{a.trace.name} x {a.rounds} after one warming pass ({a.layers} layers, 6 experts each; "
          f"{resident_layers} of {layers} layers resident at their turn, hit rate {hit_rate:.3f}):")
    for way, ts in path.items():
        print(f"  {way:>14}: {1e6 * statistics.median(ts):7.1f} us per layer between its routes and its "
              f"segment's launch (median of {len(ts)}; mean {1e6 * statistics.fmean(ts):.1f})")
    if off:
        print(f"  {'':>14}  acquire after the launch: {1e6 * statistics.median(off):7.1f} us per resident "
              f"layer (median), beside the device's segment")
    print(f"  same statistics and usage: {same}")
    for files in providers.values():
        files.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
