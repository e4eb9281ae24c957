"""RMSNorm + FP8 activation quantisation on CUDA (TileLang) in one launch; same contract as
`reference.rms_norm_quant`.

x [M, K] (bf16/fp16/fp32), weight [K] or None -> (y [M, K] in x's dtype, q [M, K] e4m3,
s [M, K/128] fp32): y = RMSNorm(x) as kernels/rms_norm.py computes it, then (q, s) =
act_quant(y, 128) as kernels/act_quant.py computes it (power-of-two scale from amax's bits,
e4m3 round to nearest even). The norms whose outputs feed FP8 linears (the attention's input
and its q_lora activation) take one launch instead of two. The weight, never written while
kernels run, is loaded before the PDL wait (kernels/pdl.py): its DRAM latency overlaps the
predecessor instead of sitting on the decode step's chain.

Layout: a CTA normalises `rows_per_cta` rows held in registers (kernels/rms_norm.py's layout),
viewed as [rows, K/128, 128] for the block maxima. K a multiple of 128 up to 16384; other rows
go to the reference. sm_90 and sm_121 (GB10): untested on a GPU. (No `from __future__ import
annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import torch

from kernels import pdl, reference as ref
from kernels.toolkit import TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, kernel_factory, pow2_scale_bits
from kernels.rms_norm import MAX_DIM, row_layout


@kernel_factory
def rms_norm_quant_kernel(d: int, dtype: str, weighted: bool, eps: float, arch: tuple[int, int]):
    """(X [rows, d] dtype, W [d] fp32, Y [rows, d] dtype, Q [rows, d] e4m3, S [rows, d/128] fp32)."""
    import tilelang.language as T

    threads, rb = row_layout(d, arch)
    nb = d // 128
    rows = T.dynamic("rows")
    inv_d = T.float32(1.0 / d)

    @T.prim_func
    def rms_norm_quant(X: T.Tensor((rows, d), dtype), W: T.Tensor((d,), "float32"), Y: T.Tensor((rows, d), dtype),
                       Q: T.Tensor((rows, d), "float8_e4m3"), S: T.Tensor((rows, nb), "float32")):
        with T.Kernel(T.ceildiv(rows, rb), threads=threads) as bx:
            x = T.alloc_fragment((rb, nb, 128), "float32")
            sq = T.alloc_fragment((rb, nb, 128), "float32")
            part = T.alloc_fragment((rb, nb), "float32")
            ss = T.alloc_fragment((rb,), "float32")
            amax = T.alloc_fragment((rb, nb), "float32")
            inv = T.alloc_fragment((rb, nb), "float32")
            sc = T.alloc_fragment((rb, nb), "float32")
            q = T.alloc_fragment((rb, nb, 128), "float8_e4m3")
            wf = T.alloc_fragment((rb, nb, 128), "float32")  # the weight, loaded before the wait
            if weighted:
                for i, b, j in T.Parallel(rb, nb, 128):
                    wf[i, b, j] = W[b * 128 + j]
            pdl.begin(T, arch)
            for i, b, j in T.Parallel(rb, nb, 128):
                x[i, b, j] = T.if_then_else(bx * rb + i < rows, T.Cast("float32", X[bx * rb + i, b * 128 + j]), 0.0)
            for i, b, j in T.Parallel(rb, nb, 128):
                sq[i, b, j] = x[i, b, j] * x[i, b, j]
            T.reduce_sum(sq, part, dim=2)
            T.reduce_sum(part, ss, dim=1)
            for i in T.Parallel(rb):
                ss[i] = T.rsqrt(ss[i] * inv_d + eps)
            for i, b, j in T.Parallel(rb, nb, 128):  # y, rounded to the output dtype, kept widened
                x[i, b, j] = T.Cast("float32", T.Cast(dtype, (wf[i, b, j] * (x[i, b, j] * ss[i])) if weighted
                                                      else x[i, b, j] * ss[i]))
            T.reduce_absmax(x, amax, dim=2)
            for i, b in T.Parallel(rb, nb):
                s_ib, inv_ib = pow2_scale_bits(T, amax[i, b])
                sc[i, b] = s_ib
                inv[i, b] = inv_ib
            for i, b, j in T.Parallel(rb, nb, 128):
                q[i, b, j] = T.clamp(x[i, b, j] * inv[i, b], -448.0, 448.0)
            for i, b, j in T.Parallel(rb, nb, 128):
                if bx * rb + i < rows:
                    Y[bx * rb + i, b * 128 + j] = T.Cast(dtype, x[i, b, j])
                    Q[bx * rb + i, b * 128 + j] = q[i, b, j]
            for i, b in T.Parallel(rb, nb):
                if bx * rb + i < rows:
                    S[bx * rb + i, b] = sc[i, b]

    return compile_kernel(rms_norm_quant, arch)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32), weight [K] or None -> (y, q, s), as `reference.rms_norm_quant`."""
    if x.dim() != 2 or x.dtype not in TORCH_TO_TL:
        raise KernelInputError(f"rms_norm_quant takes x [M, K] in bf16, fp16 or fp32, got {x.dtype} {tuple(x.shape)}")
    m, d = x.shape
    if weight is not None and tuple(weight.shape) != (d,):
        raise KernelInputError(f"rms_norm_quant: weight shape {tuple(weight.shape)} != ({d},)")
    if d % 128:
        raise KernelInputError(f"rms_norm_quant quantises in blocks of 128 channels, got K={d}: "
                               "use rms_norm for other widths")
    if d > MAX_DIM:
        return ref.rms_norm_quant(x, weight, eps)
    arch = cuda_arch(x.device)
    x2 = x.contiguous()
    y = torch.empty_like(x2)
    q = torch.empty(m, d, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, d // 128, dtype=torch.float32, device=x.device)
    if m:
        w = x2.new_empty(d, dtype=torch.float32) if weight is None else weight.float().contiguous()
        rms_norm_quant_kernel(d, TORCH_TO_TL[x.dtype], weight is not None, float(eps), arch)(x2, w, y, q, s)
    return y, q, s
