"""A MoE layer's output on CUDA (TileLang) in one launch; same contract as `reference.moe_combine`.

routed [N, k, D] (bf16/fp16/fp32), shared [N, D] (bf16/fp16/fp32) -> out [N, D] in `dtype`:
y = routed[:, 0] + routed[:, 1] + ... + routed[:, k-1] in this order in fp32, then + shared
(widened), rounded once into dtype. The reference is 2k launches (widen, add per expert, the
final add with its narrowing). The decode and chunk steps sum all but their last layer's MoE
output inside the next mHC kernel instead (kernels/mhc.py `moe_post_pre`, the same expression). A
prefill's cells come grouped by expert ([G, D] bf16, `rows` [N, k] says where each (token,
choice) is): read in place, instead of widened and put back in (token, choice) order first (at
728 tokens, 108 MB of widening and 144 MB of index_copy per layer).

Bits: each sum is a single fp32 rounding (`__fadd_rn`: nvcc may not reassociate or contract
it), the sum starts from routed[:, 0] itself (not from 0, which would turn -0 into +0), and
the final narrowing is round-to-nearest-even (cvt.rn) as torch's — the reference's operations
in the same order, so the results are bit-identical (tests/kernels/test_moe_kernels_gpu.py checks equality).

Layout: one thread per output element (token n, channel d); grid (D / threads, N); routed and
shared contiguous. sm_90 tested, sm_121 (GB10) untested. (No `from __future__ import
annotations`: TileLang evaluates the kernel signature's annotations.)
"""

import functools

import torch

from kernels import pdl
from kernels.toolkit import (TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, fp32_call, kernel_factory,
                             tile_params)

TILE_PARAMS = {(9, 0): {"threads": 128}, (12, 1): {"threads": 128}}  # sm_121 (GB10): untested
DEFAULT_TILE = {"threads": 128}


@kernel_factory
def moe_combine_kernel(k: int, d: int, routed_dtype: str, shared_dtype: str, out_dtype: str, arch: tuple[int, int],
                       indexed: bool = False):
    """(R [N, k, d] routed_dtype, Sh [N, d] shared_dtype, Y [N, d] out_dtype); `indexed`:
    (R [cells, d], ROWS [N, k] int64, Sh, Y), (n, j) read from row ROWS[n, j] of R."""
    import tilelang.language as T

    threads = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["threads"]
    tokens, cells = T.dynamic("tokens"), T.dynamic("cells")

    add = functools.partial(fp32_call, T, "__fadd_rn")

    def cell(R, ROWS, n, j, c):  # (token n, choice j)'s value at channel c
        return R[ROWS[n, j], c] if indexed else R[n, j, c]

    @T.macro
    def combine(R, ROWS, Sh, Y, bx, bn):
        tx = T.get_thread_binding(0)
        acc = T.alloc_local((1,), "float32")
        pdl.begin(T, arch)
        c = bx * threads + tx
        if c < d:
            acc[0] = T.Cast("float32", cell(R, ROWS, bn, 0, c))
            for j in T.unroll(1, k):  # routing order, whatever order the experts ran in
                acc[0] = add(acc[0], T.Cast("float32", cell(R, ROWS, bn, j, c)))
            Y[bn, c] = T.Cast(out_dtype, add(acc[0], T.Cast("float32", Sh[bn, c])))

    if indexed:
        @T.prim_func
        def moe_combine_rows(R: T.Tensor((cells, d), routed_dtype), ROWS: T.Tensor((tokens, k), "int64"),
                             Sh: T.Tensor((tokens, d), shared_dtype), Y: T.Tensor((tokens, d), out_dtype)):
            with T.Kernel(T.ceildiv(d, threads), tokens, threads=threads) as (bx, bn):
                combine(R, ROWS, Sh, Y, bx, bn)

        return compile_kernel(moe_combine_rows, arch)

    @T.prim_func
    def moe_combine_main(R: T.Tensor((tokens, k, d), routed_dtype), Sh: T.Tensor((tokens, d), shared_dtype),
                         Y: T.Tensor((tokens, d), out_dtype)):
        with T.Kernel(T.ceildiv(d, threads), tokens, threads=threads) as (bx, bn):
            combine(R, R, Sh, Y, bx, bn)  # no row table

    return compile_kernel(moe_combine_main, arch)


def check_parts(caller: str, routed: torch.Tensor, shared: torch.Tensor,
                rows: torch.Tensor | None) -> tuple[int, int, int]:
    """(N, k, D) of a MoE layer's parts: routed [N, k, D], or cells [G, D] with rows [N, k] int64,
    and shared [N, D]; a KernelInputError naming `caller` where they do not fit."""
    if rows is not None:
        if routed.dim() != 2 or rows.dim() != 2 or rows.shape[1] < 1 or rows.dtype != torch.int64:
            raise KernelInputError(f"{caller} with rows needs cells [G, D] and rows [N, k] int64, got cells "
                                   f"{tuple(routed.shape)} and rows {rows.dtype} {tuple(rows.shape)}")
        (n, k), d = rows.shape, routed.shape[1]
    elif routed.dim() != 3 or routed.shape[1] < 1:
        raise KernelInputError(f"{caller} needs routed [N, k, D] with k >= 1, got {tuple(routed.shape)}")
    else:
        n, k, d = routed.shape
    if tuple(shared.shape) != (n, d):
        raise KernelInputError(f"{caller}: shared {tuple(shared.shape)} does not fit routed "
                               f"{tuple(routed.shape)} (want {(n, d)})")
    return n, k, d


def moe_combine(routed: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """routed [N, k, D] (or cells [G, D] with rows [N, k] int64), shared [N, D] -> [N, D] in
    dtype, as `reference.moe_combine`."""
    n, k, d = check_parts("moe_combine", routed, shared, rows)
    for name, dt in (("routed", routed.dtype), ("shared", shared.dtype), ("out", dtype)):
        if dt not in TORCH_TO_TL:
            raise KernelInputError(f"moe_combine: {name} dtype must be bf16, fp16 or fp32, got {dt}")
    arch = cuda_arch(routed.device)
    if shared.device != routed.device or (rows is not None and rows.device != routed.device):
        raise KernelInputError(f"moe_combine: routed on {routed.device}, shared on {shared.device}"
                               + ("" if rows is None else f", rows on {rows.device}"))
    y = torch.empty(n, d, dtype=dtype, device=routed.device)
    if not (n and d):
        return y
    dtypes = TORCH_TO_TL[routed.dtype], TORCH_TO_TL[shared.dtype], TORCH_TO_TL[dtype]
    if rows is None:
        moe_combine_kernel(k, d, *dtypes, arch)(routed.contiguous(), shared.contiguous(), y)
    else:
        moe_combine_kernel(k, d, *dtypes, arch, indexed=True)(routed.contiguous(), rows.contiguous(),
                                                              shared.contiguous(), y)
    return y
