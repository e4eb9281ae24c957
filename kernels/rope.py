"""Interleaved RoPE on CUDA (TileLang) in one launch; same contract as `reference.rope`.

x [S, H, D] (or [S, D]) at positions [S]: the trailing R = 2·len(inv_freq) channels rotate in
pairs (2i, 2i+1) by the angle pos·inv_freq[i] (or its negative with `inverse`); the leading
channels are copied. The reference is about ten launches per call (angles, cos, sin, widen,
four products, two sums, the copy of the leading channels), and a decode step rotates q, kv,
the attention output, compressed entries and indexer queries of every layer.

Bits: the angle is the fp32 product pos·inv_freq, cos/sin are CUDA's precise `cosf`/`sinf`
(TileLang does not pass --use_fast_math by default), the four products and two sums are single
fp32 roundings (`__fmul_rn`/`__fadd_rn`/`__fsub_rn`: nvcc may not contract them into FMAs),
rounded once into x's dtype — the reference's operations in the same order, so on the same GPU
the results are bit-identical (tests/kernels/test_kernels_gpu.py checks equality).

Layout: one thread per channel pair of one row (token × head), rows contiguous [S·H, D].
(No `from __future__ import annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import functools

import torch

from kernels import pdl
from kernels.toolkit import (TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, fp32_call, kernel_factory,
                             tile_params)

TILE_PARAMS = {(9, 0): {"threads": 128}, (12, 1): {"threads": 128}}  # sm_121 (GB10): untested
DEFAULT_TILE = {"threads": 128}


def rope_angle(T, position, inv_freq):
    """The angle position·inv_freq as one fp32 rounding (TileLang expression)."""
    return fp32_call(T, "__fmul_rn", T.Cast("float32", position), inv_freq)


def rotate_pair(T, re, im, cos, sin, inverse: bool = False):
    """(re, im) rotated by the angle with this (cos, sin), or by its negative, as TileLang fp32
    expressions: every product and sum rounded on its own, in the reference's order."""
    mul = functools.partial(fp32_call, T, "__fmul_rn")
    add = functools.partial(fp32_call, T, "__fadd_rn")
    sub = functools.partial(fp32_call, T, "__fsub_rn")
    if inverse:  # angle -a: the reference's signs folded in
        return add(mul(re, cos), mul(im, sin)), sub(mul(im, cos), mul(re, sin))
    return sub(mul(re, cos), mul(im, sin)), add(mul(re, sin), mul(im, cos))


@kernel_factory
def rope_kernel(heads: int, d: int, half: int, inverse: bool, dtype: str, arch: tuple[int, int]):
    """(X [S, heads, d] dtype, P [S] int64, F [half] fp32, Y [S, heads, d] dtype)."""
    import tilelang.language as T

    threads = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["threads"]
    pairs = d // 2  # per row
    lead = d // 2 - half  # leading pairs, copied
    seq = T.dynamic("seq")

    @T.prim_func
    def rope_main(X: T.Tensor((seq, heads, d), dtype), P: T.Tensor((seq,), "int64"),
                  F: T.Tensor((half,), "float32"), Y: T.Tensor((seq, heads, d), dtype)):
        with T.Kernel(T.ceildiv(seq * heads * pairs, threads), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            v = T.alloc_local((6,), "float32")  # re, im, cos, sin, angle, unused
            pdl.begin(T, arch)
            g = bx * threads + tx  # pair index over all rows
            t = g // (heads * pairs)
            h = (g // pairs) % heads
            j = g % pairs
            if g < seq * heads * pairs:
                if j < lead:
                    Y[t, h, 2 * j] = X[t, h, 2 * j]
                    Y[t, h, 2 * j + 1] = X[t, h, 2 * j + 1]
                else:
                    v[4] = rope_angle(T, P[t], F[j - lead])
                    v[2] = T.cos(v[4])
                    v[3] = T.sin(v[4])
                    v[0] = T.Cast("float32", X[t, h, 2 * j])
                    v[1] = T.Cast("float32", X[t, h, 2 * j + 1])
                    Y[t, h, 2 * j] = T.Cast(dtype, rotate_pair(T, v[0], v[1], v[2], v[3], inverse)[0])
                    Y[t, h, 2 * j + 1] = T.Cast(dtype, rotate_pair(T, v[0], v[1], v[2], v[3], inverse)[1])

    return compile_kernel(rope_main, arch)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [S, ..., D] (bf16/fp16/fp32), positions [S] int, inv_freq [R/2] fp32 -> x rotated, as
    `reference.rope`."""
    half = inv_freq.shape[-1]
    s, d = x.shape[0], x.shape[-1]
    if x.dtype not in TORCH_TO_TL:
        raise KernelInputError(f"rope takes bf16, fp16 or fp32 input, got {x.dtype}")
    if d % 2 or 2 * half > d:
        raise KernelInputError(f"rope: {2 * half} rotary channels do not fit rows of {d}")
    if tuple(positions.shape) != (s,):
        raise KernelInputError(f"rope: positions {tuple(positions.shape)} for {s} tokens")
    arch = cuda_arch(x.device)
    x3 = x.contiguous().reshape(s, -1, d)  # [S, H, D]: middle dims flattened into heads
    y = torch.empty_like(x3)
    if x3.numel():
        rope_kernel(x3.shape[1], d, half, bool(inverse), TORCH_TO_TL[x.dtype], arch)(
            x3, positions.to(torch.int64), inv_freq.float().contiguous(), y)
    return y.reshape(x.shape)
