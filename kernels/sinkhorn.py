"""mHC Sinkhorn projection on CUDA (TileLang); same contract as `reference.sinkhorn`.

logits [S, n, n] fp32 -> [S, n, n]: row softmax + eps, column normalisation, then `iters - 1`
rounds of row and column normalisation (spec §C.3 step 6). In torch this is ~120 tiny kernel
launches per call (two calls per layer and token); here one thread owns one token's n×n matrix
in registers and the whole projection is one launch. Data layout: row-major n×n per token,
contiguous [S, n·n].

TileLang is imported lazily. The thread count per CTA is a per-architecture parameter; sm_90 is
tested, sm_121 (GB10) untested. (No `from __future__ import annotations`: TileLang evaluates the
kernel signature's annotations.)
"""

import functools

import torch

from kernels.act_quant import KernelInputError, compile_kernel, cuda_arch, tile_params

TILE_PARAMS = {(9, 0): {"threads": 128}, (12, 1): {"threads": 128}}
DEFAULT_TILE = {"threads": 128}


@functools.cache
def sinkhorn_kernel(n: int, iters: int, eps: float, arch: tuple[int, int]):
    """(L [S, n·n] fp32) -> M [S, n·n] fp32, one thread per token."""
    import tilelang.language as T

    threads = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["threads"]
    nn = n * n
    tokens = T.dynamic("tokens")

    @T.prim_func
    def sinkhorn_main(L: T.Tensor((tokens, nn), "float32"), M: T.Tensor((tokens, nn), "float32")):
        with T.Kernel(T.ceildiv(tokens, threads), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            m = T.alloc_local((nn,), "float32")
            acc = T.alloc_local((1,), "float32")
            t = bx * threads + tx
            if t < tokens:
                for i in T.unroll(nn):
                    m[i] = L[t, i]
                for r in T.unroll(n):  # row softmax, then + eps
                    acc[0] = m[r * n]
                    for c in T.unroll(n):
                        acc[0] = T.max(acc[0], m[r * n + c])
                    for c in T.unroll(n):
                        m[r * n + c] = T.exp(m[r * n + c] - acc[0])
                    acc[0] = 0.0
                    for c in T.unroll(n):
                        acc[0] += m[r * n + c]
                    for c in T.unroll(n):
                        m[r * n + c] = m[r * n + c] / acc[0] + eps
                for c in T.unroll(n):  # column normalisation first
                    acc[0] = 0.0
                    for r in T.unroll(n):
                        acc[0] += m[r * n + c]
                    for r in T.unroll(n):
                        m[r * n + c] = m[r * n + c] / (acc[0] + eps)
                for _ in T.serial(iters - 1):
                    for r in T.unroll(n):
                        acc[0] = 0.0
                        for c in T.unroll(n):
                            acc[0] += m[r * n + c]
                        for c in T.unroll(n):
                            m[r * n + c] = m[r * n + c] / (acc[0] + eps)
                    for c in T.unroll(n):
                        acc[0] = 0.0
                        for r in T.unroll(n):
                            acc[0] += m[r * n + c]
                        for r in T.unroll(n):
                            m[r * n + c] = m[r * n + c] / (acc[0] + eps)
                for i in T.unroll(nn):
                    M[t, i] = m[i]

    return compile_kernel(sinkhorn_main, arch)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [..., n, n] fp32 on CUDA -> doubly-stochastic projection, as reference.sinkhorn."""
    n = logits.shape[-1]
    if logits.shape[-2] != n or logits.dtype != torch.float32:
        raise KernelInputError(f"sinkhorn needs fp32 [..., n, n] logits, got {logits.dtype} {tuple(logits.shape)}")
    if iters < 1:
        raise KernelInputError(f"sinkhorn needs iters >= 1, got {iters}")
    flat = logits.reshape(-1, n * n).contiguous()  # [S, n·n]
    out = torch.empty_like(flat)
    if flat.shape[0]:
        sinkhorn_kernel(n, iters, float(eps), cuda_arch(logits.device))(flat, out)
    return out.view(logits.shape)
