"""wo_a's grouped projection of 2 to 16 tokens on the tensor cores (TileLang): kernels/grouped_linear.py's
`grouped_gemv_kernel` contract (bf16 activations, FP8 weight, bf16 out) at 2 <= m <= MAX_M.

Why: the CUDA-core grouped GEMV widens every weight byte to fp32 and spends one FMA per weight
and token, so at a chunk step's 16 token rows it runs 16 times its one-token arithmetic. Here a
weight word is decoded once for the one or two MMAs (8 tokens each) that use it (H200, 16 rows:
14.0 us against 45.4; docs/performance-log.md, 2026-12-03 18:50).

The activations stay bf16 (the reference multiplies them unquantised), so the MMA is bf16 x bf16
with fp32 sums, and the A operand is the weight code as a bf16, exactly: kernels/lowbit.py's bit
moves give the e4m3 value times 2^-8 as an fp16 (subnormal codes included), the full-rate
widening gives its fp32, whose upper half is the bf16 of the same value (at most four significant
bits, exponent >= -17: nothing is rounded). The block scale takes back 2^8.

Data layout: kernels/fp8_mma_few_tokens.py's weight side (a CTA = `tiles` tiles of 16 rows of
one group, its `ksplit` warps each summing a contiguous range of whole 128-channel blocks; per
block and tile lane ti loads the 16 bytes of each 64-channel span s of rows gi and gi + 8,
channels 128·kb + 64·s + 16·ti .. + 15; lane = 4·gi + ti). Word v of span s covers channels
c = 128·kb + 64·s + 16·ti + 4·v .. c + 3 and is one MMA (m16n8k16) per column of 8 tokens:
* A: k positions (2ti, 2ti+1) hold channels (c, c+1) and (2ti+8, 2ti+9) channels (c+2, c+3), of
  row gi in a0/a2 and of row gi + 8 in a1/a3 (`dsv4_e4m3x4_to_bf16x2`);
* B: column gi holds token 8u + gi's activations at the same positions, which are the two bf16x2
  words of X at channels (c, c+1) and (c+2, c+3) as they lie in memory (two 16-byte loads per
  span and column);
* so D [16 rows, 8 tokens] of a block holds the tile's rows' block sums per token; the lane adds
  D[gi + 8h, 2ti + j] times the block's weight scale times 2^8 to its accumulators; the `ksplit`
  warps' sums meet in shared memory in warp order (deterministic) and lanes store their (row,
  token) results.
A warp issues the loads of its first `depth` blocks before the kernel waits for its predecessor
(kernels/pdl.py: the weight and its scales are never written while kernels run), the
activations after.

Results equal the reference up to fp32 summation order (tests/kernels/test_kernels_gpu.py); the
layout's logic is replayed on the CPU in tests/kernels/test_grouped_mma_few_tokens_layout.py.
Compiled without TileLang's bounds guards (kernels/toolkit.UNGUARDED): rows are whole CTAs of
one group (`mma_tile`), tokens past m are clamped on load and skipped on store, K is whole
128-channel blocks. TileLang is imported lazily (see kernels/toolkit.py).
"""


from kernels import lowbit, pdl
from kernels.fp8_mma_one_token import weight_loads_macro
from kernels.toolkit import UNGUARDED, KernelInputError, compile_kernel, kernel_factory

SOURCE = r"""
// 4 e4m3 codes (byte 0 = channel c) -> p[0] = the bf16x2 of channels (c, c+1), p[1] = that of
// (c+2, c+3) (low half first), values times 2^-8, exactly: lowbit's fp16 of each code, widened
// to fp32 (exact), of which the upper 16 bits are the bf16 (no bit of it is dropped).
__device__ __forceinline__ void dsv4_e4m3x4_to_bf16x2(unsigned w, unsigned* p) {
  float f[4];
  dsv4_e4m3x4_to_f32(w, f);
  p[0] = __byte_perm(__float_as_uint(f[0]), __float_as_uint(f[1]), 0x7632u);
  p[1] = __byte_perm(__float_as_uint(f[2]), __float_as_uint(f[3]), 0x7632u);
}
// The A fragment of one e4m3 word of rows gi (w0) and gi + 8 (w1): a[0], a[1] the rows' channels
// (c, c+1) at k positions (2ti, 2ti+1), a[2], a[3] their channels (c+2, c+3) at (2ti+8, 2ti+9).
__device__ __forceinline__ void dsv4_bf16_a_fragment(int w0, int w1, unsigned* a) {
  unsigned p0[2], p1[2];
  dsv4_e4m3x4_to_bf16x2((unsigned)w0, p0);
  dsv4_e4m3x4_to_bf16x2((unsigned)w1, p1);
  a[0] = p0[0]; a[1] = p1[0]; a[2] = p0[1]; a[3] = p1[1];
}
// One m16n8k16 MMA, bf16 in, fp32 out: D = A·B (`first`) or D += A·B.
template <bool first>
__device__ __forceinline__ void dsv4_mma_bf16_t(const unsigned* a, const int* b, float* d) {
  float c[4] = {first ? 0.f : d[0], first ? 0.f : d[1], first ? 0.f : d[2], first ? 0.f : d[3]};
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
__device__ __forceinline__ void dsv4_mma_bf16_start(const unsigned* a, const int* b, float* d) {
  dsv4_mma_bf16_t<true>(a, b, d);
}
__device__ __forceinline__ void dsv4_mma_bf16_add(const unsigned* a, const int* b, float* d) {
  dsv4_mma_bf16_t<false>(a, b, d);
}
"""

MMA_ARCHS = ((9, 0),)  # where kernels/grouped_linear.py sends 2..16-token launches here (sm_121: untested)
MIN_M, MAX_M = 2, 16
BLOCKS_PER_WARP = 4  # 128-channel blocks a warp sums (fewer where K has fewer)
MIN_CTAS = 128  # 2-tile CTAs only while that leaves this many CTAs (H200: 132 SMs)
DEPTH = 2  # blocks whose loads run ahead of the sums


def mma_tile(n: int, k: int, groups: int) -> tuple[int, int, int] | None:
    """(tiles of 16 rows per CTA, ksplit warps, depth) for a grouped [n, k] weight of `groups`
    equal row groups, or None where this kernel does not take it: K not whole 128-channel blocks,
    more blocks than 32 warps of BLOCKS_PER_WARP take, or a group's rows not whole CTAs."""
    if k % 128 or n < 1 or groups < 1 or n % groups:
        return None
    blocks = k // 128
    ksplit = next(s for s in range(1, blocks + 1) if blocks % s == 0 and blocks // s <= BLOCKS_PER_WARP)
    if ksplit > 32:
        return None
    tiles = 2 if -(-n // 32) >= MIN_CTAS else 1
    if (n // groups) % (16 * tiles):
        return None
    return tiles, ksplit, DEPTH


@kernel_factory
def grouped_mma_few_tokens_kernel(m: int, groups: int, k: int, n: int, tiles: int, ksplit: int, depth: int,
                                  arch: tuple[int, int]):
    """(X [m, groups·k/2] int32 = bf16 pairs, W [n, k/4] int32 = e4m3 codes, SW [ceil(n/128), k/128]
    u8) -> Y [m, n] bf16, rows g·n/groups .. of W reading channels g·k .. of X; 2 <= m <= MAX_M;
    a CTA owns `tiles` tiles of 16 rows of one group, its `ksplit` warps sum K/ksplit channels
    each, loads kept `depth` blocks ahead."""
    import tilelang.language as T

    blocks = k // 128
    cta_rows = 16 * tiles
    if (not MIN_M <= m <= MAX_M or k % 128 or blocks % ksplit or ksplit > 32 or depth < 1 or n % groups
            or (n // groups) % cta_rows):
        raise KernelInputError(f"grouped_mma_few_tokens_kernel: m={m} (must be {MIN_M}..{MAX_M}), k={k} must be whole "
                               f"128-channel blocks that {ksplit} warps (at most 32) share evenly, depth {depth} >= 1, "
                               f"and each of {groups} groups of n={n} rows whole CTAs of {cta_rows} rows")
    per = blocks // ksplit  # blocks per warp
    lead = min(depth, per)  # blocks whose loads are issued before the first sum
    kw, kb_all, nb, xw = k // 4, k // 128, (n + 127) // 128, groups * k // 2
    ctas_per_group = n // groups // cta_rows
    cols = -(-m // 8)  # columns of 8 tokens

    load = weight_loads_macro(T, n, tiles, per)

    @T.prim_func
    def grouped_mma_few(X: T.Tensor((m, xw), "int32"), W: T.Tensor((n, kw), "int32"),
                        SW: T.Tensor((nb, kb_all), "uint8"), Y: T.Tensor((m, n), "bfloat16")):
        with T.Kernel(n // cta_rows, threads=(32, ksplit)) as bn:
            lowbit.import_source(T, SOURCE)
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            gi, ti = lane // 4, lane % 4
            ww = T.alloc_local((per, tiles, 2, 2, 4), "int32")  # block, tile, row gi / gi + 8, span, word
            sw = T.alloc_local((per, tiles), "uint8")
            b = T.alloc_local((cols, 2, 8), "int32")  # the block's activation words: column, span, bf16x2 word
            a = T.alloc_local((tiles, 4), "uint32")  # a weight word's A fragment per tile
            d = T.alloc_local((tiles, cols, 4), "float32")
            acc = T.alloc_local((tiles, cols, 4), "float32")  # [t, u, 2h + j]: row gi + 8h, token 8u + 2ti + j
            red = T.alloc_shared((ksplit, tiles * cols * 4, 32), "float32")
            row0 = bn * cta_rows
            x0 = (bn // ctas_per_group) * (k // 2)  # the group's first activation word
            for i in T.unroll(lead):  # weights and their scales: never written, read before the wait
                load(W, SW, ww, sw, warp, lane, row0, i)
            pdl.begin(T, arch)
            T.clear(acc)
            for i in T.unroll(per):
                kb = warp * per + i
                if i + lead < per:  # the block `lead` ahead (after unrolling, a constant test)
                    load(W, SW, ww, sw, warp, lane, row0, i + lead)
                for u in T.unroll(cols):  # token 8u + gi's channels 128kb + 64s + 16ti .. + 15
                    for s in T.unroll(2):
                        for h in T.unroll(2):
                            for v in T.vectorized(4):
                                b[u, s, 4 * h + v] = X[T.min(8 * u + gi, m - 1), x0 + 64 * kb + 32 * s + 8 * ti
                                                       + 4 * h + v]
                for t in T.unroll(tiles):  # word 0 of span 0 starts each tile's D
                    T.evaluate(T.call_extern("handle", "dsv4_bf16_a_fragment", ww[i, t, 0, 0, 0], ww[i, t, 1, 0, 0],
                                             T.address_of(a[t, 0])))
                    for u in T.unroll(cols):
                        T.evaluate(T.call_extern("handle", "dsv4_mma_bf16_start", T.address_of(a[t, 0]),
                                                 T.address_of(b[u, 0, 0]), T.address_of(d[t, u, 0])))
                for w in T.unroll(1, 8):  # word w % 4 of span w // 4: one MMA per tile and column
                    for t in T.unroll(tiles):
                        T.evaluate(T.call_extern("handle", "dsv4_bf16_a_fragment", ww[i, t, 0, w // 4, w % 4],
                                                 ww[i, t, 1, w // 4, w % 4], T.address_of(a[t, 0])))
                        for u in T.unroll(cols):
                            T.evaluate(T.call_extern("handle", "dsv4_mma_bf16_add", T.address_of(a[t, 0]),
                                                     T.address_of(b[u, w // 4, 2 * (w % 4)]),
                                                     T.address_of(d[t, u, 0])))
                for t in T.unroll(tiles):
                    ws = lowbit.e8m0_bits_to_float(T, sw[i, t], lowbit.E4M3_SHIFT)  # the codes carry 2^-8
                    for u in T.unroll(cols):
                        for c in T.unroll(4):
                            acc[t, u, c] += d[t, u, c] * ws
            for t in T.unroll(tiles):
                for u in T.unroll(cols):
                    for c in T.unroll(4):
                        red[warp, 4 * (cols * t + u) + c, lane] = acc[t, u, c]
            T.sync_threads()
            if warp == 0:
                for t in T.unroll(tiles):
                    for u in T.unroll(cols):
                        for c in T.unroll(4):
                            for w in T.unroll(1, ksplit):  # warp order: deterministic
                                acc[t, u, c] += red[w, 4 * (cols * t + u) + c, lane]
                            row = row0 + 16 * t + 8 * (c // 2) + gi
                            tok = 8 * u + 2 * ti + c % 2
                            if tok < m:
                                Y[tok, row] = T.Cast("bfloat16", acc[t, u, c])

    return compile_kernel(grouped_mma_few, arch, pass_configs=UNGUARDED)
