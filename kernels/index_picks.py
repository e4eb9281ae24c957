"""A CSA step's key rows straight from the lightning indexer's scores on CUDA (TileLang), in one
launch; same contract as `reference.index_picks`: the window's rows, then the entry slots in
descending score order (ties -> the lower slot), the first k of them moved by `offset` where
visible and -1 elsewhere, then -1 up to `width`. It replaces torch's stable sort (three copies,
an iota, a radix sort) and `sparse_index`: about six launches on a CSA layer's critical path.

An entry's rank is the number of entries with a larger score, or an equal score and a lower
slot: a strict total order (NaN counts as +inf, -0.0 equals +0.0), so rank r < k fills column
W + r exactly as the reference's stable descending sort (`reference.topk_desc`) would.
Layout: SCORES [S, N] fp32, WIN [S, W] int64, VIS [S] int64 -> OUT [S, W + width] int64. Grid
(N / threads, S): each CTA copies the query's N scores to shared memory and ranks `threads` of
them, one per thread (N comparisons, a broadcast read each); CTA 0 also copies the window's
rows and writes the padding. The ranking costs N² comparisons per query: above `MAX_N` entries
(`MAX_N_ONE_QUERY` for a decode step's one query) the wrapper sorts with torch and writes the
rows with `kernels.sparse_index` (`python -m bench.kernels --index-picks` times both: at 2,048
slots a chunk of 128 queries ranked in 225 µs against torch's 27 on the H200).
(No `from __future__ import annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import torch

from kernels import pdl, reference as ref
from kernels.sparse_index import check_key_rows, sparse_index
from kernels.toolkit import KernelInputError, compile_kernel, cuda_arch, kernel_factory

MAX_N = 512  # entry slots ranked in-kernel for several queries; torch sorts more
MAX_N_ONE_QUERY = 2048  # ... and for one query (8 KB of shared memory per CTA)
MAX_THREADS = 128


def kernel_threads(n: int) -> int:
    """The kernel's CTA size for n entry slots: one thread a slot, a warp to MAX_THREADS."""
    return min(MAX_THREADS, max(32, 1 << (n - 1).bit_length()))


@kernel_factory
def index_picks_kernel(w: int, n: int, k: int, offset: int, width: int, threads: int, arch: tuple[int, int]):
    """(SCORES [S, n] fp32, WIN [S, w], VIS [S], OUT [S, w + width]) int64 but SCORES; k <= min(n, width)."""
    import tilelang.language as T

    s_len = T.dynamic("s_len")
    cols = w + width

    @T.prim_func
    def index_picks(SCORES: T.Tensor((s_len, n), "float32"), WIN: T.Tensor((s_len, w), "int64"),
                    VIS: T.Tensor((s_len,), "int64"), OUT: T.Tensor((s_len, cols), "int64")):
        with T.Kernel(T.ceildiv(n, threads), s_len, threads=threads) as (b, s):
            tx = T.get_thread_binding(0)
            key = T.alloc_shared((n,), "float32")
            mine = T.alloc_local((1,), "float32")
            rank = T.alloc_local((1,), "int32")
            pdl.begin(T, arch)
            for jo in T.serial(T.ceildiv(n, threads)):
                if jo * threads + tx < n:
                    mine[0] = SCORES[s, jo * threads + tx]
                    key[jo * threads + tx] = T.if_then_else(T.isnan(mine[0]), T.infinity("float32"), mine[0])
            T.sync_threads()
            i = b * threads + tx
            rank[0] = 0
            mine[0] = key[T.min(i, n - 1)]
            for j in T.serial(n):  # entries ranked above ours: a larger score, or an equal one at a lower slot
                rank[0] += T.Cast("int32", T.if_then_else(j < i, key[j] >= mine[0], key[j] > mine[0]))
            if i < n and rank[0] < k:
                OUT[s, w + rank[0]] = T.if_then_else(T.Cast("int64", i) < VIS[s], T.Cast("int64", i) + T.int64(offset),
                                                     T.int64(-1))
            if b == 0:
                for jo in T.serial(T.ceildiv(w, threads)):
                    if jo * threads + tx < w:
                        OUT[s, jo * threads + tx] = WIN[s, jo * threads + tx]
                for jo in T.serial(T.ceildiv(width - k, threads)):
                    if jo * threads + tx < width - k:
                        OUT[s, w + k + jo * threads + tx] = T.int64(-1)

    return compile_kernel(index_picks, arch)


def index_picks(scores: torch.Tensor, window_rows: torch.Tensor, visible: torch.Tensor, k: int, offset: int,
                width: int) -> torch.Tensor:
    """scores [S, N] fp32, window_rows [S, W], visible [S] (int64) -> int64 [S, W + width], as the reference."""
    check_key_rows("index_picks", "scores", window_rows, scores, visible, k, width)
    if scores.dtype != torch.float32:
        raise KernelInputError(f"index_picks takes fp32 scores (the indexer's), got {scores.dtype}")
    arch = cuda_arch(scores.device)
    s_len, n = scores.shape
    if n == 0 or n > (MAX_N_ONE_QUERY if s_len == 1 else MAX_N) or window_rows.shape[1] == 0:  # torch's sort
        return sparse_index(window_rows, ref.topk_desc(scores, k), visible, k, offset, width)
    out = torch.empty(s_len, window_rows.shape[1] + width, dtype=torch.int64, device=scores.device)
    if s_len:
        index_picks_kernel(window_rows.shape[1], n, k, int(offset), width, kernel_threads(n), arch)(
            scores.contiguous(), window_rows.to(torch.int64).contiguous(), visible.to(torch.int64).contiguous(), out)
    return out
