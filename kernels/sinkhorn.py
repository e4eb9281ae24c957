"""mHC Sinkhorn projection on CUDA (TileLang); same contract as `reference.sinkhorn`.

logits [S, n, n] fp32 -> [S, n, n]: row softmax + eps, column normalisation, then `iters - 1`
rounds of row and column normalisation (spec §C.3 step 6). In torch this is ~120 tiny kernel
launches per call (two calls per layer and token); here it is one launch, one thread per matrix
element (a one-thread-per-token loop took ~21 µs per call on the H200: ~1000 dependent
divisions). Data layout: row-major n×n per token, contiguous [S, n·n].

TileLang is imported lazily. The thread count per CTA is a per-architecture parameter; sm_90 is
tested, sm_121 (GB10) untested. (No `from __future__ import annotations`: TileLang evaluates the
kernel signature's annotations.)
"""

import functools

import torch

from kernels import pdl
from kernels.act_quant import KernelInputError, compile_kernel, cuda_arch, tile_params

TILE_PARAMS = {(9, 0): {"threads": 128}, (12, 1): {"threads": 128}}
DEFAULT_TILE = {"threads": 128}


def sinkhorn_macro(T, n: int, iters: int, eps: float):
    """A TileLang macro `steps(sm, v, acc, j, e)`: the projection of one n×n matrix by n·n threads.

    Thread (j, e) holds element e (row e // n, column e % n) of matrix j in v[0] and leaves the
    result there; `sm` is shared [matrices, n·n] fp32, `acc` a one-element local. A thread keeps
    its element in a register; row and column sums read the matrix from shared memory, summed
    from index 0 upwards like the reference loop, so every thread of a row (column) computes the
    same sum and the result equals a one-thread-per-token loop. Every thread of the CTA must run
    it (it holds barriers); threads with no element of their own can work on a scratch matrix.
    """

    @T.macro
    def publish(sm, v, j, e):
        """Every thread's element into shared memory, between barriers (all threads reach them)."""
        T.sync_threads()
        sm[j, e] = v[0]
        T.sync_threads()

    @T.macro
    def normalise_row(sm, v, acc, j, e, r0):
        publish(sm, v, j, e)
        acc[0] = 0.0
        for c in T.unroll(n):
            acc[0] += sm[j, r0 + c]
        v[0] = v[0] / (acc[0] + eps)

    @T.macro
    def normalise_column(sm, v, acc, j, e, c0):
        publish(sm, v, j, e)
        acc[0] = 0.0
        for r in T.unroll(n):
            acc[0] += sm[j, r * n + c0]
        v[0] = v[0] / (acc[0] + eps)

    @T.macro
    def steps(sm, v, acc, j, e):
        r0 = (e // n) * n
        c0 = e % n
        sm[j, e] = v[0]
        T.sync_threads()
        acc[0] = sm[j, r0]
        for c in T.unroll(n):  # row softmax, then + eps
            acc[0] = T.max(acc[0], sm[j, r0 + c])
        v[0] = T.exp(v[0] - acc[0])
        publish(sm, v, j, e)
        acc[0] = 0.0
        for c in T.unroll(n):
            acc[0] += sm[j, r0 + c]
        v[0] = v[0] / acc[0] + eps
        normalise_column(sm, v, acc, j, e, c0)  # column normalisation first
        for _ in T.serial(iters - 1):
            normalise_row(sm, v, acc, j, e, r0)
            normalise_column(sm, v, acc, j, e, c0)

    return steps


@functools.cache
def sinkhorn_kernel(n: int, iters: int, eps: float, arch: tuple[int, int]):
    """(L [S, n·n] fp32) -> M [S, n·n] fp32; one thread per matrix element, n·n threads per token
    (`sinkhorn_macro`)."""
    import tilelang.language as T

    threads = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["threads"]
    nn = n * n
    per_cta = max(1, threads // nn)  # tokens per CTA
    threads = per_cta * nn
    tokens = T.dynamic("tokens")
    steps = sinkhorn_macro(T, n, iters, eps)

    @T.prim_func
    def sinkhorn_main(L: T.Tensor((tokens, nn), "float32"), M: T.Tensor((tokens, nn), "float32")):
        with T.Kernel(T.ceildiv(tokens, per_cta), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            sm = T.alloc_shared((per_cta, nn), "float32")
            v = T.alloc_local((1,), "float32")
            acc = T.alloc_local((1,), "float32")
            pdl.begin(T, arch)
            j = tx // nn  # token within the CTA
            e = tx % nn  # element: row e // n, column e % n
            t = T.min(bx * per_cta + j, tokens - 1)  # every thread reaches every barrier
            v[0] = L[t, e]
            steps(sm, v, acc, j, e)
            if bx * per_cta + j < tokens:
                M[t, e] = v[0]

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
