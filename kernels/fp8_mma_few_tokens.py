"""FP8 block-scaled GEMV of 2 to 16 tokens on the tensor cores (TileLang): kernels/fp8_gemm.py's
`fp8_gemv_kernel` contract at 2 <= m <= MAX_M.

Why: the CUDA-core GEMV keeps rows x tokens fp32 accumulators and spends a widening and an FMA
per weight and token; at a chunk step's 16 rows it is the step's largest cost. Here the decoded
weight words go into the tensor cores once for every 8 tokens.

Data layout: kernels/fp8_mma_one_token.py's (a CTA = `tiles` tiles of 16 weight rows; its
`ksplit` warps each sum a contiguous range of whole 128-channel blocks; per block and tile lane
ti loads 16 bytes of each 64-channel span of rows gi and gi + 8; word v of span s is one MMA
whose k positions (2ti, 2ti+1) hold the word's bytes (0, 2) and (2ti+8, 2ti+9) its bytes
(1, 3)), except that the B operand is no longer one activation vector in every column:
* column gi of B (lane gi's b registers) is token 8u + gi's activation word at the same
  positions, for each column group u of 8 tokens (`cols` = 1 or 2);
* so D [16 rows, 8 tokens] of a block holds the tile's rows' block sums per token, and the lane
  scales D[gi + 8h, 2ti + j] by the block's weight scale times token (8u + 2ti + j)'s activation
  scale times 2^16 (exact powers of two) into its accumulators;
* a weight word is decoded once (`dsv4_fp8_a_fragment`) for the `cols` MMAs that use it.
The `ksplit` warps' sums meet in shared memory in warp order (deterministic), and lanes store
their (row, token) results. A warp issues the loads of its first `depth` blocks before the
kernel waits for its predecessor (kernels/pdl.py; weights and scales are never written while
kernels run), then those of block i + depth before it sums block i.

Results equal the reference up to fp32 summation order (tests/kernels/test_kernels_gpu.py); the
layout's logic is replayed on the CPU in tests/kernels/test_fp8_mma_few_tokens_layout.py.
Compiled without TileLang's bounds guards (kernels/toolkit.UNGUARDED): rows past n and tokens
past m are clamped on load and skipped on store, and K is whole 128-channel blocks.
TileLang is imported lazily (see kernels/toolkit.py).
"""


from kernels import lowbit, pdl
from kernels.fp8_mma_one_token import weight_loads_macro
from kernels.toolkit import UNGUARDED, KernelInputError, compile_kernel, kernel_factory

SOURCE = r"""
// The A fragment of one e4m3 word (4 channels) of rows gi (w0) and gi + 8 (w1): k positions
// (2ti, 2ti+1) hold bytes 0 and 2, (2ti+8, 2ti+9) bytes 1 and 3 (values times 2^-8).
__device__ __forceinline__ void dsv4_fp8_a_fragment(int w0, int w1, unsigned* a) {
  unsigned h0[2], h1[2];
  dsv4_e4m3x4_to_f16x2((unsigned)w0, h0);
  dsv4_e4m3x4_to_f16x2((unsigned)w1, h1);
  a[0] = h0[0]; a[1] = h1[0]; a[2] = h0[1]; a[3] = h1[1];
}
// D = A·B (a block's first word) and D += A·B.
__device__ __forceinline__ void dsv4_mma_start(const unsigned* a, const unsigned* b, float* d) {
  dsv4_mma_f16<true>(a[0], a[1], a[2], a[3], b[0], b[1], d);
}
__device__ __forceinline__ void dsv4_mma_add(const unsigned* a, const unsigned* b, float* d) {
  dsv4_mma_f16<false>(a[0], a[1], a[2], a[3], b[0], b[1], d);
}
"""

MMA_ARCHS = ((9, 0),)  # where kernels/fp8_gemm.py sends 2..16-token launches here (sm_121: untested)
MIN_M, MAX_M = 2, 16
BLOCKS_PER_WARP = 4  # 128-channel blocks a warp sums (fewer where K has fewer)
MIN_CTAS = 128  # 2-tile CTAs only while that leaves this many CTAs (H200: 132 SMs)
DEPTH = 2  # blocks whose loads run ahead of the sums


def mma_tile(n: int, k: int) -> tuple[int, int, int] | None:
    """(tiles of 16 rows per CTA, ksplit warps, depth) for an [n, k] weight, or None where this
    kernel does not take it (K not whole 128-channel blocks, or more blocks than 32 warps of
    BLOCKS_PER_WARP take)."""
    if k % 128 or n < 1:
        return None
    blocks = k // 128
    ksplit = next(s for s in range(1, blocks + 1) if blocks % s == 0 and blocks // s <= BLOCKS_PER_WARP)
    if ksplit > 32:
        return None
    tiles = 2 if -(-n // 32) >= MIN_CTAS else 1
    return tiles, ksplit, DEPTH


@kernel_factory
def fp8_mma_few_tokens_kernel(m: int, n: int, k: int, tiles: int, ksplit: int, depth: int,
                              arch: tuple[int, int]):
    """(Q [m, k/4] int32 = e4m3 codes, SA [m, k/128] fp32, W [n, k/4] int32 = e4m3 codes,
    SW [ceil(n/128), k/128] u8) -> Y [m, n] bf16, 2 <= m <= MAX_M; a CTA owns `tiles` tiles of
    16 rows, its `ksplit` warps sum K/ksplit channels each, loads kept `depth` blocks ahead."""
    import tilelang.language as T

    blocks = k // 128
    if not MIN_M <= m <= MAX_M or k % 128 or blocks % ksplit or ksplit > 32 or depth < 1:
        raise KernelInputError(f"fp8_mma_few_tokens_kernel: m={m} (must be {MIN_M}..{MAX_M}), k={k} must be whole "
                               f"128-channel blocks that {ksplit} warps (at most 32) share evenly, depth {depth} >= 1")
    per = blocks // ksplit  # blocks per warp
    lead = min(depth, per)  # blocks whose loads are issued before the first sum
    kw, kb_all, nb = k // 4, k // 128, (n + 127) // 128
    cta_rows = 16 * tiles
    cols = -(-m // 8)  # columns of 8 tokens

    load = weight_loads_macro(T, n, tiles, per)

    @T.prim_func
    def fp8_mma_few(Q: T.Tensor((m, kw), "int32"), SA: T.Tensor((m, kb_all), "float32"),
                    W: T.Tensor((n, kw), "int32"), SW: T.Tensor((nb, kb_all), "uint8"),
                    Y: T.Tensor((m, n), "bfloat16")):
        with T.Kernel(T.ceildiv(n, cta_rows), threads=(32, ksplit)) as bn:
            lowbit.import_source(T, SOURCE)
            lane = T.get_thread_binding(0)
            warp = T.get_thread_binding(1)
            gi, ti = lane // 4, lane % 4
            ww = T.alloc_local((per, tiles, 2, 2, 4), "int32")  # block, tile, row gi / gi + 8, span, word
            sw = T.alloc_local((per, tiles), "uint8")
            aw = T.alloc_local((cols, 2, 4), "int32")  # the block's activation words: column, span, word
            b = T.alloc_local((cols, 2, 4, 2), "uint32")  # their fp16x2 pairs
            a = T.alloc_local((tiles, 4), "uint32")  # a weight word's A fragment per tile
            sa = T.alloc_local((cols, 2), "float32")  # tokens 8u + 2ti + j's block scales
            d = T.alloc_local((tiles, cols, 4), "float32")
            acc = T.alloc_local((tiles, cols, 4), "float32")  # [t, u, 2h + j]: row gi + 8h, token 8u + 2ti + j
            red = T.alloc_shared((ksplit, tiles * cols * 4, 32), "float32")
            row0 = bn * cta_rows
            for i in T.unroll(lead):  # weights and their scales: never written, read before the wait
                load(W, SW, ww, sw, warp, lane, row0, i)
            pdl.begin(T, arch)
            T.clear(acc)
            for i in T.unroll(per):
                kb = warp * per + i
                if i + lead < per:  # the block `lead` ahead (after unrolling, a constant test)
                    load(W, SW, ww, sw, warp, lane, row0, i + lead)
                for u in T.unroll(cols):
                    for s in T.unroll(2):
                        for v in T.vectorized(4):
                            aw[u, s, v] = Q[T.min(8 * u + gi, m - 1), 32 * kb + 16 * s + 4 * ti + v]
                    for j in T.unroll(2):
                        sa[u, j] = SA[T.min(8 * u + 2 * ti + j, m - 1), kb]
                for u in T.unroll(cols):
                    for s in T.unroll(2):
                        for v in T.unroll(4):
                            T.evaluate(T.call_extern("handle", "dsv4_e4m3x4_to_f16x2", aw[u, s, v],
                                                     T.address_of(b[u, s, v, 0])))
                for t in T.unroll(tiles):  # word 0 of span 0 starts each tile's D
                    T.evaluate(T.call_extern("handle", "dsv4_fp8_a_fragment", ww[i, t, 0, 0, 0], ww[i, t, 1, 0, 0],
                                             T.address_of(a[t, 0])))
                    for u in T.unroll(cols):
                        T.evaluate(T.call_extern("handle", "dsv4_mma_start", T.address_of(a[t, 0]),
                                                 T.address_of(b[u, 0, 0, 0]), T.address_of(d[t, u, 0])))
                for w in T.unroll(1, 8):  # word w % 4 of span w // 4: one MMA per tile and column
                    for t in T.unroll(tiles):
                        T.evaluate(T.call_extern("handle", "dsv4_fp8_a_fragment", ww[i, t, 0, w // 4, w % 4],
                                                 ww[i, t, 1, w // 4, w % 4], T.address_of(a[t, 0])))
                        for u in T.unroll(cols):
                            T.evaluate(T.call_extern("handle", "dsv4_mma_add", T.address_of(a[t, 0]),
                                                     T.address_of(b[u, w // 4, w % 4, 0]), T.address_of(d[t, u, 0])))
                for t in T.unroll(tiles):
                    ws = lowbit.e8m0_bits_to_float(T, sw[i, t], 2 * lowbit.E4M3_SHIFT)  # both operands carry 2^-8
                    for u in T.unroll(cols):
                        for c in T.unroll(4):
                            acc[t, u, c] += d[t, u, c] * (ws * sa[u, c % 2])
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
                            if row < n and tok < m:
                                Y[tok, row] = T.Cast("bfloat16", acc[t, u, c])

    return compile_kernel(fp8_mma_few, arch, pass_configs=UNGUARDED)
