"""Clamped SwiGLU + routing weight + FP8 quantisation on CUDA (TileLang) in one launch; same
contract as `reference.swiglu_quant` (an expert's w2 input, §C.7 step 4).

g, u [M, I] (bf16/fp16/fp32, widened), weights [M] or None, limit -> (q [M, I] e4m3, s [M, I/block]
fp32): h = silu(min(g, limit)) · clamp(u, ±limit) (· weights[m]) in fp32, rounded to bf16, then
`act_quant` of h per row and `block` channels. The reference is about ten launches.

Bits: silu is torch CUDA's `x / (1 + expf(-x))` (precise `expf`: TileLang does not pass
--use_fast_math), the products are single fp32 roundings (`__fmul_rn`: no FMA contraction), the
bf16 rounding is cvt.rn; the scale is read off amax's bits (`pow2_scale_bits`, as
kernels/act_quant.py), q = e4m3(clamp(h · 2^-e, ±448)) by cvt.rn.satfinite, and h · 2^-e equals
the reference's h / 2^e exactly. On the same GPU q and s are bit-identical to the reference
(tests/kernels/test_moe_kernels_gpu.py checks equality).

Layout: one warp per (row, block of `block` channels), block / 32 consecutive channels per lane,
amax by warp shuffle; `warps` blocks per CTA. g and u may be strided rows (e.g. the two column
halves of one [M, 2I] tensor): their row strides are read at launch, no copies. sm_90 tested,
sm_121 (GB10) untested. (No `from __future__ import annotations`: TileLang evaluates the kernel
signature's annotations.)
"""

import functools

import torch

from kernels import pdl
from kernels.toolkit import (TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, fp32_call, kernel_factory,
                             pow2_scale_bits, tile_params)

TILE_PARAMS = {(9, 0): {"warps": 2}, (12, 1): {"warps": 2}}  # sm_121 (GB10): untested
DEFAULT_TILE = {"warps": 2}


@kernel_factory
def swiglu_quant_kernel(inter: int, block: int, limit: float, weighted: bool, dtype: str, arch: tuple[int, int]):
    """(G [M, inter] dtype, row stride gs, U [M, inter] dtype, row stride us, W [M] fp32,
    Q [M, inter] e4m3, S [M, inter / block] fp32); W is read only when `weighted`."""
    import tilelang.language as T

    warps = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["warps"]
    per, nb = block // 32, inter // block  # values per lane, blocks per row
    rows, gs, us = T.dynamic("rows"), T.dynamic("gs"), T.dynamic("us")
    lim = T.float32(limit)

    f32 = functools.partial(fp32_call, T)

    @T.prim_func
    def swiglu_quant_main(G: T.StridedTensor((rows, inter), (gs, 1), dtype),
                          U: T.StridedTensor((rows, inter), (us, 1), dtype), W: T.Tensor((rows,), "float32"),
                          Q: T.Tensor((rows, inter), "float8_e4m3"), S: T.Tensor((rows, nb), "float32")):
        with T.Kernel(T.ceildiv(rows * nb, warps), threads=(32, warps)) as bx:
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            h = T.alloc_local((per,), "float32")
            q = T.alloc_local((per,), "float8_e4m3")
            v = T.alloc_local((4,), "float32")  # min(g, limit), clamped u, amax, unused
            pdl.begin(T, arch)
            b = bx * warps + warp  # this warp's (row, block); out-of-range warps redo the last one
            bc = T.min(b, rows * nb - 1)
            r = bc // nb
            c0 = (bc % nb) * block + lane * per
            for i in T.unroll(per):
                v[0] = T.min(T.Cast("float32", G[r, c0 + i]), lim)
                v[1] = T.min(T.max(T.Cast("float32", U[r, c0 + i]), -lim), lim)
                v[0] = f32("__fmul_rn", f32("__fdiv_rn", v[0], f32("__fadd_rn", T.float32(1.0), T.exp(-v[0]))), v[1])
                if weighted:
                    v[0] = f32("__fmul_rn", v[0], W[r])
                h[i] = T.Cast("float32", T.Cast("bfloat16", v[0]))
            v[2] = T.abs(h[0])
            for i in T.unroll(1, per):
                v[2] = T.max(v[2], T.abs(h[i]))
            v[2] = T.warp_reduce_max(v[2])  # every lane of the warp takes part
            s, inv = pow2_scale_bits(T, v[2])
            for i in T.unroll(per):
                q[i] = T.Cast("float8_e4m3", T.clamp(f32("__fmul_rn", h[i], inv), -448.0, 448.0))
            if b < rows * nb:
                for i in T.vectorized(per):
                    Q[r, c0 + i] = q[i]
                if lane == 0:
                    S[r, bc % nb] = s

    return compile_kernel(swiglu_quant_main, arch)


def swiglu_quant(g: torch.Tensor, u: torch.Tensor, weights: torch.Tensor | None, limit: float,
                 block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """g, u [M, I] (bf16/fp16/fp32; rows may be strided), weights [M] or None -> (q [M, I] e4m3,
    s [M, I/block] fp32), as `reference.swiglu_quant`."""
    if g.dim() != 2 or tuple(u.shape) != tuple(g.shape):
        raise KernelInputError(f"swiglu_quant needs g and u of one shape [M, I], got {tuple(g.shape)} and "
                               f"{tuple(u.shape)}")
    if g.dtype not in TORCH_TO_TL or u.dtype != g.dtype:
        raise KernelInputError(f"swiglu_quant takes g and u both bf16, fp16 or fp32, got {g.dtype} and {u.dtype}")
    m, inter = g.shape
    if block <= 0 or block % 32 or inter % block:
        raise KernelInputError(f"swiglu_quant needs I ({inter}) to be a multiple of block={block}, "
                               "itself a positive multiple of 32")
    if weights is not None and (tuple(weights.shape) != (m,) or not weights.is_floating_point()):
        raise KernelInputError(f"swiglu_quant: weights must be floating point of shape ({m},), got "
                               f"{weights.dtype} {tuple(weights.shape)}")
    arch = cuda_arch(g.device)
    if u.device != g.device or (weights is not None and weights.device != g.device):
        raise KernelInputError("swiglu_quant: g, u and weights must be on one device")
    q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=g.device)
    s = torch.empty(m, inter // block, dtype=torch.float32, device=g.device)
    if m and inter:
        g2 = g if g.stride(1) == 1 else g.contiguous()  # strided rows are read in place
        u2 = u if u.stride(1) == 1 else u.contiguous()
        w = g.new_empty(m, dtype=torch.float32) if weights is None else weights.float().contiguous()
        swiglu_quant_kernel(inter, block, float(limit), weights is not None, TORCH_TO_TL[g.dtype], arch)(
            g2, u2, w, q, s)
    return q, s
