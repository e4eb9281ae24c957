"""MoE router on CUDA (TileLang) in two launches (the reference: ~11 at decode); same contract as
`reference.moe_gate`: x [N, D] (bf16/fp16/fp32, widened), weight [E, D] fp32, bias [E] or None
(hash layers: hash_ids [N, k]), k, route_scale -> (idx [N, k] int64, w [N, k] fp32).

1. `gate_gemv_kernel`, grid (E, N / `tokens`): logits [N, E] fp32 = x · weightᵀ. A CTA per expert
   row, its warps split D into contiguous ranges; a lane loads 4 fp32 weights (16 bytes) per 128
   channels, all before the PDL wait (the weight is never written while kernels run: its DRAM
   latency overlaps the predecessor) and so before the FMAs; warp shuffle sums, then the warps'
   partials in warp order (deterministic). Above GEMV_MAX_N tokens: torch's fp32 matmul, the
   reference's op.
2. `gate_select_kernel`, a CTA per token: scores = sqrtf(l > 20 ? l : log1pf(expf(l))) (torch's
   CUDA softplus, beta 1, threshold 20; precise libm: TileLang does not pass --use_fast_math),
   key = scores + bias (NaN counts as +inf; the bias is loaded before the PDL wait). An expert's
   rank = the number of experts with a larger key, or an equal key and a lower index: a strict
   total order, so rank r < k fills slot r exactly as the reference's stable descending sort
   (ties -> lowest index). Hash layers: slot j = hash_ids[:, j] (not range-checked, that needs
   a host sync; clamped to [0, E) for the gather).
   w_j = scores[idx_j] / (Σ_j scores[idx_j] + 1e-20) · route_scale, summed in slot order,
   single roundings (__fadd_rn, __fdiv_rn, __fmul_rn).

Numerics: the reference's up to fp32 summation order (GEMV, k-term sum): a routing decision may
differ only where two biased scores are within ~1e-5 relative. Layout: row-major, 16-byte aligned
bases (copied otherwise); D a multiple of 128 up to 65536, E <= MAX_EXPERTS, 1 <= k <= E. Only
compiled for sm_90a and its CUDA source read: nothing has run on a GPU yet (sm_90 and sm_121
(GB10) untested). (No `from __future__ import annotations`: TileLang evaluates annotations.)
"""

import torch

from kernels import pdl
from kernels.toolkit import (TORCH_TO_TL, KernelInputError, aligned16, compile_kernel, cuda_arch, fp32_call,
                             kernel_factory, tile_params)

# GEMV: warps per CTA (K split), most 128-channel steps per warp, token tile; select: most threads.
TILE_PARAMS = {(9, 0): {"warps": 4, "max_steps": 16, "tokens": 8, "threads": 256},
               (12, 1): {"warps": 4, "max_steps": 16, "tokens": 8, "threads": 256}}  # both untested
DEFAULT_TILE = {"warps": 4, "max_steps": 16, "tokens": 8, "threads": 256}
GEMV_MAX_N = 16
MAX_EXPERTS = 1024


@kernel_factory
def gate_gemv_kernel(e: int, d: int, mt: int, warps: int, dtype: str, arch: tuple[int, int]):
    """(X [N, d] dtype, W [e, d] fp32, L [N, e] fp32); `mt` tokens per CTA, `warps` split d."""
    import tilelang.language as T

    steps = d // 128  # 128 channels (32 lanes × 4) per step
    spw = -(-steps // warps)  # steps per warp
    full = spw * warps == steps  # else the last warps skip steps past d
    tokens = T.dynamic("tokens")

    @T.prim_func
    def gate_gemv(X: T.Tensor((tokens, d), dtype), W: T.Tensor((e, d), "float32"), L: T.Tensor((tokens, e), "float32")):
        with T.Kernel(e, T.ceildiv(tokens, mt), threads=(32, warps)) as (row, bt):
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            wr = T.alloc_local((spw, 4), "float32")
            xr = T.alloc_local((4,), dtype)
            acc = T.alloc_local((mt,), "float32")
            red = T.alloc_shared((warps, mt), "float32")
            T.clear(acc)
            for s in T.unroll(spw):  # every weight load of this warp first, before the PDL wait
                if full or warp * spw + s < steps:
                    for v in T.vectorized(4):
                        wr[s, v] = W[row, (warp * spw + s) * 128 + lane * 4 + v]
            pdl.begin(T, arch)
            for i in T.unroll(mt):
                for s in T.unroll(spw):
                    if full or warp * spw + s < steps:
                        for v in T.vectorized(4):
                            xr[v] = X[T.min(bt * mt + i, tokens - 1), (warp * spw + s) * 128 + lane * 4 + v]
                        for v in T.unroll(4):
                            acc[i] += T.Cast("float32", xr[v]) * wr[s, v]
            for i in T.unroll(mt):
                total = T.warp_reduce_sum(acc[i])  # all 32 lanes take part
                if lane == 0:
                    red[warp, i] = total
            T.sync_threads()
            if warp == 0 and lane < mt and bt * mt + lane < tokens:
                acc[0] = red[0, lane]
                for j in T.unroll(1, warps):  # warp order: deterministic
                    acc[0] = fp32_call(T, "__fadd_rn", acc[0], red[j, lane])
                L[bt * mt + lane, row] = acc[0]

    return compile_kernel(gate_gemv, arch)


@kernel_factory
def gate_select_kernel(e: int, k: int, route_scale: float, hashed: bool, threads: int, arch: tuple[int, int]):
    """(L [N, e] fp32, B [e] fp32, H [N, k] int64, IDX [N, k] int64, WOUT [N, k] fp32); B is read
    only without `hashed`, H only with it."""
    import tilelang.language as T

    per = -(-e // threads)  # experts per thread
    tokens = T.dynamic("tokens")

    @T.prim_func
    def gate_select(L: T.Tensor((tokens, e), "float32"), B: T.Tensor((e,), "float32"), H: T.Tensor((tokens, k), "int64"),
                    IDX: T.Tensor((tokens, k), "int64"), WOUT: T.Tensor((tokens, k), "float32")):
        with T.Kernel(tokens, threads=threads) as t:
            tx = T.get_thread_binding(0)
            sc = T.alloc_shared((e,), "float32")  # scores
            key = T.alloc_shared((e,), "float32")  # scores + bias
            sel = T.alloc_shared((k,), "int32")  # the chosen experts in slot order
            v = T.alloc_local((per + 1,), "float32")  # own scores, then keys; the denominator
            rank = T.alloc_local((per,), "int32")
            bias = T.alloc_local((per,), "float32")  # this thread's experts' bias, loaded before the wait
            if not hashed:
                for p in T.unroll(per):
                    bias[p] = B[T.min(p * threads + tx, e - 1)]
            pdl.begin(T, arch)
            for p in T.unroll(per):
                v[p] = L[t, T.min(p * threads + tx, e - 1)]  # the experts past e: never stored
                v[p] = fp32_call(T, "sqrtf", T.if_then_else(v[p] > T.float32(20.0), v[p],
                                                            fp32_call(T, "log1pf", fp32_call(T, "expf", v[p]))))
                rank[p] = 0
                if p * threads + tx < e:
                    sc[p * threads + tx] = v[p]
                if not hashed:
                    v[p] = fp32_call(T, "__fadd_rn", v[p], bias[p])
                    v[p] = T.if_then_else(T.isnan(v[p]), T.infinity("float32"), v[p])  # own key
                    if p * threads + tx < e:
                        key[p * threads + tx] = v[p]
            T.sync_threads()
            if hashed:
                for jo in T.serial(T.ceildiv(k, threads)):
                    if jo * threads + tx < k:
                        sel[jo * threads + tx] = T.Cast("int32", T.min(T.max(H[t, jo * threads + tx], 0), e - 1))
            else:
                for j in T.serial(e):  # experts that beat ours: a larger key, or an equal key and lower index
                    for p in T.unroll(per):
                        rank[p] += T.Cast("int32", T.if_then_else(j < p * threads + tx, key[j] >= v[p], key[j] > v[p]))
                for p in T.unroll(per):
                    if p * threads + tx < e and rank[p] < k:
                        sel[rank[p]] = p * threads + tx
            T.sync_threads()
            for jo in T.serial(T.ceildiv(k, threads)):
                if jo * threads + tx < k:
                    v[per] = sc[sel[0]]
                    for j in T.serial(1, k):  # slot order
                        v[per] = fp32_call(T, "__fadd_rn", v[per], sc[sel[j]])
                    v[per] = fp32_call(T, "__fadd_rn", v[per], T.float32(1e-20))
                    IDX[t, jo * threads + tx] = T.Cast("int64", sel[jo * threads + tx])
                    WOUT[t, jo * threads + tx] = fp32_call(
                        T, "__fmul_rn", fp32_call(T, "__fdiv_rn", sc[sel[jo * threads + tx]], v[per]),
                        T.float32(route_scale))

    return compile_kernel(gate_select, arch)


def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, route_scale: float,
             hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], weight [E, D] fp32, bias [E] or None (then hash_ids [N, k] integer) ->
    (idx [N, k] int64, w [N, k] fp32), as `reference.moe_gate`."""
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype not in TORCH_TO_TL
            or weight.dtype != torch.float32):
        raise KernelInputError(f"moe_gate needs x [N, D] bf16/fp16/fp32 and weight [E, D] fp32, got {x.dtype} "
                               f"{tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    (n, d), e, k = x.shape, weight.shape[0], int(k)
    if d % 128 or not 0 < d <= 65536 or not 0 < e <= MAX_EXPERTS or not 1 <= k <= e:
        raise KernelInputError(f"moe_gate needs D ({d}) a positive multiple of 128 up to 65536, E ({e}) in "
                               f"1..{MAX_EXPERTS} and k ({k}) in 1..E")
    sel = bias if bias is not None else hash_ids
    want = ((e,), True) if bias is not None else ((n, k), False)  # (shape, floating point)
    if sel is None or (tuple(sel.shape), sel.is_floating_point()) != want or sel.dtype == torch.bool:
        raise KernelInputError(f"moe_gate needs a floating-point bias of shape ({e},) or, without one, integer hash_ids"
                               f" of shape ({n}, {k}); got {None if sel is None else (sel.dtype, tuple(sel.shape))}")
    arch = cuda_arch(x.device)
    if not x.device == weight.device == sel.device:
        raise KernelInputError("moe_gate: x, weight and bias / hash_ids must be on one device")
    idx = torch.empty(n, k, dtype=torch.int64, device=x.device)
    w = torch.empty(n, k, dtype=torch.float32, device=x.device)
    if n == 0:
        return idx, w
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    if n > GEMV_MAX_N:
        logits = torch.matmul(x.float(), weight.T)  # prefill: cuBLAS, the reference's own op
    else:
        steps = d // 128
        warps = min(steps, max(p["warps"], -(-steps // p["max_steps"])))
        mt = min(p["tokens"], 1 << (n - 1).bit_length())
        logits = torch.empty(n, e, dtype=torch.float32, device=x.device)
        gate_gemv_kernel(e, d, mt, warps, TORCH_TO_TL[x.dtype], arch)(aligned16(x), aligned16(weight), logits)
    threads = min(p["threads"], max(32, 1 << (e - 1).bit_length()))
    b = bias.float().contiguous() if bias is not None else logits.new_empty(e)  # dummy: not read
    h = hash_ids.to(torch.int64).contiguous() if bias is None else idx.new_empty(n, k)  # dummy: not read
    gate_select_kernel(e, k, float(route_scale), bias is None, threads, arch)(logits, b, h, idx, w)
    return idx, w
