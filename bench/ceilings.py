"""What one launch of a given size can reach on this GPU, against the 1 GiB copy ceiling.

bench.kernels rates every kernel against the device-to-device copy bandwidth of 1 GiB. A decode
kernel moves 1-60 MB per launch, where a fixed cost per launch (first loads, last wave) weighs
in. This prints, in one run: graphed copies and read-only reductions (torch's fp32 sum and amax)
of 27-428 MB, each timed like bench.kernels' rows (a CUDA graph of calls over rotating buffers
that together exceed L2), and the routed FP4 GEMV (w1+w3 of 6-48 experts in one launch, the
one-token tensor-core kernel and the CUDA-core one), whose slope is its steady rate.

    python -m bench.ceilings
"""

import argparse

import torch

from bench.kernels import CALLS_PER_GRAPH, copy_bandwidth, fp4_arena, time_calls, time_rotating

SIZES_MB = (27, 54, 107, 428)
EXPERTS = (6, 12, 24, 48)


def _buffers(nbytes: int, dev) -> list[torch.Tensor]:
    return [torch.randn(nbytes // 4, device=dev) for _ in range(max(3, 1000 * 2 ** 20 // nbytes))]


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.ceilings needs a CUDA GPU")
    from kernels.act_quant import act_quant, cuda_arch
    from kernels.fp4_mma1 import fp4_mma1_kernel, mma1_tile
    from kernels.fp4_moe import fp4_gemv_kernel, gemv_tile
    from kernels.fp8_gemm import as_words

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
    arena = fp4_arena(2 * max(EXPERTS) + 16, 2 * n, k, dev)  # records: w1|w3 weights, then their scales
    arch = cuda_arch(dev)
    q, sq = act_quant(torch.randn(1, 1, k, device=dev).to(torch.bfloat16), 128)
    w_off, s_off = (0, n * k // 2), (n * k, n * k + n * k // 32)
    per = n * k // 2 + n * k // 32
    core = fp4_gemv_kernel(1, n, k, arena.shape[1], w_off, arena.shape[1], s_off, *gemv_tile(n, arch, 12),
                           "bfloat16", arch)
    mma1 = fp4_mma1_kernel(n, k, arena.shape[1], w_off, arena.shape[1], s_off, *mma1_tile(k), "bfloat16", arch,
                           False, True)
    for g in EXPERTS:
        y = torch.empty(2, g, 1, n, dtype=torch.bfloat16, device=dev)
        tables = [torch.randperm(arena.shape[0], device=dev)[:g].to(torch.int32) for _ in range(CALLS_PER_GRAPH)]
        for name, kernel, scales in (("tensor cores, early", mma1, as_words(arena)), ("CUDA cores", core, arena)):
            t, _ = time_rotating(tables, lambda s: kernel(as_words(q), sq, as_words(arena), scales, s, y))
            show(f"fp4 w1+w3 of {g} experts, {name}", 2 * g * per, t)


if __name__ == "__main__":
    main()
