"""Unit tests of the reference numerics (kernels/reference.py): the oracle for GPU kernels."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference as ref


@pytest.fixture(autouse=True)
def _seeded():
    """Random inputs are the same whatever ran before (the bounds below were checked on them)."""
    torch.manual_seed(0)


def test_pow2_scale_rounds_up_and_keeps_exact_powers():
    amax = torch.tensor([448.0, 449.0, 224.0, 300.0, 1e-9, 448.0 * 2 ** -10])
    s = ref.pow2_scale(amax, 448.0, 1e-4)
    assert s.tolist() == [1.0, 2.0, 0.5, 1.0, 2.0 ** math.ceil(math.log2(1e-4 / 448)), 2.0 ** -10]
    assert torch.all(torch.frexp(s).mantissa == 0.5)  # every scale a power of two


def test_act_quant_roundtrip_and_e4m3_rounding():
    x = torch.tensor([[448.0, -448.0, 1.0, 0.0] + [0.0] * 124])
    q, s = ref.act_quant(x, 128)
    assert s.item() == 1.0 and q.dtype == torch.float8_e4m3fn
    assert torch.equal(ref.act_dequant(q, s, 128), x)
    # e4m3 has 3 mantissa bits: in [8, 16) the spacing is 1; 9.5 ties to even (10 has mantissa
    # 010, 9 has 001) -> 10; 10.5 -> 10.
    y = torch.zeros(1, 128)
    y[0, :3] = torch.tensor([448.0, 9.5, 10.5])
    q, s = ref.act_quant(y, 128)
    assert ref.act_dequant(q, s, 128)[0, :3].tolist() == [448.0, 10.0, 10.0]


def test_act_quant_is_per_row_and_per_block():
    x = torch.randn(3, 256) * torch.tensor([[1.0], [100.0], [0.01]])
    x[:, 128:] *= 1000
    q, s = ref.act_quant(x, 128)
    assert s.shape == (3, 2)
    assert torch.all(s[:, 1] > s[:, 0])
    # 3 mantissa bits: at most half a unit in the last place (2^-4 relative) for normal e4m3
    # values; below 2^-6 the codes are subnormal with a fixed step 2^-9 of the block scale.
    err = (ref.act_dequant(q, s, 128) - x).abs()
    bound = torch.maximum(x.abs() * 2 ** -4, s.repeat_interleave(128, dim=1) * 2 ** -10)
    assert torch.all(err <= bound)


def test_e2m1_round_ties_to_even():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 0.3, 5.1, 6.0])
    assert ref.e2m1_round(v).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, 0.5, 6.0, 6.0]


def test_qdq4_uses_pow2_scale_per_32():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 32] = 6.0, 1.25, 12.0  # block 0: scale 1; block 1: scale 2
    y = ref.qdq4(x, 32)
    assert y[0, 0] == 6.0 and y[0, 1] == 1.0 and y[0, 32] == 12.0
    assert y.dtype == x.dtype


def test_qdq8_changes_values_like_e4m3():
    x = torch.tensor([[1.0, 1.0625, 1.125] + [0.0] * 61], dtype=torch.bfloat16)
    y = ref.qdq8(x, 64)
    assert y.dtype == torch.bfloat16
    assert y[0, :3].tolist() == [1.0, 1.0, 1.125]  # 1.0625 is a tie between 1 and 1.125 -> even


def test_fp4_unpack_record_order_and_table():
    # record order: bit 7 sign of a, bits 4..6 magnitude of b, bits 1..3 magnitude of a, bit 0 sign of b
    packed = torch.tensor([[0x22, 0x7F]], dtype=torch.uint8).view(torch.int8)
    assert ref.unpack_fp4(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    assert ref.fp4_official_order(packed).tolist() == [[0x21, 0xF7]]  # low nibble = element a
    scale = torch.tensor([[130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^3
    w = ref.dequant_fp4(torch.zeros(1, 16, dtype=torch.int8) + 0x14, scale)  # a = 2, b = 1
    assert w.shape == (1, 32) and w[0, :2].tolist() == [8.0, 4.0]
    w = ref.dequant_fp4(torch.zeros(1, 16, dtype=torch.uint8) + 0x83, scale)  # a = -0.5, b = -0
    assert w[0, :2].tolist() == [-4.0, 0.0] and str(w[0, 1].item()) == "-0.0"


def test_fp4_record_order_is_a_lossless_reordering_of_the_official_codes():
    official = torch.arange(256, dtype=torch.uint8)  # every pair of codes
    record = ref.fp4_record_order(official)
    assert sorted(record.tolist()) == list(range(256))
    assert torch.equal(ref.fp4_official_order(record), official)
    low_nibble_first = torch.stack((official & 0xF, official >> 4), dim=-1).flatten()
    assert torch.equal(ref.fp4_codes(record), low_nibble_first)
    assert torch.equal(ref.unpack_fp4(record[None]), ref.FP4_VALUES[low_nibble_first.long()][None])


def test_dequant_fp8_block_scales_by_block():
    w = torch.ones(256, 256).to(torch.float8_e4m3fn)
    s = torch.tensor([[127, 128], [126, 129]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    d = ref.dequant_fp8_block(w, s)
    assert d[0, 0] == 1 and d[0, 200] == 2 and d[200, 0] == 0.5 and d[255, 255] == 4


def test_fp8_gemm_equals_dequantised_product():
    torch.manual_seed(0)
    w = (torch.randn(128, 256) * 10).to(torch.float8_e4m3fn)
    s = torch.tensor([[120, 121]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.randn(3, 256).to(torch.bfloat16)
    q, sa = ref.act_quant(x, 128)
    want = (ref.act_dequant(q, sa, 128) @ ref.dequant_fp8_block(w, s).T).to(torch.bfloat16)
    assert torch.equal(ref.fp8_gemm(x, w, s), want)


def test_a_rows_product_does_not_depend_on_how_many_rows_are_multiplied():
    """A token's product is the same alone (a decode step) and among others (a prefill chunk):
    on some CPUs MKL rounds products of fewer than 4 rows differently (ref.matmul pads them)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 256, generator=g)
    for k, n in ((256, 512), (256, 24)):
        w = torch.randn(n, k, generator=g)
        full = ref.matmul(x[:, :k], w.T)
        for m in (1, 2, 3, 4, 5, 17):
            for start in (0, 5):
                assert torch.equal(ref.matmul(x[start:start + m, :k], w.T), full[start:start + m])
        assert torch.equal(full, x[:, :k] @ w.T)  # four rows and more: the plain product
    u = torch.randn(24, 4, 32, generator=g)  # [S, G, K]
    wg = torch.randn(4, 16, 32, generator=g)  # [G, R, K]
    whole = ref.grouped_matmul(u, wg)
    assert whole.shape == (24, 4, 16)
    assert all(torch.equal(ref.grouped_matmul(u[i:i + 1], wg), whole[i:i + 1]) for i in range(24))
    assert torch.allclose(whole, torch.einsum("sgi,gri->sgr", u, wg))


def test_hadamard_is_orthonormal_sylvester():
    eye = torch.eye(8)
    h = ref.hadamard(eye)
    assert torch.allclose(h @ h.T, eye, atol=1e-6)
    assert torch.allclose(h[1] * math.sqrt(8), torch.tensor([1.0, -1, 1, -1, 1, -1, 1, -1]))
    assert torch.allclose(h[2] * math.sqrt(8), torch.tensor([1.0, 1, -1, -1, 1, 1, -1, -1]))
    x = torch.randn(5, 128)
    assert torch.allclose(ref.hadamard(ref.hadamard(x)), x, atol=1e-5)


def test_yarn_frequencies_match_spec_bands():
    base = ref.rope_inv_freq(64, 160000.0)
    yarn = ref.rope_inv_freq(64, 160000.0, {"factor": 16, "original_seq_len": 65536, "beta_fast": 32,
                                           "beta_slow": 1})
    assert torch.equal(yarn[:16], base[:16])  # pairs 0-15 keep their frequency (low = 15)
    assert torch.allclose(yarn[25:], base[25:] / 16)  # pairs 25-31 divided by 16 (high = 25)
    assert torch.all(yarn[16:25] < base[16:25]) and torch.all(yarn[16:25] > base[16:25] / 16)


def test_rope_interleaved_trailing_and_inverse():
    x = torch.randn(3, 2, 8)
    inv = ref.rope_inv_freq(4, 10000.0)
    pos = torch.tensor([0, 1, 7])
    cos, sin = ref.rope_cos_sin(pos, inv)
    y = ref.apply_rope(x, cos, sin)
    assert torch.equal(y[..., :4], x[..., :4])  # leading dims untouched
    assert torch.equal(y[0], x[0])  # position 0: no rotation
    a = 1 * inv[0]  # position 1, pair 0 = channels (4, 5)
    assert torch.allclose(y[1, :, 4], x[1, :, 4] * torch.cos(a) - x[1, :, 5] * torch.sin(a))
    assert torch.allclose(y[1, :, 5], x[1, :, 4] * torch.sin(a) + x[1, :, 5] * torch.cos(a))
    assert torch.allclose(ref.apply_rope(y, cos, sin, inverse=True), x, atol=1e-6)


def test_sinkhorn_column_first_doubly_stochastic():
    logits = torch.randn(5, 4, 4) * 3
    m = ref.sinkhorn(logits, 20, 1e-6)
    assert torch.allclose(m.sum(-2), torch.ones(5, 4), atol=1e-3)  # 1 - eps/colsum: eps in the divisor
    assert torch.allclose(m.sum(-1), torch.ones(5, 4), atol=0.05)  # rows converge, columns exact
    one = ref.sinkhorn(logits, 1, 1e-6)  # one round = softmax + eps, then columns only
    assert torch.allclose(one.sum(-2), torch.ones(5, 4), atol=1e-3)
    assert not torch.allclose(one.sum(-1), torch.ones(5, 4), atol=0.05)


def test_hc_pre_hands_comb_logits_and_hc_post_projects_them():
    """HCPre returns the residual mix's logits z[2n:] (scale · r · fn·x + base); HCPost projects
    them by Sinkhorn, then mixes: post_k · out + Σ_j comb[j, k] · stream_j (spec §C.3)."""
    s, n, d, eps, hc_eps = 3, 4, 64, 1e-6, 1e-6
    cols = 2 * n + n * n
    streams = torch.randn(s, n, d).to(torch.bfloat16)
    fn, base = torch.randn(cols, n * d) * 0.1, torch.randn(cols)
    scale = torch.cat((torch.full((n,), 0.7), torch.full((n,), 1.3), torch.full((n * n,), 2.0)))
    x, post, logits = ref.hc_pre(streams, fn, scale, base, n, hc_eps, eps)
    flat = streams.double().flatten(1)
    z = (flat / (flat.pow(2).mean(-1, keepdim=True) + eps).sqrt()) @ fn.double().T * scale.double() + base.double()
    assert logits.shape == (s, n, n) and logits.dtype == torch.float32
    assert torch.allclose(logits.double(), z[:, 2 * n:].view(s, n, n), rtol=1e-5, atol=1e-5)
    assert torch.allclose(post.double(), 2 * torch.sigmoid(z[:, n:2 * n]), atol=1e-6)
    pre = torch.sigmoid(z[:, :n]) + hc_eps
    assert torch.allclose(x.double(), (pre.unsqueeze(-1) * streams.double()).sum(1), rtol=1e-2, atol=1e-2)

    out = torch.randn(s, d).to(torch.bfloat16)
    new = ref.hc_post(out, streams, post, logits, 20, hc_eps)
    comb = ref.sinkhorn(logits, 20, hc_eps).double()
    want = post.double().unsqueeze(-1) * out.double().unsqueeze(1) + torch.einsum(
        "sjk,sjd->skd", comb, streams.double())
    assert new.dtype == torch.bfloat16 and torch.allclose(new.double(), want, rtol=2 ** -7, atol=1e-6)
    assert torch.equal(ref.hc_post(out, streams, post, logits, 20, hc_eps, early=True), new)  # a kernel hint


def test_topk_breaks_ties_by_lowest_index():
    scores = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 0.5]])
    assert ref.topk_desc(scores, 4).tolist() == [[1, 3, 5, 0]]
    inf = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0]])
    assert ref.topk_desc(inf, 3).tolist() == [[1, 3, 0]]


def test_index_picks_orders_visible_slots_best_first():
    inf = float("-inf")
    # slots 1 and 3 tie (the lower first); slots 4 and 5 are not visible yet (they score -inf, as
    # the indexer's scores do): the fifth pick is -1; the window's rows lead, -1 pads to width
    scores = torch.tensor([[0.5, 2.0, 1.0, 2.0, inf, inf]])
    window = torch.tensor([[7, 8, -1]])
    got = ref.index_picks(scores, window, torch.tensor([4]), 5, 100, 7)
    assert got.dtype == torch.int64
    assert got.tolist() == [[7, 8, -1, 101, 103, 102, 100, -1, -1, -1]]
    # k < the visible count keeps the best k; each query has its own visible count
    two = ref.index_picks(torch.tensor([[3.0, 1.0, 2.0], [3.0, 1.0, 2.0]]), torch.tensor([[0], [1]]),
                          torch.tensor([3, 1]), 2, 10, 2)
    assert two.tolist() == [[0, 10, 12], [1, 10, -1]]


def test_sparse_attention_sink_and_absent_rows():
    q = torch.randn(2, 3, 8)
    kv = torch.randn(5, 8)
    idx = torch.tensor([[0, 2, -1], [4, -1, -1]])
    sink = torch.tensor([0.0, -1e9, 2.0])
    out = ref.sparse_attention(q, kv, idx, sink, 0.5)
    # Query 1 sees only row 4: P = e^s / (e^s + e^sink).
    s = (q[1] @ kv[4]) * 0.5
    p = torch.exp(s) / (torch.exp(s) + torch.exp(sink))
    assert torch.allclose(out[1], p.unsqueeze(-1) * kv[4], atol=1e-6)
    # Head 1's sink is -inf-like: the probabilities over its rows sum to 1.
    logits = torch.stack([q[0, 1] @ kv[0], q[0, 1] @ kv[2]]) * 0.5
    w = torch.softmax(logits, 0)
    assert torch.allclose(out[0, 1], w[0] * kv[0] + w[1] * kv[2], atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 128), (7, 384)])
def test_fp4_gemm_matches_dequantised_product(shape):
    m, k = shape
    packed = torch.randint(-128, 128, (64, k // 2), dtype=torch.int8)
    scale = torch.randint(120, 130, (64, k // 32), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.randn(m, k).to(torch.bfloat16)
    q, s = ref.act_quant(x, 128)
    want = (ref.act_dequant(q, s, 128) @ ref.dequant_fp4(packed, scale).T).to(torch.bfloat16)
    assert torch.equal(ref.fp4_gemm(x, packed, scale), want)


def _rope_by_the_book(x, cos, sin, inverse=False):
    """RoPE written plainly (negated sin for the inverse, stack + cast + cat)."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    s = -s if inverse else s
    tail = x[..., -r:].float().reshape(*x.shape[:-1], r // 2, 2)
    re, im = tail[..., 0], tail[..., 1]
    rot = torch.stack((re * c - im * s, re * s + im * c), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], rot.to(x.dtype)), dim=-1)


@pytest.mark.parametrize("shape,dtype", [((5, 64), torch.float32), ((3, 8, 64), torch.bfloat16),
                                         ((1, 16, 512), torch.bfloat16), ((7, 4, 128), torch.float32)])
def test_apply_rope_is_bitwise_the_plain_formula(shape, dtype):
    # apply_rope writes into one output with fewer ops (fewer GPU launches); the numbers must not move
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    ang = torch.randn(shape[0], 32, generator=g) * 10
    for inverse in (False, True):
        got = ref.apply_rope(x, ang.cos(), ang.sin(), inverse)
        assert got.dtype == dtype and torch.equal(got, _rope_by_the_book(x, ang.cos(), ang.sin(), inverse))


def _hadamard_by_the_book(x):
    n, y, h = x.shape[-1], x.float(), 1
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return (y.reshape(x.shape) / math.sqrt(n)).to(x.dtype)


@pytest.mark.parametrize("shape,dtype", [((3, 128), torch.float32), ((2, 4, 64), torch.bfloat16),
                                         ((5, 2), torch.float32), ((4, 1), torch.bfloat16)])
def test_hadamard_is_bitwise_the_plain_butterfly(shape, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    before = x.clone()
    got = ref.hadamard(x)
    assert got.dtype == dtype and torch.equal(got, _hadamard_by_the_book(x))
    assert torch.equal(x, before)  # the ping-pong buffers never alias the input


def test_norm_rope_writes_buffer_rows_in_place():
    """With out/rows, token s lands in out[rows[s]] bitwise as returned without them (the KV
    window row of a decode step); the other rows keep their values."""
    x = torch.randn(3, 128).to(torch.bfloat16)
    w, pos, inv_freq = torch.rand(128) + 0.5, torch.tensor([4, 90, 7]), ref.rope_inv_freq(32, 10000.0)
    want = ref.norm_rope(x, w, 1e-6, pos, inv_freq, 64)
    buf = torch.randn(6, 128).to(torch.bfloat16)
    before = buf.clone()
    rows = torch.tensor([5, 0, 3])
    assert ref.norm_rope(x, w, 1e-6, pos, inv_freq, 64, buf, rows) is None
    assert torch.equal(buf[rows], want)
    assert torch.equal(buf[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (128, 128)])
def test_fp8_weight_dequantises_to_bf16_exactly(n, k):
    """`reference.fp8_dequant_bf16` of an FP8 weight's 128x128 blocks, on the scales
    `kernels.fp8_gemm.weight_scales_f32` gives (prepared at load, or decoded from e8m0), equals
    the fp32 reference rounded to bf16, bit for bit: e4m3 times a power of two fits bf16; ragged
    edge blocks too."""
    from kernels.fp8_gemm import weight_scales_f32

    def dequant(w, scale, prepared=None):
        return ref.fp8_dequant_bf16(w, weight_scales_f32(scale, prepared), 128, 128)

    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(127 - 30, 127 + 10, (-(-n // 128), -(-k // 128)), generator=gen, dtype=torch.uint8)
    scale = exps.view(torch.float8_e8m0fnu)
    want = ref.dequant_fp8_block(w, scale)
    for prepared in (None, ref.e8m0_to_float(scale)):  # the scales' fp32 values, prepared at load
        got = dequant(w, scale, prepared)
        assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want.float())
    extremes = torch.tensor([[0, 1], [254, 127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^-127 .. 2^127
    w4 = torch.ones(256, 256).to(torch.float8_e4m3fn)
    assert torch.equal(dequant(w4, extremes, ref.e8m0_to_float(extremes)), dequant(w4, extremes))


@pytest.mark.parametrize("m,k", [(1, 4096), (7, 256), (3, 384)])
def test_fp8_dequant_of_activations_is_act_dequant_in_bf16(m, k):
    """reference.fp8_dequant_bf16 at blocks of 1 x 128 (act_quant's output, widened for prefill's
    GEMMs) equals act_dequant rounded to bf16, bit for bit, and loses nothing: every value is exact."""
    gen = torch.Generator().manual_seed(5)
    q, s = ref.act_quant(torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k), 128)
    got = ref.fp8_dequant_bf16(q, s, 1, 128)
    want = ref.act_dequant(q, s, 128)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want)


def test_moe_combine_of_cells_by_row_equals_the_combine_in_token_order():
    """Cells [N·k, D] in any order with the row of each (token, choice): the same bits as the
    cells put back in (token, choice) order first."""
    n, k, d = 5, 3, 64
    cells = torch.randn(n * k, d).to(torch.bfloat16)
    rows = torch.randperm(n * k).view(n, k)
    shared = torch.randn(n, d).to(torch.bfloat16)
    want = ref.moe_combine(cells[rows.reshape(-1)].view(n, k, d), shared, torch.bfloat16)
    assert torch.equal(ref.moe_combine(cells, shared, torch.bfloat16, rows), want)


def test_bf16_gemm_is_the_fp32_product_of_the_widened_operands():
    x = torch.randn(6, 256).to(torch.bfloat16)
    w = torch.randn(40, 256).to(torch.bfloat16)
    got = ref.bf16_gemm(x, w)
    assert got.dtype == torch.float32 and got.shape == (6, 40)
    assert torch.equal(got, ref.matmul(x.float(), w.float().T))
    assert (got - x.double() @ w.double().T).abs().max() < 1e-4  # exact products, fp32 sums


def test_compressor_pool_weighs_the_overlapping_slots_and_hands_prev_the_first_halves():
    r, d = 4, 6
    buf_kv, buf_gate = torch.randn(r, 2 * d), torch.randn(r, 2 * d)
    prev_kv, prev_gate = torch.randn(r, d), torch.randn(r, d)
    kv = torch.cat((prev_kv, buf_kv[:, d:]))  # the 2r slots: prev's rows, then the window's second halves
    gate = torch.cat((prev_gate, buf_gate[:, d:]))
    want = (kv * torch.softmax(gate, dim=0)).sum(dim=0, keepdim=True)
    got = ref.compressor_pool(buf_kv.unsqueeze(0), buf_gate.unsqueeze(0), prev_kv, prev_gate, torch.float32)
    assert got.shape == (1, d) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(prev_kv, buf_kv[:, :d]) and torch.equal(prev_gate, buf_gate[:, :d])
    # the first window: prev's -inf logits weigh nothing
    prev_gate.fill_(float("-inf"))
    alone = (buf_kv[:, d:] * torch.softmax(buf_gate[:, d:], dim=0)).sum(dim=0, keepdim=True)
    assert torch.allclose(ref.compressor_pool(buf_kv.unsqueeze(0), buf_gate.unsqueeze(0), prev_kv, prev_gate,
                                              torch.float32), alone, rtol=1e-6, atol=1e-6)


def test_compressor_pool_of_several_windows_equals_one_window_at_a_time():
    # n consecutive windows at once: window i's first halves come from window i - 1 (prev for the
    # first), prev ends as the last window's; pooling them one by one gives the same bits
    r, d, n = 4, 8, 5
    win_kv, win_gate = torch.randn(n, r, 2 * d), torch.randn(n, r, 2 * d) * 3
    prev = [torch.randn(r, d), torch.full((r, d), float("-inf"))]
    one_by_one = [t.clone() for t in prev]
    got = ref.compressor_pool(win_kv, win_gate, *prev, torch.bfloat16)
    want = torch.cat([ref.compressor_pool(win_kv[i:i + 1], win_gate[i:i + 1], *one_by_one, torch.bfloat16)
                      for i in range(n)])
    assert got.shape == (n, d) and torch.equal(got, want)
    assert torch.equal(prev[0], one_by_one[0]) and torch.equal(prev[1], win_gate[-1, :, :d])
    # without overlap each window is its own r slots
    flat = ref.compressor_pool(win_kv, win_gate, None, None, torch.float32)
    assert torch.equal(flat, ref.pool_windows(win_kv, win_gate))
    # no window: nothing pooled, prev kept
    assert ref.compressor_pool(win_kv[:0], win_gate[:0], *prev, torch.float32).shape == (0, d)
    assert torch.equal(prev[1], win_gate[-1, :, :d])


def test_compressor_pool_without_overlap_rounds_once_into_the_dtype():
    buf_kv, buf_gate = torch.randn(128, 8), torch.randn(128, 8) * 4
    want = (buf_kv * torch.softmax(buf_gate, dim=0)).sum(dim=0, keepdim=True)
    got = ref.compressor_pool(buf_kv.unsqueeze(0), buf_gate.unsqueeze(0), None, None, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref.pool_windows(buf_kv.unsqueeze(0), buf_gate.unsqueeze(0)).to(torch.bfloat16))
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-3)
