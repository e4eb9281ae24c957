"""Grouped projection with bf16 activations and an FP8 weight on CUDA (TileLang); same contract
as `reference.grouped_linear` (wo_a, spec §C.4 steps 14–15).

y[:, g·R:(g+1)·R] = x[:, g·K:(g+1)·K] · W[g·R:(g+1)·R]ᵀ for W [G·R, K] e4m3 with 128×128 e8m0
block scales, fp32 accumulation, bf16 output. The official convert.py dequantises this weight to
bf16 and multiplies bf16 activations without quantising them; dequantisation is exact (an e4m3
value times a power of two fits bf16), so reading the FP8 bytes and decoding them in the kernel
computes the same products from half the bytes (32 MiB instead of 64 MiB per Flash layer).

* Decode (one row, or up to GEMV_MAX_M where the next kernel does not take them): the FP8 GEMV's
  layout (kernels/fp8_gemm.py) over the G·R weight rows: each warp owns `rows` output rows of
  one group, each lane reads 16 weight bytes per row per step and 16 bf16 activations of that
  group (two 16-byte loads, widened exactly to fp32), and the 16-term fp32 dot product is added
  times the block scale · 2^8 (exact). Rows finish as in the FP8 GEMV (warp sum, K-split warps
  added in shared memory in a fixed order).
* 2 to 16 rows on sm_90: kernels/grouped_mma_few_tokens.py's tensor-core kernel (same contract),
  where a group's rows are whole CTAs of it.
* Otherwise (prefill, or groups of rows that do not split into whole CTAs): the weight is
  dequantised to bf16 and multiplied by cuBLAS, as the reference does.

Results equal the reference up to fp32 summation order (tests/kernels/test_kernels_gpu.py). Tile sizes
are the FP8 GEMV's (sm_90 tested, sm_121 untested). TileLang is imported lazily.
"""

import torch

from kernels import grouped_mma_few_tokens, lowbit, pdl
from kernels.toolkit import KernelInputError, aligned16, compile_kernel, cuda_arch, kernel_factory, pad_rows_to_bucket
from kernels.bf16_gemm import pad_rows_for_cublas
from kernels.fp8_dequant import fp8_dequant_bf16
from kernels.fp8_gemm import GEMV_MAX_M, check_fp8_weight, gemv_tile, weight_scales_f32
from kernels.gemv import VEC, as_words, scale_bytes, store_rows_macro, weight_steps_macro


@kernel_factory
def grouped_gemv_kernel(m: int, groups: int, k: int, n: int, rows: int, warps: int, ksplit: int,
                        arch: tuple[int, int]):
    """(X [m, groups·k] bf16, W [n, k/4] int32 = e4m3 codes, SW [ceil(n/128), k/128] u8)
    -> Y [m, n] bf16, n = groups·R; a CTA's rows lie in one group (R a multiple of the CTA's rows)."""
    import tilelang.language as T

    kb, nb, kw = k // 128, (n + 127) // 128, k // 4
    cta_rows = rows * (warps // ksplit)
    ctas_per_group = n // groups // cta_rows
    store = store_rows_macro(T, m, n, rows, ksplit)

    @T.macro
    def step(k0, wq, s, first, X, SW, x0, xb, af, acc):
        for i in T.unroll(m):
            for h in T.unroll(2):  # 16 bf16 = two 16-byte loads
                for v in T.vectorized(VEC // 2):
                    xb[h * (VEC // 2) + v] = X[i, x0 + k0 + h * (VEC // 2) + v]
            for v in T.unroll(VEC):
                af[v] = T.Cast("float32", xb[v])
            for r in T.unroll(rows):
                # the weight codes decode to value * 2^-8: the block scale takes 2^8
                scale = lowbit.e8m0_bits_to_float(T, SW[(first + r) // 128, k0 // 128], lowbit.E4M3_SHIFT)
                acc[r, i] += lowbit.dot_e4m3x16(T, wq[s, r, 0], af[0]) * scale

    _, weight_steps = weight_steps_macro(T, n, k, rows, ksplit, step)

    @T.prim_func
    def grouped_gemv(X: T.Tensor((m, groups * k), "bfloat16"), W: T.Tensor((n, kw), "int32"),
                     SW: T.Tensor((nb, kb), "uint8"), Y: T.Tensor((m, n), "bfloat16")):
        with T.Kernel(n // cta_rows, threads=(32, warps)) as bn:
            lowbit.import_source(T, pdl.SOURCE)
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            wq = T.alloc_local((1, rows, VEC // 4), "int32")
            xb = T.alloc_local((VEC,), "bfloat16")
            af = T.alloc_local((VEC,), "float32")
            acc = T.alloc_local((rows, m), "float32")
            red = T.alloc_shared((ksplit, cta_rows, m), "float32")
            if lane == 0 and warp == 0:  # the CTA's rows: one range
                pdl.prefetch_rows(T, arch, n * k, W[bn * cta_rows, 0], cta_rows * k)
            pdl.begin(T, arch)
            first = bn * cta_rows + (warp // ksplit) * rows  # this warp's first row
            x0 = (bn // ctas_per_group) * k  # the group's first activation channel
            T.clear(acc)
            weight_steps(W, wq, lane, warp, first, X, SW, x0, xb, af, acc)
            store(acc, red, lane, warp, first, Y)

    return compile_kernel(grouped_gemv, arch)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int,
                   w_scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, G·K] bf16, FP8 weight [G·R, K] with e8m0 scales [ceil(G·R/128), K/128] -> bf16 [S, G·R];
    `w_scale_f32`: those scales' fp32 values, prepared once (read by the prefill path)."""
    n, k = w.shape
    if x.dim() != 2 or x.dtype != torch.bfloat16 or groups < 1 or n % groups or x.shape[1] != groups * k:
        raise KernelInputError(f"grouped_linear takes x [S, {groups}·{k}] bf16 and a weight of {groups} equal "
                               f"row groups, got x {x.dtype} {tuple(x.shape)} and weight {tuple(w.shape)}")
    m = x.shape[0]
    check_fp8_weight(x.reshape(m * groups, k), w, w_scale)
    arch = cuda_arch(x.device)
    if m == 0:
        return torch.empty(0, n, dtype=torch.bfloat16, device=x.device)
    rows, warps, ksplit = gemv_tile(n, k, arch)
    if m > GEMV_MAX_M or (n // groups) % (rows * warps // ksplit):
        xp = pad_rows_for_cublas(x)  # cuBLAS meets bucketed row counts only
        u = xp.view(xp.shape[0], groups, k)  # [S', G, K]
        wd = fp8_dequant_bf16(w, weight_scales_f32(w_scale, w_scale_f32), 128, 128)  # exact
        wd = wd.view(groups, n // groups, k)  # [G, R, K]
        return torch.einsum("sgi,gri->sgr", u, wd).reshape(xp.shape[0], n)[:m]
    xp = aligned16(pad_rows_to_bucket(x.contiguous()))  # zero rows: zero outputs, sliced off
    y = torch.empty(xp.shape[0], n, dtype=torch.bfloat16, device=x.device)
    few = grouped_mma_few_tokens
    tile = few.mma_tile(n, k, groups) if m >= few.MIN_M and arch in few.MMA_ARCHS else None
    if tile is not None:  # 2..16 rows: the tensor cores
        few.grouped_mma_few_tokens_kernel(xp.shape[0], groups, k, n, *tile, arch)(
            xp.view(torch.int32), as_words(w), scale_bytes(w_scale), y)
    else:
        grouped_gemv_kernel(xp.shape[0], groups, k, n, rows, warps, ksplit, arch)(
            xp, as_words(w), scale_bytes(w_scale), y)
    return y[:m]
