"""mHC Sinkhorn projection on CUDA (TileLang); same contract as `reference.sinkhorn`.

logits [S, n, n] fp32 -> [S, n, n]: row softmax + eps, column normalisation, then `iters - 1`
rounds of row and column normalisation (spec §C.3 step 6). In torch this is ~120 tiny kernel
launches per call (two calls per layer and token); here it is one launch. A matrix is held by
n·n consecutive lanes of one warp (n ≤ 5), one element each, and its row and column sums are
read with warp shuffles: no shared memory and no barriers in the ~2·iters dependent steps (a
one-thread-per-token loop took ~21 µs per call on the H200; one thread per element with shared
memory and two CTA barriers per step was the version before this one). Data layout: row-major
n×n per token, contiguous [S, n·n].

TileLang is imported lazily. The thread count per CTA is a per-architecture parameter; sm_90 is
tested, sm_121 (GB10) untested. (No `from __future__ import annotations`: TileLang evaluates the
kernel signature's annotations.)
"""

import functools

import torch

from kernels import pdl
from kernels.toolkit import KernelInputError, compile_kernel, cuda_arch, tile_params

TILE_PARAMS = {(9, 0): {"threads": 128}, (12, 1): {"threads": 128}}
DEFAULT_TILE = {"threads": 128}
WARP = 32
MAX_N = 5  # n·n elements must fit one warp


def check_n(n: int) -> None:
    """The kernels hold a matrix in one warp: n ≤ MAX_N (DeepSeek-V4's hc_mult is 4)."""
    if not 1 <= n <= MAX_N:
        raise KernelInputError(f"the TileLang Sinkhorn holds an n×n matrix in one warp: n must be 1..{MAX_N}, "
                               f"got {n} (use the torch kernel backend for larger hc_mult)")


def sinkhorn_macro(T, n: int, iters: int, eps: float):
    """A TileLang macro `steps(v, acc, base, e)`: the projection of one n×n matrix by n·n lanes.

    The lane holding element e (row e // n, column e % n) keeps it in v[0] and leaves the result
    there; the matrix sits in lanes base .. base + n·n - 1 of the warp (base = lane - e), `acc` is
    a one-element local. Row and column sums shuffle the elements in from index 0 upwards like
    the reference loop, so every lane of a row (column) computes the same sum. Every lane of the
    warp must run it (the shuffles are warp-wide); lanes with no element of their own compute on
    whatever they hold, and their results are not used.
    """
    check_n(n)

    @T.macro
    def normalise(v, acc, first, stride):
        """v /= (Σ_i element(first + i·stride) + eps), i = 0 .. n-1 in order."""
        acc[0] = 0.0
        for i in T.unroll(n):
            acc[0] += T.shfl_sync(v[0], first + i * stride)
        v[0] = v[0] / (acc[0] + eps)

    @T.macro
    def steps(v, acc, base, e):
        row = base + (e // n) * n  # lane of the row's first element
        col = base + e % n  # lane of the column's first element
        acc[0] = T.shfl_sync(v[0], row)
        for c in T.unroll(1, n):  # row softmax, then + eps
            acc[0] = T.max(acc[0], T.shfl_sync(v[0], row + c))
        v[0] = T.exp(v[0] - acc[0])
        acc[0] = 0.0
        for c in T.unroll(n):
            acc[0] += T.shfl_sync(v[0], row + c)
        v[0] = v[0] / acc[0] + eps
        normalise(v, acc, col, n)  # column normalisation first
        for _ in T.serial(iters - 1):
            normalise(v, acc, row, 1)
            normalise(v, acc, col, n)

    return steps


@functools.cache
def sinkhorn_kernel(n: int, iters: int, eps: float, arch: tuple[int, int]):
    """(L [S, n·n] fp32) -> M [S, n·n] fp32: a warp holds 32 // (n·n) tokens' matrices, one lane
    per element (`sinkhorn_macro`); the lanes left over run on a copy of the last token."""
    import tilelang.language as T

    threads = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["threads"]
    nn = n * n
    per_warp = WARP // nn
    per_cta = per_warp * (threads // WARP)  # tokens per CTA
    tokens = T.dynamic("tokens")
    steps = sinkhorn_macro(T, n, iters, eps)

    @T.prim_func
    def sinkhorn_main(L: T.Tensor((tokens, nn), "float32"), M: T.Tensor((tokens, nn), "float32")):
        with T.Kernel(T.ceildiv(tokens, per_cta), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            v = T.alloc_local((1,), "float32")
            acc = T.alloc_local((1,), "float32")
            pdl.begin(T, arch)
            lane = tx % WARP
            e = lane % nn  # element: row e // n, column e % n
            mine = bx * per_cta + (tx // WARP) * per_warp + lane // nn  # this lane's token
            t = T.min(mine, tokens - 1)  # every lane runs the shuffles
            v[0] = L[t, e]
            steps(v, acc, lane - e, e)
            if lane < per_warp * nn and mine < tokens:
                M[t, e] = v[0]

    return compile_kernel(sinkhorn_main, arch)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [..., n, n] fp32 on CUDA -> doubly-stochastic projection, as reference.sinkhorn."""
    n = logits.shape[-1]
    if logits.shape[-2] != n or logits.dtype != torch.float32:
        raise KernelInputError(f"sinkhorn needs fp32 [..., n, n] logits, got {logits.dtype} {tuple(logits.shape)}")
    if iters < 1:
        raise KernelInputError(f"sinkhorn needs iters >= 1, got {iters}")
    check_n(n)
    flat = logits.reshape(-1, n * n).contiguous()  # [S, n·n]
    out = torch.empty_like(flat)
    if flat.shape[0]:
        sinkhorn_kernel(n, iters, float(eps), cuda_arch(logits.device))(flat, out)
    return out.view(logits.shape)
