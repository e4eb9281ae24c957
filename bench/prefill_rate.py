"""A prefill chunk's wall time and its host's share, many times over, through the app's `Engine` (CUDA).

    python -m bench.prefill_rate [--tokens 728[,700,...]] [--repeat 15] [--layers 43] [--experts 24]
                                 [--workdir /tmp/dsv4fd] [--pack DIR] [--device cuda]

Builds (or reuses) the pack of bench/full_depth.py (or takes `--pack`) and loads it with every
expert resident, then
prefills each `--tokens` length (one chunk) into a fresh state once (the first call at that
length, reported alone: what a user's prompt of a new length meets), then `--repeat` times. Per call it times `Runtime.launch` (the host queueing every kernel of the chunk; it returns
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
    p.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[728])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=24)
    p.add_argument("--workdir", default="/tmp/dsv4fd")
    p.add_argument("--pack", help="a converted pack to load instead of bench/full_depth.py's")
    p.add_argument("--device", default="cuda", help="cuda (the figures), or cpu (the torch reference: a smoke "
                   "run of the script itself)")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench.prefill_rate needs a CUDA GPU (or --device cpu)", file=sys.stderr)
        return 2
    if min(a.tokens) < 17 or a.repeat < 1:
        print("bench.prefill_rate: --tokens must be > 16 (shorter prompts are not eager chunks) and --repeat >= 1",
              file=sys.stderr)
        return 2

    from bench.full_depth import build_pack
    from engine.config import EngineConfig
    from engine.engine import Engine

    if a.pack:
        pack = Path(a.pack)
    else:
        workdir = Path(a.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        pack = build_pack(workdir, a.layers, a.experts)
    eng = Engine.load(pack, EngineConfig(device=a.device, backend="tilelang" if cuda else "torch"))
    for n in a.tokens:
        measure(eng, n, a.repeat)
    eng.close()
    return 0


def _sync(eng) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def measure(eng, n: int, repeat: int) -> None:
    """Time the first prefill of n tokens, then `repeat` more; print the figures."""
    runtime, model = eng.runtime, eng.model
    ids = [int(i) for i in torch.randint(1000, 60000, (n,), generator=torch.Generator().manual_seed(0))]
    launch_s, wall_s, cpu_s = [], [], []
    for _ in range(repeat + 1):
        state = model.new_state()
        _sync(eng)
        t0, c0 = time.perf_counter(), time.process_time()
        launched = runtime.launch(state, ids)
        t1, c1 = time.perf_counter(), time.process_time()
        runtime.finish(launched)
        t2 = time.perf_counter()
        launch_s.append(t1 - t0)
        wall_s.append(t2 - t0)
        cpu_s.append(c1 - c0)

    def line(name: str, k: int) -> str:
        return (f"{n} tokens, {name}: {1e3 * wall_s[k]:.1f} ms = {n / wall_s[k]:.0f} tok/s, of which launching "
                f"{1e3 * launch_s[k]:.1f} ms ({1e3 * cpu_s[k]:.1f} ms of CPU time)")
    print(line("first call", 0), flush=True)
    order = sorted(range(1, repeat + 1), key=wall_s.__getitem__)
    for name, k in (("median", order[len(order) // 2]), ("fastest", order[0]), ("slowest", order[-1])):
        print(line(name, k), flush=True)
    print(f"launch share: median {statistics.median(l / w for l, w in zip(launch_s[1:], wall_s[1:])):.0%} "
          f"over {repeat} calls", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
