"""What one launch of a given size can reach on this GPU, against the 1 GiB copy ceiling.

bench.kernels rates every kernel against the device-to-device copy bandwidth of 1 GiB. A decode
kernel moves 1-60 MB per launch. This prints, in one run, at each size (`--sizes`, MiB): graphed
copies, torch's read-only fp32 sum and amax, a plain streaming read (`read_kernel`) and the same
read as a link of a dependent chain (`chained_read_kernel`), each timed like bench.kernels' rows (a
CUDA graph of calls over rotating buffers that together exceed L2); then the routed FP4 GEMVs
(w1+w3 and w2 of 6-48 experts in one launch, through bench.kernels.fp4_tile_rows: the CUDA-core
kernel and the one-token tensor-core one, early), whose slope is their steady rate.
H200, one run: the streaming read with PDL (`early`) reached 92-99 % of the copy bandwidth at
27 MB and 100-102 % at 54 MB (without PDL 84-85 % and 95-96 %), where torch's sum reached 47 %
and 66 %. Smaller launches lose a fixed cost even so: the chained read (kernels/pdl.py's protocol,
one dependent read and one write after the wait) reached 37.5-37.6 % at 2 MiB, 60.9-61.6 % at
6 MiB (two runs), 68.3-69.1 % at 8 MiB, 91.7-93.8 % at 16 MiB (three runs each) and 97.2 % at
32 MiB (one). Released first (its successor launches once all its CTAs have issued their loads,
not after its wait; one run): 39.2 % at 2 MiB, 70.9 % at 6 MiB, 83.6 % at 8 MiB and 100.8 % at
16 MiB. (An earlier variant that released before issuing its loads: 43.3 %, 87.5 % and 102.0 % at
2, 8 and 16 MiB.) That order did not speed up the decode: see kernels/pdl.py.

    python -m bench.ceilings
"""

import argparse
import functools

import torch

from bench.kernels import copy_bandwidth, fp4_arena, fp4_tile_rows, time_calls

SIZES_MB = (6, 8, 16, 27, 54, 107, 428)
EXPERTS = (6, 12, 24, 48)
READ_TILES = ((256, 4, False), (256, 8, False), (256, 8, True), (256, 16, True), (128, 16, True))
# (threads, 16-byte vectors per thread, early) of the streaming read
CHAINED_TILE = (256, 16)  # that of the chained read


def _stream_macros(T, threads: int, unroll: int):
    """(load, fold) TileLang macros of the streaming reads: load(X, v, bx, tid) issues the thread's
    `unroll` 16-byte vectors of CTA bx's range into v [unroll, 4]; fold(v, acc) XORs them into acc[0]."""
    per_cta = threads * unroll  # 16-byte vectors

    @T.macro
    def load(X, v, bx, tid):
        for u in T.unroll(unroll):
            for j in T.vectorized(4):
                v[u, j] = X[bx * per_cta + u * threads + tid, j]

    @T.macro
    def fold(v, acc):
        for u in T.unroll(unroll):
            for j in T.unroll(4):
                acc[0] = acc[0] ^ v[u, j]

    return load, fold


@functools.cache
def read_kernel(words: int, threads: int, unroll: int, arch: tuple[int, int], early: bool):
    """A streaming read of `words` int32 (a multiple of 4·threads·unroll): every thread loads
    `unroll` 16-byte vectors (all issued before their XOR), and writes nothing unless the XOR of
    its words is a sentinel, so the loads cannot be dropped. The best a read-only launch of that
    size can do, for the kernels' figures to be set against. `early`: PDL as fp4_mma_one_token's early
    (loads issued before the wait on the kernel before); else no PDL, as torch's kernels."""
    import tilelang.language as T

    from kernels import pdl
    from kernels.toolkit import UNGUARDED, compile_kernel

    per_cta = threads * unroll  # 16-byte vectors
    load, fold = _stream_macros(T, threads, unroll)

    @T.prim_func
    def read(X: T.Tensor((words // 4, 4), "int32"), OUT: T.Tensor((1,), "int32")):
        with T.Kernel(words // 4 // per_cta, threads=threads) as bx:
            tid = T.get_thread_binding(0)
            v = T.alloc_local((unroll, 4), "int32")
            acc = T.alloc_local((1,), "int32")
            load(X, v, bx, tid)
            if early:
                pdl.begin(T, arch)
            acc[0] = 0
            fold(v, acc)
            if acc[0] == 0x5A5A5A5A:
                OUT[0] = acc[0]

    return compile_kernel(read, arch, pass_configs=UNGUARDED)


@functools.cache
def chained_read_kernel(words: int, threads: int, unroll: int, arch: tuple[int, int], release_first: bool = False):
    """`read_kernel`'s early streaming read as a link of a dependent chain: after its wait every
    thread also reads PREV[0], which the link before wrote, and one thread writes NEXT[0] =
    PREV[0] + 1. The least a decode GEMV does beyond reading its weight (one read of what its
    predecessor wrote, one write its successor reads): the ceiling for the GEMVs' chained figures.
    `release_first`: the grid lets its successor launch once every CTA has issued its loads (before
    its wait), instead of after its wait as kernels/pdl.py's `begin` does."""
    import tilelang.language as T

    from kernels import pdl
    from kernels.toolkit import UNGUARDED, compile_kernel

    per_cta = threads * unroll  # 16-byte vectors
    load, fold = _stream_macros(T, threads, unroll)

    @T.prim_func
    def chained_read(X: T.Tensor((words // 4, 4), "int32"), PREV: T.Tensor((1,), "int32"),
                     NEXT: T.Tensor((1,), "int32")):
        with T.Kernel(words // 4 // per_cta, threads=threads) as bx:
            tid = T.get_thread_binding(0)
            v = T.alloc_local((unroll, 4), "int32")
            acc = T.alloc_local((1,), "int32")
            load(X, v, bx, tid)
            if release_first and pdl.enabled(arch):  # the other order than pdl.begin's
                T.evaluate(T.pdl_trigger())
                T.evaluate(T.pdl_sync())
            else:
                pdl.begin(T, arch)
            acc[0] = PREV[0]
            fold(v, acc)
            if bx == 0 and tid == 0:
                NEXT[0] = PREV[0] + T.if_then_else(acc[0] == 0x5A5A5A5A, 2, 1)

    return compile_kernel(chained_read, arch, pass_configs=UNGUARDED)


def _buffers(nbytes: int, dev) -> list[torch.Tensor]:
    return [torch.randn(nbytes // 4, device=dev) for _ in range(max(3, 1000 * 2 ** 20 // nbytes))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_MB), metavar="MB",
                        help=f"launch sizes in MiB (default {' '.join(map(str, SIZES_MB))})")
    parser.add_argument("--skip-fp4", action="store_true", help="leave out the routed FP4 GEMV rows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.ceilings needs a CUDA GPU")
    from kernels import pdl
    from kernels.toolkit import cuda_arch
    from kernels.fp4_mma_one_token import mma_tile
    from kernels.fp4_moe import gemv_tile

    dev = torch.device("cuda")
    arch = cuda_arch(dev)
    ceiling = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}: copy of 1 GiB {ceiling / 1e9:.0f} GB/s (read + write)")

    def show(what: str, nbytes: int, seconds: float) -> None:
        bw = nbytes / seconds
        print(f"| {what:44s} | {nbytes / 1e6:8.1f} MB | {seconds * 1e6:8.2f} us | {bw / 1e9:5.0f} GB/s | "
              f"{100 * bw / ceiling:5.1f}% |")

    for mb in args.sizes:
        bufs = _buffers(mb << 20, dev)
        out = torch.empty(len(bufs), device=dev)
        half = bufs[0].numel() // 2  # a copy of half a buffer moves mb MB (read + write)
        t, _ = time_calls([(lambda i=i: bufs[(i + 1) % len(bufs)][:half].copy_(bufs[i][:half]))
                           for i in range(len(bufs))] * 2)
        show(f"copy, {mb // 2} MB read + {mb // 2} MB written", mb << 20, t)
        for name, op in (("sum", torch.sum), ("amax", torch.amax)):
            t, _ = time_calls([(lambda i=i: op(bufs[i], dim=0, out=out[i])) for i in range(len(bufs))] * 2)
            show(f"read only, torch fp32 {name}", mb << 20, t)
        words = bufs[0].numel()
        sentinel = torch.zeros(1, dtype=torch.int32, device=dev)
        for threads, unroll, early in READ_TILES:
            if words % (4 * threads * unroll) == 0:
                kern = read_kernel(words, threads, unroll, arch, early)
                t, _ = time_calls([(lambda i=i: kern(bufs[i].view(torch.int32).view(-1, 4), sentinel))
                                   for i in range(len(bufs))] * 2)
                show(f"read only, {threads} threads x {unroll} vectors{' early' if early else ''}", mb << 20, t)
        threads, unroll = CHAINED_TILE
        for release_first in (False, True) if words % (4 * threads * unroll) == 0 and pdl.enabled(arch) else ():
            kern = chained_read_kernel(words, threads, unroll, arch, release_first)
            dep = torch.zeros(2, dtype=torch.int32, device=dev)
            t, _ = time_calls([(lambda i=i: kern(bufs[i].view(torch.int32).view(-1, 4), dep[i % 2:i % 2 + 1],
                                                 dep[1 - i % 2:2 - i % 2])) for i in range(2 * (len(bufs) // 2))] * 2)
            show(f"chained read, {threads} x {unroll} early{', released first' if release_first else ''}", mb << 20, t)
        del bufs

    if args.skip_fp4:
        return
    n, k = 2048, 4096
    arena = fp4_arena(64, 2 * n, k, dev)  # records: w1|w3 weights, then their scales
    tiles, ksplit, depth = mma_tile(k)  # w1+w3's tile, w2 timed at it too (each row names its tile)
    for g in EXPERTS:  # both kernels at decode's one-token tiles: w1+w3 of g experts, then w2
        for name, nbytes, t, _ in fp4_tile_rows(dev, arena, n, k, g, 1, [gemv_tile(n, arch, 2 * g)], [],
                                                [(tiles, ksplit, True, depth)]):
            show(name, nbytes, t)


if __name__ == "__main__":
    main()
