"""FP4 routed-expert GEMMs on CUDA (TileLang); `fp4_gemm` has the contract of `reference.fp4_gemm`.

y = act_quant(x) · W^T with W [N, K] stored as packed e2m1 codes [N, K/2] (two a byte, in
kernels/reference.py's record order) and 1×32 e8m0 scales [N, K/32]; fp32 accumulation, bf16
output (spec §B.4).

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
For more than GEMV_MAX_M rows, `fp4_gemm` dequantises exactly to bf16 and uses cuBLAS; `fp4_moe` in
prefill dequantises its experts in one launch (kernels/fp4_dequant.py) and runs one grouped bf16
GEMM per linear over the cells grouped by expert (`fp4_moe_dequantized`). Where
kernels/fp4_mma_few_tokens.py lists the architecture and supports the launch (MMA_MIN_M to 16 rows), the
grouped GEMV runs on the tensor cores instead, with the same contract; so does a one-row launch
where kernels/fp4_mma_one_token.py lists it.

Tile sizes per compute capability are in TILE_PARAMS; sm_90 is tested. sm_121 (GB10, FP4 tensor
cores, ~99 KB shared memory per block) runs this same CUDA-core path and is untested.
"""


import torch
import torch.nn.functional as F

from kernels import fp4_mma_few_tokens, fp4_mma_one_token, lowbit, pdl
from kernels.act_quant import act_quant
from kernels.fp8_dequant import fp8_dequant_bf16
from kernels.fp4_dequant import fp4_dequant_slots
from kernels.toolkit import (TORCH_TO_TL, UNGUARDED, KernelInputError, check_fp4_parts, compile_kernel, cuda_arch,
                             kernel_factory, pad_rows_to_bucket, tile_params)
from kernels import reference as ref
from kernels.gemv import as_words, gemv_rows
from kernels.swiglu_quant import swiglu_quant

GEMV_MAX_M = 16
# Rows per warp shrink (gemv_tile) until the launch has >= 256 CTAs: at one token, counting every
# group and part (H200, decode's six experts' w1+w3: 19.84 us at 4 rows x 4 warps against 21.27
# at 2 x 4); with more tokens per row (rows x tokens accumulators), one group's (sm_90 sends those
# to kernels/fp4_mma_few_tokens.py). The sweep: docs/performance-log.md.
TILE_PARAMS = {
    (9, 0): {"rows": 4, "warps": 4},
    (12, 1): {"rows": 2, "warps": 4},
}
DEFAULT_TILE = {"rows": 2, "warps": 4}
_VEC = 16  # packed bytes per lane per step = 32 channels = one scale group


@kernel_factory
def fp4_gemv_kernel(m: int, n: int, k: int, w_stride: int, w_off: tuple[int, ...], s_stride: int,
                    s_off: tuple[int, ...], rows: int, warps: int, out_dtype: str, arch: tuple[int, int],
                    lookup: bool = False):
    """Grouped FP4 GEMV, `rows` rows per warp and `warps` warps per CTA, over P = len(w_off) parts.

    (Q [A,m,k/4] int32 = e4m3 codes, SA [A,m,k/128] fp32 with A = G, or A = 1 for activations
    shared by every group, WA [Sw, w_stride/4] int32, SWA [Ss, s_stride]
    u8, SLOT [G] int32, Y [P,G,m,n] out_dtype): part p of group g uses the n*k/2 bytes at byte w_off[p]
    of row SLOT[g] of WA as W [n, k/2] (packed e2m1) and the n*k/32 bytes at s_off[p] of row SLOT[g]
    of SWA as its scales (e.g. an expert's w1 and w3 on the same activations: one launch; the offsets
    must be evenly spaced, w_off's by a multiple of 16 bytes). Outputs
    are rounded to bf16; an fp32 `out_dtype` stores them widened (what the MoE sums).
    `lookup`: SLOT is replaced by TABLE [E] int32 and IDS [G] int64, and group g reads slot
    max(TABLE[IDS[g]], 0) (a layer's slot table and the routed expert ids: no lookup launches).
    Compiled without TileLang's bounds guards (`UNGUARDED`): ids must be below E and slots
    below the arena's rows, as the callers guarantee.
    """
    import tilelang.language as T

    kstep = 32 * 2 * _VEC
    steps = (k + kstep - 1) // kstep
    kw, kg = k // 8, k // 32  # int32 words per weight row, scale groups per row
    parts = len(w_off)
    loop = T.unroll if steps <= 16 else T.serial
    groups, wslots, sslots = T.dynamic("groups"), T.dynamic("wslots"), T.dynamic("sslots")
    agroups = T.dynamic("agroups")  # activation groups: G, or 1 when every group reads the same
    entries = T.dynamic("entries")  # slot-table entries (lookup)

    @T.macro
    def body(Q, SA, WA, SWA, Y, slot, bn, g, part):
        lowbit.import_source(T)
        lane = T.get_thread_binding(0)
        warp = T.get_thread_binding(1)
        wq = T.alloc_local((rows, _VEC // 4), "int32")
        wsc = T.alloc_local((rows,), "uint8")
        aq = T.alloc_local((2 * _VEC // 4,), "int32")
        af = T.alloc_local((2 * _VEC,), "float32")
        acc = T.alloc_local((rows, m), "float32")
        ga = T.min(g, agroups - 1)
        w_off_w = fp4_mma_few_tokens.part_offset(part, [o // 4 for o in w_off])  # in int32 words
        s_off_p = fp4_mma_few_tokens.part_offset(part, list(s_off))
        T.clear(acc)
        for ko in loop(steps):
            k0 = ko * kstep + lane * 2 * _VEC  # this lane's 32 channels = 16 bytes = 4 words
            # without a guard (k whole steps) the unrolled steps are one basic block, so that
            # the compiler may issue the later steps' loads before the first step's arithmetic
            if steps * kstep == k or k0 < k:
                for r in T.unroll(rows):
                    row = T.min(bn * rows * warps + warp * rows + r, n - 1)
                    for v in T.vectorized(_VEC // 4):
                        wq[r, v] = WA[slot, w_off_w + row * kw + k0 // 8 + v]
                    wsc[r] = SWA[slot, s_off_p + row * kg + k0 // 32]
                for i in T.unroll(m):
                    for v in T.vectorized(2 * _VEC // 4):
                        aq[v] = Q[ga, i, k0 // 4 + v]
                    lowbit.e4m3x16_to_f32(T, aq[0], af[0])
                    lowbit.e4m3x16_to_f32(T, aq[_VEC // 4], af[_VEC])
                    for r in T.unroll(rows):
                        # activations decode to value * 2^-8, weights to value * 2^-14
                        scale = SA[ga, i, k0 // 128] * lowbit.e8m0_bits_to_float(
                            T, wsc[r], lowbit.E4M3_SHIFT + lowbit.E2M1_SHIFT)
                        acc[r, i] += lowbit.dot_e2m1x32(T, wq[r, 0], af[0]) * scale
        for r in T.unroll(rows):
            for i in T.unroll(m):
                total = T.warp_reduce_sum(acc[r, i])
                if lane == 0 and bn * rows * warps + warp * rows + r < n:
                    Y[part, g, i, bn * rows * warps + warp * rows + r] = T.Cast(
                        out_dtype, T.Cast("bfloat16", total))

    if lookup:
        @T.prim_func
        def fp4_gemv(Q: T.Tensor((agroups, m, k // 4), "int32"), SA: T.Tensor((agroups, m, k // 128), "float32"),
                     WA: T.Tensor((wslots, w_stride // 4), "int32"), SWA: T.Tensor((sslots, s_stride), "uint8"),
                     TABLE: T.Tensor((entries,), "int32"), IDS: T.Tensor((groups,), "int64"),
                     Y: T.Tensor((parts, groups, m, n), out_dtype)):
            with T.Kernel(T.ceildiv(n, rows * warps), groups, parts, threads=(32, warps)) as (bn, g, part):
                pdl.begin(T, arch)  # before the slot is read: a kernel before wrote it
                body(Q, SA, WA, SWA, Y, T.max(TABLE[IDS[g]], 0), bn, g, part)
    else:
        @T.prim_func
        def fp4_gemv(Q: T.Tensor((agroups, m, k // 4), "int32"), SA: T.Tensor((agroups, m, k // 128), "float32"),
                     WA: T.Tensor((wslots, w_stride // 4), "int32"), SWA: T.Tensor((sslots, s_stride), "uint8"),
                     SLOT: T.Tensor((groups,), "int32"), Y: T.Tensor((parts, groups, m, n), out_dtype)):
            with T.Kernel(T.ceildiv(n, rows * warps), groups, parts, threads=(32, warps)) as (bn, g, part):
                pdl.begin(T, arch)  # before the slot is read: a kernel before wrote it
                body(Q, SA, WA, SWA, Y, SLOT[g], bn, g, part)

    return compile_kernel(fp4_gemv, arch, pass_configs=UNGUARDED)


# Prefill (`fp4_moe` on at least GROUPED_MIN_CELLS cells, GROUPED_MIN_PER_EXPERT or more per
# expert) runs on the tensor cores (`fp4_moe_dequantized`); fewer cells run the grouped GEMV.
GROUPED_MIN_CELLS = 128
GROUPED_MIN_PER_EXPERT = 16
# Experts whose bf16 weights are held at once by `fp4_moe_dequantized` (2·inter·dim·2 bytes each for
# w1|w3, then half that for w2): one grouped GEMM covers a layer of the 24-expert pack.
EXPERTS_PER_DEQUANT = 32


def gemv_tile(n: int, arch: tuple[int, int], gemvs: int = 1) -> tuple[int, int]:
    """(rows per warp, warps per CTA) of the FP4 GEMV for N output rows on `arch`, where one
    launch runs `gemvs` such GEMVs side by side (groups times parts)."""
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    return gemv_rows(n * gemvs, p), p["warps"]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _check(x: torch.Tensor, n: int, k: int, what: str) -> None:
    if x.shape[-1] != k or k % 128:
        raise KernelInputError(f"{what}: x has {x.shape[-1]} channels, weight has K={k} "
                               "(K must match and be a multiple of 128)")
    if n < 1:
        raise KernelInputError(f"{what}: weight has no rows")


def _check_arena(wb: torch.Tensor, w_offs, sb: torch.Tensor, s_offs, n: int, k: int, slots: torch.Tensor,
                 g: int, table: torch.Tensor | None = None) -> None:
    check_fp4_parts("fp4_gemm_grouped", wb.shape[1], w_offs, sb.shape[1], s_offs, n, k)
    want = torch.int32 if table is None else torch.int64  # slots, or expert ids looked up in table
    if slots.dtype != want or slots.shape != (g,):
        raise KernelInputError(f"fp4_gemm_grouped: {'slots' if table is None else 'expert ids'} must be {want} "
                               f"[{g}], got {slots.dtype} {tuple(slots.shape)}")
    if table is not None and (table.dtype != torch.int32 or table.dim() != 1):
        raise KernelInputError(f"fp4_gemm_grouped: the slot table must be int32 [E], got {table.dtype} "
                               f"{tuple(table.shape)}")


def grouped_gemv(q: torch.Tensor, s: torch.Tensor, w_arena: torch.Tensor, w_offs: tuple, s_arena: torch.Tensor,
                 s_offs: tuple, n: int, k: int, slots: torch.Tensor, out_dtype: torch.dtype,
                 table: torch.Tensor | None = None, early: bool = False) -> torch.Tensor:
    """The grouped GEMV on quantised activations q [A, M, K] e4m3, s [A, M, K/128] (A = G, or 1 for
    all groups) over the parts (w_offs[p], s_offs[p]) of each slot's arena rows -> [P, G, M, N].
    With `table` [E] int32, `slots` are expert ids (int64) and group g reads slot max(table[id], 0).
    `early`: the kernel may read slots, ids and weights before its predecessor completes (see
    kernels/fp4_mma_one_token.py; the kernel launched just before must not write them)."""
    g, m = slots.shape[0], q.shape[1]
    wb, sb = _as_bytes(w_arena), _as_bytes(s_arena)
    _check_arena(wb, w_offs, sb, s_offs, n, k, slots, g, table)
    y = torch.empty(len(w_offs), g, m, n, dtype=out_dtype, device=q.device)
    if g:
        arch = cuda_arch(q.device)
        where = (slots,) if table is None else (table.contiguous(), slots.contiguous())
        one, few = fp4_mma_one_token, fp4_mma_few_tokens
        if m == 1 and arch in one.MMA_ARCHS and one.supports(k, tuple(s_offs), sb.shape[1]):
            tiles, ksplit, depth = one.mma_tile(k)
            kernel = one.fp4_mma_one_token_kernel(n, k, wb.shape[1], tuple(w_offs), sb.shape[1], tuple(s_offs),
                                                  tiles, ksplit, TORCH_TO_TL[out_dtype], arch, table is not None,
                                                  early, depth)
            kernel(as_words(q), s, as_words(wb), as_words(sb), *where, y)
        elif arch in few.MMA_ARCHS and m >= few.MMA_MIN_M and few.supports(m, k, tuple(s_offs), sb.shape[1]):
            kernel = few.fp4_mma_few_tokens_kernel(m, n, k, wb.shape[1], tuple(w_offs), sb.shape[1], tuple(s_offs),
                                                   *few.mma_tile(k), TORCH_TO_TL[out_dtype], arch, table is not None)
            kernel(as_words(q), s, as_words(wb), as_words(sb), *where, y)
        else:
            gemvs = g * len(w_offs) if m == 1 else 1  # see TILE_PARAMS
            kernel = fp4_gemv_kernel(m, n, k, wb.shape[1], tuple(w_offs), sb.shape[1], tuple(s_offs),
                                     *gemv_tile(n, arch, gemvs), TORCH_TO_TL[out_dtype], arch, table is not None)
            kernel(as_words(q), s, as_words(wb), sb, *where, y)
    return y


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
    if x3.shape[1] > GEMV_MAX_M:
        raise KernelInputError(f"fp4_gemm_grouped takes at most {GEMV_MAX_M} rows per group, got {x3.shape[1]}")
    q, s = act_quant(x3, 128)
    y = grouped_gemv(q, s, w_arena, (w_off,), s_arena, (s_off,), n, k, slots, torch.bfloat16)[0]
    return y[:, 0] if squeeze else y


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
        y = torch.matmul(fp8_dequant_bf16(*act_quant(x2, 128), 1, 128), ref.dequant_fp4_bf16(w, w_scale).T)
    else:
        slot0 = torch.zeros(1, dtype=torch.int32, device=x.device)
        y = fp4_gemm_grouped(pad_rows_to_bucket(x2).unsqueeze(0), _as_bytes(w).reshape(1, -1), 0,
                             _as_bytes(w_scale).reshape(1, -1), 0, n, k, slot0)[0, :m]
    return y.reshape(*x.shape[:-1], n)


def fp4_moe(x: torch.Tensor, arena: torch.Tensor, fields: dict, slots: torch.Tensor, weights: torch.Tensor,
            limit: float, groups: list | None = None, rows: torch.Tensor | None = None, run: int = 1) -> torch.Tensor:
    """Routed experts read from arena slots: the contract of `reference.fp4_moe` (x [G, D], or the
    tokens [N, D] with rows [G]; arena uint8 [slots, record_bytes], fields, slots [G], routing
    weights [G] -> bf16 [G, D]). Quantises x (once when its rows are one broadcast row; each token
    once with `rows`, its k cells then gathered); then a prefill's many cells per expert go to the
    tensor cores (`fp4_moe_dequantized`), the rest to the grouped GEMV (`fp4_moe_quantized`).

    `groups`, from a caller that knows how its cells spread over the experts: the cells are
    already grouped by expert and `groups` are their `expert_groups` (the tensor cores, no host
    synchronisation), or [] (the grouped GEMV). None: decided here, at one host synchronisation
    for a prefill (`expert_spans`). `run` > 1 (with `groups` []): the cells come in runs of `run`
    consecutive cells that share their slot (a chunk step's cells per expert, engine/moe.py
    `ExpertRuns`), and each run reads its expert once (`fp4_moe_quantized`)."""
    _check(x, fields["w2.weight"].shape[0], fields["w1.weight"].shape[1] * 2, "fp4_moe")
    g = slots.shape[0]
    if rows is not None and (rows.dim() != 1 or rows.shape[0] != g or rows.dtype != torch.int64):
        raise KernelInputError(f"fp4_moe: rows must be int64 [{g}] (a token row per cell), got {rows.dtype} "
                               f"{tuple(rows.shape)}")
    if run < 1 or g % run or (run > 1 and groups):
        raise KernelInputError(f"fp4_moe: {g} cells do not come in runs of {run} (a run of cells sharing a slot "
                               "takes the grouped GEMV: groups must be [])")
    xa = x[:1] if x.shape[0] and x.stride(0) == 0 else x  # an expanded row: quantise it once
    q, s = act_quant(xa, 128)
    if groups:
        return fp4_moe_dequantized(q, s, arena, fields, None, groups, weights, limit, swiglu_quant,
                                   fp4_dequant_slots, rows, fp8_dequant_bf16)
    if rows is not None:
        q, s = q.index_select(0, rows), s.index_select(0, rows)
    if groups is None and q.shape[0] == g >= GROUPED_MIN_CELLS:  # prefill: are there enough cells per expert?
        order, spans = expert_spans(slots)
        if dense(g, len(spans)):
            return fp4_moe_dequantized(q, s, arena, fields, order, expert_groups(spans, q.device), weights, limit,
                                       swiglu_quant, fp4_dequant_slots, dequant_act=fp8_dequant_bf16)
    return fp4_moe_quantized(q, s, arena, fields, slots, weights, limit, run=run).to(torch.bfloat16)  # exact


def dense(cells: int, experts: int) -> bool:
    """Whether `cells` (token, choice) cells over `experts` distinct experts go to the tensor cores
    (`fp4_moe_dequantized`: a fixed dequantisation per expert, paid back by enough cells each)."""
    return cells >= GROUPED_MIN_CELLS and cells >= GROUPED_MIN_PER_EXPERT * experts


def expert_spans(slots: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The cells of `slots` [G] grouped by slot: (order [G] int64, the cell indices sorted by
    slot (stable), [(slot, start, count)] over the sorted cells). One host synchronisation."""
    order = torch.argsort(slots, stable=True)
    uniq, counts = torch.unique_consecutive(slots.index_select(0, order), return_counts=True)
    spans, start = [], 0
    for slot, n in torch.stack((uniq.long(), counts.long())).T.tolist():
        spans.append((slot, start, n))
        start += n
    return order, spans


def expert_groups(spans: list[tuple[int, int, int]], device: torch.device,
                  experts_per_group: int = EXPERTS_PER_DEQUANT) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """What `fp4_moe_dequantized` runs from host-known spans [(slot, first cell, cells)] of
    consecutive cells: per group of up to `experts_per_group` experts (first cell, end cell, slots
    [E] int32, cumulative cell ends within the group [E] int32), on `device` (copies that do not
    wait for the device)."""
    groups = []
    for i in range(0, len(spans), experts_per_group):
        group = spans[i:i + experts_per_group]
        c0 = group[0][1]
        ends = [start + n - c0 for _, start, n in group]
        meta = torch.tensor([[slot for slot, _, _ in group], ends], dtype=torch.int32).to(device, non_blocking=True)
        groups.append((c0, c0 + ends[-1], meta[0], meta[1]))
    return groups


def fp4_moe_dequantized(q: torch.Tensor, s: torch.Tensor, arena: torch.Tensor, fields: dict,
                        order: torch.Tensor | None, groups: list[tuple[int, int, torch.Tensor, torch.Tensor]],
                        weights: torch.Tensor, limit: float, quantize_h=ref.swiglu_quant,
                        dequant=ref.fp4_dequant_slots, rows: torch.Tensor | None = None,
                        dequant_act=ref.fp8_dequant_bf16) -> torch.Tensor:
    """`fp4_moe_quantized` for many cells per expert (prefill), on the tensor cores: q [G, D] e4m3,
    s [G, D/128], weights [G] -> bf16 [G, D] (w2's outputs, not widened) in the cells' order;
    with `rows` [G], q and s are the tokens' [N, ...] and cell g reads row rows[g] (each token's
    activations dequantised once, then gathered).

    The cells in `order` (None: as given) are grouped by expert: `groups` [(first cell, end cell,
    slots [E] int32, cumulative cell ends [E] int32)] cover them (`expert_groups`; an expert
    with no cells is an empty span). Per group, its experts' weights are dequantised exactly to
    bf16 from the arena (`dequant`: the backend's fp4_dequant_slots, or the reference's; w1 and
    w3 stacked), then one grouped bf16 GEMM with fp32 accumulation and bf16 output
    (`torch.nn.functional.grouped_mm`, each expert on its cells' exact FP8 activations) for
    w1|w3 and one for w2 (the reference's rounding, its sums in another order); w2's input
    through `quantize_h` (the backend's swiglu_quant, or the reference's), as decode does; each
    GEMM's FP8 activations widened to bf16 by `dequant_act` (the backend's fp8_dequant_bf16, or
    the reference's). Runs on any device."""
    dim = q.shape[1]
    inter = fields["w1.weight"].shape[0]
    off = {name: f.offset for name, f in fields.items()}
    a = dequant_act(q, s, 1, 128)
    if rows is not None:
        a = a.index_select(0, rows)
    if order is not None:
        a, weights = a.index_select(0, order), weights.index_select(0, order)
    # one buffer of a fixed size for every group's weights, w1|w3 then w2 (the caching allocator
    # reuses one block from call to call instead of blocks of every expert count)
    if max(slots.shape[0] for _, _, slots, _ in groups) > EXPERTS_PER_DEQUANT:
        raise KernelInputError(f"fp4_moe_dequantized: a group has more than {EXPERTS_PER_DEQUANT} experts "
                               "(EXPERTS_PER_DEQUANT, what the memory plan reserves)")
    buf = torch.empty(EXPERTS_PER_DEQUANT * 2 * inter * dim, dtype=torch.bfloat16, device=q.device)

    def weights_of(slots: torch.Tensor, names: tuple[str, ...], n: int, k: int) -> torch.Tensor:
        out = buf[:slots.shape[0] * len(names) * n * k].view(slots.shape[0], len(names) * n, k)
        return dequant(arena, tuple(off[f"{x}.weight"] for x in names), tuple(off[f"{x}.scale"] for x in names),
                       n, k, slots, out=out)

    def grouped(x: torch.Tensor, names: tuple[str, ...], n: int, k: int) -> torch.Tensor:
        """x's cells times their experts' weights `names` ([n, k] each): [G, len(names)·n] bf16."""
        outs = [F.grouped_mm(x[c0:c1], weights_of(slots, names, n, k).transpose(1, 2), offs=ends)
                for c0, c1, slots, ends in groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    gu = grouped(a, ("w1", "w3"), inter, dim)  # [gate | up] per cell
    del a
    hq, hs = quantize_h(gu[:, :inter], gu[:, inter:], weights.float(), limit)
    del gu
    y = grouped(dequant_act(hq, hs, 1, 128), ("w2",), dim, inter)
    if order is None:
        return y
    return torch.empty_like(y).index_copy_(0, order, y)


def fp4_moe_quantized(q: torch.Tensor, s: torch.Tensor, arena: torch.Tensor, fields: dict, slots: torch.Tensor,
                      weights: torch.Tensor, limit: float, table: torch.Tensor | None = None,
                      early: bool = False, run: int = 1) -> torch.Tensor:
    """`fp4_moe` on activations quantised by act_quant, as `reference.fp4_moe_quantized` (q [A, D]
    e4m3, s [A, D/128], A = G or 1 for every slot; with `table`, slots are expert ids looked up in
    the kernels). Three launches for all G: w1 and w3 of every expert in one GEMV, SwiGLU +
    weighting + w2's activation quantisation in one kernel (kernels/swiglu_quant.py), w2 (its
    bf16-rounded outputs stored as fp32). `early`: the kernel launched just before this call does
    not write slots, table or arena, so w1+w3 may read them (and the weights) before it completes;
    w2 always may (the kernel just before it, swiglu_quant, writes none of them). `run` > 1: runs
    of `run` consecutive cells share their slot (q [G, D], no table), and each run is one group of
    `run` rows of the grouped GEMVs: its expert read once."""
    _check(q, fields["w2.weight"].shape[0], fields["w1.weight"].shape[1] * 2, "fp4_moe_quantized")
    g = slots.shape[0]
    if q.dim() != 2 or q.shape[0] not in (1, g) or tuple(s.shape) != (q.shape[0], q.shape[1] // 128):
        raise KernelInputError(f"fp4_moe_quantized takes q [1 or {g}, D] and s [.., D/128], got "
                               f"{tuple(q.shape)} and {tuple(s.shape)}")
    if run > 1 and (g % run or table is not None or q.shape[0] != g or run > GEMV_MAX_M):
        raise KernelInputError(f"fp4_moe_quantized: runs of {run} cells need G ({g}) a multiple of the run, a run "
                               f"of at most {GEMV_MAX_M}, a row of q per cell and slots, not a table")
    slots = slots.to(torch.int32 if table is None else torch.int64)
    if run > 1:
        slots = slots.view(-1, run)[:, 0].contiguous()  # a slot per run
    inter, dim = fields["w1.weight"].shape[0], q.shape[-1]
    off = {name: f.offset for name, f in fields.items()}
    gu = grouped_gemv(q.view(-1, run, dim), s.view(-1, run, dim // 128), arena, (off["w1.weight"], off["w3.weight"]),
                      arena, (off["w1.scale"], off["w3.scale"]), inter, dim, slots, torch.bfloat16, table,
                      early)  # [2, G / run, run, inter] (A = 1: [2, G, 1, inter])
    q2, s2 = swiglu_quant(gu[0].reshape(g, inter), gu[1].reshape(g, inter), weights, limit)  # [G, inter]
    return grouped_gemv(q2.view(-1, run, inter), s2.view(-1, run, inter // 128), arena, (off["w2.weight"],),
                        arena, (off["w2.scale"],), dim, inter, slots, torch.float32, table, True)[0].reshape(g, dim)
