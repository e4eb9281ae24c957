"""FP8 block-scaled GEMM on CUDA (TileLang); same contract as `reference.fp8_gemm`.

y = act_quant(x) · W^T with W [N, K] e4m3 and 128×128 e8m0 block scales, fp32 accumulation,
bf16 output (spec §B.4).

* Decode (M <= GEMV_MAX_M rows): a weight-streaming GEMV. Each warp owns `rows` output rows;
  each lane reads 16 contiguous weight bytes per row per step (a warp covers 512 channels of a
  row, coalesced), forms the 16-term fp32 dot product with the quantised activations, and adds
  it times s_act · s_weight (both powers of two, so the scaling is exact). A warp shuffle sum
  finishes each row. The weight is read once whatever M is; activations come from L1.
* Prefill (larger M): both operands are dequantised exactly to bf16 (an e4m3 value times a
  power of two has 4 significant bits) and multiplied by cuBLAS with fp32 accumulation.

Results equal the reference up to fp32 summation order (measured in tests/test_kernels_gpu.py).
Tile sizes per compute capability are in TILE_PARAMS; sm_90 is tested, sm_121 (GB10) is not.
TileLang is imported lazily (see kernels/act_quant.py).
"""

import functools

import torch

from kernels.act_quant import (KernelInputError, act_quant, compile_kernel, cuda_arch,
                               pad_rows_to_bucket, tile_params)

GEMV_MAX_M = 16
# rows per warp and warps per CTA of the GEMV, per compute capability (sm_121: untested).
TILE_PARAMS = {
    (9, 0): {"rows": 4, "warps": 4},
    (12, 1): {"rows": 2, "warps": 4},
}
DEFAULT_TILE = {"rows": 2, "warps": 4}
_VEC = 16  # fp8 weight bytes per lane per step (one 16-byte load)


def e8m0_bits_to_float(T, byte, extra_exp: int = 0):
    """2^(byte - 127 + extra_exp) as fp32, built from its bits (TileLang expression)."""
    return T.reinterpret((T.Cast("uint32", byte) + T.uint32(extra_exp)) << T.uint32(23), "float32")


def _gemv_rows(n: int, p: dict) -> int:
    """Rows per warp: fewer for small N so that the grid still covers the GPU."""
    rows = p["rows"]
    while rows > 1 and n // (rows * p["warps"]) < 256:
        rows //= 2
    return rows


@functools.cache
def fp8_gemv_kernel(m: int, n: int, k: int, arch: tuple[int, int]):
    """(Q [m,k] e4m3, SA [m,k/128] fp32, W [n,k] e4m3, SW [ceil(n/128),k/128] u8) -> Y [m,n] bf16."""
    import tilelang.language as T

    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    rows, warps = _gemv_rows(n, p), p["warps"]
    kstep = 32 * _VEC
    steps = (k + kstep - 1) // kstep
    kb, nb = k // 128, (n + 127) // 128
    loop = T.unroll if steps <= 16 else T.serial

    @T.prim_func
    def fp8_gemv(Q: T.Tensor((m, k), "float8_e4m3"), SA: T.Tensor((m, kb), "float32"),
                 W: T.Tensor((n, k), "float8_e4m3"), SW: T.Tensor((nb, kb), "uint8"),
                 Y: T.Tensor((m, n), "bfloat16")):
        with T.Kernel(T.ceildiv(n, rows * warps), threads=(32, warps)) as bn:
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            wq = T.alloc_local((rows, _VEC), "float8_e4m3")
            aq = T.alloc_local((_VEC,), "float8_e4m3")
            af = T.alloc_local((_VEC,), "float32")
            acc = T.alloc_local((rows, m), "float32")
            part = T.alloc_local((1,), "float32")
            T.clear(acc)
            for ko in loop(steps):
                k0 = ko * kstep + lane * _VEC
                if k0 < k:
                    for r in T.unroll(rows):
                        row = T.min(bn * rows * warps + warp * rows + r, n - 1)
                        for v in T.vectorized(_VEC):
                            wq[r, v] = W[row, k0 + v]
                    for i in T.unroll(m):
                        for v in T.vectorized(_VEC):
                            aq[v] = Q[i, k0 + v]
                        for v in T.unroll(_VEC):
                            af[v] = T.Cast("float32", aq[v])
                        for r in T.unroll(rows):
                            row = T.min(bn * rows * warps + warp * rows + r, n - 1)
                            part[0] = 0.0
                            for v in T.unroll(_VEC):
                                part[0] += af[v] * T.Cast("float32", wq[r, v])
                            acc[r, i] += part[0] * (SA[i, k0 // 128] * e8m0_bits_to_float(T, SW[row // 128, k0 // 128]))
            for r in T.unroll(rows):
                for i in T.unroll(m):
                    total = T.warp_reduce_sum(acc[r, i])
                    if lane == 0 and bn * rows * warps + warp * rows + r < n:
                        Y[i, bn * rows * warps + warp * rows + r] = T.Cast("bfloat16", total)

    return compile_kernel(fp8_gemv, arch)


def check_fp8_weight(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> None:
    """Raise KernelInputError unless (x, w, w_scale) form a valid FP8 linear on one CUDA device."""
    n, k = w.shape
    if w.dtype != torch.float8_e4m3fn:
        raise KernelInputError(f"fp8_gemm needs an e4m3 weight, got {w.dtype}")
    if x.shape[-1] != k or k % 128:
        raise KernelInputError(f"fp8_gemm: x has {x.shape[-1]} channels, weight [N={n}, K={k}] "
                               "(K must match and be a multiple of 128)")
    if tuple(w_scale.shape) != ((n + 127) // 128, k // 128):
        raise KernelInputError(f"fp8_gemm: scale shape {tuple(w_scale.shape)} != "
                               f"{((n + 127) // 128, k // 128)} for weight [{n}, {k}]")
    if not (x.device == w.device == w_scale.device):
        raise KernelInputError("fp8_gemm: x, weight and scale must be on one device")


def scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (float8_e8m0fnu or uint8) as contiguous uint8 bytes."""
    return scale.contiguous().view(torch.uint8)


def dequant_fp8_bf16(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """FP8 weight -> bf16 [N, K], exactly (e4m3 times a power of two fits bf16)."""
    n, k = w.shape
    s = scale_bytes(w_scale).to(torch.int32) - 127  # [N/128, K/128] exponents
    s = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return torch.ldexp(w.to(torch.bfloat16), s.to(torch.bfloat16))


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16) × FP8 weight [N, K] with e8m0 scales [N/128, K/128] -> bf16 [..., N]."""
    check_fp8_weight(x, w, w_scale)
    n, k = w.shape
    arch = cuda_arch(x.device)
    x2 = x.reshape(-1, k)  # [M, K]
    m = x2.shape[0]
    if m == 0:
        return torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16, device=x.device)
    if m > GEMV_MAX_M:
        q, s = act_quant(x2, 128)
        a = q.to(torch.bfloat16).view(m, k // 128, 128) * s.to(torch.bfloat16).unsqueeze(-1)  # exact
        y = torch.matmul(a.view(m, k), dequant_fp8_bf16(w, w_scale).T)
    else:
        xp = pad_rows_to_bucket(x2)
        q, s = act_quant(xp, 128)
        y = torch.empty(xp.shape[0], n, dtype=torch.bfloat16, device=x.device)
        fp8_gemv_kernel(xp.shape[0], n, k, arch)(q, s, w.contiguous(), scale_bytes(w_scale), y)
        y = y[:m]
    return y.reshape(*x.shape[:-1], n)
