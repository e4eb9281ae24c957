"""FP8 block-scaled GEMM on CUDA (TileLang); same contract as `reference.fp8_gemm`.

y = act_quant(x) · W^T with W [N, K] e4m3 and 128×128 e8m0 block scales, fp32 accumulation,
bf16 output (spec §B.4).

* One token on sm_90 with K <= 4096: the tensor-core GEMV of kernels/fp8_mma1.py (same contract).
* Decode (M <= GEMV_MAX_M rows): a weight-streaming GEMV. Each warp owns `rows` output rows;
  each lane reads 16 contiguous weight bytes (4 int32 words) per row per step (a warp covers 512
  channels of a row, coalesced), decodes them and the activation codes with integer bit moves
  (kernels/lowbit.py: value times 2^-8, exact), forms the 16-term fp32 dot product and adds it
  times s_act · s_weight · 2^16 (powers of two, so the scaling is exact). A warp shuffle sum
  finishes each row. Small grids split K between the warps of a CTA (`ksplit`), whose partial
  sums meet in shared memory in a fixed order. The weight is read once whatever M is;
  activations come from L1.
* Prefill (larger M): both operands are dequantised exactly to bf16 (an e4m3 value times a
  power of two has 4 significant bits) and multiplied by cuBLAS with fp32 accumulation.

Results equal the reference up to fp32 summation order (measured in tests/test_kernels_gpu.py).
Tile sizes per compute capability are in TILE_PARAMS; sm_90 is tested, sm_121 (GB10) is not.
TileLang is imported lazily (see kernels/toolkit.py).
"""

import functools

import torch

from kernels import fp8_mma1, lowbit, pdl
from kernels.act_quant import act_quant
from kernels.toolkit import (KernelInputError, aligned16, compile_kernel, cuda_arch, pad_rows_to_bucket,
                             tile_params)

GEMV_MAX_M = 16
# GEMV rows per warp, warps per CTA, and the grid size below which K is split between the warps
# of a CTA, per compute capability (sm_121: untested).
TILE_PARAMS = {
    (9, 0): {"rows": 4, "warps": 4, "min_ctas": 512},
    (12, 1): {"rows": 2, "warps": 4, "min_ctas": 192},
}
DEFAULT_TILE = {"rows": 2, "warps": 4, "min_ctas": 256}
_VEC = 16  # fp8 weight bytes per lane per step (one 16-byte load)


def _gemv_rows(n: int, p: dict) -> int:
    """Rows per warp: fewer for small N so that the grid still covers the GPU."""
    rows = p["rows"]
    while rows > 1 and n // (rows * p["warps"]) < 256:
        rows //= 2
    return rows


@functools.cache
def fp8_gemv_kernel(m: int, n: int, k: int, rows: int, warps: int, ksplit: int, arch: tuple[int, int],
                    early: bool = True):
    """(Q [m,k/4] int32 = e4m3 codes, SA [m,k/128] fp32, W [n,k/4] int32 = e4m3 codes,
    SW [ceil(n/128),k/128] u8) -> Y [m,n] bf16.

    A CTA has `warps` warps in warps/ksplit row groups of `rows` rows; the `ksplit` warps of a
    group each sum one contiguous K range, and the group's partial sums are added in shared
    memory in a fixed order (deterministic).

    `early` (with PDL): each lane loads the weight words of its first `early_steps` steps before
    the kernel waits for its predecessor (kernels/pdl.py), so they overlap that kernel's tail; the
    L2 prefetch of the CTA's rows is then left out where those steps are all of them. H200, one
    token, graphed chains (3 repeats; us, each step loading its own words -> early): wo_b 4096 x
    8192 10.97-11.03 -> 9.66-9.78, 4096 x 2048 5.01-5.02 -> 3.91-3.95, 1536 x 4096 3.98-4.04 ->
    3.22-3.52; slower for 32768 x 1024 (10.34-10.42 -> 11.12-11.35), 8192 x 1024 and 4096 x 4096
    (+0.1-0.2). One token at K <= 4096 now goes to the tensor-core kernel; more tokens were not
    timed."""
    import tilelang.language as T

    kb, nb, kw = k // 128, (n + 127) // 128, k // 4
    groups = warps // ksplit
    cta_rows = rows * groups
    store = store_rows_macro(T, m, n, rows, ksplit)

    @T.macro
    def step(k0, wq, s, first, Q, SA, SW, aq, af, acc):
        for i in T.unroll(m):
            for v in T.vectorized(_VEC // 4):
                aq[v] = Q[i, k0 // 4 + v]
            lowbit.e4m3x16_to_f32(T, aq[0], af[0])
            for r in T.unroll(rows):
                # both operands decode to value * 2^-8: the block scale takes 2^16
                scale = SA[i, k0 // 128] * lowbit.e8m0_bits_to_float(
                    T, SW[T.min(first + r, n - 1) // 128, k0 // 128], 2 * lowbit.E4M3_SHIFT)
                acc[r, i] += lowbit.dot_e4m3x16(T, wq[s, r, 0], af[0]) * scale

    ahead = early_steps(k, rows, ksplit) if early and pdl.enabled(arch) else 0
    preload, weight_steps = weight_steps_macro(T, n, k, rows, ksplit, step, ahead)

    @T.prim_func
    def fp8_gemv(Q: T.Tensor((m, kw), "int32"), SA: T.Tensor((m, kb), "float32"),
                 W: T.Tensor((n, kw), "int32"), SW: T.Tensor((nb, kb), "uint8"),
                 Y: T.Tensor((m, n), "bfloat16")):
        with T.Kernel(T.ceildiv(n, cta_rows), threads=(32, warps)) as bn:
            lowbit.import_source(T, pdl.SOURCE)
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            wq = T.alloc_local((weight_slots(k, ksplit, ahead), rows, _VEC // 4), "int32")
            aq = T.alloc_local((_VEC // 4,), "int32")
            af = T.alloc_local((_VEC,), "float32")
            acc = T.alloc_local((rows, m), "float32")
            red = T.alloc_shared((ksplit, cta_rows, m), "float32")
            first = bn * cta_rows + (warp // ksplit) * rows  # this warp's first row
            if lane == 0 and warp == 0 and ahead < split_steps(k, ksplit):  # the CTA's rows: one range
                pdl.prefetch_rows(T, arch, n * k, W[bn * cta_rows, 0], T.min(cta_rows, n - bn * cta_rows) * k)
            preload(W, wq, lane, warp, first)  # the weight is never written: read before the wait
            pdl.begin(T, arch)
            T.clear(acc)
            weight_steps(W, wq, lane, warp, first, Q, SA, SW, aq, af, acc)
            store(acc, red, lane, warp, first, Y)

    return compile_kernel(fp8_gemv, arch)


UNROLL_MAX_STEPS = 16  # a warp's K loop is unrolled up to this many steps (else a serial loop)
EARLY_WORDS = 32  # weight words per lane that `early_steps` may hold in registers before the PDL wait


def split_steps(k: int, ksplit: int) -> int:
    """Steps (32 lanes × 16 weight bytes of each row) of one warp's K range."""
    steps = -(-k // (32 * _VEC))
    return -(-steps // ksplit)


def early_steps(k: int, rows: int, ksplit: int) -> int:
    """Steps of a warp's K range whose weight words each lane loads before the PDL wait: as many as
    EARLY_WORDS registers hold (at least one), none where the K loop is not unrolled."""
    per = split_steps(k, ksplit)
    return 0 if per > UNROLL_MAX_STEPS else min(per, max(1, EARLY_WORDS // (rows * _VEC // 4)))


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
    kstep = 32 * _VEC
    per = split_steps(k, ksplit)
    loop = T.unroll if per <= UNROLL_MAX_STEPS else T.serial
    if ahead and per > UNROLL_MAX_STEPS:
        raise KernelInputError(f"weight_steps_macro: {per} steps per warp cannot be loaded ahead (at most "
                               f"{UNROLL_MAX_STEPS})")

    @T.macro
    def load(W, wq, lane, warp, first, ko, s):
        k0 = ((warp % ksplit) * per + ko) * kstep + lane * _VEC
        if k0 < k:
            for r in T.unroll(rows):
                for v in T.vectorized(_VEC // 4):
                    wq[s, r, v] = W[T.min(first + r, n - 1), k0 // 4 + v]

    @T.macro
    def preload(W, wq, lane, warp, first):
        for ko in T.unroll(ahead):
            load(W, wq, lane, warp, first, ko, ko)

    @T.macro
    def weight_steps(W, wq, lane, warp, first, *args):
        for ko in loop(per):
            k0 = ((warp % ksplit) * per + ko) * kstep + lane * _VEC
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


def gemv_tile(n: int, k: int, arch: tuple[int, int]) -> tuple[int, int, int]:
    """(rows per warp, warps per CTA, K split) of the FP8 GEMV for an [n, k] weight on `arch`."""
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    rows, warps = _gemv_rows(n, p), p["warps"]
    ksplit = 1  # split K between the warps of a CTA while the grid is small and each keeps a full step
    while (ksplit < warps and -(-n // (rows * warps // ksplit)) < p["min_ctas"]
           and k // (2 * ksplit) >= 32 * _VEC):
        ksplit *= 2
    return rows, warps, ksplit


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A tensor of byte codes (last dim a multiple of 4 bytes) as int32 words on a 16-byte aligned
    base, which the kernels' 16-byte loads need (a misaligned view is copied)."""
    return aligned16(t).view(torch.uint8).view(torch.int32)


def check_fp8_weight(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> None:
    """Raise KernelInputError unless (x, w, w_scale) form a valid FP8 linear on one CUDA device."""
    n, k = w.shape
    if w.dtype != torch.float8_e4m3fn:
        raise KernelInputError(f"fp8_gemm needs an e4m3 weight, got {w.dtype}")
    if x.shape[-1] != k or k % 128:
        raise KernelInputError(f"fp8_gemm: x has {x.shape[-1]} channels, weight [N={n}, K={k}] "
                               "(K must match and be a multiple of 128)")
    if tuple(w_scale.shape) != ((n + 127) // 128, k // 128):
        raise KernelInputError(f"fp8_gemm: scale shape {tuple(w_scale.shape)} != "
                               f"{((n + 127) // 128, k // 128)} for weight [{n}, {k}]")
    if not (x.device == w.device == w_scale.device):
        raise KernelInputError("fp8_gemm: x, weight and scale must be on one device")


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (float8_e8m0fnu or uint8) as contiguous uint8 bytes."""
    return scale.contiguous().view(torch.uint8)


def dequant_fp8_bf16(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """FP8 weight -> bf16 [N, K], exactly (e4m3 times a power of two fits bf16)."""
    n, k = w.shape
    s = scale_bytes(w_scale).to(torch.int32) - 127  # [N/128, K/128] exponents
    s = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return torch.ldexp(w.to(torch.bfloat16), s.to(torch.bfloat16))


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16) × FP8 weight [N, K] with e8m0 scales [N/128, K/128] -> bf16 [..., N]."""
    check_fp8_weight(x, w, w_scale)
    n, k = w.shape
    cuda_arch(x.device)
    x2 = x.reshape(-1, k)  # [M, K]
    return fp8_gemm_quantized(*act_quant(x2, 128), w, w_scale).reshape(*x.shape[:-1], n)


def fp8_gemm_quantized(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`fp8_gemm` on activations quantised by act_quant: q [M, K] e4m3, s [M, K/128] fp32 ->
    bf16 [M, N], as `reference.fp8_gemm_quantized` (the GEMV for M <= GEMV_MAX_M rows)."""
    check_fp8_weight(q, w, w_scale)
    n, k = w.shape
    m = q.shape[0]
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn or tuple(s.shape) != (m, k // 128):
        raise KernelInputError(f"fp8_gemm_quantized needs q [M, {k}] e4m3 and s [M, {k // 128}], got "
                               f"{q.dtype} {tuple(q.shape)} and {tuple(s.shape)}")
    arch = cuda_arch(q.device)
    if m == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=q.device)
    if m > GEMV_MAX_M:
        a = q.to(torch.bfloat16).view(m, k // 128, 128) * s.to(torch.bfloat16).unsqueeze(-1)  # exact
        return torch.matmul(a.view(m, k), dequant_fp8_bf16(w, w_scale).T)
    q, s = pad_rows_to_bucket(q), pad_rows_to_bucket(s)  # zero codes: zero rows
    y = torch.empty(q.shape[0], n, dtype=torch.bfloat16, device=q.device)
    tile = fp8_mma1.mma1_tile(n, k) if m == 1 and arch in fp8_mma1.MMA1_ARCHS else None
    if tile is not None:  # one token: the tensor-core GEMV
        fp8_mma1.fp8_mma1_kernel(n, k, *tile, arch)(as_words(q), s.float().contiguous(), as_words(w),
                                                     scale_bytes(w_scale), y)
        return y
    fp8_gemv_kernel(q.shape[0], n, k, *gemv_tile(n, k, arch), arch)(as_words(q), s.float().contiguous(), as_words(w),
                                                                  scale_bytes(w_scale), y)
    return y[:m]
