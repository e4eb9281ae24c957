"""bf16 × bf16 -> fp32 GEMM on CUDA; same contract as `reference.bf16_gemm`.

cuBLAS on the tensor cores (`torch.mm` with `out_dtype=torch.float32`): each product of two
bf16 values is exact and the tensor cores sum in fp32, so the result is the reference's fp32
GEMM of the widened operands in another summation order. The reference path widens the weight on
every call (a compressor's wkv|wgate, 2,048 × 4,096, is a 32 MB fp32 copy per layer and chunk)
and runs the fp32 GEMM on the CUDA cores. Prefill's compressor projections and the indexer's
weights of a chunk run here; one-token decode has its GEMVs (kernels/compressor_project.py,
kernels/indexer_weights.py).

cuBLAS chooses an algorithm the first time it meets a GEMM's (M, N, K): 3-5 ms a new M on the
H200 for these GEMMs (docs/performance-log.md, 2026-12-03), and every prompt length is a new M.
So M goes up to a multiple of CUBLAS_ROW_BUCKET (`pad_rows_for_cublas`, also wo_a's prefill
einsum in kernels/grouped_linear.py), the row counts the warm-up runs (`engine.buckets`).
"""

import torch

from kernels.fp8_gemm import GEMV_MAX_M
from kernels.toolkit import KernelInputError, cuda_arch

CUBLAS_ROW_BUCKET = 256


def cublas_rows(m: int) -> int:
    """The rows a GEMM of m rows runs on: m up to GEMV_MAX_M (chunks that short come in powers of
    two, engine.buckets), else m rounded up to a multiple of CUBLAS_ROW_BUCKET."""
    return m if m <= GEMV_MAX_M else -(-m // CUBLAS_ROW_BUCKET) * CUBLAS_ROW_BUCKET


def pad_rows_for_cublas(x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, ...] -> [cublas_rows(M), ...] (x2 itself when that is M): x2's rows, then rows left
    unset, in one copy (one launch). A GEMM's output row reads its own input row only, and the
    callers slice the rows past M off, so those rows' values reach no result."""
    m = x2.shape[0]
    rows = cublas_rows(m)
    if rows == m:
        return x2
    out = x2.new_empty(rows, *x2.shape[1:])
    out[:m].copy_(x2)
    return out


def bf16_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16, w [N, K] bf16 (both on one CUDA device) -> fp32 [M, N], as
    `reference.bf16_gemm`."""
    if (x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != torch.bfloat16
            or w.dtype != torch.bfloat16):
        raise KernelInputError(f"bf16_gemm takes x [M, K] and w [N, K], both bf16; got x {x.dtype} "
                               f"{tuple(x.shape)} and w {w.dtype} {tuple(w.shape)}")
    if x.device != w.device:
        raise KernelInputError(f"bf16_gemm: x is on {x.device}, w on {w.device}; they must share a device")
    cuda_arch(x.device)
    return torch.mm(pad_rows_for_cublas(x), w.t(), out_dtype=torch.float32)[:x.shape[0]]
