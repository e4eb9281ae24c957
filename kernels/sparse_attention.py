"""Sparse attention with a learned sink on CUDA (TileLang); contract of `reference.sparse_attention`.

q [S, H, D] bf16, kv [T, D] bf16 (key = value), idx [S, K] int (-1 = absent), sink [H] fp32 ->
out [S, H, D] in q's dtype (the fp32 result rounded once; fp32 on request): one softmax per
(query, head) over the selected rows whose denominator also holds exp(sink_h) (spec §C.4 steps
10–12).

One CTA per (query, block of heads, split of the K selected rows) walks its rows in blocks
of `block_i`: it gathers the rows into shared memory (absent rows load row 0 and get a -inf
score), computes the scores on the tensor cores (bf16 inputs, fp32 accumulation, exact
products), and keeps an online softmax. The probabilities are split into a bf16 high part and a
bf16 remainder and both multiply the rows, so P·V carries about 16 mantissa bits (the official
kernel rounds P to bf16 once; the reference keeps fp32). A second launch combines the splits'
partial softmaxes (flash-decoding), adds the sink to the denominator last and rounds the result. Decode (one
query: 4 CTAs per call without splits) uses `splits` splits of `decode_block_i`-row blocks and
16 heads a CTA; prefill fills the GPU with queries and uses one split of `block_i`-row blocks
and `prefill_block_h` heads a CTA, which gathers each selected row once for all of them.

Tile sizes per compute capability are in TILE_PARAMS; sm_90 is tested, sm_121 (GB10, ~99 KB
shared memory per block: 16×512 + 2×block_i×512 bf16 fits at block_i = 32) is untested.
"""

import torch

from kernels import pdl, reference as ref
from kernels.rope import rope_angle, rotate_pair
from kernels.toolkit import KernelInputError, compile_kernel, cuda_arch, kernel_factory, tile_params

# decode_block_i: rows per block when the K rows are split (decode). H200 (bench.kernels' sweep,
# one query, 64 heads): both launches 7.80 us at K = 640 with 32 rows x 32 splits vs 9.14 at
# 64 x 16, and 8.36 vs 9.56 at K = 128: a CTA's one block of rows is latency-bound, so smaller.
# few_query_ctas: the CTAs a few queries' split launch may take (`splits`). H200, K = 640, both
# launches (`python -m bench.kernels --chunk 16`): 16 queries 82.9 / 53.7 / 33.6 / 21.4 / 32.1 us
# at 32 / 16 / 8 / 4 / 2 splits, 8 queries 39.4 / 29.4 / 18.1 us at 32 / 16 / 8.
# prefill_block_h / prefill_threads: heads and threads a CTA when the queries fill the GPU (a
# selected row is gathered into shared memory once per head block). H200, 2,048 queries of 64
# heads, K = 640 (`python -m bench.kernels --prefill-attention 2048`): 0.88 ms at 64 heads and
# 256 threads against 2.29 at 16 and 128, the same output bit for bit.
# A chunk step's token slots (engine/decode_graph.py's CHUNK_SLOTS): `splits` treats 2..16 queries alike.
FEW_QUERIES = 16
TILE_PARAMS = {
    (9, 0): {"block_h": 16, "block_i": 64, "decode_block_i": 32, "threads": 128, "stages": 2, "min_ctas": 132,
             "splits": 32, "few_query_ctas": 256, "prefill_block_h": 64, "prefill_threads": 256},
    (12, 1): {"block_h": 16, "block_i": 32, "decode_block_i": 32, "threads": 128, "stages": 1, "min_ctas": 48,
              "splits": 8, "few_query_ctas": 192, "prefill_block_h": 16, "prefill_threads": 128},
}
DEFAULT_TILE = {"block_h": 16, "block_i": 32, "decode_block_i": 32, "threads": 128, "stages": 1, "min_ctas": 64,
                "splits": 8, "few_query_ctas": 256, "prefill_block_h": 16, "prefill_threads": 128}
_LOG2E = 1.4426950408889634
_NO_MAX = -(2.0 ** 30)  # a finite "-inf" for running maxima: keeps (m_prev - m) free of inf - inf
_OUT_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


@kernel_factory
def partial_kernel(heads: int, dim: int, scale: float, nsplit: int, arch: tuple[int, int], block_i: int = 0,
                   block_h: int = 0, threads: int = 0):
    """(Q [S,H,D] bf16, KV [T,D] bf16, IDX [S,K] int64, PO [S,nsplit,H,D] fp32, PM, PL [S,nsplit,H] fp32);
    rows per block `block_i`, heads per CTA `block_h`, `threads` per CTA (0: the architecture's
    decode tiles).

    Split `sp` of query s covers blocks sp·per .. (sp+1)·per - 1 of its K selected rows (per =
    ceil(blocks / nsplit)) and writes its unnormalised output PO, running max PM and sum of
    exponentials PL (relative to PM); H % block_h == 0."""
    import tilelang
    import tilelang.language as T

    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    bh, bi, n_threads = block_h or p["block_h"], block_i or p["block_i"], threads or p["threads"]
    # the score GEMM [bh, bi]: warps along its columns while each gets 8 or more, else a grid
    qk_policy = T.GemmWarpPolicy.FullCol if bi >= 8 * (n_threads // 32) else T.GemmWarpPolicy.Square
    s_len, t_len, k_len = T.dynamic("s_len"), T.dynamic("t_len"), T.dynamic("k_len")
    c = scale * _LOG2E  # exp(x * scale) = exp2(x * c)

    @T.prim_func
    def sparse_attn_partial(Q: T.Tensor((s_len, heads, dim), "bfloat16"), KV: T.Tensor((t_len, dim), "bfloat16"),
                            IDX: T.Tensor((s_len, k_len), "int64"),
                            PO: T.Tensor((s_len, nsplit, heads, dim), "float32"),
                            PM: T.Tensor((s_len, nsplit, heads), "float32"),
                            PL: T.Tensor((s_len, nsplit, heads), "float32")):
        with T.Kernel(s_len, heads // bh, nsplit, threads=n_threads) as (s, hb, sp):
            q_sh = T.alloc_shared((bh, dim), "bfloat16")
            kv_sh = T.alloc_shared((bi, dim), "bfloat16")
            p_hi = T.alloc_shared((bh, bi), "bfloat16")
            p_lo = T.alloc_shared((bh, bi), "bfloat16")
            acc_s = T.alloc_fragment((bh, bi), "float32")
            acc_o = T.alloc_fragment((bh, dim), "float32")
            m_i = T.alloc_fragment((bh,), "float32")
            m_prev = T.alloc_fragment((bh,), "float32")
            l_i = T.alloc_fragment((bh,), "float32")
            l_blk = T.alloc_fragment((bh,), "float32")
            alpha = T.alloc_fragment((bh,), "float32")
            valid = T.alloc_fragment((bi,), "bool")
            pdl.begin(T, arch)

            per = T.ceildiv(T.ceildiv(k_len, bi), nsplit)  # blocks of rows per split
            T.copy(Q[s, hb * bh:(hb + 1) * bh, :], q_sh)
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, _NO_MAX)
            for it in T.Pipelined(per, num_stages=p["stages"]):
                base = (sp * per + it) * bi  # first selected row of this block
                for j in T.Parallel(bi):
                    valid[j] = T.if_then_else(base + j < k_len, IDX[s, T.min(base + j, k_len - 1)], T.int64(-1)) >= 0
                for j, d in T.Parallel(bi, dim):  # absent rows load row 0 and score -inf
                    kv_sh[j, d] = KV[T.max(T.if_then_else(base + j < k_len,
                                                          IDX[s, T.min(base + j, k_len - 1)], T.int64(0)), T.int64(0)), d]
                for h, j in T.Parallel(bh, bi):
                    acc_s[h, j] = T.if_then_else(valid[j], 0, -T.infinity("float32"))
                T.gemm(q_sh, kv_sh, acc_s, transpose_B=True, policy=qk_policy)
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_i, dim=1, clear=False)
                for h in T.Parallel(bh):
                    alpha[h] = T.exp2((m_prev[h] - m_i[h]) * c)
                for h, j in T.Parallel(bh, bi):
                    acc_s[h, j] = T.exp2(acc_s[h, j] * c - m_i[h] * c)
                T.reduce_sum(acc_s, l_blk, dim=1)
                for h in T.Parallel(bh):
                    l_i[h] = l_i[h] * alpha[h] + l_blk[h]
                for h, d in T.Parallel(bh, dim):
                    acc_o[h, d] = acc_o[h, d] * alpha[h]
                for h, j in T.Parallel(bh, bi):
                    p_hi[h, j] = acc_s[h, j]
                for h, j in T.Parallel(bh, bi):
                    p_lo[h, j] = acc_s[h, j] - T.Cast("float32", T.Cast("bfloat16", acc_s[h, j]))
                T.gemm(p_hi, kv_sh, acc_o, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(p_lo, kv_sh, acc_o, policy=T.GemmWarpPolicy.FullCol)
            T.copy(acc_o, PO[s, sp, hb * bh:(hb + 1) * bh, :])
            for h in T.Parallel(bh):
                PM[s, sp, hb * bh + h] = m_i[h]
                PL[s, sp, hb * bh + h] = l_i[h]

    return compile_kernel(sparse_attn_partial, arch, pass_configs={
        tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
    })


@kernel_factory
def combine_kernel(heads: int, dim: int, scale: float, nsplit: int, out_dtype: str, arch: tuple[int, int],
                   half: int = 0):
    """(PO [S,nsplit,H,D], PM, PL [S,nsplit,H], SINK [H] fp32, O [S,H,D] out_dtype): the splits'
    partial softmaxes rescaled to their common maximum, the sink added to the denominator last,
    the result rounded once into out_dtype. With `half` > 0: (PO, PM, PL, SINK, P [S] int64,
    F [half] fp32, O), the rounded result's trailing 2·half channels then rotated back by the
    query's RoPE angles (kernels/rope.py's inverse rotation, bit for bit)."""
    import tilelang.language as T

    s_len = T.dynamic("s_len")
    c = scale * _LOG2E
    threads = 128
    lead = dim - 2 * half  # channels before the rotary tail
    per = -(-dim // threads)  # channels a thread rotates back

    @T.macro
    def combined(PO, PM, PL, sink, m, total, w, acc, s, h):
        """acc [dim] = the softmax-weighted rows of (s, h), not yet divided; total[0] = the
        denominator; sink[0] = the head's sink (loaded before the wait: a weight)."""
        m[0] = _NO_MAX
        for sp in T.unroll(nsplit):  # unrolled: every split's loads in flight at once
            m[0] = T.max(m[0], PM[s, sp, h])
        total[0] = 0.0
        for sp in T.unroll(nsplit):
            w[sp] = T.exp2((PM[s, sp, h] - m[0]) * c)
            total[0] = total[0] + w[sp] * PL[s, sp, h]
        total[0] = total[0] + T.exp2(sink[0] * _LOG2E - m[0] * c)
        T.fill(acc, 0)
        for sp in T.unroll(nsplit):
            for d in T.Parallel(dim):
                acc[d] = acc[d] + w[sp] * PO[s, sp, h, d]

    if half:
        @T.prim_func
        def sparse_attn_combine(PO: T.Tensor((s_len, nsplit, heads, dim), "float32"),
                                PM: T.Tensor((s_len, nsplit, heads), "float32"),
                                PL: T.Tensor((s_len, nsplit, heads), "float32"),
                                SINK: T.Tensor((heads,), "float32"), P: T.Tensor((s_len,), "int64"),
                                F: T.Tensor((half,), "float32"), O: T.Tensor((s_len, heads, dim), out_dtype)):
            with T.Kernel(s_len, heads, threads=threads) as (s, h):
                tx = T.get_thread_binding()
                m = T.alloc_local((1,), "float32")
                total = T.alloc_local((1,), "float32")
                sink = T.alloc_local((1,), "float32")
                freq = T.alloc_local((per,), "float32")  # channel i·threads + tx's RoPE frequency
                w = T.alloc_local((nsplit,), "float32")
                acc = T.alloc_fragment((dim,), "float32")
                o_sh = T.alloc_shared((dim,), "float32")  # the rounded result, for the pairs
                sink[0] = SINK[h]  # the constants, before the wait (kernels/pdl.py)
                for i in T.unroll(per):
                    freq[i] = F[T.min(T.max(i * threads + tx - lead, 0) // 2, half - 1)]
                pdl.begin(T, arch)
                combined(PO, PM, PL, sink, m, total, w, acc, s, h)
                for d in T.Parallel(dim):
                    o_sh[d] = T.Cast("float32", T.Cast(out_dtype, acc[d] / total[0]))
                for i in T.unroll(per):  # channel d = i·threads + tx
                    d = i * threads + tx
                    re = lead + ((d - lead) // 2) * 2  # this channel's pair: (re, re + 1)
                    if d < dim:
                        angle = rope_angle(T, P[s], freq[i])
                        back = rotate_pair(T, o_sh[re], o_sh[re + 1], T.cos(angle), T.sin(angle), True)
                        O[s, h, d] = T.Cast(out_dtype, T.if_then_else(
                            d < lead, o_sh[d], T.if_then_else((d - lead) % 2 == 0, back[0], back[1])))
    else:
        @T.prim_func
        def sparse_attn_combine(PO: T.Tensor((s_len, nsplit, heads, dim), "float32"),
                                PM: T.Tensor((s_len, nsplit, heads), "float32"),
                                PL: T.Tensor((s_len, nsplit, heads), "float32"),
                                SINK: T.Tensor((heads,), "float32"), O: T.Tensor((s_len, heads, dim), out_dtype)):
            with T.Kernel(s_len, heads, threads=threads) as (s, h):
                m = T.alloc_local((1,), "float32")
                total = T.alloc_local((1,), "float32")
                sink = T.alloc_local((1,), "float32")
                w = T.alloc_local((nsplit,), "float32")
                acc = T.alloc_fragment((dim,), "float32")
                sink[0] = SINK[h]  # a weight: before the wait (kernels/pdl.py)
                pdl.begin(T, arch)
                combined(PO, PM, PL, sink, m, total, w, acc, s, h)
                for d in T.Parallel(dim):
                    O[s, h, d] = T.Cast(out_dtype, acc[d] / total[0])

    return compile_kernel(sparse_attn_combine, arch)


def splits(s_len: int, heads: int, arch: tuple[int, int]) -> int:
    """K splits per (query, head block): 1 when the queries fill the GPU (prefill), else the
    largest power of two up to the architecture's `splits` that keeps the launch within
    `few_query_ctas` CTAs: decode's one query takes them all, a chunk step's 16 queries fewer,
    since the combine reads back S x splits x H x D fp32 partial outputs (67 MB at 16 x 32).
    2..FEW_QUERIES queries split as FEW_QUERIES do: a chunk step runs that many slots whatever its
    real tokens, and an eager call of the same tokens must sum each query's keys in the same
    order, or the two differ in the last bits (4 % in the logits after the FP8 quantisations that
    follow). Fixed per query count, so a growing key count never compiles a new kernel."""
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    blocks = (FEW_QUERIES if 1 < s_len <= FEW_QUERIES else s_len) * (heads // p["block_h"])
    if blocks >= p["min_ctas"]:
        return 1
    n = p["splits"]
    while n > 1 and blocks * n > p["few_query_ctas"]:
        n //= 2
    return n


def launch_shape(s_len: int, heads: int, arch: tuple[int, int]) -> tuple[int, int, int, int]:
    """(nsplit, block_h, threads, block_i) of the partial launch for S queries of `heads` heads
    (0 = the kernel's default): decode's splits of 16-head blocks; prefill's head blocks of
    `prefill_block_h` (never more heads than the launch has, rounded up to 16) while the queries
    still fill the GPU with them, else of 16 heads."""
    p = tile_params(TILE_PARAMS, arch, DEFAULT_TILE)
    nsplit = splits(s_len, -(-heads // p["block_h"]) * p["block_h"], arch)
    if nsplit > 1:
        return nsplit, p["block_h"], p["threads"], p["decode_block_i"]
    bh = min(p["prefill_block_h"], -(-heads // 16) * 16)
    if bh > p["block_h"] and s_len * (-(-heads // bh)) >= p["min_ctas"]:
        return 1, bh, p["prefill_threads"], 0
    return 1, p["block_h"], p["threads"], 0


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                     scale: float, inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [S, H, D] bf16, kv [T, D] bf16, idx [S, K] (-1 absent), sink [H] -> [S, H, D] in q's
    dtype, as the reference (`out_dtype` torch.float32: the unrounded fp32 result);
    `inverse_rope` = (positions [S], inv_freq [R/2]): rotated back in the combine launch."""
    out_dtype = q.dtype if out_dtype is None else out_dtype
    s_len, heads, dim = q.shape
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        raise KernelInputError(f"sparse_attention takes bf16 q and kv, got {q.dtype} and {kv.dtype}")
    if kv.dim() != 2 or kv.shape[1] != dim or idx.dim() != 2 or idx.shape[0] != s_len or sink.shape != (heads,):
        raise KernelInputError(f"sparse_attention: shapes q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                               f"idx {tuple(idx.shape)}, sink {tuple(sink.shape)} do not agree")
    if dim % 64:
        raise KernelInputError(f"sparse_attention needs a head dim that is a multiple of 64, got {dim}")
    half = 0 if inverse_rope is None else inverse_rope[1].shape[-1]
    if inverse_rope is not None and (tuple(inverse_rope[0].shape) != (s_len,) or 2 * half > dim):
        raise KernelInputError(f"sparse_attention: inverse_rope positions {tuple(inverse_rope[0].shape)} and "
                               f"{2 * half} rotary channels do not fit q {tuple(q.shape)}")
    arch = cuda_arch(q.device)
    nsplit, bh, threads, block_i = launch_shape(s_len, heads, arch)
    hp = -(-heads // bh) * bh
    if out_dtype not in _OUT_DTYPES:
        raise KernelInputError(f"sparse_attention writes bf16 or fp32, not {out_dtype}")
    out = torch.empty(s_len, hp, dim, dtype=out_dtype, device=q.device)
    if s_len == 0:
        return out[:, :heads]
    if idx.shape[1] == 0 or kv.shape[0] == 0:  # nothing selected: every probability is 0
        out = out.zero_()[:, :heads]
        return out if inverse_rope is None else ref.rope(out, *inverse_rope, inverse=True)
    qp, sinkp = q, sink.float()
    if hp != heads:  # pad heads to the CTA's head block (padding heads are discarded)
        qp = torch.cat((q, q.new_zeros(s_len, hp - heads, dim)), dim=1)
        sinkp = torch.cat((sinkp, sinkp.new_zeros(hp - heads)))
    po = torch.empty(s_len, nsplit, hp, dim, dtype=torch.float32, device=q.device)
    pm = torch.empty(s_len, nsplit, hp, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    partial_kernel(hp, dim, float(scale), nsplit, arch, block_i, bh, threads)(
        qp.contiguous(), kv.contiguous(), idx.to(torch.int64).contiguous(), po, pm, pl)
    rope_args = () if inverse_rope is None else (inverse_rope[0].to(torch.int64).contiguous(),
                                                 inverse_rope[1].float().contiguous())
    combine_kernel(hp, dim, float(scale), nsplit, _OUT_DTYPES[out_dtype], arch, half)(
        po, pm, pl, sinkp.contiguous(), *rope_args, out)
    return out[:, :heads]
