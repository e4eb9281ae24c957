"""A decode step's compressor emission on CUDA (TileLang): the completed window pooled in one
launch; same contract as `reference.compressor_pool`.

A decode token that completes a compression window pools it into one entry (§C.5): per channel,
the softmax of the gate logits over the window's slots weighs the kv values. In torch that is
about ten launches per compressor (an overlap compressor's slots gathered by concatenations,
its previous half copied twice, the transposed softmax, the product, the sum over slots, the
narrowing), each a few microseconds of latency. They run on the step's side lane, but the
attention joins it: at a ratio-4 layer (two compressors) they were on the step's critical path,
and the one step in four that emits took ~1.2 ms longer at 43 layers (bench.full_depth's step
times, H200).

Layout: one thread per output channel ch (CTAs of up to 128 threads); each thread reads its
channel of every slot -- the previous window's first half prev[:, ch] then the window's second
half buf[:, d + ch] (overlap, C = 2d), or buf[:, ch] (C = d) -- in three passes over the slots
(max, the sum of exp(g - max), the weighted sum), the loads of UNROLL slots issued together;
then (overlap) it copies buf[:, ch] into prev[:, ch], after its own reads of prev. Coalesced:
the threads of a warp read consecutive channels.

Bits: exp(g - max) by precise expf (TileLang does not pass --use_fast_math), weights e / sum,
products and sums single fp32 roundings in slot order (`__fmul_rn`, `__fadd_rn`), rounded once
into `dtype`: equal to the reference up to fp32 summation order (torch's softmax sums by warp
shuffles, its sum over slots in its own order). sm_90 tested; sm_121 (GB10) untested.
(No `from __future__ import annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import functools

import torch

from kernels import pdl, reference as ref
from kernels.toolkit import TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, fp32_call, kernel_factory

THREADS = 128  # channels per CTA (fewer when d is smaller)
UNROLL = 8  # slots whose loads are issued together


@kernel_factory
def compressor_pool_kernel(r: int, d: int, overlap: bool, dtype: str, arch: tuple[int, int]):
    """(KV [r, C] fp32, G [r, C] fp32[, PK [r, d] fp32, PG [r, d] fp32], Y [1, d] dtype) with C =
    2d when `overlap` (then PK, PG: the previous window's first halves, replaced by KV[:, :d],
    G[:, :d]), else C = d."""
    import tilelang.language as T

    threads = min(d, THREADS)
    if d % 32 or d % threads:
        raise KernelInputError(f"compressor_pool: d = {d} must be a multiple of 32 (and of {THREADS} above it)")
    unroll = min(r, UNROLL)
    if r % unroll:
        raise KernelInputError(f"compressor_pool: the ratio {r} must be a multiple of {UNROLL} or below it")
    c = 2 * d if overlap else d
    add = functools.partial(fp32_call, T, "__fadd_rn")
    mul = functools.partial(fp32_call, T, "__fmul_rn")
    div = functools.partial(fp32_call, T, "__fdiv_rn")
    steps = r // unroll

    # One pass over r slots: rows 0..r-1 of `gates` (and `values`) at column off + ch.
    @T.macro
    def max_pass(gates, off, ch, v, g):
        for jb in T.serial(steps):
            for u in T.unroll(unroll):
                g[u] = gates[jb * unroll + u, off + ch]
            for u in T.unroll(unroll):
                v[0] = T.max(v[0], g[u])

    @T.macro
    def sum_pass(gates, off, ch, v, g):
        for jb in T.serial(steps):
            for u in T.unroll(unroll):
                g[u] = gates[jb * unroll + u, off + ch]
            for u in T.unroll(unroll):
                v[1] = add(v[1], T.exp(g[u] - v[0]))

    @T.macro
    def weighted_pass(gates, values, off, ch, v, g, kv):
        for jb in T.serial(steps):
            for u in T.unroll(unroll):
                g[u] = gates[jb * unroll + u, off + ch]
                kv[u] = values[jb * unroll + u, off + ch]
            for u in T.unroll(unroll):
                v[3] = div(T.exp(g[u] - v[0]), v[1])
                v[2] = add(v[2], mul(kv[u], v[3]))

    if overlap:  # the slots: prev's rows (the previous window's first halves), then buf[:, d:]
        @T.prim_func
        def compressor_pool(KV: T.Tensor((r, c), "float32"), G: T.Tensor((r, c), "float32"),
                            PK: T.Tensor((r, d), "float32"), PG: T.Tensor((r, d), "float32"),
                            Y: T.Tensor((1, d), dtype)):
            with T.Kernel(d // threads, threads=threads) as bx:
                ch = bx * threads + T.get_thread_binding(0)
                v = T.alloc_local((4,), "float32")  # max, sum of exps, weighted sum, weight
                g = T.alloc_local((unroll,), "float32")
                kv = T.alloc_local((unroll,), "float32")
                pdl.begin(T, arch)  # the projection just before wrote the window's last row
                v[0] = -T.infinity("float32")
                max_pass(PG, 0, ch, v, g)
                max_pass(G, d, ch, v, g)
                v[1] = T.float32(0)
                sum_pass(PG, 0, ch, v, g)
                sum_pass(G, d, ch, v, g)
                v[2] = T.float32(0)
                weighted_pass(PG, PK, 0, ch, v, g, kv)
                weighted_pass(G, KV, d, ch, v, g, kv)
                Y[0, ch] = T.Cast(dtype, v[2])
                for j in T.unroll(r):  # after this thread's reads of prev[:, ch]; no other thread's
                    PK[j, ch] = KV[j, ch]
                    PG[j, ch] = G[j, ch]
    else:
        @T.prim_func
        def compressor_pool(KV: T.Tensor((r, c), "float32"), G: T.Tensor((r, c), "float32"),
                            Y: T.Tensor((1, d), dtype)):
            with T.Kernel(d // threads, threads=threads) as bx:
                ch = bx * threads + T.get_thread_binding(0)
                v = T.alloc_local((4,), "float32")
                g = T.alloc_local((unroll,), "float32")
                kv = T.alloc_local((unroll,), "float32")
                pdl.begin(T, arch)
                v[0] = -T.infinity("float32")
                max_pass(G, 0, ch, v, g)
                v[1] = T.float32(0)
                sum_pass(G, 0, ch, v, g)
                v[2] = T.float32(0)
                weighted_pass(G, KV, 0, ch, v, g, kv)
                Y[0, ch] = T.Cast(dtype, v[2])

    return compile_kernel(compressor_pool, arch)


def compressor_pool(buf_kv: torch.Tensor, buf_gate: torch.Tensor, prev_kv: torch.Tensor | None,
                    prev_gate: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The window buf_kv, buf_gate [r, C] fp32 (with prev_kv, prev_gate [r, d] fp32 when the
    compressor overlaps, C = 2d) -> pooled entry [1, d] in `dtype`, as `reference.compressor_pool`
    (prev updated in place)."""
    overlap = prev_kv is not None
    r, c = buf_kv.shape
    d = c // 2 if overlap else c
    tensors = (buf_kv, buf_gate) + ((prev_kv, prev_gate) if overlap else ())
    if (tuple(buf_gate.shape) != (r, c) or (overlap and (prev_gate is None or c % 2 or tuple(prev_kv.shape) != (r, d)
                                                         or tuple(prev_gate.shape) != (r, d)))):
        raise KernelInputError(f"compressor_pool: buf_kv {tuple(buf_kv.shape)}, buf_gate {tuple(buf_gate.shape)}, "
                               f"prev {None if prev_kv is None else tuple(prev_kv.shape)} do not fit one window "
                               "(buf [r, C]; with overlap prev [r, C/2])")
    if any(t.dtype != torch.float32 for t in tensors) or dtype not in TORCH_TO_TL:
        raise KernelInputError(f"compressor_pool takes fp32 windows and a bf16, fp16 or fp32 result, got "
                               f"{[t.dtype for t in tensors]} -> {dtype}")
    if d % 32 or (d > THREADS and d % THREADS) or (r > UNROLL and r % UNROLL) or not all(
            t.is_contiguous() for t in tensors):
        return ref.compressor_pool(buf_kv, buf_gate, prev_kv, prev_gate, dtype)
    y = torch.empty(1, d, dtype=dtype, device=buf_kv.device)
    compressor_pool_kernel(r, d, overlap, TORCH_TO_TL[dtype], cuda_arch(buf_kv.device))(*tensors, y)
    return y
