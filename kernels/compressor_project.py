"""A compressor's decode projection on CUDA (TileLang); same contract as
`reference.compressor_project` (spec §C.5: the token's kv and gate logits into the open window).

One launch replaces the widening of x, the two fp32 GEMVs over wkv and wgate, the ape lookup and
add, and the two row writes. W [2C, K] bf16 holds wkv's rows then wgate's, as on disk (the
reference path's fp32 copies read twice the bytes).

Data layout: kernels/bf16_gemv.py's row-per-warp GEMV (fp32 products and sums). Row n < C of
the result goes to BKV[ROW[i], n]; row C + j goes to BG[ROW[i], j] plus APE[ROW[i], j]. ROW is
read on the device, so CUDA graphs replay it.

Results equal the reference up to fp32 summation order (tests/kernels/test_kernels_gpu.py). TileLang is
imported lazily.
"""

import torch

from kernels import reference as ref
from kernels.toolkit import KernelInputError, aligned16, compile_kernel, cuda_arch, kernel_factory
from kernels.bf16_gemv import VEC, bf16_gemv_tile, gemv_macro

MAX_M = 16


@kernel_factory
def compressor_project_kernel(m: int, c: int, k: int, r: int, rows: int, warps: int, ksplit: int,
                              arch: tuple[int, int]):
    """(X [m, k] bf16, W [2c, k] bf16, APE [r, c] fp32, ROW [m] int64, BKV [r, c] fp32,
    BG [r, c] fp32): BKV[ROW[i], :] = X[i]·W[:c]ᵀ, BG[ROW[i], :] = X[i]·W[c:]ᵀ + APE[ROW[i], :]."""
    import tilelang.language as T

    n = 2 * c
    cta_rows = rows * (warps // ksplit)

    @T.macro
    def put(BKV, BG, APE, ROW, i, row, total):
        if row < c:
            BKV[ROW[i], row] = total
        else:
            BG[ROW[i], row - c] = total + APE[ROW[i], row - c]

    gemv = gemv_macro(T, arch, m, n, k, rows, warps, ksplit, put)

    @T.prim_func
    def compressor_project(X: T.Tensor((m, k), "bfloat16"), W: T.Tensor((n, k), "bfloat16"),
                           APE: T.Tensor((r, c), "float32"), ROW: T.Tensor((m,), "int64"),
                           BKV: T.Tensor((r, c), "float32"), BG: T.Tensor((r, c), "float32")):
        with T.Kernel(T.ceildiv(n, cta_rows), threads=(32, warps)) as bn:
            gemv(X, W, bn, BKV, BG, APE, ROW)

    return compile_kernel(compressor_project, arch)


def compressor_project(x: torch.Tensor, w: torch.Tensor, ape: torch.Tensor, row: torch.Tensor,
                       buf_kv: torch.Tensor, buf_gate: torch.Tensor) -> None:
    """x [M, K] bf16 (M <= 16), w [2C, K] bf16 (wkv rows, then wgate rows), ape, buf_kv and
    buf_gate [r, C] fp32, row [M] int64 (distinct buffer rows): writes rows `row` of the buffers
    in place, as `reference.compressor_project`."""
    m, k = x.shape if x.dim() == 2 else (-1, -1)
    r, c = buf_kv.shape if buf_kv.dim() == 2 else (-1, -1)
    if (m < 0 or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or tuple(w.shape) != (2 * c, k)
            or c < 0 or tuple(buf_gate.shape) != (r, c) or tuple(ape.shape) != (r, c)
            or buf_kv.dtype != torch.float32 or buf_gate.dtype != torch.float32 or tuple(row.shape) != (m,)):
        raise KernelInputError(
            f"compressor_project takes x [M, K] bf16, w [2C, K] bf16, ape/buf_kv/buf_gate [r, C] fp32 and "
            f"row [M]; got x {x.dtype} {tuple(x.shape)}, w {w.dtype} {tuple(w.shape)}, ape {tuple(ape.shape)}, "
            f"buf_kv {buf_kv.dtype} {tuple(buf_kv.shape)}, buf_gate {buf_gate.dtype} {tuple(buf_gate.shape)}, "
            f"row {tuple(row.shape)}")
    if not buf_kv.is_contiguous() or not buf_gate.is_contiguous():
        raise KernelInputError("compressor_project writes buf_kv and buf_gate in place: they must be contiguous")
    arch = cuda_arch(x.device)
    if m == 0:
        return
    if m > MAX_M or k % VEC:
        ref.compressor_project(x, w, ape, row, buf_kv, buf_gate)
        return
    kernel = compressor_project_kernel(m, c, k, r, *bf16_gemv_tile(2 * c, k, arch), arch)
    kernel(aligned16(x), aligned16(w), ape.float().contiguous(), row.to(torch.int64).contiguous(), buf_kv, buf_gate)
