"""FP4 routed-expert GEMV on the tensor cores (sm_80+ `mma.sync` m16n8k16, fp16 in, fp32 out).

The contract of kernels/fp4_moe.py's `fp4_gemv_kernel` (same arguments, same outputs) for at
most 16 activation rows. The CUDA-core kernel widens every weight channel to fp32 before its FMA
and keeps rows x tokens accumulators; here the decoded fp16 codes go straight into the tensor
cores, which multiply exactly and sum in fp32.

Data layout (a CTA = `tiles` tiles of 16 weight rows, its `ksplit` warps each summing a
contiguous range of whole 128-channel blocks; lane = 4·gi + ti):
* a scale group is 32 channels = 4 words of e2m1 codes per row; lane ti reads word ti of the
  group for rows gi and gi + 8 of its tile, i.e. channels 8·ti .. 8·ti + 7;
* `dsv4_e2m1x8_to_f16x2` turns a word into the fp16x2 pairs (p, p + 4), p = 0..3 (values times
  2^-14); the activations of token gi get the same pairs (`dsv4_e4m3x8_to_f16x2`, values times
  2^-8);
* MMA 0 of a group takes pairs 0 and 1 as its k positions (2ti, 2ti+1) and (2ti+8, 2ti+9), MMA 1
  pairs 2 and 3: the two MMAs cover the group's 32 channels once, and A and B agree on which
  channel sits at each k position (the MMA sums over k in any order);
* the fp32 result D [16 rows, 8 tokens] of a group is then scaled by that group's weight scale
  (per row) times the activation block scale (per token) -- exact powers of two times 2^22 --
  and added to the lane's accumulators: D[gi, 2ti], D[gi, 2ti+1], D[gi+8, 2ti], D[gi+8, 2ti+1];
* past 8 tokens a second column of 8 (tokens 8 + gi in B, 8 + 2ti + j in D) takes the same
  decoded weight words through two more MMAs (`dsv4_fp4_mma_group2`): each expert a launch reads
  once serves up to 16 rows (a chunk step's cells grouped by expert, engine/moe.py).

Scales are read as words: the record's scale block must start 4-byte aligned (`supports`).
GPU-tested on the H200 (sm_90a); kernels/fp4_moe.py uses it only where `MMA_ARCHS` lists the
architecture, for MMA_MIN_M to MAX_M rows, where the CUDA-core kernel's per-row arithmetic grows
(H200, decode's six experts' w1+w3 at 8 rows: 34.54 us against 103.25; the other measurements
are in docs/performance-log.md).
"""


from kernels import lowbit, pdl
from kernels.toolkit import KernelInputError, compile_kernel, kernel_factory

MAX_M = 16  # tokens per launch: two columns of the MMA's n = 8
GROUPS_PER_STEP = 4  # scale groups per loop step: one 128-channel activation block

SOURCE = r"""
// 8 e4m3 codes (w[0] = channels 0..3, w[1] = 4..7) -> out[p] = the fp16x2 of channels
// (p, p + 4), values times 2^-8: a byte permute puts the two codes in the high bytes of the
// halves, then the seven magnitude bits move down one (fp16 bits 7..13) and the sign stays at 15.
__device__ __forceinline__ void dsv4_e4m3x8_to_f16x2(const int* w, unsigned* out) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    unsigned b = __byte_perm((unsigned)w[0], (unsigned)w[1], ((4u + p) << 12) | ((unsigned)p << 4));
    out[p] = ((b >> 1) & 0x3F803F80u) | (b & 0x80008000u);
  }
}

// One scale group of a 16-row tile: d[0..3] = this lane's D[gi, 2ti], D[gi, 2ti+1],
// D[gi+8, 2ti], D[gi+8, 2ti+1] of (codes times 2^-14) x (activations times 2^-8), fp32.
// w0, w1: the lane's e2m1 word of rows gi and gi + 8; a: its token's activation pairs.
__device__ __forceinline__ void dsv4_fp4_mma_group(int w0, int w1, const unsigned* a, float* d) {
  unsigned h0[4], h1[4];
  dsv4_e2m1x8_to_f16x2((unsigned)w0, h0);
  dsv4_e2m1x8_to_f16x2((unsigned)w1, h1);
  float z = 0.f;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(h0[0]), "r"(h1[0]), "r"(h0[1]), "r"(h1[1]), "r"(a[0]), "r"(a[1]), "f"(z));
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(h0[2]), "r"(h1[2]), "r"(h0[3]), "r"(h1[3]), "r"(a[2]), "r"(a[3]));
}

// The same group for two columns of 8 tokens: a[0..3] the pairs of token gi, a[4..7] of token
// 8 + gi; d[0..3] and d[4..7] their results. The weight words are decoded once for both.
__device__ __forceinline__ void dsv4_fp4_mma_group2(int w0, int w1, const unsigned* a, float* d) {
  unsigned h0[4], h1[4];
  dsv4_e2m1x8_to_f16x2((unsigned)w0, h0);
  dsv4_e2m1x8_to_f16x2((unsigned)w1, h1);
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    dsv4_mma_f16<true>(h0[0], h1[0], h0[1], h1[1], a[4 * u], a[4 * u + 1], d + 4 * u);
    dsv4_mma_f16<false>(h0[2], h1[2], h0[3], h1[3], a[4 * u + 2], a[4 * u + 3], d + 4 * u);
  }
}
"""

MMA_ARCHS = ((9, 0),)  # where kernels/fp4_moe.py dispatches to this kernel (sm_121: untested)
# Launches of fewer rows go to the CUDA-core kernel (H200, decode's six experts' w1+w3 at one row:
# 19.84 us there against 23.29 here).
MMA_MIN_M = 2


def supports(m: int, k: int, s_off: tuple[int, ...], s_stride: int) -> bool:
    """Whether the MMA kernel takes this launch: at most MAX_M rows, K whole 128-channel blocks,
    and every scale block (and the scale arena row) 4-byte aligned."""
    return m <= MAX_M and k % 128 == 0 and s_stride % 4 == 0 and all(o % 4 == 0 for o in s_off)


def part_offset(p, values):
    """values[p] as first + p·step, for a kernel's part index p (a linear index keeps the loads
    provably aligned); the FP4 GEMVs' part offsets must be evenly spaced."""
    step = values[1] - values[0] if len(values) > 1 else 0
    if any(v != values[0] + i * step for i, v in enumerate(values)):
        raise KernelInputError(f"fp4 GEMV part offsets {values} must be evenly spaced")
    return values[0] + p * step


def warp_sums_macro(T, tiles: int, ksplit: int, width: int = 4):
    """A TileLang macro `warp_sums(acc, red, warp, lane)`: the `ksplit` warps' accumulators acc
    [tiles, width] meet in shared memory red [ksplit, tiles * width, 32]; warp 0's acc then holds
    their sums, added in warp order (every thread must call it: it synchronises the CTA)."""
    @T.macro
    def warp_sums(acc, red, warp, lane):
        for t in T.unroll(tiles):
            for c in T.unroll(width):
                red[warp, width * t + c, lane] = acc[t, c]
        T.sync_threads()
        if warp == 0:
            for t in T.unroll(tiles):
                for c in T.unroll(width):
                    for w in T.unroll(1, ksplit):
                        acc[t, c] += red[w, width * t + c, lane]
    return warp_sums


@kernel_factory
def fp4_mma_few_tokens_kernel(m: int, n: int, k: int, w_stride: int, w_off: tuple[int, ...], s_stride: int,
                              s_off: tuple[int, ...], tiles: int, ksplit: int, out_dtype: str, arch: tuple[int, int],
                              lookup: bool = False):
    """Grouped FP4 GEMV on the tensor cores: the arguments and tensors of kernels/fp4_moe.py's
    `fp4_gemv_kernel`, except that SWA is the scale arena as int32 words [Ss, s_stride/4] and
    that a CTA owns `tiles` tiles of 16 rows, its `ksplit` warps each summing one contiguous K
    range (whole 128-channel blocks; their partial sums meet in shared memory in warp order)."""
    import tilelang.language as T

    blocks = k // 128
    if not supports(m, k, s_off, s_stride) or blocks % ksplit:
        raise KernelInputError(f"fp4_mma_few_tokens_kernel: m={m}, k={k}, ksplit={ksplit}, scale offsets {s_off} / "
                               f"stride {s_stride} unsupported (see `supports`; ksplit must divide K/128)")
    kw, kgw = k // 8, k // 128  # int32 words per weight row, scale words per row
    parts = len(w_off)
    cta_rows = 16 * tiles
    cols = -(-m // 8)  # columns of 8 tokens: the MMAs of a weight word (1, or 2 past 8 tokens)
    odd = m > 1  # tokens 2ti + 1 exist
    mma_group = "dsv4_fp4_mma_group" if cols == 1 else "dsv4_fp4_mma_group2"
    groups, wslots, sslots = T.dynamic("groups"), T.dynamic("wslots"), T.dynamic("sslots")
    agroups, entries = T.dynamic("agroups"), T.dynamic("entries")

    warp_sums = warp_sums_macro(T, tiles, ksplit, 4 * cols)
    per = blocks // ksplit  # blocks per warp

    @T.macro
    def body(Q, SA, WA, SWA, Y, slot, bn, g, part):
        lowbit.import_source(T, SOURCE)
        lane = T.get_thread_binding(0)
        warp = T.get_thread_binding(1)
        gi, ti = lane // 4, lane % 4
        aw = T.alloc_local((2,), "int32")
        ap = T.alloc_local((4 * cols,), "uint32")  # column u's pairs: ap[4u .. 4u + 3]
        ww = T.alloc_local((tiles, 2, GROUPS_PER_STEP), "int32")
        sw = T.alloc_local((tiles, 2), "int32")
        sa = T.alloc_local((cols, 2), "float32")
        d = T.alloc_local((4 * cols,), "float32")
        acc = T.alloc_local((tiles, 4 * cols), "float32")  # [t, 4u + 2h + j]: row gi + 8h, token 8u + 2ti + j
        red = T.alloc_shared((ksplit, tiles * 4 * cols, 32), "float32")
        ga = T.min(g, agroups - 1)
        w_off_w = part_offset(part, [o // 4 for o in w_off])
        s_off_w = part_offset(part, [o // 4 for o in s_off])
        row0 = bn * cta_rows
        T.clear(acc)
        for kr in T.serial(per):
            kb = warp * per + kr  # this warp's K range: contiguous 128-channel blocks
            for t in T.unroll(tiles):  # the step's weight and scale words, loaded first
                for h in T.unroll(2):
                    row = T.min(row0 + 16 * t + 8 * h + gi, n - 1)
                    for q in T.unroll(GROUPS_PER_STEP):
                        ww[t, h, q] = WA[slot, w_off_w + row * kw + 4 * (kb * GROUPS_PER_STEP + q) + ti]
                    sw[t, h] = SWA[slot, s_off_w + row * kgw + kb]
            for u in T.unroll(cols):
                for j in T.unroll(2):
                    sa[u, j] = SA[ga, T.min(8 * u + 2 * ti + j, m - 1), kb]
            for q in T.unroll(GROUPS_PER_STEP):
                for u in T.unroll(cols):  # column u's B: token 8u + gi (columns >= m: computed, never stored)
                    for v in T.unroll(2):
                        aw[v] = Q[ga, T.min(8 * u + gi, m - 1), 8 * (kb * GROUPS_PER_STEP + q) + 2 * ti + v]
                    T.evaluate(T.call_extern("handle", "dsv4_e4m3x8_to_f16x2", T.address_of(aw[0]),
                                             T.address_of(ap[4 * u])))
                for t in T.unroll(tiles):
                    T.evaluate(T.call_extern("handle", mma_group, ww[t, 0, q], ww[t, 1, q], T.address_of(ap[0]),
                                             T.address_of(d[0])))
                    for h in T.unroll(2):
                        # codes carry 2^-14, activations 2^-8: the group scale takes back 2^22
                        ws = lowbit.e8m0_bits_to_float(T, (sw[t, h] >> (8 * q)) & 0xFF,
                                                lowbit.E4M3_SHIFT + lowbit.E2M1_SHIFT)
                        for u in T.unroll(cols):
                            acc[t, 4 * u + 2 * h] += d[4 * u + 2 * h] * (ws * sa[u, 0])
                            if odd:
                                acc[t, 4 * u + 2 * h + 1] += d[4 * u + 2 * h + 1] * (ws * sa[u, 1])
        warp_sums(acc, red, warp, lane)
        if warp == 0:
            for t in T.unroll(tiles):
                for h in T.unroll(2):
                    row = row0 + 16 * t + 8 * h + gi
                    for u in T.unroll(cols):
                        for j in T.unroll(2 if odd else 1):
                            if row < n and 8 * u + 2 * ti + j < m:
                                Y[part, g, 8 * u + 2 * ti + j, row] = T.Cast(
                                    out_dtype, T.Cast("bfloat16", acc[t, 4 * u + 2 * h + j]))

    if lookup:
        @T.prim_func
        def fp4_mma(Q: T.Tensor((agroups, m, k // 4), "int32"), SA: T.Tensor((agroups, m, k // 128), "float32"),
                    WA: T.Tensor((wslots, w_stride // 4), "int32"), SWA: T.Tensor((sslots, s_stride // 4), "int32"),
                    TABLE: T.Tensor((entries,), "int32"), IDS: T.Tensor((groups,), "int64"),
                    Y: T.Tensor((parts, groups, m, n), out_dtype)):
            with T.Kernel(T.ceildiv(n, cta_rows), groups, parts, threads=(32, ksplit)) as (bn, g, part):
                pdl.begin(T, arch)  # before the slot is read: a kernel before wrote it
                body(Q, SA, WA, SWA, Y, T.max(TABLE[IDS[g]], 0), bn, g, part)
    else:
        @T.prim_func
        def fp4_mma(Q: T.Tensor((agroups, m, k // 4), "int32"), SA: T.Tensor((agroups, m, k // 128), "float32"),
                    WA: T.Tensor((wslots, w_stride // 4), "int32"), SWA: T.Tensor((sslots, s_stride // 4), "int32"),
                    SLOT: T.Tensor((groups,), "int32"), Y: T.Tensor((parts, groups, m, n), out_dtype)):
            with T.Kernel(T.ceildiv(n, cta_rows), groups, parts, threads=(32, ksplit)) as (bn, g, part):
                pdl.begin(T, arch)  # before the slot is read: a kernel before wrote it
                body(Q, SA, WA, SWA, Y, SLOT[g], bn, g, part)

    return compile_kernel(fp4_mma, arch)


def mma_tile(k: int) -> tuple[int, int]:
    """(tiles of 16 rows per CTA, ksplit warps) for K channels: 2 tiles and up to 4 warps, each
    summing at least two whole 128-channel blocks; ksplit divides K/128 (H200, decode's six
    experts' w1+w3: 24.08 us at 2 tiles x 4 warps against 27.10 at 1 x 8)."""
    blocks, ksplit = k // 128, 4
    while ksplit > 1 and (blocks % ksplit or blocks < 2 * ksplit):
        ksplit //= 2
    return 2, ksplit
