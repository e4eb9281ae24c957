"""Building blocks of the row-per-warp GEMVs (kernels/fp8_gemm.py, grouped_linear.py, head_gemv.py,
bf16_gemv.py, fp4_moe.py): a warp owns `rows` weight rows, its 32 lanes stream 16 weight bytes each
per step, and the `ksplit` warps of a row group meet in shared memory in warp order
(deterministic). The macros take TileLang's language module `T`; nothing here imports TileLang.
"""

import torch

from kernels.toolkit import KernelInputError, aligned16

VEC = 16  # fp8 weight bytes per lane per step (one 16-byte load)
UNROLL_MAX_STEPS = 16  # a warp's K loop is unrolled up to this many steps (else a serial loop)
EARLY_WORDS = 32  # weight words per lane that `early_steps` may hold in registers before the PDL wait


def split_steps(k: int, ksplit: int) -> int:
    """Steps (32 lanes × 16 weight bytes of each row) of one warp's K range."""
    steps = -(-k // (32 * VEC))
    return -(-steps // ksplit)


def early_steps(k: int, rows: int, ksplit: int) -> int:
    """Steps of a warp's K range whose weight words each lane loads before the PDL wait: as many as
    EARLY_WORDS registers hold (at least one), none where the K loop is not unrolled."""
    per = split_steps(k, ksplit)
    return 0 if per > UNROLL_MAX_STEPS else min(per, max(1, EARLY_WORDS // (rows * VEC // 4)))


def weight_slots(k: int, ksplit: int, ahead: int) -> int:
    """Steps whose weight words a lane's `wq` holds for `weight_steps_macro` (one per step when
    loading `ahead`, else one reused)."""
    return split_steps(k, ksplit) if ahead else 1


def weight_steps_macro(T, n: int, k: int, rows: int, ksplit: int, step, ahead: int = 0):
    """TileLang macros `(preload(W, wq, lane, warp, first), steps(W, wq, lane, warp, first, *args))`:
    the K loop of a row-per-warp FP8 GEMV. A warp's K range is range warp % ksplit of `ksplit`
    contiguous ones; at each of its steps that starts below k, a lane loads its 16 weight bytes of
    rows first.. (clamped to n - 1) of W [n, k/4] int32 into wq [weight_slots, rows, 4] and runs
    `step(k0, wq, s, first, *args)` (a macro; k0 = the lane's first channel of the step, wq[s] its
    words), which reads the activations and accumulates.

    `ahead` (0 or `early_steps`): `preload` loads the first `ahead` steps (into slots 0..ahead-1)
    and `steps` loads step i + ahead at step i, so the caller may run `preload` before its PDL
    wait (weights only). At 0, `preload` is empty and each step loads its own words."""
    kstep = 32 * VEC
    per = split_steps(k, ksplit)
    loop = T.unroll if per <= UNROLL_MAX_STEPS else T.serial
    if ahead and per > UNROLL_MAX_STEPS:
        raise KernelInputError(f"weight_steps_macro: {per} steps per warp cannot be loaded ahead (at most "
                               f"{UNROLL_MAX_STEPS})")

    @T.macro
    def load(W, wq, lane, warp, first, ko, s):
        k0 = ((warp % ksplit) * per + ko) * kstep + lane * VEC
        if k0 < k:
            for r in T.unroll(rows):
                for v in T.vectorized(VEC // 4):
                    wq[s, r, v] = W[T.min(first + r, n - 1), k0 // 4 + v]

    @T.macro
    def preload(W, wq, lane, warp, first):
        for ko in T.unroll(ahead):
            load(W, wq, lane, warp, first, ko, ko)

    @T.macro
    def weight_steps(W, wq, lane, warp, first, *args):
        for ko in loop(per):
            k0 = ((warp % ksplit) * per + ko) * kstep + lane * VEC
            if ahead:
                if ko + ahead < per:  # after unrolling, a constant test
                    load(W, wq, lane, warp, first, ko + ahead, ko + ahead)
                if k0 < k:
                    step(k0, wq, ko, first, *args)
            else:
                if k0 < k:
                    load(W, wq, lane, warp, first, ko, 0)
                    step(k0, wq, 0, first, *args)

    return preload, weight_steps


def store_rows_macro(T, m: int, n: int, rows: int, ksplit: int, put=None):
    """A TileLang macro `store(acc, red, lane, warp, first, *outs)` ending a row-per-warp GEMV.

    Each warp holds fp32 partial sums acc [rows, m] (one per lane) of rows first..first+rows-1
    over its K range: it sums them over its lanes, the `ksplit` warps of a row group meet in
    shared `red` [ksplit, rows * warps / ksplit, m] and are added in warp order (deterministic),
    and `put(*outs, i, row, total)` (a macro) stores each total of a row below n; by default
    outs = (Y,) and Y [m, n] bf16 receives it. Every thread of the CTA must run it (a barrier).
    """
    if put is None:
        @T.macro
        def put(Y, i, row, total):
            Y[i, row] = T.Cast("bfloat16", total)

    @T.macro
    def store(acc, red, lane, warp, first, *outs):
        for r in T.unroll(rows):
            for i in T.unroll(m):
                total = T.warp_reduce_sum(acc[r, i])
                if lane == 0:
                    red[warp % ksplit, (warp // ksplit) * rows + r, i] = total
        T.sync_threads()
        for r in T.unroll(rows):
            for i in T.unroll(m):
                if lane == 0 and warp % ksplit == 0 and first + r < n:
                    acc[r, i] = red[0, (warp // ksplit) * rows + r, i]
                    for j in T.unroll(1, ksplit):
                        acc[r, i] += red[j, (warp // ksplit) * rows + r, i]
                    put(*outs, i, first + r, acc[r, i])

    return store


def gemv_rows(n: int, p: dict) -> int:
    """Rows per warp: fewer for small N so that the grid still covers the GPU."""
    rows = p["rows"]
    while rows > 1 and n // (rows * p["warps"]) < 256:
        rows //= 2
    return rows


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A tensor of byte codes (last dim a multiple of 4 bytes) as int32 words on a 16-byte aligned
    base, which the kernels' 16-byte loads need (a misaligned view is copied)."""
    return aligned16(t).view(torch.uint8).view(torch.int32)


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (float8_e8m0fnu or uint8) as contiguous uint8 bytes."""
    return scale.contiguous().view(torch.uint8)
