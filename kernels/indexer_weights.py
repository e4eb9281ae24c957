"""The lightning indexer's per-head weights on CUDA (TileLang); same contract as
`reference.indexer_weights` (spec §C.6): x times the bf16 weights_proj in fp32, rounded to bf16
(the official bf16 matmul), widened and scaled by n_heads^-1/2 — one launch instead of five
(widen, matmul, round, widen, scale), reading the bf16 weight as stored (not an fp32 copy).

Data layout: kernels/bf16_gemv.py's row-per-warp GEMV; each finished row is rounded to bf16
and multiplied by `scale` in fp32, as the reference does. Results equal the reference up to
fp32 summation order (which can move a bf16 rounding by one step). TileLang is imported lazily.
"""

import torch

from kernels import reference as ref
from kernels.toolkit import KernelInputError, aligned16, compile_kernel, cuda_arch, kernel_factory
from kernels.bf16_gemm import bf16_gemm
from kernels.bf16_gemv import VEC, bf16_gemv_tile, gemv_macro

MAX_M = 16


@kernel_factory
def indexer_weights_kernel(m: int, n: int, k: int, scale: float, rows: int, warps: int, ksplit: int,
                           arch: tuple[int, int]):
    """(X [m, k] bf16, W [n, k] bf16, Y [m, n] fp32): Y = float(bf16(X·Wᵀ)) · scale."""
    import tilelang.language as T

    cta_rows = rows * (warps // ksplit)

    @T.macro
    def put(Y, i, row, total):
        Y[i, row] = T.Cast("float32", T.Cast("bfloat16", total)) * T.float32(scale)

    gemv = gemv_macro(T, arch, m, n, k, rows, warps, ksplit, put)

    @T.prim_func
    def indexer_weights(X: T.Tensor((m, k), "bfloat16"), W: T.Tensor((n, k), "bfloat16"),
                        Y: T.Tensor((m, n), "float32")):
        with T.Kernel(T.ceildiv(n, cta_rows), threads=(32, warps)) as bn:
            gemv(X, W, bn, Y)

    return compile_kernel(indexer_weights, arch)


def indexer_weights(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """x [S, D] bf16, w [IH, D] bf16 -> fp32 [S, IH], as `reference.indexer_weights` (the GEMV
    for S <= 16 rows, kernels/bf16_gemm.py's tensor-core GEMM for more)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise KernelInputError(f"indexer_weights takes x [S, D] and w [IH, D], both bf16; got x {x.dtype} "
                               f"{tuple(x.shape)} and w {w.dtype} {tuple(w.shape)}")
    arch = cuda_arch(x.device)
    (m, k), n = x.shape, w.shape[0]
    if m > MAX_M:  # a chunk: the tensor-core GEMM, then the reference's rounding and scale
        return bf16_gemm(x, w).to(torch.bfloat16).float() * scale
    if k % VEC:
        return ref.indexer_weights(x, w, scale)
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m:
        indexer_weights_kernel(m, n, k, float(scale), *bf16_gemv_tile(n, k, arch), arch)(aligned16(x), aligned16(w), y)
    return y
