"""FP8 block-scaled GEMM on CUDA (TileLang); same contract as `reference.fp8_gemm`.

y = act_quant(x) · W^T with W [N, K] e4m3 and 128×128 e8m0 block scales, fp32 accumulation,
bf16 output (spec §B.4).

* One token on sm_90 with K <= 4096: the tensor-core GEMV of kernels/fp8_mma_one_token.py (same contract);
  2..16 tokens on sm_90: kernels/fp8_mma_few_tokens.py's (same contract).
* Decode (M <= GEMV_MAX_M rows): a weight-streaming GEMV. Each warp owns `rows` output rows;
  each lane reads 16 contiguous weight bytes (4 int32 words) per row per step (a warp covers 512
  channels of a row, coalesced), decodes them and the activation codes with integer bit moves
  (kernels/lowbit.py: value times 2^-8, exact), forms the 16-term fp32 dot product and adds it
  times s_act · s_weight · 2^16 (powers of two, so the scaling is exact). A warp shuffle sum
  finishes each row. Small grids split K between the warps of a CTA (`ksplit`), whose partial
  sums meet in shared memory in a fixed order. The weight is read once whatever M is;
  activations come from L1.
* Prefill (larger M) on sm_90 where the blocks tile the weight (N and K multiples of 128, K/128 a
  multiple of 4): cuBLAS's FP8 GEMM with DeepSeek's block scales (`torch._scaled_mm`, 1×128
  activation blocks times 128×128 weight blocks, fp32 scales applied per 128-channel block):
  no bf16 copy of the weight per call. Elsewhere both operands are dequantised exactly to bf16
  (an e4m3 value times a power of two has 4 significant bits) and multiplied by cuBLAS with
  fp32 accumulation.

The GEMVs and the bf16 path equal the reference up to fp32 summation order; the block-scaled FP8
GEMM's tensor-core accumulation adds a relative error of ~7e-4 (measured in
tests/kernels/test_kernels_gpu.py, bound 4e-3).
Tile sizes per compute capability are in TILE_PARAMS; sm_90 is tested, sm_121 (GB10) is not.
TileLang is imported lazily (see kernels/toolkit.py).
"""

import torch

from kernels import fp8_mma_few_tokens, fp8_mma_one_token, lowbit, pdl
from kernels.act_quant import act_quant
from kernels.fp8_dequant import fp8_dequant_bf16
from kernels.gemv import (VEC, as_words, early_steps, gemv_rows, scale_bytes, split_steps, store_rows_macro,
                          weight_slots, weight_steps_macro)
from kernels.toolkit import KernelInputError, compile_kernel, cuda_arch, kernel_factory, pad_rows_to_bucket, tile_params

GEMV_MAX_M = 16
# GEMV rows per warp, warps per CTA, and the grid size below which K is split between the warps
# of a CTA, per compute capability (sm_121: untested).
TILE_PARAMS = {
    (9, 0): {"rows": 4, "warps": 4, "min_ctas": 512},
    (12, 1): {"rows": 2, "warps": 4, "min_ctas": 192},
}
DEFAULT_TILE = {"rows": 2, "warps": 4, "min_ctas": 256}


@kernel_factory
def fp8_gemv_kernel(m: int, n: int, k: int, rows: int, warps: int, ksplit: int, arch: tuple[int, int],
                    early: bool = True):
    """(Q [m,k/4] int32 = e4m3 codes, SA [m,k/128] fp32, W [n,k/4] int32 = e4m3 codes,
    SW [ceil(n/128),k/128] u8) -> Y [m,n] bf16.

    A CTA has `warps` warps in warps/ksplit row groups of `rows` rows; the `ksplit` warps of a
    group each sum one contiguous K range, and the group's partial sums are added in shared
    memory in a fixed order (deterministic).

    `early` (with PDL): each lane loads the weight words of its first `early_steps` steps before
    the kernel waits for its predecessor (kernels/pdl.py), so they overlap that kernel's tail; the
    L2 prefetch of the CTA's rows is then left out where those steps are all of them (H200, one
    token: wo_b 4096 x 8192 9.66-9.78 us early against 10.97-11.03; other shapes in
    docs/performance-log.md, 2026-12-01)."""
    import tilelang.language as T

    kb, nb, kw = k // 128, (n + 127) // 128, k // 4
    groups = warps // ksplit
    cta_rows = rows * groups
    store = store_rows_macro(T, m, n, rows, ksplit)

    @T.macro
    def step(k0, wq, s, first, Q, SA, SW, aq, af, acc):
        for i in T.unroll(m):
            for v in T.vectorized(VEC // 4):
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
            wq = T.alloc_local((weight_slots(k, ksplit, ahead), rows, VEC // 4), "int32")
            aq = T.alloc_local((VEC // 4,), "int32")
            af = T.alloc_local((VEC,), "float32")
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


def gemv_tile(n: int, k: int, arch: tuple[int, int]) -> tuple[int, int, int]:
    """(rows per warp, warps per CTA, K split) of the FP8 GEMV for an [n, k] weight on `arch`."""
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    rows, warps = gemv_rows(n, p), p["warps"]
    ksplit = 1  # split K between the warps of a CTA while the grid is small and each keeps a full step
    while (ksplit < warps and -(-n // (rows * warps // ksplit)) < p["min_ctas"]
           and k // (2 * ksplit) >= 32 * VEC):
        ksplit *= 2
    return rows, warps, ksplit


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


def weight_scales_f32(w_scale: torch.Tensor, w_scale_f32: torch.Tensor | None) -> torch.Tensor:
    """A weight's block scales as fp32 [N/128, K/128]: the prepared ones, or decoded from e8m0."""
    if w_scale_f32 is not None:
        return w_scale_f32
    return torch.pow(2.0, (scale_bytes(w_scale).to(torch.int32) - 127).to(torch.float32))


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             w_scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16) × FP8 weight [N, K] with e8m0 scales [N/128, K/128] -> bf16 [..., N];
    `w_scale_f32`: those scales' fp32 values, prepared once (else computed per prefill call)."""
    check_fp8_weight(x, w, w_scale)
    n, k = w.shape
    cuda_arch(x.device)
    x2 = x.reshape(-1, k)  # [M, K]
    return fp8_gemm_quantized(*act_quant(x2, 128), w, w_scale, w_scale_f32).reshape(*x.shape[:-1], n)


def blockwise_mm(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 w_scale_f32: torch.Tensor | None) -> torch.Tensor:
    """q [M, K] e4m3 with s [M, K/128] times w [N, K] e4m3 with e8m0 w_scale [N/128, K/128] (its
    fp32 values `w_scale_f32` when prepared, else computed here: three launches) -> bf16 [M, N]
    by cuBLASLt's block-scaled FP8 GEMM. Its layout rules: M a multiple of 4 (zero rows appended,
    then dropped), both scale tensors column-major ([M, K/128] and [K/128, N/128])."""
    m = q.shape[0]
    pad = -m % 4
    if pad:
        q = torch.cat((q, q.new_zeros(pad, q.shape[1])))
        s = torch.cat((s, s.new_ones(pad, s.shape[1])))
    sa = s.float().t().contiguous().t()
    sw = weight_scales_f32(w_scale, w_scale_f32).t()
    y = torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
    return y[:m] if pad else y


def fp8_gemm_quantized(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       w_scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_gemm` on activations quantised by act_quant: q [M, K] e4m3, s [M, K/128] fp32 ->
    bf16 [M, N], as `reference.fp8_gemm_quantized` (the GEMV for M <= GEMV_MAX_M rows; above it
    the block-scaled GEMM, or the bf16 one on dequantised operands, reads `w_scale_f32`, w_scale's
    fp32 values, when a caller prepared them)."""
    check_fp8_weight(q, w, w_scale)
    n, k = w.shape
    m = q.shape[0]
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn or tuple(s.shape) != (m, k // 128):
        raise KernelInputError(f"fp8_gemm_quantized needs q [M, {k}] e4m3 and s [M, {k // 128}], got "
                               f"{q.dtype} {tuple(q.shape)} and {tuple(s.shape)}")
    arch = cuda_arch(q.device)
    if m == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=q.device)
    if m > GEMV_MAX_M:  # both paths read w_scale_f32
        if w_scale_f32 is not None and tuple(w_scale_f32.shape) != tuple(w_scale.shape):
            raise KernelInputError(f"fp8_gemm: w_scale_f32 {tuple(w_scale_f32.shape)} is not the shape of "
                                   f"w_scale {tuple(w_scale.shape)}")
        if arch == (9, 0) and n % 128 == 0 and (k // 128) % 4 == 0:
            return blockwise_mm(q, s, w, w_scale, w_scale_f32)
        wd = fp8_dequant_bf16(w, weight_scales_f32(w_scale, w_scale_f32), 128, 128)
        return torch.matmul(fp8_dequant_bf16(q, s, 1, 128), wd.T)
    q, s = pad_rows_to_bucket(q), pad_rows_to_bucket(s)  # zero codes: zero rows
    y = torch.empty(q.shape[0], n, dtype=torch.bfloat16, device=q.device)
    operands = (as_words(q), s.float().contiguous(), as_words(w), scale_bytes(w_scale), y)
    one, few = fp8_mma_one_token, fp8_mma_few_tokens
    tile = one.mma_tile(n, k) if m == 1 and arch in one.MMA_ARCHS else None
    if tile is not None:  # one token: the tensor-core GEMV
        one.fp8_mma_one_token_kernel(n, k, *tile, arch)(*operands)
        return y
    tile = few.mma_tile(n, k) if m > 1 and arch in few.MMA_ARCHS else None
    if tile is not None:  # 2..16 rows: the tensor cores too
        few.fp8_mma_few_tokens_kernel(q.shape[0], n, k, *tile, arch)(*operands)
    else:
        fp8_gemv_kernel(q.shape[0], n, k, *gemv_tile(n, k, arch), arch)(*operands)
    return y[:m]
