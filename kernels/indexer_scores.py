"""Lightning-indexer scores on CUDA (TileLang) in one launch; same contract as `reference.indexer_scores`.

q [S, H, D] bf16 (the indexer's rotated, QDQ4-rounded queries), keys [T, D] bf16 (its compressed
entries), weights [S, H] fp32 (per-head weights, already scaled), visible [S] int ->
scores [S, T] fp32: Σ_h weights[s, h] · relu(q[s, h] · keys[t]) · scale, and -inf for entries at
or after visible[s] (spec §C.6). The reference is an einsum plus about eight elementwise and
reduction launches; at long contexts this op reads every compressed key of the layer per token.

One CTA per (query, block of `block_t` keys): the query's H×D block and the keys' block_t×D
block go to shared memory, the H×block_t dot products run on the tensor cores (bf16 inputs,
exact products, fp32 accumulation), then relu, the scale and the head weight (single fp32
roundings, no FMA) and a sum over the heads (TileLang block reduction); head counts that are
not multiples of 16 are padded with zero heads, which add exact zeros. Results equal the
reference up to fp32 summation order (the D-dot and the head sum); tests/kernels/test_kernels_gpu.py
measures it. Keys past T are clamped to the last row and never stored. Tile sizes per compute
capability in TILE_PARAMS: sm_90 tested, sm_121 (GB10) untested. (No `from __future__ import
annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import functools

import torch

from kernels import pdl
from kernels.toolkit import KernelInputError, compile_kernel, cuda_arch, fp32_call, kernel_factory, tile_params

TILE_PARAMS = {(9, 0): {"block_t": 64, "threads": 128}, (12, 1): {"block_t": 64, "threads": 128}}
DEFAULT_TILE = {"block_t": 64, "threads": 128}


@kernel_factory
def indexer_scores_kernel(heads: int, dim: int, scale: float, arch: tuple[int, int]):
    """(Q [S, heads, dim] bf16, K [T, dim] bf16, W [S, heads] fp32, VIS [S] int64, OUT [S, T] fp32)."""
    import tilelang.language as T

    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    bt = p["block_t"]
    hp = -(-heads // 16) * 16  # the tensor-core tile needs multiples of 16 rows: zero heads pad it
    seq, keys = T.dynamic("seq"), T.dynamic("keys")

    mul = functools.partial(fp32_call, T, "__fmul_rn")

    @T.prim_func
    def indexer_scores(Q: T.Tensor((seq, heads, dim), "bfloat16"), K: T.Tensor((keys, dim), "bfloat16"),
                       W: T.Tensor((seq, heads), "float32"), VIS: T.Tensor((seq,), "int64"),
                       OUT: T.Tensor((seq, keys), "float32")):
        with T.Kernel(T.ceildiv(keys, bt), seq, threads=p["threads"]) as (bx, s):
            q_sh = T.alloc_shared((hp, dim), "bfloat16")
            k_sh = T.alloc_shared((bt, dim), "bfloat16")
            acc = T.alloc_fragment((hp, bt), "float32")
            total = T.alloc_fragment((bt,), "float32")
            pdl.begin(T, arch)
            for h, d in T.Parallel(hp, dim):
                q_sh[h, d] = T.if_then_else(h < heads, Q[s, T.min(h, heads - 1), d], T.Cast("bfloat16", 0))
            for t, d in T.Parallel(bt, dim):
                k_sh[t, d] = K[T.min(bx * bt + t, keys - 1), d]
            T.clear(acc)
            T.gemm(q_sh, k_sh, acc, transpose_B=True)
            for h, t in T.Parallel(hp, bt):
                acc[h, t] = T.if_then_else(h < heads, mul(mul(T.max(acc[h, t], 0.0), scale), W[s, T.min(h, heads - 1)]),
                                           0.0)
            T.reduce_sum(acc, total, dim=0)
            for t in T.Parallel(bt):
                if bx * bt + t < keys:
                    OUT[s, bx * bt + t] = T.if_then_else(bx * bt + t >= VIS[s], -T.infinity("float32"), total[t])

    return compile_kernel(indexer_scores, arch)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [S, H, D] bf16, keys [T, D] bf16, weights [S, H], visible [S] int -> scores [S, T] fp32,
    as `reference.indexer_scores`."""
    if q.dim() != 3 or keys.dim() != 2 or q.shape[-1] != keys.shape[-1]:
        raise KernelInputError(f"indexer_scores needs q [S, H, D] and keys [T, D], got {tuple(q.shape)} "
                               f"and {tuple(keys.shape)}")
    if q.dtype != torch.bfloat16 or keys.dtype != torch.bfloat16:
        raise KernelInputError(f"indexer_scores takes bf16 q and keys, got {q.dtype} and {keys.dtype}")
    s, h, d = q.shape
    if tuple(weights.shape) != (s, h) or tuple(visible.shape) != (s,):
        raise KernelInputError(f"indexer_scores: weights {tuple(weights.shape)} and visible "
                               f"{tuple(visible.shape)} do not fit q {tuple(q.shape)}")
    arch = cuda_arch(q.device)
    out = torch.empty(s, keys.shape[0], dtype=torch.float32, device=q.device)
    if out.numel():
        indexer_scores_kernel(h, d, float(scale), arch)(q.contiguous(), keys.contiguous(),
                                                        weights.float().contiguous(),
                                                        visible.to(torch.int64).contiguous(), out)
    return out
