"""FP4 weights read from expert-arena rows, dequantised exactly to bf16 on CUDA (TileLang); the
contract of `reference.fp4_dequant_slots`.

arena uint8 [S, R], slots [G] int32 -> bf16 [G, P·n, k]: part p of group g is the weight [n, k/2]
(packed e2m1, kernels/reference.py's record order) at byte w_offs[p] of arena row slots[g], times
its 1×32 e8m0 scales [n, k/32] at byte s_offs[p]. Every value is exact in bf16 (an e2m1 value has
at most two significant bits; the scale is a power of two), so the output equals the reference
bit for bit.

One pass over memory: a thread reads one word (8 codes) and its scale byte straight from the
arena row and writes its 8 bf16 values, so prefill's bf16 GEMMs
(kernels/fp4_moe.py: `fp4_moe_dequantized`) pay 5 bytes of traffic per weight byte instead of the
reference's ~20 (widened indices, a lookup, a multiply). Memory-bound by design; sm_90 tested.
"""

import torch

from kernels.lowbit import e8m0_bits_to_float
from kernels.toolkit import (UNGUARDED, KernelInputError, check_fp4_parts, compile_kernel, cuda_arch,
                             kernel_factory)

THREADS = 256


def _e2m1(T, mag, sign):
    """The fp32 value of an e2m1 code given as its 3 magnitude bits and its sign bit (int32
    expressions): 0, 0.5, 1, 1.5, 2, 3, 4, 6, negated when the sign is set (-0 for code 8)."""
    # magnitudes 2..7 are (2 + m) · 2^(e-1) / 2 with e = mag >> 1, m = mag & 1; 0 and 1 are mag / 2
    big = (2 + (mag & 1)) << T.max((mag >> 1) - 1, 0)
    v = T.Cast("float32", T.if_then_else(mag < 2, mag, big)) * T.float32(0.5)
    return T.if_then_else(sign == 1, -v, v)


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
            t = T.get_thread_binding(0)
            y = T.alloc_local((8,), "bfloat16")
            i = bx * THREADS + t  # this thread's word of the part: row i // kw, word i % kw
            if i < per_part:
                slot = SLOT[g]
                row, col = i // kw, i % kw
                word = WA[slot, w_off[0] // 4 + part * w_step + i]
                scale = e8m0_bits_to_float(T, SWA[slot, s_off[0] + part * s_step + row * kg + col // 4])
                for j in T.unroll(4):  # byte j: element 2j (sign bit 7, magnitude bits 1..3), 2j+1 (4..6, 0)
                    b = (word >> (8 * j)) & 0xFF
                    y[2 * j] = T.Cast("bfloat16", _e2m1(T, (b >> 1) & 7, b >> 7) * scale)
                    y[2 * j + 1] = T.Cast("bfloat16", _e2m1(T, (b >> 4) & 7, b & 1) * scale)
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
