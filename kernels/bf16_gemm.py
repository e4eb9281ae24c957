"""bf16 × bf16 -> fp32 GEMM on CUDA; same contract as `reference.bf16_gemm`.

cuBLAS on the tensor cores (`torch.mm` with `out_dtype=torch.float32`): each product of two
bf16 values is exact and the tensor cores sum in fp32, so the result is the reference's fp32
GEMM of the widened operands in another summation order. The reference path widens the weight on
every call (a compressor's wkv|wgate, 2,048 × 4,096, is a 32 MB fp32 copy per layer and chunk)
and runs the fp32 GEMM on the CUDA cores. Prefill's compressor projections and the indexer's
weights of a chunk run here; one-token decode has its GEMVs (kernels/compressor_project.py,
kernels/indexer_weights.py).
"""

import torch

from kernels.toolkit import KernelInputError, cuda_arch


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
    return torch.mm(x, w.t(), out_dtype=torch.float32)
