"""MoE router on CUDA (TileLang) in two launches; same contract as `reference.moe_gate`.

x [N, D] (bf16/fp16/fp32, widened), weight [E, D] fp32, bias [E] fp32 or None, k, route_scale
(hash layers: bias None and hash_ids [N, k]) -> (idx [N, k] int64, w [N, k] fp32). The reference
is about eleven launches per call at decode (widen, GEMM, softplus, sqrt, add, sort, gather,
sum, add, divide, scale); here:

1. `gate_gemv_kernel`, grid (E, N / `tokens`): logits [N, E] fp32 = x · weightᵀ. One CTA per
   expert row; its `warps` warps split D into contiguous ranges, each lane streams 4 fp32
   weights (one 16-byte load) per 128 channels, all of a warp's weight loads issued before the
   FMAs (bytes in flight: the GEMV reads the 4 MB weight once per token tile); warp shuffle
   sums, then the warps' partials meet in shared memory in warp order (deterministic). Above
   GEMV_MAX_N tokens the logits are torch's fp32 matmul (cuBLAS), the reference's own op.
2. `gate_select_kernel`, one CTA per token: scores = sqrtf(softplus(logits)) with torch's fp32
   softplus (`l > 20 ? l : log1pf(expf(l))`, precise libm calls: TileLang does not pass
   --use_fast_math), key = scores + bias (NaN keys read as +inf). The rank of an expert is the
   number of experts with a larger key, or an equal key and a lower index (a strict total order:
   ranks are a permutation of 0..E-1); rank r < k puts the expert in slot r, which is exactly the
   first k of the reference's stable descending sort (ties -> lowest index). Hash layers take
   idx = hash_ids (not range-checked, which would need a host sync: out-of-range ids are
   clamped to [0, E) for the gather). w_j = scores[idx_j] / (Σ_j scores[idx_j] + 1e-20) ·
   route_scale, the sum in slot order, single roundings (__fadd_rn, __fdiv_rn, __fmul_rn).

Numerics: equal to the reference up to fp32 summation order in the GEMV (and in the k-term
sum), so a routing decision may legitimately differ only where two candidates' biased scores
are within ~1e-5 relative. Layouts: row-major, contiguous, 16-byte aligned bases (copied
otherwise); D a multiple of 128 (at most 65536), E at most 1024, 1 <= k <= E. Status: only
compiled to sm_90a CUDA source and read; nothing has run on a GPU yet (sm_90 and sm_121 (GB10)
both untested). (No `from __future__ import annotations`: TileLang evaluates the kernel
signatures' annotations.)
"""

import functools

import torch

from kernels.act_quant import _TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, tile_params

# GEMV: warps per CTA (K split), most 128-channel steps per warp, token tile; select: most threads.
TILE_PARAMS = {(9, 0): {"warps": 4, "max_steps": 16, "tokens": 8, "threads": 256},
               (12, 1): {"warps": 4, "max_steps": 16, "tokens": 8, "threads": 256}}  # both untested
DEFAULT_TILE = {"warps": 4, "max_steps": 16, "tokens": 8, "threads": 256}
GEMV_MAX_N = 16
MAX_EXPERTS = 1024


def _f32(T, name, *args):
    return T.call_extern("float32", name, *args)


@functools.cache
def gate_gemv_kernel(e: int, d: int, mt: int, warps: int, dtype: str, arch: tuple[int, int]):
    """(X [N, d] dtype, W [e, d] fp32, L [N, e] fp32); `mt` tokens per CTA, `warps` split d."""
    import tilelang.language as T

    steps = d // 128  # 128 channels (32 lanes x 4) per step
    spw = -(-steps // warps)  # steps per warp
    tokens = T.dynamic("tokens")

    @T.prim_func
    def gate_gemv(X: T.Tensor((tokens, d), dtype), W: T.Tensor((e, d), "float32"),
                  L: T.Tensor((tokens, e), "float32")):
        with T.Kernel(e, T.ceildiv(tokens, mt), threads=(32, warps)) as (row, bt):
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            wr = T.alloc_local((spw, 4), "float32")
            xr = T.alloc_local((4,), dtype)
            acc = T.alloc_local((mt,), "float32")
            red = T.alloc_shared((warps, mt), "float32")
            T.clear(acc)
            for s in T.unroll(spw):  # every weight load of this warp first
                if spw * warps == steps or warp * spw + s < steps:
                    for v in T.vectorized(4):
                        wr[s, v] = W[row, (warp * spw + s) * 128 + lane * 4 + v]
            for i in T.unroll(mt):
                for s in T.unroll(spw):
                    if spw * warps == steps or warp * spw + s < steps:
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
                    acc[0] = _f32(T, "__fadd_rn", acc[0], red[j, lane])
                L[bt * mt + lane, row] = acc[0]

    return compile_kernel(gate_gemv, arch)


@functools.cache
def gate_select_kernel(e: int, k: int, route_scale: float, hashed: bool, threads: int, arch: tuple[int, int]):
    """(L [N, e] fp32, B [e] fp32, H [N, k] int64, IDX [N, k] int64, WOUT [N, k] fp32); B is read
    only without `hashed`, H only with it."""
    import tilelang.language as T

    per = -(-e // threads)  # experts per thread
    tokens = T.dynamic("tokens")
    inf = T.infinity("float32")

    @T.prim_func
    def gate_select(L: T.Tensor((tokens, e), "float32"), B: T.Tensor((e,), "float32"),
                    H: T.Tensor((tokens, k), "int64"), IDX: T.Tensor((tokens, k), "int64"),
                    WOUT: T.Tensor((tokens, k), "float32")):
        with T.Kernel(tokens, threads=threads) as t:
            tx = T.get_thread_binding(0)
            sc = T.alloc_shared((e,), "float32")  # scores
            key = T.alloc_shared((e,), "float32")  # scores + bias
            sel = T.alloc_shared((k,), "int32")  # the chosen experts, slot order
            v = T.alloc_local((per + 2,), "float32")  # own keys; then the sum, the denominator
            rank = T.alloc_local((per,), "int32")
            for p in T.unroll(per):
                if p * threads + tx < e:
                    v[0] = L[t, p * threads + tx]
                    v[0] = _f32(T, "sqrtf", T.if_then_else(v[0] > T.float32(20.0), v[0],
                                                           _f32(T, "log1pf", _f32(T, "expf", v[0]))))
                    sc[p * threads + tx] = v[0]
                    if not hashed:
                        v[0] = _f32(T, "__fadd_rn", v[0], B[p * threads + tx])
                        key[p * threads + tx] = T.if_then_else(T.isnan(v[0]), inf, v[0])
            T.sync_threads()
            if hashed:
                for jo in T.serial(T.ceildiv(k, threads)):
                    if jo * threads + tx < k:
                        sel[jo * threads + tx] = T.Cast("int32", T.min(T.max(H[t, jo * threads + tx], 0), e - 1))
            else:
                for p in T.unroll(per):
                    v[p] = key[T.min(p * threads + tx, e - 1)]
                    rank[p] = 0
                for j in T.serial(e):  # experts that beat ours: larger key, or equal key and lower index
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
                        v[per] = _f32(T, "__fadd_rn", v[per], sc[sel[j]])
                    v[per + 1] = _f32(T, "__fadd_rn", v[per], T.float32(1e-20))
                    IDX[t, jo * threads + tx] = T.Cast("int64", sel[jo * threads + tx])
                    WOUT[t, jo * threads + tx] = _f32(T, "__fmul_rn", _f32(T, "__fdiv_rn", sc[sel[jo * threads + tx]],
                                                                          v[per + 1]), T.float32(route_scale))

    return compile_kernel(gate_select, arch)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous on a 16-byte aligned base (the GEMV's vector loads need it)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, route_scale: float,
             hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], weight [E, D] fp32, bias [E] or None (then hash_ids [N, k] integer) ->
    (idx [N, k] int64, w [N, k] fp32), as `reference.moe_gate`."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise KernelInputError(f"moe_gate needs x [N, D] and weight [E, D], got {tuple(x.shape)} and "
                               f"{tuple(weight.shape)}")
    (n, d), e, k = x.shape, weight.shape[0], int(k)
    if x.dtype not in _TORCH_TO_TL or weight.dtype != torch.float32:
        raise KernelInputError(f"moe_gate takes bf16, fp16 or fp32 x and an fp32 weight, got {x.dtype} and {weight.dtype}")
    if d % 128 or not 0 < d <= 65536 or not 0 < e <= MAX_EXPERTS or not 1 <= k <= e:
        raise KernelInputError(f"moe_gate needs D ({d}) a multiple of 128 up to 65536, E ({e}) in 1..{MAX_EXPERTS} "
                               f"and k ({k}) in 1..E")
    if bias is not None and (tuple(bias.shape) != (e,) or not bias.is_floating_point()):
        raise KernelInputError(f"moe_gate: bias must be floating point of shape ({e},), got {bias.dtype} {tuple(bias.shape)}")
    if bias is None and (hash_ids is None or tuple(hash_ids.shape) != (n, k) or hash_ids.is_floating_point()
                         or hash_ids.dtype == torch.bool):
        got = None if hash_ids is None else f"{hash_ids.dtype} {tuple(hash_ids.shape)}"
        raise KernelInputError(f"moe_gate without bias needs integer hash_ids of shape ({n}, {k}), got {got}")
    arch = cuda_arch(x.device)
    other = weight if bias is None else bias
    if weight.device != x.device or other.device != x.device or (bias is None and hash_ids.device != x.device):
        raise KernelInputError("moe_gate: x, weight, bias and hash_ids must be on one device")
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
        logits = torch.empty(n, e, dtype=torch.float32, device=x.device)
        mt = min(p["tokens"], 1 << (n - 1).bit_length())
        gate_gemv_kernel(e, d, mt, warps, _TORCH_TO_TL[x.dtype], arch)(_aligned(x), _aligned(weight), logits)
    threads = min(p["threads"], max(32, 1 << (e - 1).bit_length()))
    b = x.new_empty(0 if bias is None else e, dtype=torch.float32) if bias is None else bias.float().contiguous()
    h = idx if bias is None and False else (hash_ids.to(torch.int64).contiguous() if bias is None else idx)
    gate_select_kernel(e, k, float(route_scale), bias is None, threads, arch)(logits, b, h, idx, w)
    return idx, w
