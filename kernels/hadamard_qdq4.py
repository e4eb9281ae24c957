"""Hadamard rotation + QDQ4 on CUDA (TileLang) in one launch; same contract as `reference.hadamard_qdq4`.

x [..., D] (bf16/fp16/fp32, D a power of two up to MAX_DIM, D % block == 0) -> x's dtype and
shape: `qdq4(hadamard(x), block)`, the indexer's storage rounding (§C.0). The reference is about
2·log2(D) + 20 launches; a decode step applies it to the indexer queries and compressed keys of
every layer.

Bits, op for op as the reference runs on a CUDA GPU (tests/kernels/test_hadamard_qdq4_gpu.py checks
torch.equal):
* butterflies: log2(D) stages h = 1, 2, 4, ...; element e with e & h == 0 becomes e + (e ^ h),
  the other (e ^ h) - e, one fp32 rounding each (`__fadd_rn`/`__fsub_rn`: no FMA contraction).
* 1/sqrt(D): torch's CUDA division by a CPU scalar multiplies by the fp32 reciprocal of the
  scalar rounded to fp32, so y = y * fl(1 / fl(sqrt(D))) (`_recip_bits`, computed on the host),
  then rounded (RNE) to x's dtype and widened back: h.
* scale per `block` channels: amax = max |h|; t = max(amax, 6·2^-126) * fl(1/6) (the same torch
  rule for `/ 6.0`); s = t if t's mantissa bits are 0 (a power of two) else 2^(exponent + 1):
  frexp's rounding up in `reference.pow2_scale`. t >= 2^-126 is normal, so 1/s is exact. (For
  the scale, * fl(1/6) and / 6 agree on every fp32 amax tried; for 1/sqrt(D) they do not.)
* v = clamp(h · (1/s), ±6) (= h / s, both correctly rounded); e2m1: a = |v|, step 0.5/1/2 below
  2/4/6, r = min(rintf(a / step) · step, 6) (half to even, like torch.round), copysign(r, v);
  the output is r · s rounded to x's dtype. (NaN/inf inputs are outside the contract: the amax
  here ignores NaN where torch's propagates it.)

Layout: rows contiguous [rows, D]; one thread per element, max(1, threads // D) rows per CTA.
Butterfly partners are exchanged through two shared-memory buffers used alternately (TileLang's
barrier pass adds a second barrier per stage); the block amax is a loop over the block's values
in shared memory (max is order-independent). Every thread reaches every barrier (rows past the
end are clamped to the last row); only the store is guarded. (No `from __future__ import
annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import functools
import math

import torch

from kernels import pdl
from kernels.toolkit import (TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, fp32_call, kernel_factory,
                             tile_params)

TILE_PARAMS = {(9, 0): {"threads": 128}, (12, 1): {"threads": 128}}  # sm_121 (GB10): untested
DEFAULT_TILE = {"threads": 128}
MAX_DIM = 1024  # one thread per element of a row
FP4_MAX = 6.0


def _recip_bits(value: float) -> int:
    """Bits of fl32(1 / fl32(value)): what torch's CUDA `tensor / value` multiplies by."""
    inv = torch.ones((), dtype=torch.float32) / torch.tensor(value, dtype=torch.float32)
    return int(inv.view(torch.int32).item()) & 0xFFFFFFFF


@kernel_factory
def hadamard_qdq4_kernel(d: int, block: int, dtype: str, arch: tuple[int, int]):
    """(X [rows, d] dtype, Y [rows, d] dtype); one thread per element, rows_per_cta rows per CTA."""
    import tilelang.language as T

    per_cta = max(1, tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["threads"] // d)
    stages = d.bit_length() - 1
    rows = T.dynamic("rows")

    def f32(bits):  # an exact fp32 constant, whatever the code generator prints for floats
        return T.reinterpret(T.uint32(bits), "float32")

    fn = functools.partial(fp32_call, T)

    @T.prim_func
    def hadamard_qdq4_main(X: T.Tensor((rows, d), dtype), Y: T.Tensor((rows, d), dtype)):
        with T.Kernel(T.ceildiv(rows, per_cta), threads=per_cta * d) as bx:
            tx = T.get_thread_binding(0)
            sm = T.alloc_shared((2, per_cta, d), "float32")
            v = T.alloc_local((3,), "float32")  # value, partner / amax / t, e2m1 input
            pdl.begin(T, arch)
            j = tx // d  # row within the CTA
            e = tx % d  # channel
            b0 = (e // block) * block  # first channel of e's block
            r = T.min(bx * per_cta + j, rows - 1)  # every thread reaches every barrier
            v[0] = T.Cast("float32", X[r, e])
            for k in T.unroll(stages):  # butterflies: stage k writes buffer k % 2
                sm[k % 2, j, e] = v[0]
                T.sync_threads()
                v[1] = sm[k % 2, j, T.bitwise_xor(e, T.shift_left(1, k))]
                if T.bitwise_and(e, T.shift_left(1, k)) == 0:
                    v[0] = fn("__fadd_rn", v[0], v[1])  # low + high
                else:
                    v[0] = fn("__fsub_rn", v[1], v[0])  # low - high
            v[0] = fn("__fmul_rn", v[0], f32(_recip_bits(math.sqrt(d))))  # y / sqrt(D), torch's CUDA way
            v[0] = T.Cast("float32", T.Cast(dtype, v[0]))  # hadamard's output dtype
            sm[stages % 2, j, e] = v[0]
            T.sync_threads()
            v[1] = T.float32(0)
            for c in T.unroll(block):
                v[1] = T.max(v[1], T.abs(sm[stages % 2, j, b0 + c]))
            # t = max(amax, floor) / 6 as torch's CUDA division by a CPU scalar: times fl(1/6)
            v[1] = fn("__fmul_rn", T.max(v[1], f32(0x01C00000)), f32(_recip_bits(FP4_MAX)))
            ebits = T.shift_right(T.reinterpret(v[1], "uint32"), T.uint32(23)) + T.Cast(
                "uint32", T.bitwise_and(T.reinterpret(v[1], "uint32"), T.uint32(0x7FFFFF)) != T.uint32(0))
            s = T.reinterpret(T.shift_left(ebits, T.uint32(23)), "float32")  # pow2 >= t
            inv_s = T.reinterpret(T.shift_left(T.uint32(254) - ebits, T.uint32(23)), "float32")  # 1/s, exact
            v[2] = T.min(T.max(fn("__fmul_rn", v[0], inv_s), T.float32(-FP4_MAX)), T.float32(FP4_MAX))
            step = T.if_then_else(T.abs(v[2]) < T.float32(2), T.float32(0.5),
                                  T.if_then_else(T.abs(v[2]) < T.float32(4), T.float32(1), T.float32(2)))
            q = T.min(fn("__fmul_rn", fn("rintf", fn("__fdiv_rn", T.abs(v[2]), step)), step), T.float32(FP4_MAX))
            if bx * per_cta + j < rows:
                Y[r, e] = T.Cast(dtype, fn("__fmul_rn", fn("copysignf", q, v[2]), s))

    return compile_kernel(hadamard_qdq4_main, arch)


def hadamard_qdq4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., D] (bf16/fp16/fp32 on CUDA) -> qdq4(hadamard(x), block), x's dtype and shape, as
    `reference.hadamard_qdq4`."""
    if x.dtype not in TORCH_TO_TL:
        raise KernelInputError(f"hadamard_qdq4 takes bf16, fp16 or fp32 input, got {x.dtype}")
    if x.dim() == 0:
        raise KernelInputError("hadamard_qdq4 needs at least one dimension, got a 0-d tensor")
    d = x.shape[-1]
    if d < 1 or d & (d - 1) or d > MAX_DIM:
        raise KernelInputError(f"hadamard_qdq4 needs the last dim to be a power of two up to {MAX_DIM}, got {d}")
    if block < 1 or d % block:
        raise KernelInputError(f"hadamard_qdq4: the last dim ({d}) is not a multiple of block={block}")
    arch = cuda_arch(x.device)
    x2 = x.contiguous().reshape(-1, d)  # [rows, D]
    y = torch.empty_like(x2)
    if x2.shape[0]:
        hadamard_qdq4_kernel(d, int(block), TORCH_TO_TL[x.dtype], arch)(x2, y)
    return y.reshape(x.shape)
