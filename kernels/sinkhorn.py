"""mHC's Sinkhorn projection as a TileLang warp macro; same contract as `reference.sinkhorn`.

logits [n, n] fp32 per token -> row softmax + eps, column normalisation, then `iters - 1` rounds
of row and column normalisation (spec §C.3 step 6). In torch this is ~120 tiny kernel launches
per call; kernels/mhc.py's gate kernel runs `sinkhorn_macro` in one of its warps instead. A matrix
is held by n·n consecutive lanes of one warp (n ≤ 5), one element each, and its row and column
sums are read with warp shuffles: no shared memory and no barriers in the ~2·iters dependent steps
(a one-thread-per-token loop took ~21 µs per call on the H200). Data layout: row-major n×n per
token. tests/kernels/test_kernels_gpu.py runs the macro alone, in a one-launch kernel, against the
reference.
"""

from kernels.toolkit import KernelInputError

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
