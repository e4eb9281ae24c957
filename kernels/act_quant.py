"""FP8 activation quantisation on CUDA (TileLang); same contract as `reference.act_quant`.

Per row and per `block` channels: s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(clamp(x / s,
±448)). The power of two is read off the bits of amax (448 = 1.75·2^8, so s = 2^(e - 8) when
amax's mantissa is at most 1.75 and 2^(e - 7) above; kernels/toolkit.py's `pow2_scale_bits`),
which avoids a division and gives the same bits as the reference. Multiplying by 1/s is exact,
and the fp32 -> e4m3 conversion rounds to nearest even as torch does, so q and s match the
reference exactly.
"""

import torch

from kernels import pdl
from kernels.toolkit import (TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, kernel_factory, pow2_scale_bits,
                             tile_params)

# Groups (rows of `block` channels) per CTA of 128 threads, per compute capability.
# sm_90 (H100/H200) is tested; sm_121 (GB10, ~99 KB shared memory per block) is untested.
TILE_PARAMS = {
    (9, 0): {"elems_per_cta": 1024, "threads": 128},
    (12, 1): {"elems_per_cta": 1024, "threads": 128},
}
DEFAULT_TILE = {"elems_per_cta": 1024, "threads": 128}


@kernel_factory
def act_quant_kernel(block: int, in_dtype: str, arch: tuple[int, int]):
    """Kernel over G groups of `block` values: X [G, block] -> (Q [G, block] e4m3, S [G] fp32)."""
    import tilelang.language as T

    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    rows = max(1, p["elems_per_cta"] // block)
    groups = T.dynamic("groups")

    @T.prim_func
    def act_quant_main(X: T.Tensor((groups, block), in_dtype), Q: T.Tensor((groups, block), "float8_e4m3"),
                       S: T.Tensor((groups,), "float32")):
        with T.Kernel(T.ceildiv(groups, rows), threads=p["threads"]) as bx:
            x = T.alloc_fragment((rows, block), "float32")
            amax = T.alloc_fragment((rows,), "float32")
            inv = T.alloc_fragment((rows,), "float32")
            sc = T.alloc_fragment((rows,), "float32")
            q = T.alloc_fragment((rows, block), "float8_e4m3")
            pdl.begin(T, arch)
            for i, j in T.Parallel(rows, block):
                x[i, j] = T.if_then_else(bx * rows + i < groups, T.Cast("float32", X[bx * rows + i, j]), 0.0)
            T.reduce_absmax(x, amax, dim=1)
            for i in T.Parallel(rows):
                s_i, inv_i = pow2_scale_bits(T, amax[i])
                sc[i] = s_i
                inv[i] = inv_i
            for i, j in T.Parallel(rows, block):
                q[i, j] = T.clamp(x[i, j] * inv[i], -448.0, 448.0)
            for i, j in T.Parallel(rows, block):
                if bx * rows + i < groups:
                    Q[bx * rows + i, j] = q[i, j]
            for i in T.Parallel(rows):
                if bx * rows + i < groups:
                    S[bx * rows + i] = sc[i]

    return compile_kernel(act_quant_main, arch)


def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (bf16/fp16/fp32, K % block == 0) -> (q [..., K] e4m3, s [..., K/block] fp32)."""
    k = x.shape[-1]
    if k % block:
        raise KernelInputError(f"act_quant needs the last dim ({k}) to be a multiple of block={block}")
    if x.dtype not in TORCH_TO_TL:
        raise KernelInputError(f"act_quant takes bf16, fp16 or fp32 input, got {x.dtype}")
    arch = cuda_arch(x.device)
    xg = x.contiguous().reshape(-1, block)  # [G, block]: one row per scale group
    q = torch.empty(xg.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(xg.shape[0], dtype=torch.float32, device=x.device)
    if xg.shape[0]:
        act_quant_kernel(block, TORCH_TO_TL[x.dtype], arch)(xg, q, s)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], k // block)
