"""RMSNorm + RoPE (+ the KV's QDQ8 storage rounding) on CUDA (TileLang) in one launch; same
contract as `reference.norm_rope`.

x [S, H, D] (or [S, D]) -> y in x's dtype: y = RMSNorm(x) (weight [D] or none) rounded to x's
dtype, then the trailing 2·len(inv_freq) channels rotated at positions [S] (interleaved pairs),
then, when `round_lead` > 0, the leading `round_lead` channels QDQ8-rounded in blocks of 64
(native KV storage, §C.0). The attention's q takes the norm and the rotation (two launches
before), its kv all three (about seven: norm, rotation, quantise, dequantise, narrow, concat).

Bits: the norm as kernels/rms_norm.py (sum of squares by warp shuffles, then the warps' partial
sums in order: equal to the reference up to fp32 summation order); the rotation as
kernels/rope.py (angle pos·inv_freq, precise cosf/sinf, unfused products and sums); the QDQ8 as
kernels/act_quant.py (power-of-two scale from amax's bits, e4m3 round to nearest even, exact
dequantisation) — bit-identical to the reference given the same normed values.

Layout: one CTA per (token, head) row, one thread per channel (D <= 1024, a multiple of 32);
rows that do not fit go to the reference. A thread's weight and frequency are loaded before the
PDL wait (kernels/pdl.py). sm_90 and sm_121 (GB10): untested on a GPU.
(No `from __future__ import annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import functools

import torch

from kernels import pdl, reference as ref
from kernels.toolkit import (TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, fp32_call, kernel_factory,
                             pow2_scale_bits)
from kernels.rope import rope_angle, rotate_pair

MAX_DIM = 1024
QDQ8_BLOCK = 64


@kernel_factory
def norm_rope_kernel(heads: int, d: int, half: int, weighted: bool, eps: float, round_lead: int, dtype: str,
                     arch: tuple[int, int], rows: bool = False):
    """(X [S, heads, d] dtype, W [d] fp32, P [S] int64, F [half] fp32, Y [S, heads, d] dtype);
    W is read only when `weighted`. With `rows`: (X, W, P, F, ROWS [S] int64, Y [R, heads, d]),
    token s written to Y[ROWS[s]] (a buffer's rows, in place)."""
    import tilelang.language as T

    warps = d // 32
    lead = d - 2 * half  # channels before the rotary tail
    inv_d = T.float32(1.0 / d)  # torch's mean multiplies the sum by the fp32 1/N
    seq, buffer_rows = T.dynamic("seq"), T.dynamic("buffer_rows")

    mul = functools.partial(fp32_call, T, "__fmul_rn")

    @T.macro
    def constants(W, F, c):
        """This thread's weight and rotary frequency into c [2] (before the PDL wait: never written
        while kernels run, so their DRAM latency overlaps the predecessor)."""
        e = T.get_thread_binding(0)
        if weighted:
            c[0] = W[e]
        if e >= lead:
            c[1] = F[(e - lead) // 2]

    @T.macro
    def body(X, c, P, Y, row, h, s):
        e = T.get_thread_binding(0)  # this thread's channel
        part = T.alloc_shared((warps,), "float32")
        sm = T.alloc_shared((d,), "float32")  # the normed row, rounded to dtype
        v = T.alloc_local((6,), "float32")  # x, sum / r, angle, cos, sin, amax
        q8 = T.alloc_local((1,), "float8_e4m3")
        v[0] = T.Cast("float32", X[s, h, e])
        v[1] = T.warp_reduce_sum(v[0] * v[0])
        if e % 32 == 0:
            part[e // 32] = v[1]
        T.sync_threads()
        v[1] = part[0]
        for i in T.serial(1, warps):  # the warps' partial sums in order
            v[1] = v[1] + part[i]
        v[1] = T.rsqrt(v[1] * inv_d + eps)
        if weighted:
            v[0] = T.Cast("float32", T.Cast(dtype, c[0] * (v[0] * v[1])))
        else:
            v[0] = T.Cast("float32", T.Cast(dtype, v[0] * v[1]))
        sm[e] = v[0]
        T.sync_threads()
        if e >= lead:  # rotary tail: pair (re, im) = channels lead + 2j, lead + 2j + 1
            v[2] = rope_angle(T, P[s], c[1])
            v[3] = T.cos(v[2])
            v[4] = T.sin(v[2])
            if (e - lead) % 2 == 0:  # this thread holds re, its neighbour im
                Y[row, h, e] = T.Cast(dtype, rotate_pair(T, v[0], sm[e + 1], v[3], v[4])[0])
            else:
                Y[row, h, e] = T.Cast(dtype, rotate_pair(T, sm[e - 1], v[0], v[3], v[4])[1])
        elif e < round_lead:  # QDQ8 of the leading channels, blocks of 64
            v[5] = T.float32(0)
            for c in T.unroll(QDQ8_BLOCK):
                v[5] = T.max(v[5], T.abs(sm[(e // QDQ8_BLOCK) * QDQ8_BLOCK + c]))
            sc, inv = pow2_scale_bits(T, v[5])
            q8[0] = T.clamp(mul(v[0], inv), -448.0, 448.0)
            Y[row, h, e] = T.Cast(dtype, mul(T.Cast("float32", q8[0]), sc))
        else:
            Y[row, h, e] = T.Cast(dtype, v[0])

    if rows:
        @T.prim_func
        def norm_rope(X: T.Tensor((seq, heads, d), dtype), W: T.Tensor((d,), "float32"), P: T.Tensor((seq,), "int64"),
                      F: T.Tensor((half,), "float32"), ROWS: T.Tensor((seq,), "int64"),
                      Y: T.Tensor((buffer_rows, heads, d), dtype)):
            with T.Kernel(heads, seq, threads=d) as (h, s):
                c = T.alloc_local((2,), "float32")
                constants(W, F, c)
                pdl.begin(T, arch)  # before the row is read: a kernel before may have written it
                body(X, c, P, Y, ROWS[s], h, s)
    else:
        @T.prim_func
        def norm_rope(X: T.Tensor((seq, heads, d), dtype), W: T.Tensor((d,), "float32"), P: T.Tensor((seq,), "int64"),
                      F: T.Tensor((half,), "float32"), Y: T.Tensor((seq, heads, d), dtype)):
            with T.Kernel(heads, seq, threads=d) as (h, s):
                c = T.alloc_local((2,), "float32")
                constants(W, F, c)
                pdl.begin(T, arch)
                body(X, c, P, Y, s, h, s)

    return compile_kernel(norm_rope, arch)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
              inv_freq: torch.Tensor, round_lead: int = 0, out: torch.Tensor | None = None,
              rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [S, ..., D] (bf16/fp16/fp32) -> normed, rotated (and lead-rounded) x, as `reference.norm_rope`;
    with `out` (a buffer [R, ..., D] of x's dtype) and `rows` [S] (int64, on the device), token s
    is written to out[rows[s]] in place instead and None returned."""
    s, d, half = x.shape[0], x.shape[-1], inv_freq.shape[-1]
    if x.dtype not in TORCH_TO_TL:
        raise KernelInputError(f"norm_rope takes bf16, fp16 or fp32 input, got {x.dtype}")
    if weight is not None and tuple(weight.shape) != (d,):
        raise KernelInputError(f"norm_rope: weight shape {tuple(weight.shape)} != ({d},)")
    if tuple(positions.shape) != (s,) or 2 * half > d or round_lead % QDQ8_BLOCK or round_lead > d - 2 * half:
        raise KernelInputError(f"norm_rope: positions {tuple(positions.shape)}, {2 * half} rotary channels and "
                               f"{round_lead} rounded channels do not fit x {tuple(x.shape)}")
    if out is not None and (out.dtype != x.dtype or out.shape[1:] != x.shape[1:] or rows is None
                            or tuple(rows.shape) != (s,)):
        raise KernelInputError(f"norm_rope: out {tuple(out.shape)} {out.dtype} with rows "
                               f"{None if rows is None else tuple(rows.shape)} cannot take x {tuple(x.shape)} {x.dtype} "
                               "(same dtype and row shape, one row index per token)")
    arch = cuda_arch(x.device)
    if d % 32 or d > MAX_DIM or (out is not None and not out.is_contiguous()):
        return ref.norm_rope(x, weight, eps, positions, inv_freq, round_lead, out, rows)
    x3 = x.contiguous().reshape(s, -1, d)  # [S, H, D]
    y = torch.empty_like(x3) if out is None else out.view(out.shape[0], -1, d)  # [S or R, H, D]
    if x3.numel():
        w = x3.new_empty(d, dtype=torch.float32) if weight is None else weight.float().contiguous()
        kernel = norm_rope_kernel(x3.shape[1], d, half, weight is not None, float(eps), int(round_lead),
                                  TORCH_TO_TL[x.dtype], arch, out is not None)
        where = () if out is None else (rows.to(torch.int64).contiguous(),)
        kernel(x3, w, positions.to(torch.int64), inv_freq.float().contiguous(), *where, y)
    return y.reshape(x.shape) if out is None else None
