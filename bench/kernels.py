"""Per-kernel achieved bandwidth at DeepSeek-V4-Flash decode shapes vs the HBM copy bandwidth.

Run on a CUDA machine:  python -m bench.kernels
Each kernel is captured in a CUDA graph (20 calls over rotating weight copies that together
exceed the L2 cache, so every call streams its weight from HBM) and replayed; the figure is the
median per-call time over replays. On sm_90+ the kernels use programmatic dependent launch
(kernels/pdl.py), so a call starts while the one before finishes, as in the decode graph: the
figures are per-call times within such a chain. Bytes = the fewest the call must move (weights +
scales + activations + outputs). The ceiling is a 1 GiB device-to-device copy (read + write counted)
measured in the same run.
"""

import argparse
import statistics

import torch

CALLS_PER_GRAPH = 20
# (name, N, K) of the FP8 linears of a Flash layer's decode step (wq_a|wkv: one fused weight)
FP8_DECODE_SHAPES = (("wq_a|wkv", 1536, 4096), ("wq_b", 32768, 1024), ("indexer wq_b", 8192, 1024),
                     ("wo_b", 4096, 8192), ("shared w1|w3", 4096, 4096), ("shared w2", 4096, 2048))
MIN_ROTATION_BYTES = 512 << 20  # well above the H200's 60 MiB L2


def median_seconds(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median GPU time of `fn()` in seconds over `reps` calls (CUDA events), after `warmup` calls."""
    times = []
    for _ in range(reps + warmup):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times[warmup:])


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of `reps`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), reps)


def time_calls(calls, reps: int = 30) -> tuple[float, bool]:
    """Median seconds per call of `calls` (a list of thunks) captured in one CUDA graph.

    Falls back to eager launches (returns graphed=False) if capture fails.
    """
    for c in calls:  # warm up: compile kernels, allocate outputs
        c()
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        run, graphed = graph.replay, True
    except RuntimeError:
        torch.cuda.synchronize()

        def run():
            for c in calls:
                c()
        graphed = False
    return median_seconds(run, reps) / len(calls), graphed


def copies(nbytes: int) -> int:
    """How many copies of a `nbytes` operand to rotate through."""
    return max(2, min(CALLS_PER_GRAPH, -(-MIN_ROTATION_BYTES // max(nbytes, 1))))


def _fp8(n, k, dev):
    w = torch.randn(n, k, device=dev).mul(40).to(torch.float8_e4m3fn)
    s = torch.randint(118, 128, ((n + 127) // 128, k // 128), device=dev, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def _fp4(n, k, dev):
    w = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(118, 128, (n, k // 32), device=dev, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def fp4_arena(slots: int, n: int, k: int, dev) -> torch.Tensor:
    """uint8 [slots, n·k/2 + n·k/32]: one random FP4 [n, k] weight per slot (codes, then e8m0 scales)."""
    arena = torch.randint(0, 256, (slots, n * k // 2 + n * k // 32), device=dev, dtype=torch.uint8)
    arena[:, n * k // 2:] = torch.randint(118, 128, (slots, n * k // 32), device=dev, dtype=torch.uint8)
    return arena


def slot_sets(slots: int, g: int, dev) -> list[torch.Tensor]:
    """CALLS_PER_GRAPH random choices of g distinct arena slots (int32 slot tables)."""
    return [torch.randperm(slots, device=dev)[:g].to(torch.int32) for _ in range(CALLS_PER_GRAPH)]


def time_rotating(operands: list, call) -> tuple[float, bool]:
    """`time_calls` of `call(operand)` cycling through `operands` (weight copies that together
    exceed L2) for CALLS_PER_GRAPH calls."""
    return time_calls([(lambda o=o: call(o)) for o in operands] * (CALLS_PER_GRAPH // len(operands) or 1))


def bench_rows(dev: torch.device, dense_only: bool = False) -> list[tuple[str, int, float, bool]]:
    """(name, bytes per call, seconds per call, graphed) for every kernel at decode shapes
    (`dense_only`: up to the dense weights' rows, without the FP4 and attention sweeps)."""
    from kernels.act_quant import act_quant
    from kernels.fp4_moe import grouped_gemv, fp4_gemm, fp4_gemm_grouped
    from kernels.fp8_dequant import fp8_dequant_bf16
    from kernels.fp8_gemm import fp8_gemm, fp8_gemm_quantized, weight_scales_f32
    from kernels.grouped_linear import grouped_linear
    from kernels.sparse_attention import sparse_attention

    rows = []
    x = torch.randn(1, 4096, device=dev).to(torch.bfloat16)
    t, _ = time_calls([lambda: act_quant(x, 128)] * CALLS_PER_GRAPH)
    rows.append(("act_quant 1x4096", 4096 * 2 + 4096 + 128, t, True))
    rows.extend(layer_op_rows(dev))
    # the engine's FP8 linears at decode: every one but wo_b reads activations quantised once,
    # elsewhere (rms_norm_quant, swiglu_quant), so the GEMV alone is the engine's call
    for name, n, k in FP8_DECODE_SHAPES:
        nbytes = n * k + n * k // 16384
        ws = [_fp8(n, k, dev) for _ in range(copies(nbytes))]
        q, sq = act_quant(torch.randn(1, k, device=dev).to(torch.bfloat16), 128)
        t, graphed = time_rotating(ws, lambda w: fp8_gemm_quantized(q, sq, w[0], w[1]))
        rows.append((f"fp8_gemm_quantized {name} M=1 {n}x{k}", nbytes + k + k // 32 + 2 * n, t, graphed))
    n, k = 4096, 8192  # wo_b reads wo_a's bf16 output: act_quant + the GEMV, as the engine calls it
    nbytes = n * k + n * k // 16384
    ws = [_fp8(n, k, dev) for _ in range(copies(nbytes))]
    xk = torch.randn(1, k, device=dev).to(torch.bfloat16)
    t, graphed = time_rotating(ws, lambda w: fp8_gemm(xk, w[0], w[1]))
    rows.append((f"fp8_gemm wo_b M=1 {n}x{k} (act_quant + GEMV)", nbytes + 3 * k + 2 * n, t, graphed))
    # wo_a: 8 groups of 1024 rows over 4096 channels, bf16 activations, FP8 weight (the bf16
    # einsum on the dequantised weight is what native ran before)
    g, r, k = 8, 1024, 4096
    nbytes = g * r * k + g * r * k // 16384
    ws = [_fp8(g * r, k, dev) for _ in range(copies(nbytes))]
    xo = torch.randn(1, g * k, device=dev).to(torch.bfloat16)
    t, graphed = time_rotating(ws, lambda w: grouped_linear(xo, w[0], w[1], g))
    rows.append((f"grouped_linear wo_a M=1 {g}x{r}x{k}", nbytes + 2 * g * k + 2 * g * r, t, graphed))
    wb = [fp8_dequant_bf16(w[0], weight_scales_f32(w[1], None), 128, 128).view(g, r, k)
          for w in ws[:copies(2 * g * r * k)]]
    t, graphed = time_rotating(wb, lambda w: torch.einsum("sgi,gri->sgr", xo.view(1, g, k), w))
    rows.append((f"bf16 einsum wo_a (before) M=1 {g}x{r}x{k}", 2 * g * r * k + 2 * g * k + 2 * g * r, t, graphed))
    if dense_only:
        return rows
    for name, n, k in [("expert w1/w3", 2048, 4096), ("expert w2", 4096, 2048)]:
        nbytes = n * k // 2 + n * k // 32
        ws = [_fp4(n, k, dev) for _ in range(copies(nbytes))]
        xk = torch.randn(1, k, device=dev).to(torch.bfloat16)
        t, graphed = time_rotating(ws, lambda w: fp4_gemm(xk, w[0], w[1]))
        rows.append((f"fp4_gemm {name} M=1 {n}x{k}", nbytes + 3 * k + 2 * n, t, graphed))
    # six experts' w1 in one launch, from an arena of 64 slots
    n, k, g = 2048, 4096, 6
    per = n * k // 2 + n * k // 32
    arena = fp4_arena(64, n, k, dev)
    xg = torch.randn(g, k, device=dev).to(torch.bfloat16)
    t, graphed = time_rotating(slot_sets(64, g, dev), lambda s: fp4_gemm_grouped(xg, arena, 0, arena, n * k // 2,
                                                                                   n, k, s))
    rows.append((f"fp4_gemm_grouped 6 experts {n}x{k}", g * per + g * (3 * k + 2 * n), t, graphed))
    # decode's routed w1 and w3 of six experts in one launch (two parts), x quantised once
    arena2 = fp4_arena(64, 2 * n, k, dev)  # records: w1|w3 weights, then their scales
    q, sq = act_quant(xg[:1].unsqueeze(1), 128)
    for early in (False, True):  # the engine's decode launches it early (engine/moe.py)
        t, graphed = time_rotating(slot_sets(64, g, dev), lambda s: grouped_gemv(
            q, sq, arena2, (0, n * k // 2), arena2, (n * k, n * k + n * k // 32), n, k, s, torch.bfloat16,
            early=early))
        rows.append((f"fp4 w1+w3 6 experts, one launch{' early' if early else ''} {n}x{k}",
                     2 * g * per + 2 * k + 4 * g * n, t, graphed))
    rows.extend(fp4_tile_rows(dev, arena2, n, k, g))
    for m in (2, 4, 8):  # a few tokens per expert (short prefills): which kernel MMA_MIN_M picks
        rows.extend(fp4_tile_rows(dev, arena2, n, k, g, m, [(2, 4), (4, 4)], [(2, 4)]))
    # decode attention: 64 heads, 512 dims, 128 window + 512 compressed rows
    tlen, kk = 128 + 2048, 640
    q = torch.randn(1, 64, 512, device=dev).to(torch.bfloat16)
    kv = torch.randn(tlen, 512, device=dev).to(torch.bfloat16)
    idx = torch.randperm(tlen, device=dev)[:kk].view(1, kk)
    sink = torch.randn(64, device=dev)
    t, graphed = time_calls([lambda: sparse_attention(q, kv, idx, sink, 512 ** -0.5)] * CALLS_PER_GRAPH)
    rows.append((f"sparse_attention S=1 H=64 K={kk}", kk * 512 * 2 + 64 * 512 * (2 + 4) + kk * 8, t, graphed))
    rows.extend(sparse_split_rows(dev))
    return rows


def sparse_split_rows(dev) -> list[tuple[str, int, float, bool]]:
    """Decode's sparse attention (one query, 64 heads of 512) at K = 128 (window only) and 640
    (window + 512 selected) rows: its two launches apart and together, at every (rows per block,
    K splits) pair below, to choose the tiles from."""
    from kernels.toolkit import cuda_arch
    from kernels.sparse_attention import combine_kernel, partial_kernel

    arch, h, d, scale = cuda_arch(dev), 64, 512, 512 ** -0.5
    q = torch.randn(1, h, d, device=dev).to(torch.bfloat16)
    kv = torch.randn(128 + 2048, d, device=dev).to(torch.bfloat16)
    sink = torch.randn(h, device=dev)
    out = torch.empty(1, h, d, dtype=torch.bfloat16, device=dev)
    rows = []
    for kk in (128, 640):
        idx = torch.randperm(kv.shape[0], device=dev)[:kk].view(1, kk)
        nbytes = kk * d * 2 + h * d * (2 + 2) + kk * 8
        for bi, nsplit in [(64, 16), (64, 8), (64, 4), (32, 16), (32, 8), (32, 32)]:
            po = torch.empty(1, nsplit, h, d, device=dev)
            pm, pl = torch.empty(1, nsplit, h, device=dev), torch.empty(1, nsplit, h, device=dev)
            part = partial_kernel(h, d, scale, nsplit, arch, bi)
            comb = combine_kernel(h, d, scale, nsplit, "bfloat16", arch)
            name = f"sparse K={kk} block {bi} splits {nsplit}"
            for what, call in [("partial", lambda: part(q, kv, idx, po, pm, pl)),
                               ("combine", lambda: comb(po, pm, pl, sink, out)),
                               ("both", lambda: (part(q, kv, idx, po, pm, pl), comb(po, pm, pl, sink, out)))]:
                t, graphed = time_calls([call] * CALLS_PER_GRAPH)
                rows.append((f"{name} {what}", nbytes, t, graphed))
    return rows


# (heads, threads) a CTA of prefill's sparse attention, the first the reference for the others
PREFILL_ATTENTION_TILES = ((16, 128), (32, 256), (64, 256), (64, 512))


def prefill_attention_rows(dev, queries: int = 2048, tiles=PREFILL_ATTENTION_TILES) -> list[tuple[str, float, float]]:
    """Prefill's sparse attention (`queries` queries of 64 heads of 512, K = 640 selected rows of
    the chunk's keys, one split) at each (heads, threads) a CTA: (name, ms per call, largest
    difference from the first tile's fp32 output). The selected rows are a sliding window of 128
    plus 512 random rows, as a CSA layer's."""
    from kernels.sparse_attention import partial_kernel
    from kernels.toolkit import cuda_arch

    arch, h, d, scale = cuda_arch(dev), 64, 512, 512 ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(queries, h, d, device=dev, generator=g).to(torch.bfloat16)
    kv = torch.randn(queries + queries // 4, d, device=dev, generator=g).to(torch.bfloat16)
    pos = torch.arange(queries, device=dev)
    window = (pos[:, None] - torch.arange(128, device=dev)).clamp_min(-1)
    chosen = torch.randint(queries, queries + queries // 4, (queries, 512), device=dev, generator=g)
    idx = torch.cat((window, chosen), dim=1)
    po = torch.empty(queries, 1, h, d, device=dev)
    pm, pl = torch.empty(queries, 1, h, device=dev), torch.empty(queries, 1, h, device=dev)
    rows, first = [], None
    for bh, threads in tiles:
        part = partial_kernel(h, d, scale, 1, arch, 0, bh, threads)
        t = median_seconds(lambda: part(q, kv, idx, po, pm, pl))
        out = po.clone()
        first = out if first is None else first
        rows.append((f"sparse prefill S={queries} K=640 heads {bh} threads {threads}", t * 1e3,
                     (out - first).abs().max().item()))
    return rows


def few_query_attention_rows(dev, queries: int, nsplits=(32, 16, 8, 4, 2)) -> list[tuple[str, int, float, bool]]:
    """A chunk step's sparse attention (`queries` queries of 64 heads of 512, K = 640 selected rows
    as a CSA layer's: a window of 128 and 512 chosen) at decode's tiles and each count of K splits
    (kernels/sparse_attention.py `splits`): both launches, the partial outputs the combine reads
    back growing with the splits. Bytes: the selected rows, read once per query."""
    from kernels.sparse_attention import TILE_PARAMS, combine_kernel, partial_kernel
    from kernels.toolkit import cuda_arch

    arch, h, d, k, scale = cuda_arch(dev), 64, 512, 640, 512 ** -0.5
    p = TILE_PARAMS[arch]
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(queries, h, d, device=dev, generator=g).to(torch.bfloat16)
    kv = torch.randn(4096, d, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 4096, (queries, k), device=dev, generator=g)
    sink = torch.zeros(h, device=dev)
    out = torch.empty(queries, h, d, dtype=torch.bfloat16, device=dev)
    rows = []
    for nsplit in nsplits:
        po = torch.empty(queries, nsplit, h, d, device=dev)
        pm, pl = torch.empty(queries, nsplit, h, device=dev), torch.empty(queries, nsplit, h, device=dev)
        part = partial_kernel(h, d, scale, nsplit, arch, p["decode_block_i"], p["block_h"], p["threads"])
        comb = combine_kernel(h, d, scale, nsplit, "bfloat16", arch, 0)

        def both(part=part, comb=comb, po=po, pm=pm, pl=pl):
            part(q, kv, idx, po, pm, pl)
            comb(po, pm, pl, sink, out)
        t, graphed = time_calls([both] * CALLS_PER_GRAPH)
        rows.append((f"sparse attention S={queries} K={k} splits {nsplit}", queries * k * d * 2, t, graphed))
    return rows


def layer_op_rows(dev) -> list[tuple[str, int, float, bool]]:
    """The small ops every layer runs, at decode shapes (one token, n = 4 streams of D = 4096,
    bf16): mHC pre (mix + gate), mHC post (Sinkhorn folded in), the RMSNorm + FP8
    quantisation. They are latency-bound; the bytes are what they must move."""
    from kernels.mhc import hc_post, hc_pre
    from kernels.rms_norm_quant import rms_norm_quant

    n, d, cols = 4, 4096, 24
    streams = torch.randn(1, n, d, device=dev).to(torch.bfloat16)
    fn = torch.randn(cols, n * d, device=dev) * 0.02
    scale, base = torch.ones(cols, device=dev), torch.zeros(cols, device=dev)
    out, post = torch.randn(1, d, device=dev).to(torch.bfloat16), torch.rand(1, n, device=dev)
    comb = torch.rand(1, n, n, device=dev)
    x, w = torch.randn(1, d, device=dev).to(torch.bfloat16), torch.ones(d, device=dev)
    cases = [(f"hc_pre S=1 n={n} D={d} (2 launches)", 4 * cols * n * d + 2 * 2 * n * d + 2 * d,
              lambda: hc_pre(streams, fn, scale, base, n, 1e-6, 1e-6)),
             (f"hc_post S=1 n={n} D={d}", 2 * 2 * n * d + 2 * d,
              lambda: hc_post(out, streams, post, comb, 20, 1e-6, early=True)),
             (f"rms_norm_quant 1x{d}", 2 * d + 4 * d + 2 * d + d + d // 32, lambda: rms_norm_quant(x, w, 1e-6))]
    rows = []
    for name, nbytes, call in cases:
        t, graphed = time_calls([call] * CALLS_PER_GRAPH)
        rows.append((name, nbytes, t, graphed))
    return rows


def index_picks_rows(dev, sizes=(16, 128, 512, 2048, 4096, 8192), queries=(1, 128)) -> list[tuple[str, float, float]]:
    """A CSA step's key rows from its index scores (top 512 of N entry slots, window of 128): the
    in-kernel ranking (`kernels.index_picks`) against torch's stable sort + `kernels.sparse_index`
    (what the wrapper falls back to above MAX_N), graphed, per (queries, N) -> (name, us, us)."""
    from kernels import reference as ref
    from kernels.index_picks import index_picks_kernel, kernel_threads
    from kernels.sparse_index import sparse_index
    from kernels.toolkit import cuda_arch

    rows, arch = [], cuda_arch(dev)
    for s in queries:
        for n in sizes:
            scores = torch.randn(s, n, device=dev)
            window, visible = torch.arange(128, device=dev).expand(s, -1).contiguous(), torch.full((s,), n, device=dev)
            k, out = min(512, n), torch.empty(s, 128 + 512, dtype=torch.int64, device=dev)
            kernel = index_picks_kernel(128, n, k, 128, 512, kernel_threads(n), arch)
            ranked, _ = time_calls([lambda: kernel(scores, window, visible, out)] * CALLS_PER_GRAPH)
            sorted_, _ = time_calls([lambda: sparse_index(window, ref.topk_desc(scores, k), visible, k, 128, 512)]
                                    * CALLS_PER_GRAPH)
            rows.append((f"S={s} N={n}", ranked * 1e6, sorted_ * 1e6))
    return rows


CUDA_TILES = [(1, 4), (2, 4), (4, 4), (2, 8), (4, 8)]  # (rows per warp, warps) of the CUDA-core FP4 GEMV
MMA_TILES = [(1, 8), (2, 8), (1, 4), (2, 4), (4, 4), (2, 2), (4, 2)]  # (tiles, ksplit warps) of the MMA one
MMA1_TILES = [(2, 4), (2, 4, True), (2, 2, True, 2), (2, 2, True, 3), (2, 4, True, 3), (2, 4, True, 4), (2, 8, True, 4)]
# (tiles, ksplit warps[, early[, depth]]) of the one-token MMA kernel (early: slots and weights read
# before the wait on the kernel before; depth: loads kept that many blocks ahead of the sums)


def fp4_tile_rows(dev, arena, n: int, k: int, g: int, m: int = 1, cuda_tiles=CUDA_TILES,
                  mma_tiles=MMA_TILES, mma1_tiles=MMA1_TILES) -> list[tuple[str, int, float, bool]]:
    """Decode's routed w1+w3 launch (two parts of `arena`'s records, m activation rows shared by
    the g experts) and its w2 launch (N = k, K = n, m rows per expert, fp32 out): the CUDA-core
    kernel at `cuda_tiles`, the tensor-core kernel (kernels/fp4_mma_few_tokens.py) at `mma_tiles` and, at one
    row, the one-token tensor-core kernel (kernels/fp4_mma_one_token.py) at `mma1_tiles`, to choose the
    kernel and its tiles from."""
    from kernels.act_quant import act_quant
    from kernels.toolkit import cuda_arch
    from kernels.fp4_mma_few_tokens import fp4_mma_few_tokens_kernel
    from kernels.fp4_mma_one_token import fp4_mma_one_token_kernel
    from kernels.fp4_mma_one_token import splits as mma1_splits
    from kernels.fp4_mma_one_token import supports as mma1_supports
    from kernels.fp4_moe import fp4_gemv_kernel
    from kernels.gemv import as_words

    arch = cuda_arch(dev)
    per = n * k // 2 + n * k // 32  # one weight's codes and scales
    q, sq = act_quant(torch.randn(1, m, k, device=dev).to(torch.bfloat16), 128)  # w1+w3's inputs [1, m, k]
    q2, s2 = act_quant(torch.randn(g, m, n, device=dev).to(torch.bfloat16), 128)  # w2's inputs [G, m, n]
    arena_w2 = fp4_arena(64, k, n, dev)
    # (name, N, K, arena, weight offsets, scale offsets, activations, scales, out, bytes per call)
    shapes = [("w1+w3", n, k, arena, (0, n * k // 2), (n * k, n * k + n * k // 32), q, sq, "bfloat16",
               2 * g * per + m * (k + k // 32) + 4 * g * m * n),
              ("w2", k, n, arena_w2, (0,), (n * k // 2,), q2, s2, "float32",
               g * per + g * m * (n + n // 32) + 4 * g * m * k)]  # G·m activation rows in, fp32 out
    tables = slot_sets(64, g, dev)  # the same slot choices for every kernel and tile
    rows = []
    for name, nn, kk, ar, w_off, s_off, qa, sa, out, nbytes in shapes:
        y = torch.empty(len(w_off), g, m, nn, dtype=getattr(torch, out), device=dev)
        for tile in cuda_tiles:
            kernel = fp4_gemv_kernel(m, nn, kk, ar.shape[1], w_off, ar.shape[1], s_off, *tile, out, arch)
            t, graphed = time_rotating(tables, lambda s: kernel(
                as_words(qa), sa, as_words(ar), ar, s, y))
            rows.append((f"fp4 {name} {g}x{m} rows {nn}x{kk} tile {tile[0]}x{tile[1]}", nbytes, t, graphed))
        for tiles, ksplit in mma_tiles:  # the tensor-core kernel
            kernel = fp4_mma_few_tokens_kernel(m, nn, kk, ar.shape[1], w_off, ar.shape[1], s_off, tiles, ksplit, out,
                                               arch)
            t, graphed = time_rotating(tables, lambda s: kernel(
                as_words(qa), sa, as_words(ar), as_words(ar), s, y))
            rows.append((f"fp4 MMA {name} {g}x{m} rows {nn}x{kk} {tiles}t x{ksplit}w", nbytes, t, graphed))
        for tiles, ksplit, *opts in mma1_tiles if m == 1 else ():  # the one-token tensor-core kernel
            early, depth = (*opts, False, 0)[:2]
            if not (mma1_supports(kk, s_off, ar.shape[1]) and mma1_splits(kk, ksplit)):
                continue
            kernel = fp4_mma_one_token_kernel(nn, kk, ar.shape[1], w_off, ar.shape[1], s_off, tiles, ksplit, out,
                                              arch, False, early, depth)
            t, graphed = time_rotating(tables, lambda s: kernel(
                as_words(qa), sa, as_words(ar), as_words(ar), s, y))
            label = (" early" if early else "") + (f" depth {depth}" if depth else "")
            rows.append((f"fp4 MMA1 {name} {g}x1 rows {nn}x{kk} {tiles}t x{ksplit}w{label}", nbytes, t, graphed))
    return rows


def chunk_rows(dev, m: int = 16) -> list[tuple[str, int, float, bool]]:
    """A chunk step's largest launches at `m` token rows (engine/decode_graph.py `DecodeRunner.chunk`):
    every FP8 linear of a layer by the dispatched kernel (fp8_gemm_quantized: the tensor cores'
    few-token GEMV on sm_90), the CUDA-core GEMV and cuBLAS's block-scaled FP8 GEMM; wo_a's grouped
    projection (bf16 activations) dispatched and on the CUDA-core grouped GEMV; and the
    routed experts of a 24-expert layer (m tokens x 6 choices) in runs of m cells per expert
    (each expert read once) against one cell per group (each cell reading its expert)."""
    from kernels.act_quant import act_quant
    from kernels.fp4_moe import fp4_moe
    from kernels.fp8_gemm import blockwise_mm, fp8_gemm_quantized, fp8_gemv_kernel, gemv_tile
    from kernels.gemv import as_words, scale_bytes
    from kernels.grouped_linear import grouped_gemv_kernel, grouped_linear
    from kernels.toolkit import cuda_arch
    from engine.moe import ExpertRuns
    from engine.pack import FieldLayout

    arch = cuda_arch(dev)
    rows = []
    for name, n, k in FP8_DECODE_SHAPES:
        nbytes = n * k + n * k // 16384
        ws = [(w, s, torch.pow(2.0, scale_bytes(s).float() - 127.0))  # the fp32 scales, as the engine holds them
              for w, s in (_fp8(n, k, dev) for _ in range(copies(nbytes)))]
        q, sq = act_quant(torch.randn(m, k, device=dev).to(torch.bfloat16), 128)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
        core = fp8_gemv_kernel(m, n, k, *gemv_tile(n, k, arch), arch)
        for label, call in (("dispatched", lambda w: fp8_gemm_quantized(q, sq, w[0], w[1])),
                            ("CUDA-core GEMV", lambda w: core(as_words(q), sq, as_words(w[0]), scale_bytes(w[1]), y)),
                            ("cuBLAS block-scaled", lambda w: blockwise_mm(q, sq, w[0], w[1], w[2]))):
            t, graphed = time_rotating(ws, call)
            rows.append((f"fp8 {name} M={m} {n}x{k} {label}", nbytes + m * (k + 2 * n), t, graphed))
    g, r, k = 8, 1024, 4096  # wo_a: bf16 activations of 8 groups, FP8 weight
    nbytes = g * r * k + g * r * k // 16384
    ws = [_fp8(g * r, k, dev) for _ in range(copies(nbytes))]
    xo = torch.randn(m, g * k, device=dev).to(torch.bfloat16)
    y = torch.empty(m, g * r, dtype=torch.bfloat16, device=dev)
    core = grouped_gemv_kernel(m, g, k, g * r, *gemv_tile(g * r, k, arch), arch)
    for label, call in (("dispatched", lambda w: grouped_linear(xo, w[0], w[1], g)),
                        ("CUDA-core GEMV", lambda w: core(xo, as_words(w[0]), scale_bytes(w[1]), y))):
        t, graphed = time_rotating(ws, call)
        rows.append((f"grouped_linear wo_a M={m} {g}x{r}x{k} {label}", nbytes + m * 2 * g * (k + r), t, graphed))
    rows.extend(few_query_attention_rows(dev, m))
    experts, k_routed, inter, dim = 24, 6, 2048, 4096
    shapes = {"w1.weight": (inter, dim // 2), "w1.scale": (inter, dim // 32), "w3.weight": (inter, dim // 2),
              "w3.scale": (inter, dim // 32), "w2.weight": (dim, inter // 2), "w2.scale": (dim, inter // 32)}
    fields, off = {}, 0
    for name, shape in shapes.items():  # engine/pack.py's record order; bytes
        fields[name] = FieldLayout(off, shape[0] * shape[1], "U8", shape)
        off += shape[0] * shape[1]
    arena = torch.randint(0, 256, (experts * 4, off), device=dev, dtype=torch.uint8)  # codes, then sane scales
    for name, f in fields.items():
        if name.endswith("scale"):
            arena[:, f.offset:f.offset + f.nbytes] = torch.randint(118, 128, (experts * 4, f.nbytes), device=dev,
                                                                    dtype=torch.uint8)
    x = torch.randn(m, dim, device=dev).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, device=dev)[:k_routed] for _ in range(m)])
    w = torch.rand(m, k_routed, device=dev)
    tables = [torch.randperm(experts * 4, device=dev)[:experts].to(torch.int32) for _ in range(4)]
    runs = ExpertRuns(idx, experts)
    per_run, spread = runs.tokens, runs.spread(w)
    cells = torch.arange(m, device=dev).repeat_interleave(k_routed)
    nbytes = experts * off
    t, graphed = time_rotating(tables, lambda tb: fp4_moe(x, arena, fields, tb.repeat_interleave(m), spread,
                                                          10.0, [], per_run, m))
    rows.append((f"fp4_moe {experts} experts, runs of {m}", nbytes, t, graphed))
    t, graphed = time_rotating(tables, lambda tb: fp4_moe(x, arena, fields, tb.index_select(0, idx.reshape(-1)),
                                                          w.reshape(-1), 10.0, [], cells))
    rows.append((f"fp4_moe {m * k_routed} cells, one a group", nbytes, t, graphed))
    n, k = inter, dim  # the runs' two launches alone, per tile
    rows.extend(fp4_tile_rows(dev, fp4_arena(4 * experts, 2 * n, k, dev), n, k, experts, m, [],
                              [(2, 4), (2, 2), (2, 8), (1, 4), (4, 4), (4, 2), (4, 1)], []))
    return rows


def print_table(rows, ceiling: float) -> None:
    print(f"HBM device-to-device copy: {ceiling / 1e9:.0f} GB/s (read + write)")
    print(f"| {'kernel (decode shape)':44s} | {'bytes':>11s} | {'us/call':>8s} | {'GB/s':>7s} | {'% copy':>6s} | graph |")
    print(f"|{'-' * 46}|{'-' * 13}|{'-' * 10}|{'-' * 9}|{'-' * 8}|-------|")
    for name, nbytes, t, graphed in rows:
        bw = nbytes / t
        print(f"| {name:44s} | {nbytes:11,d} | {t * 1e6:8.2f} | {bw / 1e9:7.0f} | {100 * bw / ceiling:5.1f}% | "
              f"{'yes' if graphed else 'no':5s} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense-only", action="store_true",
                    help="only the small ops and the dense (FP8, wo_a) weights, not the FP4 and attention rows")
    ap.add_argument("--chunk", type=int, metavar="M",
                    help="only a chunk step's FP8 linears and routed experts at M token rows, per kernel")
    ap.add_argument("--prefill-attention", type=lambda v: [int(x) for x in v.split(",")], metavar="S,S",
                    help="only prefill's sparse attention at these query counts, per (heads, threads) a CTA")
    ap.add_argument("--index-picks", action="store_true",
                    help="only a CSA step's key rows: the in-kernel ranking against torch's sort, per entry count")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels needs a CUDA GPU")
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev))
    if a.prefill_attention:
        print("| launch | ms | max diff from the first |")
        print("|---|---|---|")
        for s in a.prefill_attention:
            for name, ms, diff in prefill_attention_rows(dev, s):
                print(f"| {name} | {ms:.3f} | {diff:.3g} |")
        return
    if a.index_picks:
        print("| queries, entry slots | in-kernel rank, us | torch sort + sparse_index, us |")
        print("|---|---|---|")
        for name, ranked, sorted_ in index_picks_rows(dev):
            print(f"| {name} | {ranked:.2f} | {sorted_:.2f} |")
        return
    ceiling = copy_bandwidth(dev)
    print_table(chunk_rows(dev, a.chunk) if a.chunk else bench_rows(dev, a.dense_only), ceiling)


if __name__ == "__main__":
    main()
