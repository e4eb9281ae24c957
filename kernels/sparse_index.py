"""A decode query's key-row list for sparse attention on CUDA (TileLang); same contract as
`reference.sparse_index`: the window's rows, then the chosen entry slots shifted past the window
(-1 where not yet visible), padded with -1 — one launch instead of the ~8 small torch ops that
filtered, shifted, padded and concatenated them.

Layout: int64 WIN [S, W], ORDER [S, N], VIS [S] -> OUT [S, W + width]; one thread per output
column, a CTA of 256 columns per (query, column block). TileLang is imported lazily.
"""

import torch

from kernels import pdl, reference as ref
from kernels.toolkit import KernelInputError, compile_kernel, cuda_arch, kernel_factory

_THREADS = 256


@kernel_factory
def sparse_index_kernel(w: int, n: int, k: int, offset: int, width: int, arch: tuple[int, int]):
    """(WIN [S, w], ORDER [S, n], VIS [S], OUT [S, w + width]), all int64, k <= min(n, width)."""
    import tilelang.language as T

    s_len = T.dynamic("s_len")
    cols = w + width

    @T.prim_func
    def sparse_index(WIN: T.Tensor((s_len, w), "int64"), ORDER: T.Tensor((s_len, n), "int64"),
                     VIS: T.Tensor((s_len,), "int64"), OUT: T.Tensor((s_len, cols), "int64")):
        with T.Kernel(s_len, T.ceildiv(cols, _THREADS), threads=_THREADS) as (i, b):
            j = b * _THREADS + T.get_thread_binding(0)
            pdl.begin(T, arch)
            if j < w:
                OUT[i, j] = WIN[i, j]
            elif j < w + k:
                OUT[i, j] = T.if_then_else(ORDER[i, j - w] < VIS[i], ORDER[i, j - w] + T.int64(offset),
                                           T.int64(-1))
            elif j < cols:
                OUT[i, j] = T.int64(-1)

    return compile_kernel(sparse_index, arch)


def check_key_rows(op: str, slots_name: str, window_rows: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                   k: int, width: int) -> None:
    """The shapes of a key-row op (`sparse_index`, `kernels.index_picks`): window_rows [S, W], a
    per-slot tensor `slots_name` [S, N] (the order, or the scores), visible [S] and k <= min(N, width)."""
    if (window_rows.dim() != 2 or slots.dim() != 2 or tuple(visible.shape) != (window_rows.shape[0],)
            or slots.shape[0] != window_rows.shape[0] or not 0 <= k <= min(slots.shape[1], width)):
        raise KernelInputError(f"{op} takes window_rows [S, W], {slots_name} [S, N], visible [S] and "
                               f"k <= min(N, width); got {tuple(window_rows.shape)}, {tuple(slots.shape)}, "
                               f"{tuple(visible.shape)}, k={k}, width={width}")


def sparse_index(window_rows: torch.Tensor, order: torch.Tensor, visible: torch.Tensor, k: int, offset: int,
                 width: int) -> torch.Tensor:
    """window_rows [S, W], order [S, N], visible [S] (int64) -> int64 [S, W + width], as the reference."""
    check_key_rows("sparse_index", "order", window_rows, order, visible, k, width)
    arch = cuda_arch(order.device)
    if order.shape[1] == 0 or window_rows.shape[1] == 0:  # no entries (or no window) to compile for
        return ref.sparse_index(window_rows, order, visible, k, offset, width)
    s_len, w = window_rows.shape
    out = torch.empty(s_len, w + width, dtype=torch.int64, device=order.device)
    if s_len:
        args = (t.to(torch.int64).contiguous() for t in (window_rows, order, visible))
        sparse_index_kernel(w, order.shape[1], k, int(offset), width, arch)(*args, out)
    return out
