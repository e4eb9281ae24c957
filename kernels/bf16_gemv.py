"""The row-per-warp GEMV over a bf16 weight with fp32 accumulation, as TileLang macros shared by
the kernels that end it differently (kernels/compressor_project.py, kernels/indexer_weights.py):
`gemv_macro` is a whole CTA's body, `accumulate_macro` its K loop.

Data layout: the FP8 GEMV's (kernels/fp8_gemm.py) with 8 bf16 weights per lane per step (one
16-byte load) and 8 bf16 activations (one 16-byte load), both widened exactly to fp32; every
product and sum in fp32. Each warp owns `rows` weight rows; `ksplit` warps of a CTA split K and
meet in shared memory in a fixed order (`fp8_gemm.store_rows_macro`, which also calls the
kernel's `put` for each finished row). Tiles per compute capability in TILE_PARAMS: sm_90
tested, sm_121 (GB10) untested.
"""

from kernels import pdl
from kernels.gemv import store_rows_macro
from kernels.toolkit import tile_params

VEC = 8  # bf16 weights per lane per step (one 16-byte load)
TILE_PARAMS = {
    (9, 0): {"rows": 2, "warps": 4, "min_ctas": 264},
    (12, 1): {"rows": 2, "warps": 4, "min_ctas": 96},
}
DEFAULT_TILE = {"rows": 2, "warps": 4, "min_ctas": 128}


def bf16_gemv_tile(n: int, k: int, arch: tuple[int, int]) -> tuple[int, int, int]:
    """(rows per warp, warps per CTA, K split) for a [n, k] bf16 weight: fewer rows, then K split
    between the warps of a CTA, while the grid is below `min_ctas` (each warp keeps a full step)."""
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    rows, warps, ksplit = p["rows"], p["warps"], 1
    while rows > 1 and -(-n // (rows * warps)) < p["min_ctas"]:
        rows //= 2
    while (ksplit < warps and -(-n // (rows * warps // ksplit)) < p["min_ctas"]
           and k // (2 * ksplit) >= 32 * VEC):
        ksplit *= 2
    return rows, warps, ksplit


def accumulate_macro(T, m: int, n: int, k: int, rows: int, ksplit: int):
    """A TileLang macro `accumulate(X, W, acc, lane, warp, first)`: this lane's fp32 partial sums
    acc [rows, m] of X [m, k] bf16 times rows first.. of W [n, k] bf16 (clamped to n - 1) over
    the warp's K range (warp % ksplit of `ksplit` contiguous ranges)."""
    kstep = 32 * VEC
    steps = (k + kstep - 1) // kstep
    split_steps = (steps + ksplit - 1) // ksplit  # steps per warp
    loop = T.unroll if split_steps <= 16 else T.serial

    @T.macro
    def accumulate(X, W, acc, lane, warp, first):
        wb = T.alloc_local((rows, VEC), "bfloat16")
        xb = T.alloc_local((VEC,), "bfloat16")
        T.clear(acc)
        for ko in loop(split_steps):
            k0 = ((warp % ksplit) * split_steps + ko) * kstep + lane * VEC
            if k0 < k:
                for j in T.unroll(rows):
                    for v in T.vectorized(VEC):
                        wb[j, v] = W[T.min(first + j, n - 1), k0 + v]
                for i in T.unroll(m):
                    for v in T.vectorized(VEC):
                        xb[v] = X[i, k0 + v]
                    for j in T.unroll(rows):
                        for v in T.unroll(VEC):
                            acc[j, i] += T.Cast("float32", xb[v]) * T.Cast("float32", wb[j, v])

    return accumulate


def gemv_macro(T, arch: tuple[int, int], m: int, n: int, k: int, rows: int, warps: int, ksplit: int, put):
    """A TileLang macro `gemv(X, W, bn, *outs)`: the whole body of CTA `bn` (threads (32, warps))
    of the GEMV of X [m, k] bf16 by W [n, k] bf16: the L2 prefetch of its weight rows, the PDL wait
    (kernels/pdl.py), `accumulate_macro`, then `fp8_gemm.store_rows_macro` calling
    `put(*outs, i, row, total)` for each finished row."""
    cta_rows = rows * (warps // ksplit)
    accumulate = accumulate_macro(T, m, n, k, rows, ksplit)
    store = store_rows_macro(T, m, n, rows, ksplit, put)

    @T.macro
    def gemv(X, W, bn, *outs):
        T.import_source(pdl.SOURCE)
        lane = T.get_thread_binding(0)
        warp = T.get_thread_binding(1)
        acc = T.alloc_local((rows, m), "float32")
        red = T.alloc_shared((ksplit, cta_rows, m), "float32")
        if lane == 0 and warp == 0:  # the CTA's rows: one range
            pdl.prefetch_rows(T, arch, n * k * 2, W[bn * cta_rows, 0], T.min(cta_rows, n - bn * cta_rows) * k * 2)
        pdl.begin(T, arch)
        first = bn * cta_rows + (warp // ksplit) * rows  # this warp's first row
        accumulate(X, W, acc, lane, warp, first)
        store(acc, red, lane, warp, first, *outs)

    return gemv
