"""The output head on CUDA (TileLang): bf16 weight, fp32 activations, fp32 products and sums.

The official head computes its logits in fp32 from the bf16 `head.weight` (spec §C.1). Keeping
an fp32 copy of the [V, D] weight doubles what every decode step reads (2 GiB instead of 1 GiB
for V = 129280, D = 4096); this GEMV reads the bf16 weight and widens it in registers, which
is exact (every bf16 is an fp32), so the result is `reference.head_logits` up to fp32
summation order. Layout: each warp owns `rows` weight rows, each lane loads 8 contiguous bf16
(16 bytes) per row per step, a warp shuffle sum finishes each row (as kernels/fp8_gemm.py).
More than GEMV_MAX_M rows (the logits CLI over a whole prompt) go to the reference.
"""

import torch

from kernels import pdl, reference as ref
from kernels.toolkit import KernelInputError, compile_kernel, cuda_arch, kernel_factory, tile_params
from kernels.fp8_gemm import DEFAULT_TILE, GEMV_MAX_M, TILE_PARAMS
from kernels.gemv import gemv_rows

_VEC = 8  # bf16 weights per lane per step (one 16-byte load)


@kernel_factory
def head_gemv_kernel(m: int, n: int, k: int, arch: tuple[int, int]):
    """(X [m,k] fp32, W [n,k] bf16) -> Y [m,n] fp32."""
    import tilelang.language as T

    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    rows, warps = gemv_rows(n, p), p["warps"]
    kstep = 32 * _VEC
    steps = (k + kstep - 1) // kstep
    loop = T.unroll if steps <= 16 else T.serial

    @T.prim_func
    def head_gemv(X: T.Tensor((m, k), "float32"), W: T.Tensor((n, k), "bfloat16"), Y: T.Tensor((m, n), "float32")):
        with T.Kernel(T.ceildiv(n, rows * warps), threads=(32, warps)) as bn:
            T.import_source(pdl.SOURCE)
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            wv = T.alloc_local((rows, _VEC), "bfloat16")
            xf = T.alloc_local((_VEC,), "float32")
            acc = T.alloc_local((rows, m), "float32")
            if lane == 0 and warp == 0:  # the CTA's rows: one range
                pdl.prefetch_rows(T, arch, n * k * 2, W[bn * rows * warps, 0],
                                  T.min(rows * warps, n - bn * rows * warps) * k * 2)
            pdl.begin(T, arch)
            T.clear(acc)
            for ko in loop(steps):
                k0 = ko * kstep + lane * _VEC
                if k0 < k:
                    for r in T.unroll(rows):
                        row = T.min(bn * rows * warps + warp * rows + r, n - 1)
                        for v in T.vectorized(_VEC):
                            wv[r, v] = W[row, k0 + v]
                    for i in T.unroll(m):
                        for v in T.vectorized(_VEC):
                            xf[v] = X[i, k0 + v]
                        for r in T.unroll(rows):
                            for v in T.unroll(_VEC):
                                acc[r, i] += xf[v] * T.Cast("float32", wv[r, v])
            for r in T.unroll(rows):
                for i in T.unroll(m):
                    total = T.warp_reduce_sum(acc[r, i])
                    if lane == 0 and bn * rows * warps + warp * rows + r < n:
                        Y[i, bn * rows * warps + warp * rows + r] = total

    return compile_kernel(head_gemv, arch)


def head_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, D] × bf16 weight [V, D] -> fp32 logits [M, V] (contract of reference.head_logits)."""
    m, k = x.shape
    n = w.shape[0]
    if w.dtype != torch.bfloat16 or w.shape[1] != k or k % _VEC:
        raise KernelInputError(f"head_logits: needs a bf16 weight [V, {k}] with D a multiple of {_VEC}, "
                               f"got {w.dtype} {tuple(w.shape)}")
    if m == 0 or m > GEMV_MAX_M:
        return ref.head_logits(x, w)
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    head_gemv_kernel(m, n, k, cuda_arch(x.device))(x.float().contiguous(), w.contiguous(), y)
    return y
