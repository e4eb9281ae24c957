"""FP8 block-scaled GEMV of one token on the tensor cores (TileLang): kernels/fp8_gemm.py's
`fp8_gemv_kernel` contract at m = 1.

Why: the CUDA-core GEMV spends about three instructions per weight (bit-move decode, fp32
widening, FMA), and a warp's arithmetic runs after its weight loads arrive. Here a weight costs
its decode alone: two fp16x2 words per four codes (kernels/lowbit.py's bit moves, exact, values
times 2^-8), which the tensor cores multiply exactly and sum in fp32 (sm_90a SASS at the decode
shapes' tiles: 0.08-0.10 instructions per weight byte and warp, against 0.17-0.25). The timings
per shape against the CUDA-core GEMV: docs/performance-log.md (2026-12-01).

Data layout (a CTA = `tiles` tiles of 16 weight rows; its `ksplit` warps each sum a contiguous
range of whole 128-channel blocks; lane = 4·gi + ti):
* per block and tile, lane ti loads 16 bytes (four words) of each 64-channel half ("span") s of
  rows gi and gi + 8: channels 128·kb + 64·s + 16·ti .. + 15; the four lanes of a quad read a
  row's whole 128-byte line;
* word v of a span is one MMA (m16n8k16, fp16 in, fp32 out): the word's bytes (0, 2) are the
  lane's k positions (2ti, 2ti+1) and bytes (1, 3) the positions (2ti+8, 2ti+9), for A (rows gi,
  gi + 8) and B alike. Every lane's B holds the activations of its own k positions, so every
  column of B is the activation vector and every column of D is the tile's row sums over the 16
  channels of that word: a block's 8 MMAs leave the rows' block sums in D (the first starts D);
* the lane's D[gi, ·] and D[gi + 8, ·] are scaled by the block's weight scale (one per 128×128
  block: a tile's 16 rows share it) times the activation scale times 2^16 (exact powers of two)
  and added to its accumulators; the `ksplit` warps' sums meet in shared memory in warp order
  (deterministic), and lanes ti = 0 store the rows.
A warp issues the loads of its first `depth` blocks (all of them at depth 0), then those of block
i + depth before it sums block i. With PDL (kernels/pdl.py) the weights and their scales, never
written while kernels run, are loaded before the kernel waits for its predecessor; the
activations after.

Results equal the reference up to fp32 summation order (tests/kernels/test_kernels_gpu.py). Tiles per
shape: `mma_tile`. Compiled without TileLang's bounds guards (kernels/toolkit.UNGUARDED): rows
past n are clamped on load and skipped on store, and K is whole 128-channel blocks.
TileLang is imported lazily (see kernels/toolkit.py).
"""


from kernels import lowbit, pdl
from kernels.toolkit import UNGUARDED, KernelInputError, compile_kernel, kernel_factory

SOURCE = r"""
// One e4m3 word (4 channels) of rows gi and gi + 8 into a tile's D: one MMA whose k positions
// (2ti, 2ti+1) hold bytes 0 and 2 and (2ti+8, 2ti+9) bytes 1 and 3, b[0..1] the activation word's
// pairs in the same places. `first`: the block's first word, whose products start D.
template <bool first>
__device__ __forceinline__ void dsv4_fp8_mma_word_t(int w0, int w1, const unsigned* b, float* d) {
  unsigned h0[2], h1[2];
  dsv4_e4m3x4_to_f16x2((unsigned)w0, h0);
  dsv4_e4m3x4_to_f16x2((unsigned)w1, h1);
  dsv4_mma_f16<first>(h0[0], h1[0], h0[1], h1[1], b[0], b[1], d);
}
__device__ __forceinline__ void dsv4_fp8_mma_word_first(int w0, int w1, const unsigned* b, float* d) {
  dsv4_fp8_mma_word_t<true>(w0, w1, b, d);
}
__device__ __forceinline__ void dsv4_fp8_mma_word(int w0, int w1, const unsigned* b, float* d) {
  dsv4_fp8_mma_word_t<false>(w0, w1, b, d);
}
"""

MMA_ARCHS = ((9, 0),)  # where kernels/fp8_gemm.py sends one-token launches here (sm_121: untested)
MAX_K = 4096  # and only up to this K: at 8192 (wo_b) the CUDA-core GEMV with early loads was faster
BLOCKS_PER_WARP = 4  # 128-channel blocks a warp sums (fewer where K has fewer)
MIN_CTAS = 128  # 2-tile CTAs only while that leaves this many CTAs (H200: 132 SMs)
ALL_AHEAD_BYTES = 8 << 20  # weights up to this size issue every load before the wait (depth 0)
DEPTH = 2  # larger ones keep their loads this many blocks ahead of the sums


def mma_tile(n: int, k: int) -> tuple[int, int, int] | None:
    """(tiles of 16 rows per CTA, ksplit warps, depth) for an [n, k] weight, or None where this
    kernel does not take it (K not whole 128-channel blocks, or over MAX_K).

    Depth 0 (every load before the wait) is the faster up to ALL_AHEAD_BYTES (H200, 4096 x 2048:
    3.58-3.69 us against 4.12-4.25 at depth 2); above, presumably, all of a weight's words do not
    fit the registers of a resident grid beside its successor's CTAs. The tile table:
    docs/performance-log.md."""
    if k % 128 or k > MAX_K or n < 1:
        return None
    blocks = k // 128
    ksplit = next(s for s in range(1, blocks + 1) if blocks % s == 0 and blocks // s <= BLOCKS_PER_WARP)
    tiles = 2 if -(-n // 32) >= MIN_CTAS else 1
    return tiles, ksplit, 0 if n * k <= ALL_AHEAD_BYTES else DEPTH


def weight_loads_macro(T, n: int, tiles: int, per: int):
    """A TileLang macro `load(W, SW, ww, sw, warp, lane, row0, i)` that issues the loads of a
    warp's block i (of `per` blocks a warp, warp w owning blocks w·per ..): lane (gi, ti)'s
    16-byte spans of rows gi and gi + 8 of each of the CTA's `tiles` tiles into ww[i] [tiles, 2
    rows, 2 spans, 4 words], the tiles' block scales into sw[i] [tiles]; rows past n read row
    n - 1. The FP8 tensor-core GEMVs' weight layout (this module's and
    kernels/fp8_mma_few_tokens.py's)."""
    @T.macro
    def load(W, SW, ww, sw, warp, lane, row0, i):
        gi, ti = lane // 4, lane % 4
        kb = warp * per + i
        for t in T.unroll(tiles):
            sw[i, t] = SW[T.min(row0 + 16 * t, n - 1) // 128, kb]
            for h in T.unroll(2):
                row = T.min(row0 + 16 * t + 8 * h + gi, n - 1)
                for s in T.unroll(2):
                    for v in T.vectorized(4):
                        ww[i, t, h, s, v] = W[row, 32 * kb + 16 * s + 4 * ti + v]
    return load


@kernel_factory
def fp8_mma_one_token_kernel(n: int, k: int, tiles: int, ksplit: int, depth: int, arch: tuple[int, int]):
    """(Q [1, k/4] int32 = e4m3 codes, SA [1, k/128] fp32, W [n, k/4] int32 = e4m3 codes,
    SW [ceil(n/128), k/128] u8) -> Y [1, n] bf16; a CTA owns `tiles` tiles of 16 rows, its
    `ksplit` warps sum K/ksplit channels each, loads kept `depth` blocks ahead (0: all first)."""
    import tilelang.language as T

    blocks = k // 128
    if k % 128 or blocks % ksplit or ksplit > 32:
        raise KernelInputError(f"fp8_mma_one_token_kernel: k={k} must be whole 128-channel blocks that {ksplit} warps "
                               "(at most 32) share evenly")
    per = blocks // ksplit  # blocks per warp
    lead = min(depth, per) if depth else per  # blocks whose loads are issued before the first sum
    kw, kb_all, nb = k // 4, k // 128, (n + 127) // 128
    cta_rows = 16 * tiles

    load = weight_loads_macro(T, n, tiles, per)

    @T.prim_func
    def fp8_mma1(Q: T.Tensor((1, kw), "int32"), SA: T.Tensor((1, kb_all), "float32"),
                 W: T.Tensor((n, kw), "int32"), SW: T.Tensor((nb, kb_all), "uint8"),
                 Y: T.Tensor((1, n), "bfloat16")):
        with T.Kernel(T.ceildiv(n, cta_rows), threads=(32, ksplit)) as bn:
            lowbit.import_source(T, SOURCE)
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            gi, ti = lane // 4, lane % 4
            ww = T.alloc_local((per, tiles, 2, 2, 4), "int32")  # block, tile, row gi / gi + 8, span, word
            sw = T.alloc_local((per, tiles), "uint8")
            aw = T.alloc_local((2, 4), "int32")  # the block's activation words: span, word
            b = T.alloc_local((2, 4, 2), "uint32")  # their fp16x2 pairs
            d = T.alloc_local((4 * tiles,), "float32")  # tile t's D fragment: d[4t .. 4t + 3]
            acc = T.alloc_local((tiles, 2), "float32")  # rows gi, gi + 8 of each tile
            red = T.alloc_shared((ksplit, tiles, 2, 8), "float32")
            row0 = bn * cta_rows
            for i in T.unroll(lead):  # weights and their scales: never written, read before the wait
                load(W, SW, ww, sw, warp, lane, row0, i)
            pdl.begin(T, arch)
            T.clear(acc)
            for i in T.unroll(per):
                kb = warp * per + i
                if i + lead < per:  # the block `lead` ahead (after unrolling, a constant test)
                    load(W, SW, ww, sw, warp, lane, row0, i + lead)
                for s in T.unroll(2):
                    for v in T.vectorized(4):
                        aw[s, v] = Q[0, 32 * kb + 16 * s + 4 * ti + v]
                for s in T.unroll(2):
                    for v in T.unroll(4):
                        T.evaluate(T.call_extern("handle", "dsv4_e4m3x4_to_f16x2", aw[s, v],
                                                 T.address_of(b[s, v, 0])))
                for t in T.unroll(tiles):  # word 0 of span 0 starts each tile's D
                    T.evaluate(T.call_extern("handle", "dsv4_fp8_mma_word_first", ww[i, t, 0, 0, 0],
                                             ww[i, t, 1, 0, 0], T.address_of(b[0, 0, 0]), T.address_of(d[4 * t])))
                for w in T.unroll(1, 8):
                    for t in T.unroll(tiles):
                        T.evaluate(T.call_extern("handle", "dsv4_fp8_mma_word", ww[i, t, 0, w // 4, w % 4],
                                                 ww[i, t, 1, w // 4, w % 4], T.address_of(b[w // 4, w % 4, 0]),
                                                 T.address_of(d[4 * t])))
                sa = SA[0, kb]
                for t in T.unroll(tiles):
                    ws = lowbit.e8m0_bits_to_float(T, sw[i, t], 2 * lowbit.E4M3_SHIFT)  # both operands carry 2^-8
                    for h in T.unroll(2):  # every column of D holds the row sums: take column 2ti
                        acc[t, h] += d[4 * t + 2 * h] * (ws * sa)
            if ti == 0:
                for t in T.unroll(tiles):
                    for h in T.unroll(2):
                        red[warp, t, h, gi] = acc[t, h]
            T.sync_threads()
            if warp == 0 and ti == 0:
                for t in T.unroll(tiles):
                    for h in T.unroll(2):
                        for w in T.unroll(1, ksplit):  # warp order: deterministic
                            acc[t, h] += red[w, t, h, gi]
                        row = row0 + 16 * t + 8 * h + gi
                        if row < n:
                            Y[0, row] = T.Cast("bfloat16", acc[t, h])

    return compile_kernel(fp8_mma1, arch, pass_configs=UNGUARDED)
