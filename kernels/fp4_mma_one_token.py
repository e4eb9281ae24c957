"""FP4 routed-expert GEMV of one token on the tensor cores, scale groups along the MMA's N axis.

The contract of kernels/fp4_moe.py's `fp4_gemv_kernel` at m = 1 (same tensors, same outputs).
The CUDA-core kernel spends about four instructions per weight (decode, fp32 widening, FMA; its
sm_90a SASS); here a weight costs its decode alone: the tensor cores multiply the fp16 codes
exactly and sum in fp32. kernels/fp4_mma_few_tokens.py does the same for 2-8 tokens, but must give
the four lanes of a quad the same scale group, so each lane reads 4-byte words; here each lane
reads a whole group (16 bytes). At decode's six experts the kernel's instruction issue, not
memory, is the limit, hence the few instructions per block described below (H200: w1+w3 in
18.08-18.18 us against 19.04-19.21 for the version before those cuts, same run). The measurements
behind each choice: docs/performance-log.md.

Data layout (a CTA = one set of `tiles` tiles of 16 weight rows; its `ksplit` warps each sum a
contiguous range of whole 128-channel blocks; lane = 4·gi + ti):
* per block, lane ti loads the 16 bytes of scale group ti (channels 32·ti .. 32·ti + 31) of rows
  gi and gi + 8 of each tile: four words w, each 8 channels, decoded by `dsv4_e2m1x8_to_f16x2`
  into the fp16x2 pairs (p, p + 4) (values times 2^-14);
* MMA 2w takes pairs 0, 1 of word w as the lane's k positions (2ti, 2ti+1) and (2ti+8, 2ti+9),
  MMA 2w+1 pairs 2, 3: k positions of lane ti always hold channels of group ti;
* B column n holds the activations of group n at the k positions of lanes ti = n (the same pairs,
  `dsv4_e4m3x8_to_f16x2`, values times 2^-8) and zeros elsewhere, so D[row, n] sums group n only:
  after the block's 8 MMAs, D columns 0..3 are the row's four 32-channel group sums (exact
  products, fp32 sums), columns 4..7 zero;
* the lane's D[gi, 2ti + j] and D[gi+8, 2ti + j] are scaled by that group's weight scale times
  the activation block scale (exact powers of two, times 2^22) and added to its accumulators
  (acc += D · (ws · sa)). ws is the e8m0 byte e at place (2ti + j) % 4 of the row's scale word,
  taken by one byte permute (`dsv4_e8m0_pick`, a selector each lane sets once) and moved, with the
  2^22, into an fp32 exponent field by one shift-and-add, bits (e + 22) << 23: four SASS
  instructions a scale with the FMUL and the FFMA. The row's sum meets over lanes ti = 0, 1 (one
  shuffle) after the warps' partial sums met in shared memory in warp order.
The activations' B fragments are decoded once per CTA into shared memory ([blocks + 1, 4, 16]
words, the last block zeros): a lane reads its four B pairs of a word in one 16-byte load, lanes
gi != ti from the zero block. A warp first loads the scale words of its whole K range (up to four
per load, `scale_vector`), then keeps its weight words `depth` 128-channel blocks ahead of its sums
(all before any arithmetic at depth 0). Registers are capped so that RESIDENT_WARPS warps fit on
an SM, the occupancy the tiles were timed at.

Scales are read as words: the record's scale block must start 4-byte aligned (fp4_mma_few_tokens.supports).
Compiled without TileLang's bounds guards, as the CUDA-core kernel (kernels/toolkit.UNGUARDED).
"""


from kernels import fp4_mma_few_tokens, lowbit, pdl
from kernels.toolkit import UNGUARDED, KernelInputError, compile_kernel, kernel_factory

SOURCE = r"""
// One e2m1 word (8 channels) of rows gi and gi + 8 into the block's D: two MMAs, the word's pairs
// (0, 4), (1, 5) in the first and (2, 6), (3, 7) in the second; b[0..3] the matching B pairs.
// `first`: the block's first word, whose products start D (lowbit's `dsv4_mma_f16`).
template <bool first>
__device__ __forceinline__ void dsv4_fp4_mma_word_t(int w0, int w1, const unsigned* b, float* d) {
  unsigned h0[4], h1[4];
  dsv4_e2m1x8_to_f16x2((unsigned)w0, h0);
  dsv4_e2m1x8_to_f16x2((unsigned)w1, h1);
  dsv4_mma_f16<first>(h0[0], h1[0], h0[1], h1[1], b[0], b[1], d);
  dsv4_mma_f16<false>(h0[2], h1[2], h0[3], h1[3], b[2], b[3], d);
}
__device__ __forceinline__ void dsv4_fp4_mma_word_first(int w0, int w1, const unsigned* b, float* d) {
  dsv4_fp4_mma_word_t<true>(w0, w1, b, d);
}
__device__ __forceinline__ void dsv4_fp4_mma_word(int w0, int w1, const unsigned* b, float* d) {
  dsv4_fp4_mma_word_t<false>(w0, w1, b, d);
}
// The e8m0 byte e that `sel` picks from scale word w (__byte_perm selector 0x4440 + p: byte p to
// byte 0, zeros above) as the fp32 of bits (e + extra) << 23 (mod 2^32), i.e. 2^(e - 127 + extra)
// for e + extra in 1..254: one byte permute, then one shift-and-add (a constant `extra`: sm_90a LEA).
__device__ __forceinline__ float dsv4_e8m0_pick(int w, unsigned sel, unsigned extra) {
  return __uint_as_float((__byte_perm((unsigned)w, 0u, sel) + extra) << 23);
}
"""

MMA_ARCHS = ((9, 0),)  # where kernels/fp4_moe.py dispatches one-token launches here (sm_121: untested)


MAX_BLOCKS = 8  # 128-channel blocks per warp: their weight words sit in registers (8 words per tile each)


DEPTH = 4  # blocks whose loads a warp keeps ahead of its sums (`depth`)
DEPTH_2_WARPS = 2  # the same for CTAs of two warps (w2: K 2048)


RESIDENT_WARPS = 12  # registers capped (168 per thread) so that this many warps fit on an SM


def mma_tile(k: int) -> tuple[int, int, int] | None:
    """(tiles of 16 rows per CTA, ksplit warps, depth) for K channels, or None where no split keeps
    a warp's K range within MAX_BLOCKS whole 128-channel blocks: 2 tiles, the warps that give each
    one 8 blocks, else the first of 4, 8, 16, 2, 1 that splits K (K <= 16384 keeps the shared
    activations within 33 KB), loads kept DEPTH blocks ahead (DEPTH_2_WARPS for two warps).
    DEPTH and DEPTH_2_WARPS are the fastest of a sweep (H200, decode's six experts: w1+w3 17.96-17.99
    us at depth 4 against 18.48-18.50 at 3; the rest in docs/performance-log.md)."""
    for ksplit in (k // 128 // MAX_BLOCKS, 4, 8, 16, 2, 1):
        if ksplit >= 1 and splits(k, ksplit):
            return 2, ksplit, DEPTH_2_WARPS if ksplit == 2 else DEPTH
    return None


def scale_vector(k: int, ksplit: int, s_off: tuple[int, ...], s_stride: int) -> int:
    """Scale words per load (4, 2 or 1): the widest that divides a warp's blocks (hence also a
    weight row's K/128 scale words) and keeps every load aligned (scale offsets, arena row)."""
    per = k // 128 // ksplit
    return next(v for v in (4, 2, 1) if per % v == 0 and (s_stride // 4) % v == 0
                and all((o // 4) % v == 0 for o in s_off))


def splits(k: int, ksplit: int) -> bool:
    """Whether `ksplit` warps share K's 128-channel blocks evenly, at most MAX_BLOCKS each."""
    blocks = k // 128
    return blocks % ksplit == 0 and blocks // ksplit <= MAX_BLOCKS


def supports(k: int, s_off: tuple[int, ...], s_stride: int) -> bool:
    """Whether this kernel takes a launch (at its `mma_tile`): K whole 128-channel blocks that
    warps can share, and 4-byte aligned scale blocks (fp4_mma_few_tokens.supports)."""
    return fp4_mma_few_tokens.supports(1, k, s_off, s_stride) and mma_tile(k) is not None


@kernel_factory
def fp4_mma_one_token_kernel(n: int, k: int, w_stride: int, w_off: tuple[int, ...], s_stride: int,
                             s_off: tuple[int, ...], tiles: int, ksplit: int, out_dtype: str, arch: tuple[int, int],
                             lookup: bool = False, early: bool = False, depth: int = 0):
    """Grouped one-token FP4 GEMV on the tensor cores: the tensors of
    kernels/fp4_mma_few_tokens.py's `fp4_mma_few_tokens_kernel` at m = 1 (SWA as int32 words
    [Ss, s_stride/4]); a CTA owns `tiles` tiles of 16 rows and its `ksplit` warps each sum
    K/ksplit channels.

    `depth`: each warp issues the loads of its whole range's scale words and of its first `depth`
    blocks' weight words, then those of block i + depth before it sums block i (0: every load
    first), so the sums of early blocks need not wait for the whole range to arrive. The unrolled
    code keeps that order (sm_90a SASS: loads interleaved with the MMAs).

    `early`: the slots (SLOT, or TABLE and IDS), the weights and the scales are read before the
    kernel waits for its predecessor (kernels/pdl.py), so the weight loads overlap that kernel's
    tail. Only where the kernel launched immediately before this one does not write the slots, the
    ids or the arena (it starts once every CTA of that predecessor has started, and by then every
    earlier kernel has completed)."""
    import tilelang.language as T

    if not fp4_mma_few_tokens.supports(1, k, s_off, s_stride) or (k // 128) % ksplit:
        raise KernelInputError(f"fp4_mma_one_token_kernel: k={k}, ksplit={ksplit}, scale offsets {s_off} / "
                               f"stride {s_stride} unsupported (K whole 128-channel blocks shared evenly, scales "
                               "4-byte aligned)")
    blocks = k // 128
    per = blocks // ksplit  # blocks per warp
    lead = min(depth, per) if depth else per  # blocks whose loads are issued before the first sum
    kw, kgw = k // 8, k // 128  # int32 words per weight row, scale words per row
    vs = scale_vector(k, ksplit, s_off, s_stride)  # scale words per load
    parts, cta_rows, threads = len(w_off), 16 * tiles, 32 * ksplit
    groups, wslots, sslots = T.dynamic("groups"), T.dynamic("wslots"), T.dynamic("sslots")
    agroups, entries = T.dynamic("agroups"), T.dynamic("entries")
    shift = lowbit.E4M3_SHIFT + lowbit.E2M1_SHIFT  # codes carry 2^-14, activations 2^-8
    warp_sums = fp4_mma_few_tokens.warp_sums_macro(T, tiles, ksplit)

    def wait_unless_early():
        """Not early: wait for the predecessor before the slot is read (a kernel before wrote it).
        Here, not in `body`: a macro binds its arguments (the slot's loads) where it is called."""
        if not early:
            pdl.begin(T, arch)

    @T.macro
    def load_scales(SWA, sw, slot, warp, lane, row0, part):
        """Issue the loads of the scale words of the warp's whole K range, `vs` words each, into sw."""
        s_off_w = fp4_mma_few_tokens.part_offset(part, [o // 4 for o in s_off])  # in int32 words
        for t in T.unroll(tiles):
            for h in T.unroll(2):
                row = T.min(row0 + 16 * t + 8 * h + lane // 4, n - 1)
                for c in T.unroll(per // vs):
                    for v in T.vectorized(vs):
                        sw[t, h, vs * c + v] = SWA[slot, s_off_w + row * kgw + warp * per + vs * c + v]

    @T.macro
    def load(WA, ww, slot, warp, lane, row0, part, i):
        """Issue the loads of the warp's block i: weight words into ww[i]."""
        gi, ti = lane // 4, lane % 4
        kb = warp * per + i
        w_off_w = fp4_mma_few_tokens.part_offset(part, [o // 4 for o in w_off])  # in int32 words
        for t in T.unroll(tiles):
            for h in T.unroll(2):
                row = T.min(row0 + 16 * t + 8 * h + gi, n - 1)
                for v in T.vectorized(4):
                    ww[i, t, h, v] = WA[slot, w_off_w + row * kw + 16 * kb + 4 * ti + v]

    @T.macro
    def body(Q, SA, WA, SWA, Y, slot, bn, g, part):
        lowbit.import_source(T, fp4_mma_few_tokens.SOURCE, SOURCE)
        if RESIDENT_WARPS // ksplit:
            T.annotate_min_blocks_per_sm(RESIDENT_WARPS // ksplit)
        lane = T.get_thread_binding(0)
        warp = T.get_thread_binding(1)
        gi, ti = lane // 4, lane % 4
        act = T.alloc_shared((blocks + 1, 4, 16), "uint32")  # B pairs of group q of block kb; block `blocks`: zeros
        red = T.alloc_shared((ksplit, tiles * 4, 32), "float32")
        aw = T.alloc_local((8,), "int32")
        ww = T.alloc_local((per, tiles, 2, 4), "int32")
        sw = T.alloc_local((tiles, 2, per), "int32")
        b = T.alloc_local((16,), "uint32")
        d = T.alloc_local((4 * tiles,), "float32")  # tile t's D fragment: d[4t .. 4t + 3]
        acc = T.alloc_local((tiles, 4), "float32")
        sel = T.alloc_local((2,), "uint32")  # __byte_perm selectors: scale bytes (2ti + j) % 4 to byte 0
        ga = T.min(g, agroups - 1)
        row0 = bn * cta_rows
        load_scales(SWA, sw, slot, warp, lane, row0, part)
        for i in T.unroll(lead):  # the warp's first `lead` blocks of weight words
            load(WA, ww, slot, warp, lane, row0, part, i)
        if early:
            pdl.begin(T, arch)  # the activations: the predecessor wrote them
        for it in T.serial((blocks * 4 + threads - 1) // threads):  # the activations' B pairs
            item = it * threads + warp * 32 + lane
            if item < blocks * 4:
                for v in T.vectorized(8):
                    aw[v] = Q[ga, 0, 8 * item + v]  # group item % 4 of block item // 4
                for w in T.unroll(4):
                    T.evaluate(T.call_extern("handle", "dsv4_e4m3x8_to_f16x2", T.address_of(aw[2 * w]),
                                             T.address_of(act[item // 4, item % 4, 4 * w])))
        for it in T.serial((64 + threads - 1) // threads):  # the zero block, B of the lanes gi != ti
            item = it * threads + warp * 32 + lane
            if item < 64:
                act[blocks, item // 16, item % 16] = T.uint32(0)
        T.sync_threads()
        T.clear(acc)
        for j in T.unroll(2):
            sel[j] = T.uint32(0x4440) | T.Cast("uint32", (2 * ti + j) % 4)
        for i in T.unroll(per):
            kb = warp * per + i
            sa = SA[ga, 0, kb]
            if i + lead < per:  # `depth`: the block `lead` ahead (after unrolling, a constant test)
                load(WA, ww, slot, warp, lane, row0, part, i + lead)
            kr = T.if_then_else(gi == ti, kb, blocks)  # lanes gi != ti: B columns of zeros
            for w in T.unroll(4):
                for v in T.vectorized(4):  # one 16-byte shared load per word
                    b[4 * w + v] = act[kr, ti, 4 * w + v]
            for t in T.unroll(tiles):  # word 0 starts each tile's D, then words 1..3 tile by tile
                T.evaluate(T.call_extern("handle", "dsv4_fp4_mma_word_first", ww[i, t, 0, 0], ww[i, t, 1, 0],
                                         T.address_of(b[0]), T.address_of(d[4 * t])))
            for w in T.unroll(1, 4):
                for t in T.unroll(tiles):
                    T.evaluate(T.call_extern("handle", "dsv4_fp4_mma_word", ww[i, t, 0, w], ww[i, t, 1, w],
                                             T.address_of(b[4 * w]), T.address_of(d[4 * t])))
            for t in T.unroll(tiles):
                for h in T.unroll(2):
                    for j in T.unroll(2):  # lanes ti >= 2: zero columns, sums never used
                        ws = T.call_extern("float32", "dsv4_e8m0_pick", sw[t, h, i], sel[j], T.uint32(shift))
                        acc[t, 2 * h + j] += d[4 * t + 2 * h + j] * (ws * sa)
        warp_sums(acc, red, warp, lane)
        if warp == 0:
            for t in T.unroll(tiles):
                for h in T.unroll(2):
                    d[h] = acc[t, 2 * h] + acc[t, 2 * h + 1]  # groups 2ti, 2ti + 1 of row gi + 8h
                    d[h] += T.shfl_xor(d[h], 1)
                    row = row0 + 16 * t + 8 * h + gi
                    if ti == 0 and row < n:
                        Y[part, g, 0, row] = T.Cast(out_dtype, T.Cast("bfloat16", d[h]))

    if lookup:
        @T.prim_func
        def fp4_mma1(Q: T.Tensor((agroups, 1, k // 4), "int32"), SA: T.Tensor((agroups, 1, k // 128), "float32"),
                     WA: T.Tensor((wslots, w_stride // 4), "int32"), SWA: T.Tensor((sslots, s_stride // 4), "int32"),
                     TABLE: T.Tensor((entries,), "int32"), IDS: T.Tensor((groups,), "int64"),
                     Y: T.Tensor((parts, groups, 1, n), out_dtype)):
            with T.Kernel(T.ceildiv(n, cta_rows), groups, parts, threads=(32, ksplit)) as (bn, g, part):
                wait_unless_early()
                body(Q, SA, WA, SWA, Y,
                     T.max(pdl.early_read(T, TABLE[pdl.early_read(T, IDS[g], "int64", early)], "int32", early), 0),
                     bn, g, part)
    else:
        @T.prim_func
        def fp4_mma1(Q: T.Tensor((agroups, 1, k // 4), "int32"), SA: T.Tensor((agroups, 1, k // 128), "float32"),
                     WA: T.Tensor((wslots, w_stride // 4), "int32"), SWA: T.Tensor((sslots, s_stride // 4), "int32"),
                     SLOT: T.Tensor((groups,), "int32"), Y: T.Tensor((parts, groups, 1, n), out_dtype)):
            with T.Kernel(T.ceildiv(n, cta_rows), groups, parts, threads=(32, ksplit)) as (bn, g, part):
                wait_unless_early()
                body(Q, SA, WA, SWA, Y, pdl.early_read(T, SLOT[g], "int32", early), bn, g, part)

    return compile_kernel(fp4_mma1, arch, pass_configs=UNGUARDED)
