"""A compressor's completed windows pooled on CUDA (TileLang) in one launch; same contract as
`reference.compressor_pool`.

Each completed compression window becomes one entry (§C.5): per channel, the softmax of the gate
logits over the window's slots weighs the kv values. In torch that is about ten launches per
compressor (an overlap compressor's slots gathered by concatenations, its previous half copied
twice, the transposed softmax, the product, the sum over slots, the narrowing), each a few
microseconds of latency: on a decode step's critical path at a ratio-4 layer (the one step in four
that emits took ~1.2 ms longer at 43 layers, H200), and hundreds of the launches whose issue
bounds an eager prefill chunk on the host.

Layout: a CTA per (window, up to 128 output channels), a thread per channel ch; each thread reads
its channel of every slot of its window -- the first halves of the window before it (rows of the
window before in KV, G; prev's for window 0) then its own second halves at column d + ch
(overlap, C = 2d), or its own rows at column ch (C = d) -- in three passes over the slots (max,
the sum of exp(g - max), the weighted sum), the loads of UNROLL slots issued together; then
(overlap) window 0's threads copy the last window's first halves into prev[:, ch], after their
own reads of prev (no other CTA reads prev). Coalesced: the threads of a warp read consecutive
channels. The windows' rows may be strided (a column slice of the projection's output): the
kernel takes the row pitch of KV and of G as static arguments.

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
def compressor_pool_kernel(r: int, d: int, overlap: bool, kv_pitch: int, gate_pitch: int, dtype: str,
                           arch: tuple[int, int]):
    """(KV [n·r, kv_pitch] fp32, G [n·r, gate_pitch] fp32[, PK [r, d] fp32, PG [r, d] fp32], Y [n, d]
    dtype), n windows of r rows whose first C columns are the values (C = 2d when `overlap`, then
    PK, PG: the first halves of the window before the first, replaced by those of the last; else
    C = d)."""
    import tilelang.language as T

    threads = min(d, THREADS)
    if d % 32 or d % threads:
        raise KernelInputError(f"compressor_pool: d = {d} must be a multiple of 32 (and of {THREADS} above it)")
    unroll = min(r, UNROLL)
    if r % unroll:
        raise KernelInputError(f"compressor_pool: the ratio {r} must be a multiple of {UNROLL} or below it")
    c = 2 * d if overlap else d
    if kv_pitch < c or gate_pitch < c:
        raise KernelInputError(f"compressor_pool: row pitches {kv_pitch}, {gate_pitch} below the {c} channels")
    rows, windows = T.dynamic("rows"), T.dynamic("windows")
    add = functools.partial(fp32_call, T, "__fadd_rn")
    mul = functools.partial(fp32_call, T, "__fmul_rn")
    div = functools.partial(fp32_call, T, "__fdiv_rn")
    steps = r // unroll

    # One pass over r slots: rows base..base+r-1 of `gates` (and `values`) at column off + ch.
    @T.macro
    def max_pass(gates, base, off, ch, v, g):
        for jb in T.serial(steps):
            for u in T.unroll(unroll):
                g[u] = gates[base + jb * unroll + u, off + ch]
            for u in T.unroll(unroll):
                v[0] = T.max(v[0], g[u])

    @T.macro
    def sum_pass(gates, base, off, ch, v, g):
        for jb in T.serial(steps):
            for u in T.unroll(unroll):
                g[u] = gates[base + jb * unroll + u, off + ch]
            for u in T.unroll(unroll):
                v[1] = add(v[1], T.exp(g[u] - v[0]))

    @T.macro
    def weighted_pass(gates, values, base, off, ch, v, g, kv):
        for jb in T.serial(steps):
            for u in T.unroll(unroll):
                g[u] = gates[base + jb * unroll + u, off + ch]
                kv[u] = values[base + jb * unroll + u, off + ch]
            for u in T.unroll(unroll):
                v[3] = div(T.exp(g[u] - v[0]), v[1])
                v[2] = add(v[2], mul(kv[u], v[3]))

    if overlap:  # the slots: the first halves of the window before (prev's for window 0), then its second halves
        @T.prim_func
        def compressor_pool(KV: T.Tensor((rows, kv_pitch), "float32"), G: T.Tensor((rows, gate_pitch), "float32"),
                            PK: T.Tensor((r, d), "float32"), PG: T.Tensor((r, d), "float32"),
                            Y: T.Tensor((windows, d), dtype)):
            with T.Kernel(d // threads, windows, threads=threads) as (bx, by):
                ch = bx * threads + T.get_thread_binding(0)
                v = T.alloc_local((4,), "float32")  # max, sum of exps, weighted sum, weight
                g = T.alloc_local((unroll,), "float32")
                kv = T.alloc_local((unroll,), "float32")
                pdl.begin(T, arch)  # the projection just before wrote the window's last row
                v[0] = -T.infinity("float32")
                if by == 0:
                    max_pass(PG, 0, 0, ch, v, g)
                else:
                    max_pass(G, (by - 1) * r, 0, ch, v, g)
                max_pass(G, by * r, d, ch, v, g)
                v[1] = T.float32(0)
                if by == 0:
                    sum_pass(PG, 0, 0, ch, v, g)
                else:
                    sum_pass(G, (by - 1) * r, 0, ch, v, g)
                sum_pass(G, by * r, d, ch, v, g)
                v[2] = T.float32(0)
                if by == 0:
                    weighted_pass(PG, PK, 0, 0, ch, v, g, kv)
                else:
                    weighted_pass(G, KV, (by - 1) * r, 0, ch, v, g, kv)
                weighted_pass(G, KV, by * r, d, ch, v, g, kv)
                Y[by, ch] = T.Cast(dtype, v[2])
                if by == 0:  # after this thread's reads of prev[:, ch]; no other thread reads it
                    for j in T.unroll(r):
                        PK[j, ch] = KV[(windows - 1) * r + j, ch]
                        PG[j, ch] = G[(windows - 1) * r + j, ch]
    else:
        @T.prim_func
        def compressor_pool(KV: T.Tensor((rows, kv_pitch), "float32"), G: T.Tensor((rows, gate_pitch), "float32"),
                            Y: T.Tensor((windows, d), dtype)):
            with T.Kernel(d // threads, windows, threads=threads) as (bx, by):
                ch = bx * threads + T.get_thread_binding(0)
                v = T.alloc_local((4,), "float32")
                g = T.alloc_local((unroll,), "float32")
                kv = T.alloc_local((unroll,), "float32")
                pdl.begin(T, arch)
                v[0] = -T.infinity("float32")
                max_pass(G, by * r, 0, ch, v, g)
                v[1] = T.float32(0)
                sum_pass(G, by * r, 0, ch, v, g)
                v[2] = T.float32(0)
                weighted_pass(G, KV, by * r, 0, ch, v, g, kv)
                Y[by, ch] = T.Cast(dtype, v[2])

    return compile_kernel(compressor_pool, arch)


def pitched_rows(t: torch.Tensor, c: int) -> torch.Tensor | None:
    """Windows t [n, r, C] whose rows are C-element runs at a common pitch (contiguous, or a column
    slice of wider rows) -> the [n·r, pitch] view of their storage the kernel reads, else None."""
    n, r, _ = t.shape
    pitch = t.stride(1)
    if t.stride(2) != 1 or pitch < c or t.stride(0) != r * pitch:
        return None
    if t.storage_offset() + n * r * pitch > t.untyped_storage().nbytes() // t.element_size():
        return None  # the last row's pitch runs past the storage
    return t.as_strided((n * r, pitch), (pitch, 1))


def compressor_pool(win_kv: torch.Tensor, win_gate: torch.Tensor, prev_kv: torch.Tensor | None,
                    prev_gate: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Windows win_kv, win_gate [n, r, C] fp32 (with prev_kv, prev_gate [r, d] fp32 when the
    compressor overlaps, C = 2d) -> pooled entries [n, d] in `dtype`, as `reference.compressor_pool`
    (prev updated in place)."""
    overlap = prev_kv is not None
    if win_kv.dim() != 3 or tuple(win_gate.shape) != tuple(win_kv.shape):
        raise KernelInputError(f"compressor_pool: win_kv {tuple(win_kv.shape)}, win_gate {tuple(win_gate.shape)} "
                               "must be windows [n, r, C] of one shape")
    n, r, c = win_kv.shape
    d = c // 2 if overlap else c
    if overlap and (prev_gate is None or c % 2 or tuple(prev_kv.shape) != (r, d) or tuple(prev_gate.shape) != (r, d)):
        raise KernelInputError(f"compressor_pool: prev {tuple(prev_kv.shape)}, "
                               f"{None if prev_gate is None else tuple(prev_gate.shape)} do not fit windows "
                               f"{tuple(win_kv.shape)} (with overlap prev [r, C/2])")
    prevs = (prev_kv, prev_gate) if overlap else ()
    if any(t.dtype != torch.float32 for t in (win_kv, win_gate) + prevs) or dtype not in TORCH_TO_TL:
        raise KernelInputError(f"compressor_pool takes fp32 windows and a bf16, fp16 or fp32 result, got "
                               f"{[t.dtype for t in (win_kv, win_gate) + prevs]} -> {dtype}")
    kv_rows, gate_rows = pitched_rows(win_kv, c), pitched_rows(win_gate, c)
    if (n == 0 or kv_rows is None or gate_rows is None or d % 32 or (d > THREADS and d % THREADS)
            or (r > UNROLL and r % UNROLL) or not all(t.is_contiguous() for t in prevs)):
        return ref.compressor_pool(win_kv, win_gate, prev_kv, prev_gate, dtype)
    y = torch.empty(n, d, dtype=dtype, device=win_kv.device)
    compressor_pool_kernel(r, d, overlap, kv_rows.shape[1], gate_rows.shape[1], TORCH_TO_TL[dtype],
                           cuda_arch(win_kv.device))(kv_rows, gate_rows, *prevs, y)
    return y
