"""RMSNorm on CUDA (TileLang) in one launch; same contract as `reference.rms_norm`.

y = w · (x · rsqrt(mean(x²) + eps)) in fp32, cast back to x's dtype (§C.0). The reference is
five to eight elementwise/reduction launches per call (widen, square, mean, add, rsqrt,
multiplies, narrow); a decode step has about eight norms per layer, so at batch 1 their launch
count, not their bytes, is what costs. Each CTA normalises `rows_per_cta` rows held in registers
(about 32 values per thread); the squares are summed by TileLang's block reduction, so results
equal the reference up to fp32 summation order (bf16 outputs: at most one rounding step). The
weight, never written while kernels run, is loaded before the PDL wait (kernels/pdl.py).
"""

import torch

from kernels import pdl, reference as ref
from kernels.toolkit import TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, kernel_factory, tile_params

# values per thread and the largest CTA, per compute capability (sm_121: untested)
TILE_PARAMS = {(9, 0): {"per_thread": 32, "max_threads": 512}, (12, 1): {"per_thread": 32, "max_threads": 512}}
DEFAULT_TILE = {"per_thread": 32, "max_threads": 512}
MAX_DIM = 16384  # mHC's flattened streams (4 × 4096)


def row_layout(d: int, arch: tuple[int, int]) -> tuple[int, int]:
    """(threads, rows per CTA) for rows of d values."""
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    threads = 128
    while threads < p["max_threads"] and threads * p["per_thread"] < d:
        threads *= 2
    return threads, max(1, threads * p["per_thread"] // d)


@kernel_factory
def rms_norm_kernel(d: int, dtype: str, weighted: bool, eps: float, arch: tuple[int, int]):
    """(X [rows, d] dtype, W [d] fp32, Y [rows, d] dtype); W is read only when `weighted`."""
    import tilelang.language as T

    threads, rb = row_layout(d, arch)
    rows = T.dynamic("rows")
    inv_d = T.float32(1.0 / d)  # torch's mean multiplies the sum by the fp32 1/N

    def scaled(x, r, w):
        return w * (x * r) if weighted else x * r

    @T.prim_func
    def rms_norm_main(X: T.Tensor((rows, d), dtype), W: T.Tensor((d,), "float32"), Y: T.Tensor((rows, d), dtype)):
        with T.Kernel(T.ceildiv(rows, rb), threads=threads) as bx:
            x = T.alloc_fragment((rb, d), "float32")
            sq = T.alloc_fragment((rb, d), "float32")
            ss = T.alloc_fragment((rb,), "float32")
            wf = T.alloc_fragment((rb, d), "float32")  # the weight, loaded before the PDL wait
            if weighted:
                for i, j in T.Parallel(rb, d):
                    wf[i, j] = W[j]
            pdl.begin(T, arch)
            for i, j in T.Parallel(rb, d):
                x[i, j] = T.if_then_else(bx * rb + i < rows, T.Cast("float32", X[bx * rb + i, j]), 0.0)
            for i, j in T.Parallel(rb, d):
                sq[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(sq, ss, dim=1)
            for i in T.Parallel(rb):
                ss[i] = T.rsqrt(ss[i] * inv_d + eps)
            for i, j in T.Parallel(rb, d):
                if bx * rb + i < rows:
                    Y[bx * rb + i, j] = T.Cast(dtype, scaled(x[i, j], ss[i], wf[i, j]))

    return compile_kernel(rms_norm_main, arch)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D] (bf16/fp16/fp32), weight [D] or None -> x's dtype and shape. Rows of other
    lengths than multiples of 128 up to MAX_DIM go to the reference."""
    d = x.shape[-1]
    if x.dtype not in TORCH_TO_TL:
        raise KernelInputError(f"rms_norm takes bf16, fp16 or fp32 input, got {x.dtype}")
    if weight is not None and tuple(weight.shape) != (d,):
        raise KernelInputError(f"rms_norm: weight shape {tuple(weight.shape)} != ({d},)")
    arch = cuda_arch(x.device)
    if d % 128 or d > MAX_DIM:
        return ref.rms_norm(x, weight, eps)
    x2 = x.contiguous().reshape(-1, d)  # [rows, D]
    y = torch.empty_like(x2)
    if x2.shape[0]:
        w = x2.new_empty(d, dtype=torch.float32) if weight is None else weight.float().contiguous()
        rms_norm_kernel(d, TORCH_TO_TL[x.dtype], weight is not None, float(eps), arch)(x2, w, y)
    return y.reshape(x.shape)
