"""FP8 (e4m3) codes times block scales, to bf16 exactly, on CUDA (TileLang); the contract of
`reference.fp8_dequant_bf16`.

q [M, K] e4m3, s [ceil(M / rows), K / cols] fp32 (powers of two) -> bf16 [M, K], element (i, j)
= q[i, j] · s[i // rows, j // cols]. `rows, cols` = (1, 128): activations quantised per row and
128 channels (kernels/act_quant.py), the bf16 inputs of prefill's cuBLAS GEMMs; (128, 128): an
FP8 weight's blocks (wo_a's prefill GEMM dequantises its weight every chunk). An e4m3 value has
at most 4 significant bits, so each product is exact in bf16 (scales from 2^-100 to 2^100 keep
it a normal number), and the result equals the reference bit for bit.

One pass: a thread reads 16 codes (one 16-byte load), decodes them by kernels/lowbit.py's bit
moves, multiplies by its block's scale and stores 16 bf16 values (two 16-byte stores), where
torch's composition makes three launches over the data (widen, widen the scales, multiply;
a 728-token prefill chunk ran 129 of each). Memory-bound by design; sm_90 tested.
"""

import torch

from kernels import lowbit
from kernels.toolkit import UNGUARDED, KernelInputError, compile_kernel, cuda_arch, kernel_factory

THREADS = 256
CODES = 16  # e4m3 codes per thread: one 16-byte load


@kernel_factory
def fp8_dequant_kernel(k: int, rows: int, cols: int, arch: tuple[int, int]):
    """(Q [M, K/4] int32: the e4m3 codes, 4 a word, S [ceil(M/rows), K/cols] fp32, Y [M, K] bf16),
    a thread per 16 codes of a row (K and cols multiples of 16: the 16 share a scale). Unguarded:
    every index is in range by construction (the thread count is checked against M·K/16)."""
    import tilelang.language as T

    per_row, kb = k // CODES, k // cols
    m, sm = T.dynamic("m"), T.dynamic("sm")

    @T.prim_func
    def fp8_dequant(Q: T.Tensor((m, k // 4), "int32"), S: T.Tensor((sm, kb), "float32"),
                    Y: T.Tensor((m, k), "bfloat16")):
        with T.Kernel(T.ceildiv(m * per_row, THREADS), threads=THREADS) as bx:
            lowbit.import_source(T)
            t = T.get_thread_binding(0)
            w = T.alloc_local((CODES // 4,), "int32")
            f = T.alloc_local((CODES,), "float32")
            y = T.alloc_local((CODES,), "bfloat16")
            i = bx * THREADS + t
            if i < m * per_row:
                r, c = i // per_row, i % per_row  # row, and the first code's channel / 16
                for v in T.vectorized(CODES // 4):
                    w[v] = Q[r, c * (CODES // 4) + v]
                scale = S[r // rows, c * CODES // cols] * T.float32(2.0 ** lowbit.E4M3_SHIFT)
                lowbit.e4m3x16_to_f32(T, w[0], f[0])  # values times 2^-E4M3_SHIFT, exactly
                for v in T.unroll(CODES):
                    y[v] = T.Cast("bfloat16", f[v] * scale)
                for v in T.vectorized(CODES):
                    Y[r, c * CODES + v] = y[v]

    return compile_kernel(fp8_dequant, arch, pass_configs=UNGUARDED)


def fp8_dequant_bf16(q: torch.Tensor, s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`reference.fp8_dequant_bf16` on CUDA: q [M, K] float8_e4m3fn, s [ceil(M/rows), K/cols] fp32
    -> bf16 [M, K], one launch."""
    if q.dtype != torch.float8_e4m3fn or q.dim() != 2 or s.dtype != torch.float32 or s.dim() != 2:
        raise KernelInputError(f"fp8_dequant_bf16 takes q [M, K] float8_e4m3fn and s [M', K'] float32, got "
                               f"{q.dtype} {tuple(q.shape)} and {s.dtype} {tuple(s.shape)}")
    m, k = q.shape
    if cols % CODES or k % cols or rows < 1 or tuple(s.shape) != ((m + rows - 1) // rows, k // cols):
        raise KernelInputError(f"fp8_dequant_bf16: q {tuple(q.shape)} in blocks of {rows}x{cols} needs scales "
                               f"[{(m + rows - 1) // max(rows, 1)}, {k // max(cols, 1)}] and K a multiple of cols, "
                               f"cols of {CODES}; got scales {tuple(s.shape)}")
    if q.device != s.device:
        raise KernelInputError("fp8_dequant_bf16: q and s must be on one device")
    y = torch.empty(m, k, dtype=torch.bfloat16, device=q.device)
    if m:
        fp8_dequant_kernel(k, rows, cols, cuda_arch(q.device))(q.contiguous().view(torch.int32), s.contiguous(), y)
    return y
