"""FP4 routed-expert GEMMs on CUDA (TileLang); `fp4_gemm` has the contract of `reference.fp4_gemm`.

y = act_quant(x) · W^T with W [N, K] stored as packed e2m1 codes [N, K/2] (low nibble = even
channel) and 1×32 e8m0 scales [N, K/32]; fp32 accumulation, bf16 output (spec §B.4).

Hopper has no FP4 tensor cores, so the weight is unpacked in the kernel (weight-only
dequantisation) with integer bit moves and a byte permute (kernels/lowbit.py): a code becomes
the fp16 of its value times 2^-14 and an activation code the fp16 of its value times 2^-8
(both exact); the 2^22 goes into the group scale. (Reading fp32-widened activations instead
was 2.3x slower at M = 1: their loads, not the decoding, became the bottleneck.) Each lane
reads 16 bytes = 4 words = 32 channels = one scale group per row and step; the rest is the FP8
GEMV of kernels/fp8_gemm.py (a warp owns `rows` rows, exact power-of-two scaling of every
32-term partial sum, warp shuffle sum).

The kernel is grouped: G independent problems, each reading its weight from a slot of an
arena (uint8 [slots, bytes], e.g. engine/experts/arena.py's records) at fixed byte offsets,
through a slot table on the device. `fp4_gemm` is the one-group case; `fp4_gemm_grouped` and
`fp4_moe` serve decode (one launch for the same linear of every selected expert).
For more than GEMV_MAX_M rows, `fp4_gemm` dequantises exactly to bf16 and uses cuBLAS.

Tile sizes per compute capability are in TILE_PARAMS; sm_90 is tested. sm_121 (GB10, FP4 tensor
cores, ~99 KB shared memory per block) runs this same CUDA-core path and is untested.
"""

import functools

import torch

from kernels import lowbit
from kernels.act_quant import (KernelInputError, act_quant, compile_kernel, cuda_arch,
                               pad_rows_to_bucket, tile_params)
from kernels import reference as ref
from kernels.fp8_gemm import as_words, e8m0_bits_to_float

GEMV_MAX_M = 16
TILE_PARAMS = {
    (9, 0): {"rows": 2, "warps": 4},
    (12, 1): {"rows": 2, "warps": 4},
}
DEFAULT_TILE = {"rows": 2, "warps": 4}
_VEC = 16  # packed bytes per lane per step = 32 channels = one scale group


@functools.cache
def fp4_gemv_kernel(m: int, n: int, k: int, w_stride: int, w_off: int, s_stride: int, s_off: int,
                    rows: int, warps: int, arch: tuple[int, int]):
    """Grouped FP4 GEMV, `rows` rows per warp and `warps` warps per CTA.

    (Q [G,m,k/4] int32 = e4m3 codes, SA [G,m,k/128] fp32, WA [Sw, w_stride/4] int32, SWA [Ss, s_stride]
    u8, SLOT [G] int32, Y [G,m,n] bf16): group g uses the n*k/2 bytes at byte w_off of row SLOT[g] of
    WA as W [n, k/2] (packed e2m1) and the n*k/32 bytes at s_off of row SLOT[g] of SWA as its scales.
    """
    import tilelang.language as T

    kstep = 32 * 2 * _VEC
    steps = (k + kstep - 1) // kstep
    kw, kg, w_off_w = k // 8, k // 32, w_off // 4  # int32 words per weight row, scale groups per row
    loop = T.unroll if steps <= 16 else T.serial
    groups, wslots, sslots = T.dynamic("groups"), T.dynamic("wslots"), T.dynamic("sslots")

    @T.prim_func
    def fp4_gemv(Q: T.Tensor((groups, m, k // 4), "int32"), SA: T.Tensor((groups, m, k // 128), "float32"),
                 WA: T.Tensor((wslots, w_stride // 4), "int32"), SWA: T.Tensor((sslots, s_stride), "uint8"),
                 SLOT: T.Tensor((groups,), "int32"), Y: T.Tensor((groups, m, n), "bfloat16")):
        with T.Kernel(T.ceildiv(n, rows * warps), groups, threads=(32, warps)) as (bn, g):
            lowbit.import_source(T)
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            wq = T.alloc_local((rows, _VEC // 4), "int32")
            wsc = T.alloc_local((rows,), "uint8")
            aq = T.alloc_local((2 * _VEC // 4,), "int32")
            af = T.alloc_local((2 * _VEC,), "float32")
            acc = T.alloc_local((rows, m), "float32")
            slot = SLOT[g]
            T.clear(acc)
            for ko in loop(steps):
                k0 = ko * kstep + lane * 2 * _VEC  # this lane's 32 channels = 16 bytes = 4 words
                if k0 < k:
                    for r in T.unroll(rows):
                        row = T.min(bn * rows * warps + warp * rows + r, n - 1)
                        for v in T.vectorized(_VEC // 4):
                            wq[r, v] = WA[slot, w_off_w + row * kw + k0 // 8 + v]
                        wsc[r] = SWA[slot, s_off + row * kg + k0 // 32]
                    for i in T.unroll(m):
                        for v in T.vectorized(2 * _VEC // 4):
                            aq[v] = Q[g, i, k0 // 4 + v]
                        lowbit.e4m3x16_to_f32(T, aq[0], af[0])
                        lowbit.e4m3x16_to_f32(T, aq[_VEC // 4], af[_VEC])
                        for r in T.unroll(rows):
                            # activations decode to value * 2^-8, weights to value * 2^-14
                            scale = SA[g, i, k0 // 128] * e8m0_bits_to_float(
                                T, wsc[r], lowbit.E4M3_SHIFT + lowbit.E2M1_SHIFT)
                            acc[r, i] += lowbit.dot_e2m1x32(T, wq[r, 0], af[0]) * scale
            for r in T.unroll(rows):
                for i in T.unroll(m):
                    total = T.warp_reduce_sum(acc[r, i])
                    if lane == 0 and bn * rows * warps + warp * rows + r < n:
                        Y[g, i, bn * rows * warps + warp * rows + r] = T.Cast("bfloat16", total)

    return compile_kernel(fp4_gemv, arch)


def gemv_tile(n: int, arch: tuple[int, int]) -> tuple[int, int]:
    """(rows per warp, warps per CTA) of the FP4 GEMV for N output rows on `arch`."""
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    rows, warps = p["rows"], p["warps"]
    while rows > 1 and n // (rows * warps) < 128:
        rows //= 2
    return rows, warps


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def dequant_fp4_bf16(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """FP4 weight [N, K/2] -> bf16 [N, K], exactly (e2m1 times a power of two fits bf16)."""
    b = _as_bytes(w)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2).long()  # [N, K/2, 2] -> [N, K]
    v = ref.FP4_VALUES.to(device=w.device, dtype=torch.bfloat16)[codes]
    e = (_as_bytes(w_scale).to(torch.int32) - 127).repeat_interleave(32, dim=-1)
    return torch.ldexp(v, e.to(torch.bfloat16))


def _check(x: torch.Tensor, n: int, k: int, what: str) -> None:
    if x.shape[-1] != k or k % 128:
        raise KernelInputError(f"{what}: x has {x.shape[-1]} channels, weight has K={k} "
                               "(K must match and be a multiple of 128)")
    if n < 1:
        raise KernelInputError(f"{what}: weight has no rows")


def fp4_gemm_grouped(x: torch.Tensor, w_arena: torch.Tensor, w_off: int, s_arena: torch.Tensor, s_off: int,
                     n: int, k: int, slots: torch.Tensor) -> torch.Tensor:
    """G FP4 linears in one launch: x [G, M, K] (or [G, K]) × the weight in slot slots[g] -> bf16 [G, M, N].

    w_arena / s_arena: uint8 [slots, bytes] (may be the same tensor); group g's weight is the n·k/2
    bytes at w_arena[slots[g], w_off:] and its scales the n·k/32 bytes at s_arena[slots[g], s_off:].
    M <= GEMV_MAX_M. slots: int32 [G] on the device (a slot table lookup, no host sync).
    """
    _check(x, n, k, "fp4_gemm_grouped")
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(1) if squeeze else x  # [G, M, K]
    g, m = x3.shape[0], x3.shape[1]
    if m > GEMV_MAX_M:
        raise KernelInputError(f"fp4_gemm_grouped takes at most {GEMV_MAX_M} rows per group, got {m}")
    wb, sb = _as_bytes(w_arena), _as_bytes(s_arena)
    if w_off % 16 or wb.shape[1] % 16 or w_off + n * k // 2 > wb.shape[1] or s_off + n * k // 32 > sb.shape[1]:
        raise KernelInputError("fp4_gemm_grouped: the weight must lie inside the arena row at a "
                               "16-byte aligned offset (and the arena row length be a multiple of 16)")
    if slots.dtype != torch.int32 or slots.shape != (g,):
        raise KernelInputError(f"fp4_gemm_grouped: slots must be int32 [{g}], got {slots.dtype} {tuple(slots.shape)}")
    arch = cuda_arch(x.device)
    q, s = act_quant(x3, 128)
    y = torch.empty(g, m, n, dtype=torch.bfloat16, device=x.device)
    if g:
        kernel = fp4_gemv_kernel(m, n, k, wb.shape[1], w_off, sb.shape[1], s_off, *gemv_tile(n, arch), arch)
        kernel(as_words(q), s, as_words(wb), sb, slots, y)
    return y.squeeze(1) if squeeze else y


def fp4_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16) × FP4 weight [N, K/2] with e8m0 scales [N, K/32] -> bf16 [..., N]."""
    n, kh = w.shape
    k = 2 * kh
    _check(x, n, k, "fp4_gemm")
    if tuple(w_scale.shape) != (n, k // 32):
        raise KernelInputError(f"fp4_gemm: scale shape {tuple(w_scale.shape)} != {(n, k // 32)}")
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    if m == 0:
        return torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16, device=x.device)
    if m > GEMV_MAX_M:
        cuda_arch(x.device)
        q, s = act_quant(x2, 128)
        a = q.to(torch.bfloat16).view(m, k // 128, 128) * s.to(torch.bfloat16).unsqueeze(-1)  # exact
        y = torch.matmul(a.view(m, k), dequant_fp4_bf16(w, w_scale).T)
    else:
        slot0 = torch.zeros(1, dtype=torch.int32, device=x.device)
        y = fp4_gemm_grouped(pad_rows_to_bucket(x2).unsqueeze(0), _as_bytes(w).reshape(1, -1), 0,
                             _as_bytes(w_scale).reshape(1, -1), 0, n, k, slot0)[0, :m]
    return y.reshape(*x.shape[:-1], n)


def fp4_moe(x: torch.Tensor, arena: torch.Tensor, fields: dict, slots: torch.Tensor, weights: torch.Tensor,
            limit: float) -> torch.Tensor:
    """Routed experts of decode, read from arena slots, three launches for all G: the contract of
    `reference.fp4_moe` (x [G, D], arena uint8 [slots, record_bytes], fields, slots [G],
    routing weights [G] -> fp32 [G, D])."""
    slots = slots.to(torch.int32)
    inter, dim = fields["w1.weight"].shape[0], x.shape[-1]
    off = {name: f.offset for name, f in fields.items()}
    g = fp4_gemm_grouped(x, arena, off["w1.weight"], arena, off["w1.scale"], inter, dim, slots).float()
    u = fp4_gemm_grouped(x, arena, off["w3.weight"], arena, off["w3.scale"], inter, dim, slots).float()
    h = (ref.swiglu(g, u, limit) * weights.float().unsqueeze(-1)).to(torch.bfloat16)
    return fp4_gemm_grouped(h, arena, off["w2.weight"], arena, off["w2.scale"], dim, inter, slots).float()
