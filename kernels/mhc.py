"""mHC HCPre / HCPost on CUDA (TileLang); same contracts as `reference.hc_pre`, `hc_post`, `hc_post_pre`,
`moe_post_pre`.

HCPre of one sub-block in torch is ~13 launches (widen, RMSNorm, the 24-column mix GEMV,
scale, bias, sigmoid, pre/post, the weighted collapse, narrowing) plus Sinkhorn; a decode step
runs two per layer. Here it is two launches:

1. `hc_mix_kernel`, grid (n·D / CHUNK, S): each CTA widens CHUNK channels of the flattened
   streams [S, n·D] and writes, for its chunk, the sum of squares and the 2n + n² dot products
   with fn's columns -> partial [S, chunks, 2n + n² + 1] fp32 (`mix_partials_macro`: a fixed order);
   From MIX_TILED_TOKENS tokens (prefill chunks) `hc_mix_tokens_kernel` writes the same partials
   for chunks of up to 512 channels, a CTA per (chunk, 64 tokens): fn's chunk is staged once
   for 64 tokens instead of read again per token, and each thread keeps a register tile of 4
   tokens x every output over a sixteenth of the chunk's channels (warp shuffles sum them);
2. `hc_gate_kernel`, one CTA per token: sums the partials in chunk order, r = rsqrt(Σx²/(n·D) +
   eps), z = (dot · r) · scale + base, pre = sigmoid(z) + hc_eps, post = 2 · sigmoid(z), writes
   the comb logits z[2n:], and collapses x = Σ_j pre_j · stream_j (streams' dtype), 8 channels
   per thread and step.

The reference normalises before the GEMV (Σ (x_i · r) fn_i); here r multiplies the finished dot
product, the same value up to fp32 rounding, so results match within fp32 summation-order
tolerance (tests/kernels/test_kernels_gpu.py prints the errors).

HCPost (`hc_post_kernel`): one warp per CTA runs the Sinkhorn projection of the comb logits
(kernels/sinkhorn.py's warp macro) into shared memory, then one thread per `VEC` channels d of
every new stream k: new = post_k · out_d + Σ_j comb[j, k] · stream_j[d] in fp32 (j in order,
single roundings), rounded once into the streams' dtype: one launch instead of ~5. With `early`
(the model's calls: the logits come from the sub-block's hc_pre, kernels before) the projection
runs before the PDL wait, while the sub-block's last kernel still runs: its ~40 dependent steps
(~2.3 µs on the H200) were on the decode step's chain of kernels inside hc_gate, twice a layer.

Between two sub-blocks the decode step runs HCPost of one and HCPre of the next on the new
streams: `hc_post_pre` makes the new streams and the mix partials in one launch
(`hc_post_mix_kernel`: a CTA per chunk of one new stream computes its channels as hc_post does,
writes them, and takes hc_mix's dot products of them: the two kernels share `mix_partials_macro`,
whose summation order is fixed by hand), then hc_gate: two launches instead of three, the same bits.
After a MoE layer `moe_post_pre` also sums the layer's output from its parts inside that kernel
(kernels/moe_combine.py's expression), so the combine's launch goes too.

`hc_gate` going on to the sub-block's RMSNorm + FP8 quantisation was measured and not adopted
(the decode step did not move at 4 layers, and was 0.07-0.11 ms slower at 43; docs/performance-log.md,
2026-12-01 and 2026-12-04 13:56).

Layouts: streams [S, n, D] contiguous (stream-major per token), fn [2n + n², n·D] fp32 row-major,
scale/base [2n + n²] fp32, post [S, n] fp32, comb logits [S, n, n] fp32 row-major; n ≤ 5 (a
comb matrix fits one warp) and D a multiple of 8. sm_90 tested; sm_121 (GB10) untested. (No
`from __future__ import annotations`: TileLang evaluates the kernel signatures' annotations.)
"""

import torch

from kernels import pdl
from kernels.moe_combine import check_parts, moe_combine
from kernels.toolkit import (TORCH_TO_TL, KernelInputError, compile_kernel, cuda_arch, fp32_call, kernel_factory,
                             tile_params)
from kernels.sinkhorn import WARP, check_n, sinkhorn_macro

TILE_PARAMS = {(9, 0): {"chunk": 256, "threads": 128}, (12, 1): {"chunk": 256, "threads": 128}}
DEFAULT_TILE = {"chunk": 256, "threads": 128}
VEC = 8  # channels per thread and step of hc_gate's collapse and of hc_post
# From this many tokens (prefill chunks) hc_pre's mix runs in tiles of MIX_TILE tokens
# (`hc_mix_tokens_kernel`) instead of hc_mix_kernel, which re-reads fn's chunk for every
# (token, chunk) CTA (0.83 ms per call at 2,048 tokens on the H200). The fp32 GEMM this replaces
# widened the streams to fp32, squared and summed them in three more passes.
MIX_TILED_TOKENS = 64
MIX_TILE = 64  # tokens per CTA of hc_mix_tokens_kernel
MIX_PER = 4  # tokens per thread
MIX_LANES = 16  # threads per token (a half warp: their sums meet by shuffles)
MIX_STEP = 64  # channels staged in shared memory at a time


def mix_partials_macro(T, cols: int, chunk: int, threads: int):
    """TileLang macros (load_fn(Fn, bc, fv), mix(xv, fv, P, bs, bc, dots, red)), per, warps:
    thread tx holds channels bc·chunk + tx·per + u (u < per = chunk / threads) of token bs's
    flattened streams, widened, in xv [per]; load_fn loads fn's columns of those channels into
    the fp32 local fv [cols, per] (called before the PDL wait: fn is never written while kernels
    run, so its DRAM latency overlaps the predecessor instead of the chain); mix writes P[bs, bc]
    = the cols dot products with fn's rows and the sum of squares. The order is fixed by hand (a
    thread's channels by fused multiply-adds, warp shuffles, then the warps in order), so every
    kernel using it makes the same bits from the same values."""
    per, warps = chunk // threads, threads // WARP
    if per * threads != chunk or threads % WARP:
        raise KernelInputError(f"mHC mix: a {chunk}-channel chunk does not split over {threads} threads in whole warps")

    def fma(a, b, c):
        return fp32_call(T, "__fmaf_rn", a, b, c)

    @T.macro
    def load_fn(Fn, bc, fv):
        tx = T.get_thread_binding(0)
        c0 = bc * chunk + tx * per
        for c in T.unroll(cols):
            for u in T.vectorized(per):
                fv[c, u] = Fn[c, c0 + u]

    @T.macro
    def mix(xv, fv, P, bs, bc, dots, red):
        tx = T.get_thread_binding(0)
        for c in T.unroll(cols):
            dots[c] = 0.0
            for u in T.unroll(per):
                dots[c] = fma(xv[u], fv[c, u], dots[c])
        dots[cols] = 0.0
        for u in T.unroll(per):
            dots[cols] = fma(xv[u], xv[u], dots[cols])
        for c in T.unroll(cols + 1):
            dots[c] = dots[c] + T.shfl_xor(dots[c], 16)
            dots[c] = dots[c] + T.shfl_xor(dots[c], 8)
            dots[c] = dots[c] + T.shfl_xor(dots[c], 4)
            dots[c] = dots[c] + T.shfl_xor(dots[c], 2)
            dots[c] = dots[c] + T.shfl_xor(dots[c], 1)
        if tx % WARP == 0:
            for c in T.unroll(cols + 1):
                red[tx // WARP, c] = dots[c]
        T.sync_threads()
        if tx < cols + 1:
            dots[0] = red[0, tx]
            for w in T.unroll(1, warps):
                dots[0] = dots[0] + red[w, tx]
            P[bs, bc, tx] = dots[0]

    return load_fn, mix, per, warps


@kernel_factory
def hc_mix_kernel(nd: int, cols: int, dtype: str, arch: tuple[int, int]):
    """(X [S, nd] dtype, Fn [cols, nd] fp32, P [S, nd / chunk, cols + 1] fp32): per chunk of
    channels, the cols dot products with fn's rows, then the sum of squares (last column)."""
    import tilelang.language as T

    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    chunk, threads = p["chunk"], p["threads"]
    chunks = nd // chunk
    load_fn, mix, per, warps = mix_partials_macro(T, cols, chunk, threads)
    tokens = T.dynamic("tokens")

    @T.prim_func
    def hc_mix(X: T.Tensor((tokens, nd), dtype), Fn: T.Tensor((cols, nd), "float32"),
               P: T.Tensor((tokens, chunks, cols + 1), "float32")):
        with T.Kernel(chunks, tokens, threads=threads) as (bc, bs):
            tx = T.get_thread_binding(0)
            xv = T.alloc_local((per,), "float32")
            dots = T.alloc_local((cols + 1,), "float32")
            red = T.alloc_shared((warps, cols + 1), "float32")
            fv = T.alloc_local((cols, per), "float32")
            load_fn(Fn, bc, fv)
            pdl.begin(T, arch)
            for u in T.unroll(per):
                xv[u] = T.Cast("float32", X[bs, bc * chunk + tx * per + u])
            mix(xv, fv, P, bs, bc, dots, red)

    return compile_kernel(hc_mix, arch)


@kernel_factory
def hc_mix_tokens_kernel(nd: int, cols: int, kc: int, dtype: str, arch: tuple[int, int]):
    """(X [S, nd] dtype, Fn [cols, nd] fp32, P [S, nd / kc, cols + 1] fp32): the partials of
    `hc_mix_kernel` for chunks of kc channels, a CTA per (chunk, MIX_TILE tokens).

    Register tiles: thread (g, l) = (tx // MIX_LANES, tx % MIX_LANES) owns tokens
    g·MIX_PER .. g·MIX_PER + MIX_PER - 1 and the channels l, l + MIX_LANES, ... of every
    MIX_STEP staged in shared memory; per channel it loads fn's cols values once and the
    MIX_PER tokens' x once, then makes MIX_PER·(cols + 1) FMAs (the sums of squares last), so
    the loop is arithmetic, not shared-memory loads. The MIX_LANES partial sums of a token meet
    by warp shuffles (a fixed tree: deterministic). x rows are padded by 4 words: the two token
    groups of a warp read 32 different banks."""
    import tilelang.language as T

    bm, lanes, per, step = MIX_TILE, MIX_LANES, MIX_PER, MIX_STEP
    threads = bm // per * lanes
    outs = cols + 1
    chunks = nd // kc
    if kc % step or nd % kc:
        raise KernelInputError(f"hc_mix_tokens_kernel: kc={kc} must divide n·D={nd} and be a multiple of {step}")
    tokens = T.dynamic("tokens")

    @T.prim_func
    def hc_mix_tokens(X: T.Tensor((tokens, nd), dtype), Fn: T.Tensor((cols, nd), "float32"),
                      P: T.Tensor((tokens, chunks, cols + 1), "float32")):
        with T.Kernel(chunks, T.ceildiv(tokens, bm), threads=threads) as (bc, bs):
            tx = T.get_thread_binding(0)
            xs = T.alloc_shared((bm, step + 4), "float32")
            fs = T.alloc_shared((cols, step), "float32")
            acc = T.alloc_local((per, outs), "float32")
            f = T.alloc_local((cols,), "float32")
            xv = T.alloc_local((per,), "float32")
            lane = tx % lanes
            g = tx // lanes
            pdl.begin(T, arch)
            for u in T.unroll(per):
                for c in T.unroll(outs):
                    acc[u, c] = 0.0
            for ks in T.serial(kc // step):
                k0 = bc * kc + ks * step
                for r in T.unroll(bm * step // threads):
                    e = r * threads + tx
                    if bs * bm + e // step < tokens:
                        xs[e // step, e % step] = T.Cast("float32", X[bs * bm + e // step, k0 + e % step])
                    else:
                        xs[e // step, e % step] = 0.0
                for r in T.unroll((cols * step + threads - 1) // threads):
                    e = r * threads + tx
                    if e < cols * step:
                        fs[e // step, e % step] = Fn[e // step, k0 + e % step]
                T.sync_threads()
                for i in T.unroll(step // lanes):
                    for c in T.unroll(cols):
                        f[c] = fs[c, lane + lanes * i]
                    for u in T.unroll(per):
                        xv[u] = xs[g * per + u, lane + lanes * i]
                    for u in T.unroll(per):
                        for c in T.unroll(cols):
                            acc[u, c] = acc[u, c] + xv[u] * f[c]
                        acc[u, cols] = acc[u, cols] + xv[u] * xv[u]
                T.sync_threads()
            for u in T.unroll(per):  # the lanes' sums of one token: a butterfly over MIX_LANES = 16 lanes
                for c in T.unroll(outs):
                    acc[u, c] = acc[u, c] + T.shfl_xor(acc[u, c], 8)
                    acc[u, c] = acc[u, c] + T.shfl_xor(acc[u, c], 4)
                    acc[u, c] = acc[u, c] + T.shfl_xor(acc[u, c], 2)
                    acc[u, c] = acc[u, c] + T.shfl_xor(acc[u, c], 1)
            for u in T.unroll(per):
                if bs * bm + g * per + u < tokens:
                    for c in T.unroll(outs):
                        if c % lanes == lane:
                            P[bs * bm + g * per + u, bc, c] = acc[u, c]

    return compile_kernel(hc_mix_tokens, arch)


@kernel_factory
def hc_gate_kernel(n: int, d: int, chunks: int, hc_eps: float, eps: float, dtype: str, arch: tuple[int, int]):
    """(P [S, chunks, cols + 1], X [S, n, d], Scale [cols], Base [cols]) -> (Y [S, d] dtype,
    Post [S, n] fp32, Comb [S, n·n] fp32 logits) with cols = 2n + n²; one CTA per token.

    Threads 0..cols sum the partials (chunk order: deterministic); threads 0..2n-1 make pre and
    post, threads 2n..cols-1 the comb logits; then every thread collapses x = Σ_j pre_j ·
    stream_j, `VEC` channels per step, every load of a thread issued before its sums. Scale and
    base, never written while kernels run, are loaded before the PDL wait."""
    import tilelang.language as T

    threads = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["threads"]
    cols, nn = 2 * n + n * n, n * n
    if cols + 1 > threads:
        raise KernelInputError(f"hc_pre needs at least {cols + 1} threads per CTA (the mix columns), the tile "
                               f"gives {threads}")
    if d % VEC:
        raise KernelInputError(f"hc_pre: D = {d} is not a multiple of {VEC}")
    inv_nd = T.float32(1.0 / (n * d))
    rounds = (d // VEC + threads - 1) // threads  # collapse steps per thread
    chunk_loop = T.unroll if chunks <= 128 else T.serial
    tokens = T.dynamic("tokens")

    @T.prim_func
    def hc_gate(P: T.Tensor((tokens, chunks, cols + 1), "float32"), X: T.Tensor((tokens, n, d), dtype),
                Scale: T.Tensor((cols,), "float32"), Base: T.Tensor((cols,), "float32"),
                Y: T.Tensor((tokens, d), dtype), Post: T.Tensor((tokens, n), "float32"),
                Comb: T.Tensor((tokens, nn), "float32")):
        with T.Kernel(tokens, threads=threads) as bs:
            tx = T.get_thread_binding(0)
            sm = T.alloc_shared((cols + 1 + n,), "float32")  # summed partials, then pre_j
            v = T.alloc_local((2,), "float32")  # running sum / z; sigmoid(z)
            pre = T.alloc_local((n,), "float32")
            xs = T.alloc_local((n, VEC), dtype)
            ys = T.alloc_local((VEC,), dtype)
            sb = T.alloc_local((2,), "float32")  # this column's scale and base, loaded before the wait
            if tx < cols:
                sb[0] = Scale[tx]
                sb[1] = Base[tx]
            pdl.begin(T, arch)
            if tx < cols + 1:
                v[0] = 0.0
                for k in chunk_loop(chunks):
                    v[0] = fp32_call(T, "__fadd_rn", v[0], P[bs, k, tx])
                sm[tx] = v[0]
            T.sync_threads()
            if tx < cols:
                v[0] = sm[tx] * T.rsqrt(sm[cols] * inv_nd + eps) * sb[0] + sb[1]  # z
                if tx < 2 * n:
                    v[1] = 1.0 / (1.0 + T.exp(-v[0]))
                    if tx < n:
                        sm[cols + 1 + tx] = v[1] + hc_eps
                    else:
                        Post[bs, tx - n] = 2.0 * v[1]
                else:
                    Comb[bs, tx - 2 * n] = v[0]
            T.sync_threads()
            for j in T.unroll(n):
                pre[j] = sm[cols + 1 + j]
            for i in T.unroll(rounds):
                c0 = (i * threads + tx) * VEC
                if c0 < d:
                    for j in T.unroll(n):
                        for u in T.vectorized(VEC):
                            xs[j, u] = X[bs, j, c0 + u]
                    for u in T.unroll(VEC):
                        v[0] = 0.0
                        for j in T.unroll(n):
                            v[0] = fp32_call(T, "__fadd_rn", v[0], fp32_call(
                                T, "__fmul_rn", pre[j], T.Cast("float32", xs[j, u])))
                        ys[u] = T.Cast(dtype, v[0])
                    for u in T.vectorized(VEC):
                        Y[bs, c0 + u] = ys[u]

    return compile_kernel(hc_gate, arch)


def comb_macro(T, n: int, iters: int, hc_eps: float, early: bool, arch: tuple[int, int]):
    """A TileLang macro project(Z, bs, comb, v, acc) of the HCPost kernels: warp 0 projects token
    bs's comb logits Z[bs] [n·n] (Sinkhorn, `iters` rounds; v, acc: fp32 locals [1]) into the
    shared comb [n·n], and every thread passes the PDL wait: after the projection with `early`
    (Z then read past L1, kernels/pdl.py), before it without."""
    steps = sinkhorn_macro(T, n, iters, hc_eps)
    nn = n * n

    @T.macro
    def project(Z, bs, comb, v, acc):
        tx = T.get_thread_binding(0)
        if not early:
            pdl.begin(T, arch)
        if tx < WARP:  # the whole warp: the shuffles need every lane
            e = tx % nn  # element: row e // n, column e % n
            v[0] = pdl.early_read(T, Z[bs, e], "float32", early)
            steps(v, acc, tx - e, e)
            if tx < nn:
                comb[e] = v[0]
        T.sync_threads()
        if early:
            pdl.begin(T, arch)

    return project


@kernel_factory
def hc_post_kernel(n: int, d: int, iters: int, hc_eps: float, dtype: str, early: bool, arch: tuple[int, int]):
    """(O [S, d] dtype, X [S, n, d] dtype, Post [S, n], Z [S, n·n] comb logits) -> Y [S, n, d] dtype.

    Warp 0 of each CTA projects its token's comb logits (Sinkhorn, `iters` rounds) into shared
    memory; with `early` before the PDL wait, reading Z past L1 (Z must come from a kernel before
    this one's predecessor: kernels/pdl.py). Then each thread makes `VEC` channels of all n new
    streams: it loads those channels of every old stream and of O once (vectorised), so each
    input is read once, not once per new stream."""
    import tilelang.language as T

    threads = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["threads"]
    nn = n * n
    if d % VEC:
        raise KernelInputError(f"hc_post: D = {d} is not a multiple of {VEC}")
    if threads < WARP:
        raise KernelInputError(f"hc_post needs a whole warp per CTA for Sinkhorn, the tile gives {threads} threads")
    project = comb_macro(T, n, iters, hc_eps, early, arch)
    tokens = T.dynamic("tokens")

    @T.prim_func
    def hc_post(O: T.Tensor((tokens, d), dtype), X: T.Tensor((tokens, n, d), dtype),
                Post: T.Tensor((tokens, n), "float32"), Z: T.Tensor((tokens, nn), "float32"),
                Y: T.Tensor((tokens, n, d), dtype)):
        with T.Kernel(T.ceildiv(d // VEC, threads), tokens, threads=threads) as (bx, bs):
            tx = T.get_thread_binding(0)
            comb = T.alloc_shared((nn,), "float32")
            v = T.alloc_local((1,), "float32")
            acc = T.alloc_local((1,), "float32")
            m = T.alloc_local((1,), "float32")
            xs = T.alloc_local((n, VEC), dtype)
            ov = T.alloc_local((VEC,), dtype)
            ys = T.alloc_local((VEC,), dtype)
            project(Z, bs, comb, v, acc)
            c0 = (bx * threads + tx) * VEC  # first channel of this thread
            if c0 < d:
                for j in T.unroll(n):
                    for u in T.vectorized(VEC):
                        xs[j, u] = X[bs, j, c0 + u]
                for u in T.vectorized(VEC):
                    ov[u] = O[bs, c0 + u]
                for k in T.unroll(n):
                    for u in T.unroll(VEC):
                        m[0] = 0.0
                        for j in T.unroll(n):
                            m[0] = fp32_call(T, "__fadd_rn", m[0], fp32_call(
                                T, "__fmul_rn", comb[j * n + k], T.Cast("float32", xs[j, u])))
                        ys[u] = T.Cast(dtype, fp32_call(T, "__fadd_rn", fp32_call(
                            T, "__fmul_rn", Post[bs, k], T.Cast("float32", ov[u])), m[0]))
                    for u in T.vectorized(VEC):
                        Y[bs, k, c0 + u] = ys[u]

    return compile_kernel(hc_post, arch)


@kernel_factory
def hc_post_mix_kernel(n: int, d: int, iters: int, hc_eps: float, dtype: str, early: bool, arch: tuple[int, int],
                       moe: int = 0, routed_dtype: str = "", shared_dtype: str = "", indexed: bool = False):
    """(O [S, d], X [S, n, d], Post [S, n], Z [S, n·n], Fn [cols, n·d] fp32) -> (Y [S, n, d] dtype,
    P [S, n·d / chunk, cols + 1] fp32), cols = 2n + n²: `hc_post_kernel`'s new streams and, from
    them, `hc_mix_kernel`'s partials of the next sub-block's HCPre, a CTA per (chunk, token).

    Chunk bc is `chunk` channels of one new stream k (d a multiple of chunk). Warp 0 projects the
    comb logits as hc_post_kernel does (before the PDL wait with `early`); then each channel's new
    value is hc_post_kernel's expression, rounded once into dtype and written, and hc_mix_kernel's
    dot products and sum of squares run on it widened back: the same values as the two kernels,
    one link fewer on the decode step's chain.

    `moe` = k > 0: O is a MoE layer's output made here from its parts, `moe_combine_kernel`'s
    expression (routed choices summed in order, then the shared expert, one rounding into dtype):
    (R [S, k, d] routed_dtype, Sh [S, d] shared_dtype, X, Post, Z, Fn) -> (Y, P); with `indexed`,
    R is cells [G, d] and (token s, choice j) is row ROWS[s, j] (ROWS [S, k] int64, after R).
    Each of the n CTAs of a channel range sums its parts again (k + 1 rows of a few KB, L2-hot):
    one more link fewer."""
    import tilelang.language as T

    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    chunk, threads = p["chunk"], p["threads"]
    nd, nn, cols = n * d, n * n, 2 * n + n * n
    chunks = nd // chunk
    if d % chunk:
        raise KernelInputError(f"hc_post_mix: D = {d} is not a multiple of the {chunk}-channel chunk")
    if threads < WARP:
        raise KernelInputError(f"hc_post_mix needs a whole warp per CTA for Sinkhorn, the tile gives {threads} threads")
    project = comb_macro(T, n, iters, hc_eps, early, arch)
    load_fn, mix, per, warps = mix_partials_macro(T, cols, chunk, threads)
    tokens = T.dynamic("tokens")

    def f32(value):
        return T.Cast("float32", value)

    def fadd(a, b):
        return fp32_call(T, "__fadd_rn", a, b)

    def fmul(a, b):
        return fp32_call(T, "__fmul_rn", a, b)

    def new_value(out, X, Post, comb, bs, k, c):  # new stream k at channel c: hc_post_kernel's order and roundings
        m = T.float32(0.0)
        for j in range(n):
            m = fadd(m, fmul(comb[j * n + k], f32(X[bs, j, c])))
        return T.Cast(dtype, fadd(fmul(Post[bs, k], f32(out)), m))

    def out_value(O, R, ROWS, Sh, bs, c):  # the sub-block output at channel c (read, or the MoE's from its parts)
        if not moe:
            return O[bs, c]
        y = f32(R[ROWS[bs, 0], c] if indexed else R[bs, 0, c])  # from the first choice (not 0 + it: -0 stays -0)
        for j in range(1, moe):  # routing order: moe_combine_kernel's sums and rounding
            y = fadd(y, f32(R[ROWS[bs, j], c] if indexed else R[bs, j, c]))
        return T.Cast(dtype, fadd(y, f32(Sh[bs, c])))

    @T.macro
    def post_mix(O, R, ROWS, Sh, X, Post, Z, Fn, Y, P, bc, bs):
        tx = T.get_thread_binding(0)
        comb = T.alloc_shared((nn,), "float32")
        v = T.alloc_local((1,), "float32")
        acc = T.alloc_local((1,), "float32")
        xv = T.alloc_local((per,), "float32")
        dots = T.alloc_local((cols + 1,), "float32")
        red = T.alloc_shared((warps, cols + 1), "float32")
        fv = T.alloc_local((cols, per), "float32")
        load_fn(Fn, bc, fv)  # before the PDL wait (in `project`)
        project(Z, bs, comb, v, acc)
        k = bc * chunk // d  # this chunk's new stream
        d0 = bc * chunk % d + tx * per  # this thread's first channel
        for u in T.unroll(per):
            xv[u] = f32(new_value(out_value(O, R, ROWS, Sh, bs, d0 + u), X, Post, comb, bs, k, d0 + u))
        for u in T.unroll(per):
            Y[bs, k, d0 + u] = T.Cast(dtype, xv[u])  # exact: xv holds a dtype value
        mix(xv, fv, P, bs, bc, dots, red)

    if not moe:
        @T.prim_func
        def hc_post_mix(O: T.Tensor((tokens, d), dtype), X: T.Tensor((tokens, n, d), dtype),
                        Post: T.Tensor((tokens, n), "float32"), Z: T.Tensor((tokens, nn), "float32"),
                        Fn: T.Tensor((cols, nd), "float32"), Y: T.Tensor((tokens, n, d), dtype),
                        P: T.Tensor((tokens, chunks, cols + 1), "float32")):
            with T.Kernel(chunks, tokens, threads=threads) as (bc, bs):
                post_mix(O, O, O, O, X, Post, Z, Fn, Y, P, bc, bs)  # O alone: no MoE parts

        return compile_kernel(hc_post_mix, arch)
    if indexed:
        cells = T.dynamic("cells")

        @T.prim_func
        def moe_post_mix_rows(R: T.Tensor((cells, d), routed_dtype), ROWS: T.Tensor((tokens, moe), "int64"),
                              Sh: T.Tensor((tokens, d), shared_dtype), X: T.Tensor((tokens, n, d), dtype),
                              Post: T.Tensor((tokens, n), "float32"), Z: T.Tensor((tokens, nn), "float32"),
                              Fn: T.Tensor((cols, nd), "float32"), Y: T.Tensor((tokens, n, d), dtype),
                              P: T.Tensor((tokens, chunks, cols + 1), "float32")):
            with T.Kernel(chunks, tokens, threads=threads) as (bc, bs):
                post_mix(R, R, ROWS, Sh, X, Post, Z, Fn, Y, P, bc, bs)

        return compile_kernel(moe_post_mix_rows, arch)

    @T.prim_func
    def moe_post_mix(R: T.Tensor((tokens, moe, d), routed_dtype), Sh: T.Tensor((tokens, d), shared_dtype),
                     X: T.Tensor((tokens, n, d), dtype), Post: T.Tensor((tokens, n), "float32"),
                     Z: T.Tensor((tokens, nn), "float32"), Fn: T.Tensor((cols, nd), "float32"),
                     Y: T.Tensor((tokens, n, d), dtype), P: T.Tensor((tokens, chunks, cols + 1), "float32")):
        with T.Kernel(chunks, tokens, threads=threads) as (bc, bs):
            post_mix(R, R, R, Sh, X, Post, Z, Fn, Y, P, bc, bs)  # no row table

    return compile_kernel(moe_post_mix, arch)


def _check_streams(streams: torch.Tensor) -> None:
    if streams.dim() != 3 or streams.dtype not in TORCH_TO_TL:
        raise KernelInputError(f"mHC kernels take streams [S, n, D] in bf16, fp16 or fp32, got "
                               f"{streams.dtype} {tuple(streams.shape)}")


def _check_pre(caller: str, streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
               n: int) -> None:
    """HCPre's parameters against streams [S, n, D]: fn [2n + n², n·D], scale and base [2n + n²]."""
    _, _, d = streams.shape
    cols = 2 * n + n * n
    if streams.shape[1] != n or tuple(fn.shape) != (cols, n * d) or scale.numel() != cols or base.numel() != cols:
        raise KernelInputError(f"{caller}: streams {tuple(streams.shape)}, fn {tuple(fn.shape)}, scale "
                               f"{scale.numel()}, base {base.numel()} do not fit n={n} ({cols} mix columns)")


def _check_post(caller: str, out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                comb_logits: torch.Tensor) -> None:
    """HCPost's inputs against streams [S, n, D]: out [S, D], post [S, n], comb_logits [S, n, n]."""
    s, n, d = streams.shape
    if tuple(out.shape) != (s, d) or tuple(post.shape) != (s, n) or tuple(comb_logits.shape) != (s, n, n):
        raise KernelInputError(f"{caller}: out {tuple(out.shape)}, post {tuple(post.shape)}, comb logits "
                               f"{tuple(comb_logits.shape)} do not fit streams {tuple(streams.shape)}")


def _gate(partial: torch.Tensor, streams: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
          eps: float, arch: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_gate_kernel` on the mix partials [S, chunks, 2n + n² + 1] of streams [S, n, D]
    (contiguous) -> (x [S, D], post [S, n], comb_logits [S, n, n])."""
    s, n, d = streams.shape
    x = torch.empty(s, d, dtype=streams.dtype, device=streams.device)
    post = torch.empty(s, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(s, n * n, dtype=torch.float32, device=streams.device)
    if s:
        hc_gate_kernel(n, d, partial.shape[1], float(hc_eps), float(eps), TORCH_TO_TL[streams.dtype], arch)(
            partial, streams, scale.float().contiguous(), base.float().contiguous(), x, post, comb)
    return x, post, comb.view(s, n, n)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
           hc_eps: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [S, n, D] -> (x [S, D], post [S, n], comb_logits [S, n, n]), as `reference.hc_pre`."""
    _check_streams(streams)
    s, _, d = streams.shape
    cols, nd = 2 * n + n * n, n * d
    arch = cuda_arch(streams.device)
    chunk = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["chunk"]
    _check_pre("hc_pre", streams, fn, scale, base, n)
    if nd % chunk:
        raise KernelInputError(f"hc_pre: n·D = {nd} is not a multiple of the {chunk}-channel chunk")
    check_n(n)
    x3 = streams.contiguous()
    dt = TORCH_TO_TL[streams.dtype]
    if s >= MIX_TILED_TOKENS:  # chunks of up to 512 channels, MIX_TILE tokens a CTA
        kc = next(k for k in (512, 256, MIX_STEP) if nd % k == 0)
        partial = torch.empty(s, nd // kc, cols + 1, dtype=torch.float32, device=streams.device)
        hc_mix_tokens_kernel(nd, cols, kc, dt, arch)(x3.view(s, nd), fn.float().contiguous(), partial)
    else:
        partial = torch.empty(s, nd // chunk, cols + 1, dtype=torch.float32, device=streams.device)
        if s:
            hc_mix_kernel(nd, cols, dt, arch)(x3.view(s, nd), fn.float().contiguous(), partial)
    return _gate(partial, x3, scale, base, hc_eps, eps, arch)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb_logits: torch.Tensor, iters: int,
            hc_eps: float, early: bool = False) -> torch.Tensor:
    """out [S, D], streams [S, n, D], post [S, n], comb_logits [S, n, n] -> new streams, as
    `reference.hc_post`; `early`: comb_logits were written before the kernel launched just
    before this call (the sub-block's last), which the projection then overlaps."""
    _check_streams(streams)
    s, n, d = streams.shape
    _check_post("hc_post", out, streams, post, comb_logits)
    check_n(n)
    y = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if s:
        hc_post_kernel(n, d, int(iters), float(hc_eps), TORCH_TO_TL[streams.dtype], bool(early),
                       cuda_arch(streams.device))(
            out.to(streams.dtype).contiguous(), streams.contiguous(), post.float().contiguous(),
            comb_logits.float().reshape(s, n * n).contiguous(), y)
    return y


def hc_post_pre(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb_logits: torch.Tensor, iters: int,
                hc_eps: float, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
                early: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_post` of a sub-block, then `hc_pre` of the next one (fn, scale, base) on the new
    streams -> (new streams, x, post, comb_logits), as `reference.hc_post_pre`. Under
    MIX_TILED_TOKENS tokens two launches (`hc_post_mix_kernel`, `hc_gate_kernel`) instead of
    three, the same values; from there (prefill chunks) the two ops."""
    _check_streams(streams)
    if not _post_mix_takes(streams):
        new = hc_post(out, streams, post, comb_logits, iters, hc_eps, early)
        return (new, *hc_pre(new, fn, scale, base, streams.shape[1], hc_eps, eps))
    _check_post("hc_post_pre", out, streams, post, comb_logits)
    return _post_mix_gate("hc_post_pre", (out.to(streams.dtype).contiguous(),), (), streams, post, comb_logits,
                          iters, hc_eps, fn, scale, base, eps, early)


def moe_post_pre(routed: torch.Tensor, shared: torch.Tensor, rows: torch.Tensor | None, streams: torch.Tensor,
                 post: torch.Tensor, comb_logits: torch.Tensor, iters: int, hc_eps: float, fn: torch.Tensor,
                 scale: torch.Tensor, base: torch.Tensor, eps: float,
                 early: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's parts (routed [S, k, D], or cells [G, D] with rows [S, k] int64; shared
    [S, D]) combined into the streams' dtype, then `hc_post_pre` -> (new streams, x, post,
    comb_logits), as `reference.moe_post_pre`. Under MIX_TILED_TOKENS tokens two launches
    (`hc_post_mix_kernel` summing the parts itself, `hc_gate_kernel`) instead of three, the same
    bits; from there (prefill chunks) `moe_combine`, then `hc_post_pre`."""
    _check_streams(streams)
    k = check_parts("moe_post_pre", routed, shared, rows)[1]
    if not _post_mix_takes(streams):
        return hc_post_pre(moe_combine(routed, shared, streams.dtype, rows), streams, post, comb_logits, iters,
                           hc_eps, fn, scale, base, eps, early)
    _check_post("moe_post_pre", shared, streams, post, comb_logits)
    for name, t in (("routed", routed), ("shared", shared)):
        if t.dtype not in TORCH_TO_TL or t.device != streams.device:
            raise KernelInputError(f"moe_post_pre: {name} must be bf16, fp16 or fp32 on {streams.device}, got "
                                   f"{t.dtype} on {t.device}")
    if rows is not None and rows.device != streams.device:
        raise KernelInputError(f"moe_post_pre: rows on {rows.device}, streams on {streams.device}")
    parts = (routed.contiguous(),) + (() if rows is None else (rows.contiguous(),)) + (shared.contiguous(),)
    variant = (k, TORCH_TO_TL[routed.dtype], TORCH_TO_TL[shared.dtype], rows is not None)
    return _post_mix_gate("moe_post_pre", parts, variant, streams, post, comb_logits, iters, hc_eps, fn, scale,
                          base, eps, early)


def _post_mix_takes(streams: torch.Tensor) -> bool:
    """Whether `hc_post_mix_kernel` takes streams [S, n, D]: under MIX_TILED_TOKENS tokens and D
    whole chunks (else the ops it fuses run apart)."""
    s, _, d = streams.shape
    return s < MIX_TILED_TOKENS and d % tile_params(TILE_PARAMS, cuda_arch(streams.device), DEFAULT_TILE)["chunk"] == 0


def _post_mix_gate(caller: str, inputs: tuple, variant: tuple, streams: torch.Tensor, post: torch.Tensor,
                   comb_logits: torch.Tensor, iters: int, hc_eps: float, fn: torch.Tensor, scale: torch.Tensor,
                   base: torch.Tensor, eps: float, early: bool) -> tuple[torch.Tensor, ...]:
    """`hc_post_mix_kernel` (its arguments after arch: `variant`) on the sub-block output's
    `inputs` (O, or the MoE parts), then `hc_gate` -> (new streams, x, post, comb_logits)."""
    s, n, d = streams.shape
    _check_pre(caller, streams, fn, scale, base, n)
    check_n(n)
    arch = cuda_arch(streams.device)
    chunk = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)["chunk"]
    y = torch.empty(s, n, d, dtype=streams.dtype, device=streams.device)
    partial = torch.empty(s, n * d // chunk, 2 * n + n * n + 1, dtype=torch.float32, device=streams.device)
    if s:
        hc_post_mix_kernel(n, d, int(iters), float(hc_eps), TORCH_TO_TL[streams.dtype], bool(early), arch, *variant)(
            *inputs, streams.contiguous(), post.float().contiguous(),
            comb_logits.float().reshape(s, n * n).contiguous(), fn.float().contiguous(), y, partial)
    return (y, *_gate(partial, y, scale, base, hc_eps, eps, arch))
