"""What one launch of a given size can reach on this GPU, against the 1 GiB copy ceiling.

bench.kernels rates every kernel against the device-to-device copy bandwidth of 1 GiB. A decode
kernel moves 1-60 MB per launch, where a fixed cost per launch (first loads, last wave) weighs
in. This prints, in one run: graphed copies and read-only reductions (torch's fp32 sum and amax)
of 27-428 MB, each timed like bench.kernels' rows (a CUDA graph of calls over rotating buffers
that together exceed L2), and the routed FP4 GEMVs (w1+w3 and w2 of 6-48 experts in one launch,
through bench.kernels.fp4_tile_rows: the CUDA-core kernel and the one-token tensor-core one,
early), whose slope is their steady rate.

    python -m bench.ceilings
"""

import argparse

import torch

from bench.kernels import copy_bandwidth, fp4_arena, fp4_tile_rows, time_calls

SIZES_MB = (27, 54, 107, 428)
EXPERTS = (6, 12, 24, 48)


def _buffers(nbytes: int, dev) -> list[torch.Tensor]:
    return [torch.randn(nbytes // 4, device=dev) for _ in range(max(3, 1000 * 2 ** 20 // nbytes))]


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.ceilings needs a CUDA GPU")
    from kernels.act_quant import cuda_arch
    from kernels.fp4_mma1 import mma1_tile
    from kernels.fp4_moe import gemv_tile

    dev = torch.device("cuda")
    ceiling = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy of 1 GiB {ceiling / 1e9:.0f} GB/s (read + write)")

    def show(what: str, nbytes: int, seconds: float) -> None:
        bw = nbytes / seconds
        print(f"| {what:44s} | {nbytes / 1e6:8.1f} MB | {seconds * 1e6:8.2f} us | {bw / 1e9:5.0f} GB/s | "
              f"{100 * bw / ceiling:5.1f}% |")

    for mb in SIZES_MB:
        bufs = _buffers(mb << 20, dev)
        out = torch.empty(len(bufs), device=dev)
        half = bufs[0].numel() // 2  # a copy of half a buffer moves mb MB (read + write)
        t, _ = time_calls([(lambda i=i: bufs[(i + 1) % len(bufs)][:half].copy_(bufs[i][:half]))
                           for i in range(len(bufs))] * 2)
        show(f"copy, {mb // 2} MB read + {mb // 2} MB written", mb << 20, t)
        for name, op in (("sum", torch.sum), ("amax", torch.amax)):
            t, _ = time_calls([(lambda i=i: op(bufs[i], dim=0, out=out[i])) for i in range(len(bufs))] * 2)
            show(f"read only, torch fp32 {name}", mb << 20, t)
        del bufs

    n, k = 2048, 4096
    arena = fp4_arena(64, 2 * n, k, dev)  # records: w1|w3 weights, then their scales
    arch = cuda_arch(dev)
    for g in EXPERTS:  # both kernels at decode's one-token tiles: w1+w3 of g experts, then w2
        for name, nbytes, t, _ in fp4_tile_rows(dev, arena, n, k, g, 1, [gemv_tile(n, arch, 2 * g)], [],
                                                [(*mma1_tile(k), True)]):
            show(name, nbytes, t)


if __name__ == "__main__":
    main()
