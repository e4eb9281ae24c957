"""FP8 activation quantisation on CUDA (TileLang); same contract as `reference.act_quant`.

Per row and per `block` channels: s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3(clamp(x / s,
±448)). The power of two is read off the bits of amax (448 = 1.75·2^8, so s = 2^(e - 8) when
amax's mantissa is at most 1.75 and 2^(e - 7) above), which avoids a division and gives the
same bits as the reference. Multiplying by 1/s is exact, and the fp32 -> e4m3 conversion
rounds to nearest even as torch does, so q and s match the reference exactly.

This module also holds the per-device helpers that the other TileLang kernel modules share
(`cuda_arch`, `compile_kernel`). TileLang is imported inside functions only: importing this
module on a CPU-only machine imports nothing GPU-related. (No `from __future__ import annotations` here: TileLang evaluates the kernel
signatures' annotations, which name local variables.)
"""

import functools

import torch

from kernels import pdl, reference as ref

# Groups (rows of `block` channels) per CTA of 128 threads, per compute capability.
# sm_90 (H100/H200) is tested; sm_121 (GB10, ~99 KB shared memory per block) is untested.
TILE_PARAMS = {
    (9, 0): {"elems_per_cta": 1024, "threads": 128},
    (12, 1): {"elems_per_cta": 1024, "threads": 128},
}
DEFAULT_TILE = {"elems_per_cta": 1024, "threads": 128}

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def pad_rows_to_bucket(x2: torch.Tensor) -> torch.Tensor:
    """Zero rows appended up to the next power of two: GEMV kernels are compiled per row count,
    so buckets (1, 2, 4, 8, 16) bound the variants a prefill can trigger. Rows are independent,
    so the padding changes no result."""
    m = x2.shape[0]
    bucket = 1 << (m - 1).bit_length()
    return x2 if bucket == m else torch.cat((x2, x2.new_zeros(bucket - m, x2.shape[1])))


class KernelInputError(ValueError):
    """An input a TileLang kernel cannot take (wrong device, dtype or shape)."""


def cuda_arch(device: torch.device) -> tuple[int, int]:
    """Compute capability of a CUDA device, e.g. (9, 0) for an H200."""
    if device.type != "cuda":
        raise KernelInputError(f"TileLang kernels need CUDA tensors, got a tensor on {device}; "
                               "use the torch backend on the CPU")
    return torch.cuda.get_device_capability(device)


def tile_params(table: dict, arch: tuple[int, int], default: dict) -> dict:
    """The tile sizes of `table` for `arch` (unknown architectures get `default`)."""
    return table.get(tuple(arch), default)


# TileLang guards every load whose index it cannot bound (a slot read from a table, a dynamic
# row count) with a branch; the GEMVs whose indices are in range by their callers' contract
# compile without, so that their unrolled K loops are straight-line code in which the compiler
# can issue later steps' loads before earlier steps' arithmetic.
UNGUARDED = {"tl.disable_safe_memory_legalize": True}


def compile_kernel(func, arch: tuple[int, int], out_idx=None, pass_configs: dict | None = None):
    """Compile a TileLang PrimFunc for `arch` = (major, minor)."""
    import tilelang

    target = {"kind": "cuda", "arch": f"sm_{arch[0]}{arch[1]}" + ("a" if arch[0] >= 9 else "")}
    return tilelang.compile(func, out_idx=out_idx, target=target, pass_configs=pass_configs)


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """t contiguous on a 16-byte aligned base, which the kernels' 16-byte loads need (a
    misaligned view is copied)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def fp32_call(T, name: str, *args):
    """A call of the CUDA fp32 function `name` as a TileLang expression (e.g. `__fmul_rn`: a
    product rounded on its own, which nvcc may not contract into an FMA)."""
    return T.call_extern("float32", name, *args)


def pow2_scale_bits(T, amax):
    """(s, 1/s) as fp32 powers of two with s = 2^ceil(log2(max(amax, 1e-4) / 448)) (TileLang expr)."""
    bits = T.reinterpret(T.max(amax, T.float32(1e-4)), "uint32")
    # e4m3 max 448 = 1.75 * 2^8: mantissa above 0.75 (0x600000) needs one more power of two.
    e = (bits >> T.uint32(23)) - T.uint32(8) + T.Cast("uint32", (bits & T.uint32(0x7FFFFF)) > T.uint32(0x600000))
    s = T.reinterpret(e << T.uint32(23), "float32")
    inv = T.reinterpret((T.uint32(254) - e) << T.uint32(23), "float32")
    return s, inv


@functools.cache
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
    if x.dtype not in _TORCH_TO_TL:
        raise KernelInputError(f"act_quant takes bf16, fp16 or fp32 input, got {x.dtype}")
    arch = cuda_arch(x.device)
    xg = x.contiguous().reshape(-1, block)  # [G, block]: one row per scale group
    q = torch.empty(xg.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(xg.shape[0], dtype=torch.float32, device=x.device)
    if xg.shape[0]:
        act_quant_kernel(block, _TORCH_TO_TL[x.dtype], arch)(xg, q, s)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], k // block)


def qdq8(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """FP8 storage simulation: the contract of `reference.qdq8`, quantised by this module's kernel
    (the same q and s bits as the reference), dequantised exactly (q times a power of two)."""
    q, s = act_quant(x, block)
    return ref.act_dequant(q, s, block).to(x.dtype)
