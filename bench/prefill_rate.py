"""A prefill chunk's wall time and its host's share, many times over, through the app's `Engine` (CUDA).

    python -m bench.prefill_rate [--tokens 728] [--repeat 15] [--layers 43] [--experts 24]
                                 [--workdir /tmp/dsv4fd]

Builds (or reuses) the pack of bench/full_depth.py and loads it with every expert resident, then
prefills `--tokens` tokens (one chunk) into a fresh state `--repeat` times after one unmeasured
call. Per call it times `Runtime.launch` (the host queueing every kernel of the chunk; it returns
before the device is done; also in the process's CPU time, which a busy or throttled host core
does not inflate as it does the wall time) and `Runtime.finish` (the wait for the device). When the launch takes
nearly all the wall time the chunk is host-bound: its launches, not its kernels, set the rate.
Prints the median, the fastest and the slowest call; a single run of bench/full_depth.py
measures one call, whose spread on one machine is wide (docs/performance-log.md, 2026-12-03).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=728)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=24)
    p.add_argument("--workdir", default="/tmp/dsv4fd")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.prefill_rate needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.tokens < 17 or a.repeat < 1:
        print("bench.prefill_rate: --tokens must be > 16 (shorter prompts are not eager chunks) and --repeat >= 1",
              file=sys.stderr)
        return 2

    from bench.full_depth import build_pack
    from engine.config import EngineConfig
    from engine.engine import Engine

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    pack = build_pack(workdir, a.layers, a.experts)
    eng = Engine.load(pack, EngineConfig(device="cuda", backend="tilelang", prefill_chunk=max(2048, a.tokens)))
    runtime, model = eng.runtime, eng.model
    ids = [int(i) for i in torch.randint(1000, 60000, (a.tokens,), generator=torch.Generator().manual_seed(0))]
    launch_s, wall_s, cpu_s = [], [], []
    for i in range(a.repeat + 1):
        state = model.new_state()
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        launched = runtime.launch(state, ids)
        t1, c1 = time.perf_counter(), time.process_time()
        runtime.finish(launched)
        t2 = time.perf_counter()
        if i:  # the first call is not measured
            launch_s.append(t1 - t0)
            wall_s.append(t2 - t0)
            cpu_s.append(c1 - c0)
    order = sorted(range(a.repeat), key=wall_s.__getitem__)
    med = order[len(order) // 2]
    for name, k in (("median", med), ("fastest", order[0]), ("slowest", order[-1])):
        print(f"{a.tokens} tokens, {name}: {1e3 * wall_s[k]:.1f} ms = {a.tokens / wall_s[k]:.0f} tok/s, "
              f"of which launching {1e3 * launch_s[k]:.1f} ms ({1e3 * cpu_s[k]:.1f} ms of CPU time)", flush=True)
    print(f"launch share: median {statistics.median(l / w for l, w in zip(launch_s, wall_s)):.0%} "
          f"over {a.repeat} calls", flush=True)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
