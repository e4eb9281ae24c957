"""FP4 weights read from expert-arena rows, dequantised exactly to bf16 on CUDA (TileLang); the
contract of `reference.fp4_dequant_slots`.

arena uint8 [S, R], slots [G] int32 -> bf16 [G, P·n, k]: part p of group g is the weight [n, k/2]
(packed e2m1, kernels/reference.py's record order) at byte w_offs[p] of arena row slots[g], times
its 1×32 e8m0 scales [n, k/32] at byte s_offs[p]. Every value is exact in bf16 (an e2m1 value has
at most two significant bits; the scale is a power of two), so the output equals the reference
bit for bit.

One pass over memory: a thread reads one word (8 codes) and its scale byte straight from the
arena row, decodes it with kernels/lowbit.py's bit moves (9 integer instructions for 8 codes)
and writes its 8 bf16 values, so prefill's bf16 GEMMs
(kernels/fp4_moe.py: `fp4_moe_dequantized`) pay 5 bytes of traffic per weight byte instead of the
reference's ~20 (widened indices, a lookup, a multiply). Memory-bound by design; sm_90 tested.
"""

import torch

from kernels import lowbit
from kernels.toolkit import (UNGUARDED, KernelInputError, check_fp4_parts, compile_kernel, cuda_arch,
                             kernel_factory)

THREADS = 256


SOURCE = r"""
#include <cuda_bf16.h>

// 8 e2m1 codes (one word, record order) times `scale` -> y[0..7] bf16: lowbit's bit moves give
// each code as an fp16 times 2^-14 (exact), widened to fp32, times 2^14 and the scale (single
// products, exact unless the scale itself is out of range, as in the reference).
__device__ __forceinline__ void dsv4_e2m1x8_to_bf16(int w, float scale, void* out) {
  unsigned h[4];
  dsv4_e2m1x8_to_f16x2((unsigned)w, h);
  __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(out);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    float2 f = __half22float2(*reinterpret_cast<__half2*>(&h[p]));
    y[p] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(f.x, 16384.f), scale));
    y[p + 4] = __float2bfloat16_rn(__fmul_rn(__fmul_rn(f.y, 16384.f), scale));
  }
}
"""


@kernel_factory
def fp4_dequant_kernel(n: int, k: int, w_off: tuple[int, ...], s_off: tuple[int, ...], arch: tuple[int, int]):
    """(WA [Sw, w_stride/4] int32 and SWA [Ss, s_stride] uint8: the same arena, SLOT [G] int32,
    Y [G, P·n, k] bf16); part p reads the weight at byte w_off[p] and the scales at s_off[p] of row
    SLOT[g] (offsets evenly spaced, the weight's 16-byte aligned). A thread per weight word: it
    reads one int32 (8 codes) and its scale byte and writes 8 bf16 values as one 16-byte store,
    so a warp's loads and its stores are each one contiguous span. Unguarded: slots must be
    below the arena's rows, as the caller checks."""
    import tilelang.language as T

    parts, kw, kg = len(w_off), k // 8, k // 32  # int32 words and scale groups per row
    w_step = (w_off[1] - w_off[0]) // 4 if parts > 1 else 0  # in int32 words
    s_step = s_off[1] - s_off[0] if parts > 1 else 0
    per_part = n * kw
    groups, wslots, sslots = T.dynamic("groups"), T.dynamic("wslots"), T.dynamic("sslots")
    w_stride, s_stride = T.dynamic("w_stride"), T.dynamic("s_stride")

    @T.prim_func
    def fp4_dequant_words(WA: T.Tensor((wslots, w_stride), "int32"), SWA: T.Tensor((sslots, s_stride), "uint8"),
                          SLOT: T.Tensor((groups,), "int32"), Y: T.Tensor((groups, parts * n, k), "bfloat16")):
        with T.Kernel(T.ceildiv(per_part, THREADS), groups, parts, threads=THREADS) as (bx, g, part):
            lowbit.import_source(T, SOURCE)
            t = T.get_thread_binding(0)
            y = T.alloc_local((8,), "bfloat16")
            i = bx * THREADS + t  # this thread's word of the part: row i // kw, word i % kw
            if i < per_part:
                slot = SLOT[g]
                row, col = i // kw, i % kw
                word = WA[slot, w_off[0] // 4 + part * w_step + i]
                scale = lowbit.e8m0_bits_to_float(T, SWA[slot, s_off[0] + part * s_step + row * kg + col // 4])
                T.evaluate(T.call_extern("handle", "dsv4_e2m1x8_to_bf16", word, scale, T.address_of(y[0])))
                for v in T.vectorized(8):
                    Y[g, part * n + row, col * 8 + v] = y[v]

    return compile_kernel(fp4_dequant_words, arch, pass_configs=UNGUARDED)


def fp4_dequant_slots(arena: torch.Tensor, w_offs: tuple[int, ...], s_offs: tuple[int, ...], n: int, k: int,
                      slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.fp4_dequant_slots` on CUDA: arena uint8 [S, R] (R a multiple of 16), slots [G]
    int32 on its device -> bf16 [G, P·n, k] (into `out`, contiguous, when given), one launch."""
    parts = len(w_offs)
    if arena.dtype != torch.uint8 or arena.dim() != 2 or arena.shape[1] % 16 or not arena.is_contiguous():
        raise KernelInputError("fp4_dequant_slots: the arena must be contiguous uint8 [slots, bytes] with rows "
                               "a multiple of 16 bytes")
    if parts == 0 or len(s_offs) != parts or k % 32 or n < 1:
        raise KernelInputError(f"fp4_dequant_slots: need one scale offset per weight offset and K a multiple of "
                               f"32, got {len(w_offs)} / {len(s_offs)} offsets, n={n}, k={k}")
    steps = {b - a for a, b in zip(w_offs, w_offs[1:])}, {b - a for a, b in zip(s_offs, s_offs[1:])}
    if len(steps[0]) > 1 or len(steps[1]) > 1:
        raise KernelInputError("fp4_dequant_slots: the parts' offsets must be evenly spaced")
    check_fp4_parts("fp4_dequant_slots", arena.shape[1], w_offs, arena.shape[1], s_offs, n, k)
    if slots.dtype != torch.int32 or slots.dim() != 1 or slots.device != arena.device:
        raise KernelInputError(f"fp4_dequant_slots: slots must be int32 [G] on the arena's device, got "
                               f"{slots.dtype} {tuple(slots.shape)} on {slots.device}")
    shape = (slots.shape[0], parts * n, k)
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.bfloat16 or not out.is_contiguous()
                            or out.device != arena.device):
        raise KernelInputError(f"fp4_dequant_slots: out must be contiguous bf16 {list(shape)} on the arena's "
                               f"device, got {out.dtype} {tuple(out.shape)}")
    y = torch.empty(shape, dtype=torch.bfloat16, device=arena.device) if out is None else out
    if slots.shape[0]:
        fp4_dequant_kernel(n, k, tuple(w_offs), tuple(s_offs), cuda_arch(arena.device))(
            arena.view(torch.int32), arena, slots, y)
    return y
