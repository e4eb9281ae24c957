"""Does warming L2 beside a chain of small kernels speed up the big read after it?

A decode layer is big weight reads separated by chains of small, latency-bound kernels
(kernels/l2_prefetch.py). This times, per decode weight shape, one CUDA graph of iterations
"a chain of `--chain` dependent RMSNorms ([1, 4096], PDL kernels like the step's), then the
one-token FP8 GEMV", over weight copies that together exceed L2 (each GEMV's weight is cold),
with the next GEMV's weight prefetched on a second stream forked at the chain's start
(`--bytes` MiB of its head: 0 = no prefetch), joined once at the graph's end as the engine's
warm lane is. Also printed: the GEMV alone on cold weights and on one hot weight, the chain
alone, and the prefetch alone (whole weight, cold), against the 1 GiB copy ceiling of the same run.

    python -m bench.l2_prefetch [--chain 5] [--bytes 0,8,16,24,32,64]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.kernels import FP8_DECODE_SHAPES, copy_bandwidth
from engine.numerics import FP8Weight
from kernels.backend import make_backend
from kernels.l2_prefetch import l2_prefetch_kernel
from kernels.toolkit import cuda_arch

ROTATION_BYTES = 640 << 20  # weight copies per shape: together well above the H200's L2
ITERATIONS = 64  # per graph


def _weights(n: int, k: int, dev) -> list[FP8Weight]:
    copies = max(2, -(-ROTATION_BYTES // (n * k)))
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev).mul(40).to(torch.float8_e4m3fn)
        s = torch.randint(118, 128, ((n + 127) // 128, k // 128), device=dev, dtype=torch.uint8)
        out.append(FP8Weight.of(w, s.view(torch.float8_e8m0fnu)))
    return out


def _graph_seconds(body, side: torch.cuda.Stream | None = None, reps: int = 15) -> float:
    """Median seconds of one replay of a graph of `body()` (which forks onto `side` when given,
    joined at the end), divided by ITERATIONS."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
        if side is not None:  # a capture must join what it forked (and only that)
            torch.cuda.current_stream().wait_stream(side)
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times[2:]) / ITERATIONS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chain", type=int, default=5, help="dependent RMSNorms before each GEMV")
    p.add_argument("--bytes", type=lambda v: [int(x) for x in v.split(",")], default=[0, 8, 16, 24, 32, 64],
                   help="MiB of the next weight's head to prefetch (0: none)")
    p.add_argument("--spans", type=lambda v: [int(x) for x in v.split(",")], default=[4, 16, 64],
                   help="KiB per prefetch request, for the prefetch-alone rows")
    p.add_argument("--shapes", default="wq_a|wkv,wq_b,wo_b,shared w1|w3")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    be = make_backend("tilelang", dev)
    ceiling = copy_bandwidth(dev)
    print(f"copy ceiling {ceiling / 1e9:,.0f} GB/s (1 GiB, read + write)")
    side = torch.cuda.Stream()
    g = torch.ones(4096, device=dev)
    h0 = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)

    def chain():
        h = h0
        for _ in range(a.chain):
            h = be.rms_norm(h, g, 1e-6)

    t_chain = _graph_seconds(lambda: [chain() for _ in range(ITERATIONS)])
    print(f"chain of {a.chain} RMSNorms alone: {t_chain * 1e6:.1f} us")
    wanted = a.shapes.split(",")
    for name, n, k in FP8_DECODE_SHAPES:
        if name not in wanted:
            continue
        ws = _weights(n, k, dev)
        nbytes = n * k
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        q, s = be.act_quant(x, 128)

        def gemv(w):
            be.fp8_gemm_quantized(q, s, w.weight, w.scale, w.scale_f32)

        cold = _graph_seconds(lambda: [gemv(ws[i % len(ws)]) for i in range(ITERATIONS)])
        hot = _graph_seconds(lambda: [gemv(ws[0]) for _ in range(ITERATIONS)])
        print(f"\n{name} [{n}, {k}] {nbytes / 2**20:.1f} MiB: GEMV cold {cold * 1e6:.2f} us "
              f"({nbytes / cold / ceiling:.0%} of copy), hot {hot * 1e6:.2f} us")
        for kib in a.spans:
            kernel = l2_prefetch_kernel(kib << 10, cuda_arch(dev))
            words = [w.weight.view(-1).view(torch.int32) for w in ws]
            warm = _graph_seconds(lambda: [kernel(words[i % len(ws)]) for i in range(ITERATIONS)])
            print(f"  prefetch alone, {kib} KiB requests: {warm * 1e6:.2f} us ({nbytes / warm / ceiling:.0%} of copy)")
        for mib in a.bytes:
            pb = min(mib << 20, nbytes)

            def body():
                for i in range(ITERATIONS):
                    w = ws[i % len(ws)]
                    if pb:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            be.l2_prefetch(w.weight, pb)
                    chain()
                    gemv(w)

            t = _graph_seconds(body, side if pb else None)
            print(f"  chain + GEMV, prefetch {pb / 2**20:5.1f} MiB: {t * 1e6:6.2f} us "
                  f"(chain + cold GEMV {(t_chain + cold) * 1e6:.2f}; saved {(t_chain + cold - t) * 1e6:+.2f})")


if __name__ == "__main__":
    main()
