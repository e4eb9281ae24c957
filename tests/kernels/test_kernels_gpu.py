"""TileLang kernels vs kernels/reference.py on random inputs (CUDA only; skipped elsewhere).

Real decode shapes of DeepSeek-V4-Flash (dim 4096, moe_inter 2048, wq_a 1024×4096, wq_b
32768×1024, wkv 512×4096, wo_b 4096×8192, shared experts 2048×4096) and odd ones. Activation
quantisation must match bit for bit; GEMMs and attention within fp32-summation-order
tolerance (each test prints its measured error; run with -s to see them).
"""

import pytest
import torch

from expert_arena import expert_arena

from kernels import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double(), want.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - want).norm() / want.norm().clamp_min(1e-30)).item()


def fp8_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, generator=gen, device=DEV) * 40).to(torch.float8_e4m3fn)
    s = torch.randint(118, 128, ((n + 127) // 128, k // 128), generator=gen, device=DEV, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def fp4_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(0, 256, (n, k // 2), generator=gen, device=DEV, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(118, 128, (n, k // 32), generator=gen, device=DEV, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    # rows of very different magnitudes, so the per-block scales vary
    mag = torch.exp2(torch.randint(-12, 6, (m, 1), generator=gen, device=DEV).float())
    return (torch.randn(m, k, generator=gen, device=DEV) * mag).to(torch.bfloat16)


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(1234)


# ------------------------------------------------------------------------------ act_quant
@pytest.mark.parametrize("shape,block,dtype", [((1, 4096), 128, torch.bfloat16), ((7, 2048), 128, torch.bfloat16),
                                               ((3, 5, 448), 64, torch.bfloat16), ((33, 1024), 128, torch.float32),
                                               ((2, 8192), 64, torch.float16)])
def test_act_quant_matches_reference_exactly(shape, block, dtype, gen):
    from kernels.act_quant import act_quant
    x = (torch.randn(*shape, generator=gen, device=DEV) *
         torch.exp2(torch.randint(-20, 10, shape[:-1] + (1,), generator=gen, device=DEV).float())).to(dtype)
    q, s = act_quant(x, block)
    q_ref, s_ref = ref.act_quant(x, block)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("m,k,rows,cols", [(1, 4096, 1, 128), (7, 2048, 1, 128), (4368, 2048, 1, 128),
                                           (8192, 4096, 128, 128), (200, 384, 128, 128), (130, 256, 128, 128)])
def test_fp8_dequant_matches_reference_exactly(m, k, rows, cols, gen):
    """kernels.fp8_dequant (prefill's FP8 activations and wo_a's weight, widened to bf16) equals
    the reference bit for bit, ragged edge blocks of rows included."""
    from kernels.fp8_dequant import fp8_dequant_bf16
    q = (torch.randn(m, k, generator=gen, device=DEV) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-40, 20, (-(-m // rows), k // cols), generator=gen, device=DEV)
    s = torch.pow(2.0, exps.float())
    got = fp8_dequant_bf16(q, s, rows, cols)
    want = ref.fp8_dequant_bf16(q, s, rows, cols)
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_act_quant_scale_boundaries(gen):
    """amax exactly 448·2^k, just above it, and below the 1e-4 floor: the pow2 rounding edges."""
    from kernels.act_quant import act_quant
    rows = []
    for amax in (448.0, 224.0, 3.5, 3.5078125, 448.0 * 2 ** -10, 1e-5, 0.0, 1.75, 1.7578125, 2.0 ** 20):
        row = torch.randn(128, generator=gen, device=DEV).clamp(-0.5, 0.5) * amax
        row[5] = amax
        rows.append(row)
    x = torch.stack(rows).to(torch.bfloat16)
    q, s = act_quant(x, 128)
    q_ref, s_ref = ref.act_quant(x, 128)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# ------------------------------------------------------------------------------- fp8_gemm
FP8_SHAPES = [(1, 1024, 4096), (1, 32768, 1024), (1, 512, 4096), (1, 4096, 8192), (1, 2048, 4096),
              (2, 4096, 4096), (16, 2048, 4096), (3, 384, 640), (1, 200, 384), (5, 136, 128), (40, 512, 1024),
              (1, 640, 1536),  # splits K unevenly (3 steps over 2 warps)
              (130, 512, 4096), (300, 1024, 4096), (2048, 4096, 1024)]  # prefill: cuBLAS's block-scaled FP8 GEMM


@pytest.mark.parametrize("m,n,k", FP8_SHAPES)
def test_fp8_gemm_matches_reference(m, n, k, gen):
    from kernels.fp8_gemm import fp8_gemm
    x = activations(m, k, gen)
    w, s = fp8_weight(n, k, gen)
    out = fp8_gemm(x, w, s)
    want = ref.fp8_gemm(x, w, s)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    err = rel_err(out, want)
    print(f"fp8_gemm M={m} N={n} K={k}: rel err {err:.2e}")
    assert err < 4e-3  # bf16 output rounding (2^-9) where summation order flips a rounding


@pytest.mark.parametrize("rows,warps,ksplit,early", [(1, 4, 4, True), (2, 8, 2, True), (4, 4, 1, True),
                                                   (1, 8, 8, True), (2, 4, 2, True), (2, 4, 2, False),
                                                   (4, 4, 1, False)])
def test_fp8_gemv_every_tile_matches_reference(rows, warps, ksplit, early, gen):
    from kernels.act_quant import act_quant
    from kernels.fp8_gemm import fp8_gemv_kernel
    from kernels.gemv import as_words, scale_bytes
    m, n, k = 2, 640, 1536  # K = 3 steps of 512 channels: a ksplit of 2 or more leaves steps out of range
    x = activations(m, k, gen)
    w, s = fp8_weight(n, k, gen)
    q, sa = act_quant(x, 128)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=DEV)
    fp8_gemv_kernel(m, n, k, rows, warps, ksplit, torch.cuda.get_device_capability(), early)(
        as_words(q), sa, as_words(w), scale_bytes(s), y)
    assert rel_err(y, ref.fp8_gemm(x, w, s)) < 4e-3


@pytest.mark.parametrize("n,k", [(1536, 4096), (4096, 4096), (4096, 2048), (8192, 1024), (4096, 8192)])
def test_fp8_gemv_loading_ahead_changes_no_bit(n, k, gen):
    """The decode shapes (their tiles): weights loaded before the PDL wait give the same output,
    bit for bit, as each step loading its own (the same products in the same order)."""
    from kernels.act_quant import act_quant
    from kernels.toolkit import cuda_arch
    from kernels.fp8_gemm import fp8_gemv_kernel, gemv_tile
    from kernels.gemv import as_words, scale_bytes
    arch = cuda_arch(torch.device(DEV))
    x = activations(1, k, gen)
    w, s = fp8_weight(n, k, gen)
    q, sa = act_quant(x, 128)
    ys = [torch.empty(1, n, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    for y, early in zip(ys, (False, True)):
        fp8_gemv_kernel(1, n, k, *gemv_tile(n, k, arch), arch, early)(as_words(q), sa, as_words(w), scale_bytes(s), y)
    assert torch.equal(ys[0], ys[1])
    assert rel_err(ys[1], ref.fp8_gemm(x, w, s)) < 4e-3


@pytest.mark.parametrize("n,k,tiles,ksplit,depth", [(200, 384, 1, 1, 0), (200, 384, 2, 3, 1), (130, 1024, 2, 2, 1),
                                                    (1536, 4096, 1, 8, 2), (1536, 4096, 2, 4, 4), (4096, 2048, 2, 4, 0),
                                                    (4096, 8192, 2, 8, 4)])
def test_fp8_mma_one_token_every_tile_matches_reference(n, k, tiles, ksplit, depth, gen):
    """The one-token tensor-core GEMV at odd row counts (partial tiles), K splits and depths."""
    from kernels.act_quant import act_quant
    from kernels.gemv import as_words, scale_bytes
    from kernels.fp8_mma_one_token import fp8_mma_one_token_kernel
    x = activations(1, k, gen)
    w, s = fp8_weight(n, k, gen)
    q, sa = act_quant(x, 128)
    y = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    fp8_mma_one_token_kernel(n, k, tiles, ksplit, depth, torch.cuda.get_device_capability())(
        as_words(q), sa, as_words(w), scale_bytes(s), y)
    assert rel_err(y, ref.fp8_gemm_quantized(q, sa, w, s)) < 4e-3


@pytest.mark.parametrize("m,n,k,tiles,ksplit,depth", [(2, 200, 384, 1, 1, 1), (16, 200, 384, 2, 3, 2),
                                                      (11, 130, 1024, 2, 2, 1), (16, 1536, 4096, 1, 8, 2),
                                                      (8, 32768, 1024, 2, 2, 2), (16, 4096, 8192, 2, 16, 2),
                                                      (4, 4096, 2048, 2, 4, 4)])
def test_fp8_mma_few_tokens_every_tile_matches_reference(m, n, k, tiles, ksplit, depth, gen):
    """The 2..16-token tensor-core GEMV at odd row and token counts (partial tiles, one or two
    columns of 8 tokens), K splits and depths, against the reference and the CUDA-core GEMV."""
    from kernels.act_quant import act_quant
    from kernels.fp8_gemm import fp8_gemv_kernel, gemv_tile
    from kernels.gemv import as_words, scale_bytes
    from kernels.fp8_mma_few_tokens import fp8_mma_few_tokens_kernel
    arch = torch.cuda.get_device_capability()
    x = activations(m, k, gen)
    w, s = fp8_weight(n, k, gen)
    q, sa = act_quant(x, 128)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    fp8_mma_few_tokens_kernel(m, n, k, tiles, ksplit, depth, arch)(as_words(q), sa, as_words(w), scale_bytes(s), y)
    core = torch.empty_like(y)
    fp8_gemv_kernel(m, n, k, *gemv_tile(n, k, arch), arch)(as_words(q), sa, as_words(w), scale_bytes(s), core)
    err = rel_err(y, ref.fp8_gemm_quantized(q, sa, w, s))
    print(f"fp8_mma_few_tokens m={m} n={n} k={k}: rel err {err:.2e}")
    assert err < 4e-3 and rel_err(y, core) < 4e-3


def test_fp8_mma_one_token_extreme_codes_and_scales(gen):
    """Every e4m3 magnitude (subnormals, 448) against every activation code, with the smallest and
    largest block scales the shapes see: the products and scalings stay exact (fp32 sums only)."""
    from kernels.act_quant import act_quant
    from kernels.gemv import as_words, scale_bytes
    from kernels.fp8_mma_one_token import fp8_mma_one_token_kernel, mma_tile
    n, k = 256, 1024
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    codes = codes[(codes & 0x7F) != 0x7F]  # no NaN codes
    w = codes[torch.randint(0, codes.numel(), (n, k), generator=gen, device=DEV)].view(torch.float8_e4m3fn)
    s = torch.tensor([[100, 127, 140, 118, 127, 150, 127, 110]] * 2, dtype=torch.uint8, device=DEV)
    x = (torch.randn(1, k, generator=gen, device=DEV) * 2.0 ** 12).to(torch.bfloat16)
    q, sa = act_quant(x, 128)
    y = torch.empty(1, n, dtype=torch.bfloat16, device=DEV)
    fp8_mma_one_token_kernel(n, k, *mma_tile(n, k), torch.cuda.get_device_capability())(
        as_words(q), sa, as_words(w), scale_bytes(s.view(torch.float8_e8m0fnu)), y)
    assert rel_err(y, ref.fp8_gemm_quantized(q, sa, w, s.view(torch.float8_e8m0fnu))) < 4e-3


def test_fp8_gemm_keeps_leading_dims(gen):
    from kernels.fp8_gemm import fp8_gemm
    x = activations(6, 256, gen).view(2, 3, 256)
    w, s = fp8_weight(128, 256, gen)
    assert rel_err(fp8_gemm(x, w, s), ref.fp8_gemm(x.reshape(6, 256), w, s).view(2, 3, 128)) < 4e-3


def test_fp8_gemm_rejects_mismatched_scale(gen):
    from kernels.toolkit import KernelInputError
    from kernels.fp8_gemm import fp8_gemm
    w, s = fp8_weight(256, 256, gen)
    with pytest.raises(KernelInputError, match="scale shape"):
        fp8_gemm(activations(1, 256, gen), w, s[:1])


# ------------------------------------------------------------------------ grouped linear (wo_a)
# Flash's wo_a (8 groups of 1024 rows over 4096 channels) at decode and prefill row counts, the
# tiny model's, a weight whose rows end inside a 128-row scale block (kernel path), groups that do
# not split into whole CTAs (cuBLAS path)
@pytest.mark.parametrize("m,groups,r,k", [(1, 8, 1024, 4096), (2, 8, 1024, 4096), (16, 8, 1024, 4096),
                                          (40, 8, 1024, 4096), (1, 2, 64, 256), (3, 3, 40, 256), (5, 3, 42, 384)])
def test_grouped_linear_matches_reference(m, groups, r, k, gen):
    from kernels.grouped_linear import grouped_linear
    x = activations(m, groups * k, gen)
    w, s = fp8_weight(groups * r, k, gen)
    out = grouped_linear(x, w, s, groups)
    want = ref.grouped_linear(x, w, s, groups)
    assert out.shape == (m, groups * r) and out.dtype == torch.bfloat16
    assert torch.equal(grouped_linear(x, w, s, groups, ref.e8m0_to_float(s)), out)  # prepared scales: same bits
    err = rel_err(out, want)
    print(f"grouped_linear M={m} G={groups} R={r} K={k}: rel err {err:.2e}")
    assert err < 4e-3


@pytest.mark.parametrize("rows,warps,ksplit", [(1, 4, 4), (2, 8, 2), (4, 4, 1), (1, 8, 8), (2, 4, 2)])
def test_grouped_gemv_every_tile_matches_reference(rows, warps, ksplit, gen):
    from kernels.gemv import as_words, scale_bytes
    from kernels.grouped_linear import grouped_gemv_kernel
    m, groups, r, k = 2, 4, 256, 1536
    x = activations(m, groups * k, gen)
    w, s = fp8_weight(groups * r, k, gen)
    y = torch.empty(m, groups * r, dtype=torch.bfloat16, device=DEV)
    grouped_gemv_kernel(m, groups, k, groups * r, rows, warps, ksplit, torch.cuda.get_device_capability())(
        x, as_words(w), scale_bytes(s), y)
    assert rel_err(y, ref.grouped_linear(x, w, s, groups)) < 4e-3


@pytest.mark.parametrize("m,groups,r,k,tiles,ksplit", [(16, 8, 1024, 4096, 2, 8), (2, 8, 1024, 4096, 2, 8),
                                                       (9, 3, 48, 384, 1, 1), (5, 2, 64, 1024, 2, 2),
                                                       (8, 4, 32, 256, 1, 2), (13, 2, 96, 640, 2, 5)])
def test_grouped_mma_few_tokens_is_the_exact_product(m, groups, r, k, tiles, ksplit, gen):
    """The tensor-core grouped projection (kernels/grouped_mma_few_tokens.py) on its own: 2 to 16 tokens (one
    or two columns of 8), 1 or 2 tiles, K split over 1 to 8 warps, every e4m3 code (subnormals too) in
    the weight; each output within one bf16 step of the exact (fp64) product: exact products, fp32
    sums, one bf16 rounding. A wrong channel, scale or token would be off by about the value itself."""
    from kernels.gemv import as_words, scale_bytes
    from kernels.grouped_mma_few_tokens import DEPTH, grouped_mma_few_tokens_kernel
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    codes = codes[(codes & 0x7F) != 0x7F]  # every e4m3 code but the NaNs
    n = groups * r
    w = codes[torch.randint(0, codes.numel(), (n, k), generator=gen, device=DEV)].view(torch.float8_e4m3fn)
    s = torch.randint(118, 128, ((n + 127) // 128, k // 128), generator=gen, device=DEV, dtype=torch.uint8)
    x = activations(m, groups * k, gen)
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    grouped_mma_few_tokens_kernel(m, groups, k, n, tiles, ksplit, DEPTH, torch.cuda.get_device_capability())(
        x.view(torch.int32), as_words(w), scale_bytes(s), y)
    wd = ref.dequant_fp8_block(w, s.view(torch.float8_e8m0fnu)).double().view(groups, r, k)
    exact = torch.einsum("sgi,gri->sgr", x.double().view(m, groups, k), wd).reshape(m, n)
    terms = torch.einsum("sgi,gri->sgr", x.double().abs().view(m, groups, k), wd.abs()).reshape(m, n)
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)  # one bf16 step (8 bits)
    assert torch.isfinite(y).all()  # every (token, row) stored
    # one bf16 step, and the fp32 sums' rounding (a few units of 2^-24 of the terms' magnitude)
    assert ((y.double() - exact).abs() <= step + 2.0 ** -21 * terms).all()


def test_grouped_linear_rejects_mismatched_groups(gen):
    from kernels.toolkit import KernelInputError
    from kernels.grouped_linear import grouped_linear
    w, s = fp8_weight(256, 256, gen)
    with pytest.raises(KernelInputError, match="row groups"):
        grouped_linear(activations(1, 3 * 256, gen), w, s, 2)


# -------------------------------------------------------------------- compressor projection
# Flash's CSA attention, indexer and HCA compressors, the tiny model's, and an odd one (K not a
# whole step, M > 1)
@pytest.mark.parametrize("m,c,k,r", [(1, 1024, 4096, 4), (1, 256, 4096, 4), (1, 512, 4096, 128), (1, 256, 128, 4),
                                     (3, 96, 200, 8)])
def test_compressor_project_matches_reference(m, c, k, r, gen):
    from kernels.compressor_project import compressor_project
    x = activations(m, k, gen)
    w = (torch.randn(2 * c, k, generator=gen, device=DEV) * 0.05).to(torch.bfloat16)
    ape = torch.randn(r, c, generator=gen, device=DEV)
    row = torch.randperm(r, generator=gen, device=DEV)[:m]
    bufs = [torch.randn(r, c, generator=gen, device=DEV) for _ in range(2)]
    want = [b.clone() for b in bufs]
    compressor_project(x, w, ape, row, *bufs)
    ref.compressor_project(x, w, ape, row, *want)
    others = ~torch.isin(torch.arange(r, device=DEV), row)
    for name, got, exp in zip(("kv", "gate"), bufs, want):
        assert torch.equal(got[others], exp[others])  # rows not written keep their values
        err = rel_err(got[row], exp[row])
        print(f"compressor_project {name} M={m} C={c} K={k}: rel err {err:.2e}")
        assert err < 1e-5  # fp32 summation order


@pytest.mark.parametrize("rows,warps,ksplit", [(1, 4, 4), (2, 8, 2), (2, 4, 1), (1, 8, 8)])
def test_compressor_project_every_tile(rows, warps, ksplit, gen):
    from kernels.compressor_project import compressor_project_kernel
    c, k, r = 160, 1536, 4
    x = activations(1, k, gen)
    w = (torch.randn(2 * c, k, generator=gen, device=DEV) * 0.05).to(torch.bfloat16)
    ape = torch.randn(r, c, generator=gen, device=DEV)
    row = torch.tensor([2], device=DEV)
    bufs = [torch.zeros(r, c, device=DEV) for _ in range(2)]
    want = [b.clone() for b in bufs]
    compressor_project_kernel(1, c, k, r, rows, warps, ksplit, torch.cuda.get_device_capability())(
        x, w, ape, row, *bufs)
    ref.compressor_project(x, w, ape, row, *want)
    assert rel_err(bufs[0], want[0]) < 1e-5 and rel_err(bufs[1], want[1]) < 1e-5


# ---------------------------------------------------------------------- compressor pooling
# Flash's CSA attention and indexer compressors (ratio 4, overlapping) and its HCA one (ratio 128),
# the tiny model's, in bf16 and fp32; the first window's -inf prev logits included; one window (a
# decode step's) and several (a prefill chunk's: the kv values a column slice of the projection's
# output, as `Compressor.__call__` hands them)
@pytest.mark.parametrize("r,d,overlap,dtype", [(4, 512, True, torch.bfloat16), (4, 128, True, torch.bfloat16),
                                               (128, 512, False, torch.bfloat16), (4, 64, True, torch.float32),
                                               (8, 32, False, torch.float32)])
@pytest.mark.parametrize("n,strided", [(1, False), (37, True), (6, False)])
def test_compressor_pool_matches_reference(r, d, overlap, dtype, n, strided, gen):
    from kernels.compressor_pool import compressor_pool
    c = 2 * d if overlap else d
    rows = torch.randn(n * r, 2 * c if strided else c, generator=gen, device=DEV)
    win_kv = rows[:, :c].view(n, r, c)  # strided: every row c values at a pitch of 2c
    win_gate = torch.randn(n, r, c, generator=gen, device=DEV) * 3
    for first in (True, False) if overlap else (False,):
        prev = None
        if overlap:
            prev = [torch.randn(r, d, generator=gen, device=DEV),
                    torch.full((r, d), float("-inf"), device=DEV) if first else torch.randn(r, d, generator=gen,
                                                                                          device=DEV)]
        want_prev = None if prev is None else [t.clone() for t in prev]
        got = compressor_pool(win_kv, win_gate, *(prev or (None, None)), dtype)
        want = ref.compressor_pool(win_kv, win_gate, *(want_prev or (None, None)), dtype)
        assert got.shape == want.shape == (n, d) and got.dtype == dtype
        err = rel_err(got, want)
        print(f"compressor_pool r={r} d={d} overlap={overlap} n={n} strided={strided} first={first} {dtype}: "
              f"rel err {err:.2e}")
        assert err < (1e-6 if dtype == torch.float32 else 4e-3)  # fp32 summation order; one rounding into bf16
        if prev is not None:
            assert torch.equal(prev[0], win_kv[-1, :, :d]) and torch.equal(prev[1], win_gate[-1, :, :d])


def test_compressor_project_rejects_mismatched_weight(gen):
    from kernels.toolkit import KernelInputError
    from kernels.compressor_project import compressor_project
    bufs = [torch.zeros(4, 64, device=DEV) for _ in range(2)]
    with pytest.raises(KernelInputError, match="w \\[2C, K\\]"):
        compressor_project(activations(1, 256, gen), torch.zeros(64, 256, dtype=torch.bfloat16, device=DEV),
                           torch.zeros(4, 64, device=DEV), torch.tensor([0], device=DEV), *bufs)


# ------------------------------------------------------------------ bf16 x bf16 -> fp32 GEMM
# prefill chunks of Flash's compressors (wkv|wgate of the CSA attention, indexer and HCA ones),
# a short chunk, and odd sizes
@pytest.mark.parametrize("m,n,k", [(728, 2048, 4096), (2048, 512, 4096), (2048, 1024, 4096), (17, 2048, 4096),
                                   (33, 192, 200)])
def test_bf16_gemm_matches_reference(m, n, k, gen):
    from kernels.bf16_gemm import bf16_gemm
    x = activations(m, k, gen)
    w = (torch.randn(n, k, generator=gen, device=DEV) * 0.05).to(torch.bfloat16)
    got = bf16_gemm(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    err = rel_err(got, ref.bf16_gemm(x, w))
    print(f"bf16_gemm M={m} N={n} K={k}: rel err {err:.2e}")
    assert err < 1e-5  # exact products, fp32 sums in another order


def test_bf16_gemm_rejects_fp32_input(gen):
    from kernels.toolkit import KernelInputError
    from kernels.bf16_gemm import bf16_gemm
    with pytest.raises(KernelInputError, match="both bf16"):
        bf16_gemm(torch.zeros(4, 256, device=DEV), torch.zeros(64, 256, dtype=torch.bfloat16, device=DEV))


# Flash's weights_proj (64 heads over 4096 channels) at decode and prefill-chunk rows, the tiny
# model's, an odd one, and chunks of more rows than the GEMV takes (the tensor-core GEMM)
@pytest.mark.parametrize("m,n,k", [(1, 64, 4096), (3, 64, 4096), (16, 64, 4096), (1, 4, 128), (2, 40, 264),
                                   (40, 64, 4096), (2048, 64, 4096)])
def test_indexer_weights_matches_reference(m, n, k, gen):
    from kernels.indexer_weights import indexer_weights
    x = activations(m, k, gen)
    w = (torch.randn(n, k, generator=gen, device=DEV) * 0.05).to(torch.bfloat16)
    got = indexer_weights(x, w, n ** -0.5)
    want = ref.indexer_weights(x, w, n ** -0.5)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # fp32 sums in another order differ by a few ulps of the sum of the products' magnitudes
    # (where the products cancel, more than the result's own ulp), then the bf16 rounding may
    # move by one step: |got - want| <= sum_err + one bf16 step of (|want| + sum_err)
    sum_err = 2.0 ** -16 * (x.float().abs() @ w.float().abs().T) * n ** -0.5
    dev = (got - want).abs()
    assert (dev <= sum_err + (want.abs() + sum_err) * 2.0 ** -7).all()
    print(f"indexer_weights M={m} N={n} K={k}: {int((got != want).sum())} of {got.numel()} differ, "
          f"{int((dev > want.abs() * 2.0 ** -7).sum())} by more than one step of the result")


# ------------------------------------------------------------------------------- fp4 GEMMs
FP4_SHAPES = [(1, 2048, 4096), (1, 4096, 2048), (2, 2048, 4096), (16, 4096, 2048), (3, 384, 640),
              (1, 100, 128), (24, 512, 1024)]


@pytest.mark.parametrize("m,n,k", FP4_SHAPES)
def test_fp4_gemm_matches_reference(m, n, k, gen):
    from kernels.fp4_moe import fp4_gemm
    x = activations(m, k, gen)
    w, s = fp4_weight(n, k, gen)
    out = fp4_gemm(x, w, s)
    want = ref.fp4_gemm(x, w, s)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    err = rel_err(out, want)
    print(f"fp4_gemm M={m} N={n} K={k}: rel err {err:.2e}")
    assert err < 4e-3


def _arena(slots: int, inter: int, dim: int, gen):
    return expert_arena(slots, inter, dim, gen, DEV)


@pytest.mark.parametrize("inter,dim", [(2048, 4096), (256, 384)])
def test_fp4_grouped_reads_arena_slots(inter, dim, gen):
    from kernels.fp4_moe import fp4_gemm_grouped
    data, fields, expert = _arena(5, inter, dim, gen)
    slots = torch.tensor([3, 0, 4, 1, 3, 2], dtype=torch.int32, device=DEV)
    x = activations(6, dim, gen)
    f, fs = fields["w1.weight"], fields["w1.scale"]
    out = fp4_gemm_grouped(x, data, f.offset, data, fs.offset, inter, dim, slots)
    for g, slot in enumerate(slots.tolist()):
        e = expert(slot)
        err = rel_err(out[g], ref.fp4_gemm(x[g:g + 1], e["w1.weight"], e["w1.scale"])[0])
        assert err < 4e-3, (g, slot, err)


@pytest.mark.parametrize("rows,warps", [(1, 4), (4, 4), (2, 8), (4, 8)])
def test_fp4_grouped_every_tile_matches_reference(rows, warps, gen):
    """Every tile, two parts (w1 and w3 of each expert in one launch), per-group and shared
    activations, bf16 and fp32 (bf16-rounded) outputs."""
    from kernels.act_quant import act_quant
    from kernels.fp4_moe import fp4_gemv_kernel
    from kernels.gemv import as_words
    inter, dim = 256, 384
    data, fields, expert = _arena(4, inter, dim, gen)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    x = activations(3, dim, gen).unsqueeze(1)  # [G, 1, K]
    q, sa = act_quant(x, 128)
    names = ("w1", "w3")
    offs = tuple(fields[f"{n}.weight"].offset for n in names), tuple(fields[f"{n}.scale"].offset for n in names)
    arch = torch.cuda.get_device_capability()
    for out_dtype, shared in ((torch.bfloat16, False), (torch.float32, True)):
        a = slice(0, 1) if shared else slice(None)  # shared: every group reads x[0]
        y = torch.empty(2, 3, 1, inter, dtype=out_dtype, device=DEV)
        fp4_gemv_kernel(1, inter, dim, data.shape[1], offs[0], data.shape[1], offs[1], rows, warps,
                        str(out_dtype).removeprefix("torch."), arch)(as_words(q[a]), sa[a], as_words(data), data,
                                                                     slots, y)
        for p, n in enumerate(names):
            for g, slot in enumerate(slots.tolist()):
                e = expert(slot)
                want = ref.fp4_gemm(x[0 if shared else g], e[f"{n}.weight"], e[f"{n}.scale"])
                assert rel_err(y[p, g], want) < 4e-3, (n, g, slot, out_dtype)
                assert torch.equal(y[p, g].to(torch.bfloat16).float(), y[p, g].float())  # bf16-rounded


def _two_part_gemv(m: int, inter: int, dim: int, lookup: bool, gen, launch) -> None:
    """w1 and w3 of three experts in one launch (two parts), per-group and shared activations, bf16
    and fp32 outputs, slots direct or looked up in a table: `launch(q, sa, data, offs, where, y,
    tl_dtype, shared)` runs the kernel under test into y [2, 3, m, inter] (NaN before), which must
    match the reference and the CUDA-core kernel (the same exact products summed in another order)."""
    from kernels.act_quant import act_quant
    from kernels.fp4_moe import fp4_gemv_kernel, gemv_tile
    from kernels.gemv import as_words
    data, fields, expert = _arena(5, inter, dim, gen)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEV)
    table = torch.tensor([3, 1, 4, -1, 0, 2], dtype=torch.int32, device=DEV)  # expert id -> slot
    ids = torch.tensor([2, 4, 5], dtype=torch.int64, device=DEV)  # -> slots 4, 0, 2
    x = activations(3 * m, dim, gen).view(3, m, dim)
    q, sa = act_quant(x, 128)
    names = ("w1", "w3")
    offs = tuple(fields[f"{n}.weight"].offset for n in names), tuple(fields[f"{n}.scale"].offset for n in names)
    arch = torch.cuda.get_device_capability()
    where = (table, ids) if lookup else (slots,)
    for out_dtype, shared in ((torch.bfloat16, False), (torch.float32, True)):
        a = slice(0, 1) if shared else slice(None)  # shared: every group reads x[0]
        tl_dtype = str(out_dtype).removeprefix("torch.")
        y = torch.full((2, 3, m, inter), float("nan"), dtype=out_dtype, device=DEV)
        launch(as_words(q[a]), sa[a], data, offs, where, y, tl_dtype, shared)
        core = torch.empty_like(y)
        fp4_gemv_kernel(m, inter, dim, data.shape[1], offs[0], data.shape[1], offs[1], *gemv_tile(inter, arch),
                        tl_dtype, arch, lookup)(as_words(q[a]), sa[a], as_words(data), data, *where, core)
        for p, n in enumerate(names):
            for g, slot in enumerate(slots.tolist()):
                e = expert(slot)
                want = ref.fp4_gemm(x[0 if shared else g], e[f"{n}.weight"], e[f"{n}.scale"])  # [m, inter]
                assert rel_err(y[p, g], want) < 4e-3, (n, g, slot, out_dtype)
                assert rel_err(y[p, g], core[p, g]) < 4e-3, (n, g, slot, out_dtype)
                assert torch.equal(y[p, g].to(torch.bfloat16).float(), y[p, g].float())  # bf16-rounded


@pytest.mark.parametrize("m,inter,dim,lookup", [(1, 2048, 4096, True), (1, 4096, 2048, False), (3, 256, 384, False),
                                                (8, 200, 1024, True), (2, 48, 256, False), (16, 2048, 4096, True),
                                                (11, 200, 1024, False), (9, 4096, 2048, True), (13, 72, 384, True)])
def test_fp4_mma_matches_reference(m, inter, dim, lookup, gen):
    """The tensor-core GEMV (kernels/fp4_mma_few_tokens.py) on its own (`_two_part_gemv`): rows that are not a
    whole 16-row tile, 1 to 16 tokens (one or two columns of 8), 1 or 2 tiles, K split over 1 to 8 warps."""
    from kernels.fp4_mma_few_tokens import fp4_mma_few_tokens_kernel, mma_tile
    from kernels.gemv import as_words
    arch = torch.cuda.get_device_capability()

    def launch(q, sa, data, offs, where, y, tl_dtype, shared):
        tiles, ksplit = mma_tile(dim) if shared else (1, 2 * mma_tile(dim)[1] if dim >= 2048 else 1)
        fp4_mma_few_tokens_kernel(m, inter, dim, data.shape[1], offs[0], data.shape[1], offs[1], tiles, ksplit,
                                  tl_dtype, arch, lookup)(q, sa, as_words(data), as_words(data), *where, y)
    _two_part_gemv(m, inter, dim, lookup, gen, launch)


@pytest.mark.parametrize("inter,dim,tiles,ksplit,lookup,early,depth", [
    (2048, 4096, 2, 4, True, True, 0), (4096, 2048, 2, 4, False, True, 0), (2048, 4096, 1, 4, True, False, 0),
    (2048, 4096, 2, 8, False, True, 0), (200, 1024, 2, 8, True, False, 0), (48, 256, 1, 1, False, True, 0),
    (72, 384, 2, 3, True, False, 0), (2048, 4096, 2, 4, True, True, 3), (4096, 2048, 2, 2, True, True, 3),
    (2048, 4096, 2, 1, True, True, 4), (200, 1024, 1, 2, True, False, 3), (72, 384, 2, 1, False, True, 2)])
def test_fp4_mma_one_token_matches_reference(inter, dim, tiles, ksplit, lookup, early, depth, gen):
    """The one-token tensor-core GEMV (kernels/fp4_mma_one_token.py, `_two_part_gemv`): slots and weights read
    before or after the wait on the predecessor, all first or `depth` blocks ahead of the sums, rows
    that are not a whole tile, K split over 1 to 8 warps."""
    from kernels.fp4_mma_one_token import fp4_mma_one_token_kernel
    from kernels.gemv import as_words
    arch = torch.cuda.get_device_capability()

    def launch(q, sa, data, offs, where, y, tl_dtype, shared):
        kernel = fp4_mma_one_token_kernel(inter, dim, data.shape[1], offs[0], data.shape[1], offs[1], tiles, ksplit,
                                          tl_dtype, arch, lookup, early, depth)
        kernel(q, sa, as_words(data), as_words(data), *where, y)
    _two_part_gemv(1, inter, dim, lookup, gen, launch)


@pytest.mark.parametrize("broadcast", [True, False])
def test_fp4_moe_matches_per_expert_reference(broadcast, gen):
    """Decode's broadcast row (quantised once) and distinct rows per expert."""
    from kernels.fp4_moe import fp4_moe
    inter, dim, limit = 2048, 4096, 10.0
    data, fields, expert = _arena(8, inter, dim, gen)
    slots = torch.tensor([5, 1, 7, 0, 2, 6], dtype=torch.int32, device=DEV)
    x = activations(1, dim, gen).expand(6, dim) if broadcast else activations(6, dim, gen)
    wts = torch.rand(6, generator=gen, device=DEV)
    out = fp4_moe(x, data, fields, slots, wts, limit)
    want = ref.fp4_moe(x, data, fields, slots, wts, limit)  # the same signature, pure torch
    for g, slot in enumerate(slots.tolist()):
        err = rel_err(out[g:g + 1], want[g:g + 1])
        print(f"fp4_moe expert slot {slot}: rel err {err:.2e}")
        assert err < 2e-2  # h may round differently in bf16 where g, u differ by an ulp


def test_fp4_moe_runs_read_each_expert_once_and_match_the_reference(gen):
    """A chunk step's cells in runs of 16 per expert (engine.moe.ExpertRuns: 6 experts, tokens
    gathered by `rows`, unused cells weighted 0) through the 16-token tensor-core GEMV: each
    cell equals the reference, and equals the same cell run on its own (one row a group)."""
    from kernels.fp4_moe import fp4_moe
    inter, dim, limit, run = 2048, 4096, 10.0, 16
    data, fields, _ = _arena(8, inter, dim, gen)
    slots = torch.tensor([5, 1, 7, 0, 2, 6], dtype=torch.int32, device=DEV).repeat_interleave(run)
    tokens = activations(run, dim, gen)
    rows = torch.randint(0, run, (6 * run,), generator=gen, device=DEV)
    wts = torch.rand(6 * run, generator=gen, device=DEV) * (torch.rand(6 * run, generator=gen, device=DEV) < 0.7)
    out = fp4_moe(tokens, data, fields, slots, wts, limit, [], rows, run)
    want = ref.fp4_moe(tokens, data, fields, slots, wts, limit, [], rows, run)
    one = fp4_moe(tokens, data, fields, slots, wts, limit, [], rows)  # each cell its own group
    assert out.dtype == torch.bfloat16 and out.shape == (6 * run, dim)
    assert not out[wts == 0].any()  # unused cells: zero outputs
    worst = max(rel_err(out[g:g + 1], want[g:g + 1]) for g in range(6 * run) if wts[g] > 0)
    print(f"fp4_moe runs of {run}: worst rel err {worst:.2e}")
    assert worst < 2e-2 and rel_err(out, one) < 2e-2


@pytest.mark.parametrize("parts", [("w1", "w3"), ("w2",)])
def test_fp4_dequant_slots_equals_the_reference_bit_for_bit(parts, gen):
    """The one-pass dequantisation of arena rows (slots repeated and out of order, every byte
    value) equals the reference's lookup, bit for bit, signed zeros included."""
    from kernels.fp4_dequant import fp4_dequant_slots
    inter, dim = 2048, 4096
    data, fields, _ = _arena(6, inter, dim, gen)
    slots = torch.tensor([4, 0, 5, 4, 2], dtype=torch.int32, device=DEV)
    w_offs = tuple(fields[f"{p}.weight"].offset for p in parts)
    s_offs = tuple(fields[f"{p}.scale"].offset for p in parts)
    n, k = fields[f"{parts[0]}.weight"].shape[0], fields[f"{parts[0]}.weight"].shape[1] * 2
    got = fp4_dequant_slots(data, w_offs, s_offs, n, k, slots)
    want = ref.fp4_dequant_slots(data, w_offs, s_offs, n, k, slots)
    assert got.shape == want.shape == (5, len(parts) * n, k)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp4_moe_prefill_runs_on_the_tensor_cores_and_matches_the_reference(gen):
    """A prefill's cells (64 per expert) take `fp4_moe_dequantized` (bf16 GEMMs on dequantised
    weights, the backend's swiglu_quant) and match the per-cell reference."""
    from kernels.act_quant import act_quant
    from kernels.fp4_dequant import fp4_dequant_slots
    from kernels.fp4_moe import GROUPED_MIN_CELLS, expert_groups, expert_spans, fp4_moe, fp4_moe_dequantized
    from kernels.swiglu_quant import swiglu_quant
    inter, dim, limit = 2048, 4096, 10.0
    data, fields, _ = _arena(8, inter, dim, gen)
    slots = torch.randint(0, 8, (512,), generator=gen, device=DEV, dtype=torch.int32)
    assert slots.shape[0] >= GROUPED_MIN_CELLS
    x = activations(512, dim, gen)
    wts = torch.rand(512, generator=gen, device=DEV)
    out = fp4_moe(x, data, fields, slots, wts, limit)
    assert out.dtype == torch.bfloat16  # w2's outputs as the grouped GEMM rounded them
    q, s = act_quant(x, 128)
    order, spans = expert_spans(slots)
    assert torch.equal(out, fp4_moe_dequantized(q, s, data, fields, order, expert_groups(spans, x.device), wts, limit,
                                                swiglu_quant, fp4_dequant_slots))
    # grouped by the caller (engine.moe.Cells: sorted by expert, device counts): no host sync, the same cells
    grouped = fp4_moe(x.index_select(0, order), data, fields, slots.index_select(0, order), wts.index_select(0, order),
                      limit, expert_groups(spans, x.device))
    assert torch.equal(grouped, out.index_select(0, order))
    # the tokens quantised once, each cell reading its token's row (engine.moe: `rows`): the same bits
    tokens, pick = x[:128], torch.arange(512, device=DEV) % 128
    gathered = fp4_moe(tokens.index_select(0, pick.index_select(0, order)), data, fields,
                       slots.index_select(0, order), wts.index_select(0, order), limit, expert_groups(spans, x.device))
    assert torch.equal(fp4_moe(tokens, data, fields, slots.index_select(0, order), wts.index_select(0, order), limit,
                               expert_groups(spans, x.device), pick.index_select(0, order)), gathered)
    assert torch.equal(fp4_moe(tokens, data, fields, slots, wts, limit, rows=pick),  # the GEMV's or host spans' path
                       fp4_moe(tokens.index_select(0, pick), data, fields, slots, wts, limit))
    want = ref.fp4_moe(x, data, fields, slots, wts, limit)
    worst = max(rel_err(out[g:g + 1], want[g:g + 1]) for g in range(0, 512, 7))
    print(f"fp4_moe prefill (64 cells per expert): worst rel err {worst:.2e}")
    assert worst < 2e-2


@pytest.mark.parametrize("rows", [1, 6])
def test_fp4_moe_quantized_equals_fp4_moe(rows, gen):
    """On act_quant's (q, s) (one row for every slot, or one per slot) the result is fp4_moe's,
    bit for bit: the FFN quantises its input once for the shared and the routed experts."""
    from kernels.act_quant import act_quant
    from kernels.fp4_moe import fp4_moe, fp4_moe_quantized
    inter, dim, limit = 2048, 4096, 10.0
    data, fields, _ = _arena(8, inter, dim, gen)
    slots = torch.tensor([5, 1, 7, 0, 2, 6], dtype=torch.int32, device=DEV)
    x = activations(rows, dim, gen)
    wts = torch.rand(6, generator=gen, device=DEV)
    out = fp4_moe_quantized(*act_quant(x, 128), data, fields, slots, wts, limit)
    moe = fp4_moe(x.expand(6, dim) if rows == 1 else x, data, fields, slots, wts, limit)
    assert out.dtype == torch.float32 and moe.dtype == torch.bfloat16
    assert torch.equal(out, moe.float())  # the same bf16 values, widened
    want = ref.fp4_moe_quantized(*ref.act_quant(x, 128), data, fields, slots, wts, limit)
    assert rel_err(out, want) < 2e-2


def test_fp4_moe_quantized_looks_slots_up_in_a_table(gen):
    """Expert ids with a layer's slot table (a -1 entry reads slot 0, as the reference's clamp)
    give the result of the looked-up slots, bit for bit."""
    from kernels.act_quant import act_quant
    from kernels.fp4_moe import fp4_moe_quantized
    inter, dim, limit = 2048, 4096, 10.0
    data, fields, _ = _arena(8, inter, dim, gen)
    table = torch.full((32,), -1, dtype=torch.int32, device=DEV)
    table[[3, 9, 17, 30, 4]] = torch.tensor([5, 1, 7, 0, 2], dtype=torch.int32, device=DEV)
    ids = torch.tensor([9, 3, 30, 17, 4, 11], device=DEV)  # expert 11 has no slot
    q, sq = act_quant(activations(1, dim, gen), 128)
    wts = torch.rand(6, generator=gen, device=DEV)
    got = fp4_moe_quantized(q, sq, data, fields, ids, wts, limit, table)
    slots = table[ids].clamp_min(0)
    assert torch.equal(got, fp4_moe_quantized(q, sq, data, fields, slots, wts, limit))
    assert rel_err(got, ref.fp4_moe_quantized(q, sq, data, fields, ids, wts, limit, table)) < 2e-2


# ------------------------------------------------------------------------ sparse attention
# decode (splits of 16 heads), prefill-sized (whole 64-head blocks a CTA), small heads
@pytest.mark.parametrize("s,h,d,t,k", [(1, 64, 512, 700, 640), (1, 64, 512, 200, 136), (4, 64, 512, 300, 200),
                                       (150, 64, 512, 900, 640), (3, 8, 128, 50, 37), (2, 16, 64, 10, 5)])
def test_sparse_attention_matches_reference(s, h, d, t, k, gen):
    from kernels.sparse_attention import sparse_attention
    q = (torch.randn(s, h, d, generator=gen, device=DEV) * 2).to(torch.bfloat16)
    kv = torch.randn(t, d, generator=gen, device=DEV).to(torch.bfloat16)
    idx = torch.randint(0, t, (s, k), generator=gen, device=DEV)
    idx[torch.rand(s, k, generator=gen, device=DEV) < 0.2] = -1
    idx[0, : k // 2] = -1
    sink = torch.randn(h, generator=gen, device=DEV)
    out = sparse_attention(q, kv, idx, sink, d ** -0.5, out_dtype=torch.float32)
    want = ref.sparse_attention(q.float(), kv.float(), idx, sink, d ** -0.5)  # fp32 result
    assert out.shape == (s, h, d) and out.dtype == torch.float32
    err = rel_err(out, want)
    print(f"sparse_attention S={s} H={h} D={d} T={t} K={k}: rel err {err:.2e}")
    assert err < 1e-4
    rounded = sparse_attention(q, kv, idx, sink, d ** -0.5)  # q's dtype: the same result rounded once
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, out.to(torch.bfloat16))


# Flash CSA (top 512 of 1024 slots), HCA (every slot), the tiny model's, several queries with
# fewer slots than the width, and a layer without entries yet
@pytest.mark.parametrize("s,w,n,k,width", [(1, 128, 1024, 512, 512), (1, 128, 8, 8, 8), (1, 16, 64, 4, 4),
                                           (3, 128, 300, 200, 512), (1, 128, 0, 0, 512)])
def test_sparse_index_matches_reference(s, w, n, k, width, gen):
    from kernels.sparse_index import sparse_index
    window_rows = torch.randint(-1, w, (s, w), generator=gen, device=DEV)
    order = torch.stack([torch.randperm(n, generator=gen, device=DEV) for _ in range(s)]).view(s, n)
    visible = torch.randint(0, n + 1, (s,), generator=gen, device=DEV)
    got = sparse_index(window_rows, order, visible, k, w, width)
    assert got.dtype == torch.int64 and torch.equal(got, ref.sparse_index(window_rows, order, visible, k, w, width))


# Flash CSA decode at short, chat and long contexts (capacity 16 .. 2048 slots ranked in-kernel,
# 4096 sorted by torch), chunk steps (several queries: 512 slots ranked, 1024 sorted), fewer
# slots than the width, and ties: scores drawn from a few values, with -inf (not visible) and both zeros
@pytest.mark.parametrize("s,w,n,k,width,offset", [(1, 128, 16, 16, 512, 128), (1, 128, 512, 512, 512, 128),
                                                  (1, 128, 2048, 512, 512, 128), (1, 128, 4096, 512, 512, 128),
                                                  (5, 128, 64, 64, 512, 133), (7, 128, 512, 512, 512, 140),
                                                  (2, 128, 1024, 512, 512, 128), (3, 16, 300, 4, 4, 16)])
@pytest.mark.parametrize("ties", [False, True])
def test_index_picks_matches_reference(s, w, n, k, width, offset, ties, gen):
    from kernels.index_picks import index_picks
    if ties:
        values = torch.tensor([1.5, 0.0, -0.0, -2.0, float("-inf")], device=DEV)
        scores = values[torch.randint(0, len(values), (s, n), generator=gen, device=DEV)]
    else:
        scores = torch.randn(s, n, generator=gen, device=DEV)
    visible = torch.randint(0, n + 1, (s,), generator=gen, device=DEV)
    scores = scores.masked_fill(torch.arange(n, device=DEV) >= visible.unsqueeze(1), float("-inf"))
    window_rows = torch.randint(-1, w, (s, w), generator=gen, device=DEV)
    got = index_picks(scores, window_rows, visible, k, offset, width)
    want = ref.index_picks(scores, window_rows, visible, k, offset, width)  # torch's stable sort on the GPU
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(want.cpu(), ref.index_picks(scores.cpu(), window_rows.cpu(), visible.cpu(), k, offset, width))


def test_sparse_attention_all_absent_gives_zero(gen):
    from kernels.sparse_attention import sparse_attention
    q = torch.randn(2, 16, 64, generator=gen, device=DEV).to(torch.bfloat16)
    kv = torch.randn(9, 64, generator=gen, device=DEV).to(torch.bfloat16)
    idx = torch.full((2, 70), -1, device=DEV)
    idx[1, 3] = 4
    out = sparse_attention(q, kv, idx, torch.zeros(16, device=DEV), 0.125, out_dtype=torch.float32)
    want = ref.sparse_attention(q.float(), kv.float(), idx, torch.zeros(16, device=DEV), 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1], want[1]) < 1e-4


@pytest.mark.parametrize("s,h,t,k", [(1, 64, 700, 640), (3, 64, 300, 200), (2, 16, 10, 5)])
def test_sparse_attention_rotates_back_in_its_combine(s, h, t, k, gen):
    """With inverse_rope the combine launch rotates its rounded output back by the queries' RoPE
    angles: bitwise the rope kernel's inverse rotation of the plain result (decode: 16 splits;
    prefill-sized: one), and the all-absent path likewise."""
    from kernels.rope import rope
    from kernels.sparse_attention import sparse_attention
    q = torch.randn(s, h, 512, generator=gen, device=DEV).to(torch.bfloat16)
    kv = torch.randn(t, 512, generator=gen, device=DEV).to(torch.bfloat16)
    idx = torch.randint(-1, t, (s, k), generator=gen, device=DEV)
    sink = torch.randn(h, generator=gen, device=DEV)
    positions = torch.randint(0, 1 << 16, (s,), generator=gen, device=DEV)
    inv_freq = ref.rope_inv_freq(64, 160000.0).to(DEV)
    plain = sparse_attention(q, kv, idx, sink, 512 ** -0.5)
    got = sparse_attention(q, kv, idx, sink, 512 ** -0.5, inverse_rope=(positions, inv_freq))
    assert torch.equal(got, rope(plain, positions, inv_freq, inverse=True))
    none = torch.full_like(idx, -1)[:, :0]
    assert torch.equal(sparse_attention(q, kv, none, sink, 512 ** -0.5, inverse_rope=(positions, inv_freq)),
                       torch.zeros_like(got))


# ------------------------------------------------------------------------------- backend
def test_tilelang_backend_has_every_kernel():
    from kernels.backend import make_backend
    b = make_backend("tilelang", DEV)
    assert b.reference_ops == ()  # every op runs its kernel (an import failure raises)


def sinkhorn_alone(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """kernels/sinkhorn.py's warp macro alone, in a one-launch kernel: logits [S, n, n] fp32 on
    CUDA -> [S, n, n]. A warp holds 32 // (n·n) tokens' matrices, one lane per element; the lanes
    left over run on a copy of the last token."""
    import tilelang.language as T

    from kernels.sinkhorn import WARP, check_n, sinkhorn_macro
    from kernels.toolkit import compile_kernel, cuda_arch

    n = logits.shape[-1]
    check_n(n)
    threads, nn = 128, n * n
    per_warp = WARP // nn
    per_cta = per_warp * (threads // WARP)  # tokens per CTA
    tokens = T.dynamic("tokens")
    steps = sinkhorn_macro(T, n, iters, eps)

    @T.prim_func
    def sinkhorn_main(L: T.Tensor((tokens, nn), "float32"), M: T.Tensor((tokens, nn), "float32")):
        with T.Kernel(T.ceildiv(tokens, per_cta), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            v = T.alloc_local((1,), "float32")
            acc = T.alloc_local((1,), "float32")
            lane = tx % WARP
            e = lane % nn  # element: row e // n, column e % n
            mine = bx * per_cta + (tx // WARP) * per_warp + lane // nn  # this lane's token
            t = T.min(mine, tokens - 1)  # every lane runs the shuffles
            v[0] = L[t, e]
            steps(v, acc, lane - e, e)
            if lane < per_warp * nn and mine < tokens:
                M[t, e] = v[0]

    flat = logits.reshape(-1, nn).contiguous()
    out = torch.empty_like(flat)
    compile_kernel(sinkhorn_main, cuda_arch(logits.device))(flat, out)
    return out.view(logits.shape)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_sinkhorn_kernel_matches_reference(tokens):
    logits = torch.randn(tokens, 4, 4, device="cuda") * 3
    got = sinkhorn_alone(logits, 20, 1e-6)
    want = ref.sinkhorn(logits, 20, 1e-6)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5


# ------------------------------------------------------------------------------- output head
@pytest.mark.parametrize("m,v,d", [(1, 129280, 4096), (3, 1000, 256), (16, 517, 64), (20, 300, 128)])
def test_head_logits_matches_reference(m, v, d, gen):
    from kernels.head_gemv import head_logits
    x = torch.randn(m, d, generator=gen, device=DEV)
    w = (torch.randn(v, d, generator=gen, device=DEV) * 0.02).to(torch.bfloat16)
    err = rel_err(head_logits(x, w), ref.head_logits(x, w))
    print(f"head_logits m={m} v={v}: rel err {err:.2e}")
    assert err < 1e-5  # fp32 products of the same operands; only the summation order differs


@pytest.mark.parametrize("shape,block", [((1, 448), 64), ((3, 448), 64), ((1, 2, 448), 64), ((5, 256), 128)])
def test_qdq8_matches_reference_exactly(shape, block, gen):
    """The KV-storage rounding through the TileLang quantiser: the reference's bits exactly."""
    from kernels.act_quant import act_quant
    full = (torch.randn(*shape[:-1], shape[-1] + 64, generator=gen, device=DEV) * 3).to(torch.bfloat16)
    x = full[..., :shape[-1]]  # a non-contiguous column slice
    got = ref.act_dequant(*act_quant(x, block), block).to(x.dtype)  # dequantisation is exact
    assert torch.equal(got, ref.qdq8(x, block))


# ------------------------------------------------------------------------------- rms_norm
RMS_CASES = [((1, 4096), torch.bfloat16, True), ((1, 64, 512), torch.bfloat16, False),
             ((1, 16384), torch.float32, False), ((3, 1024), torch.bfloat16, True),
             ((37, 512), torch.float32, True), ((5, 384), torch.bfloat16, True)]


@pytest.mark.parametrize("shape,dtype,weighted", RMS_CASES)
def test_rms_norm_matches_reference(shape, dtype, weighted, gen):
    from kernels.rms_norm import rms_norm
    x = (torch.randn(*shape, generator=gen, device=DEV) * 3).to(dtype)
    w = torch.rand(shape[-1], generator=gen, device=DEV) + 0.5 if weighted else None
    got, want = rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.double() - want.double()).abs().max().item()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22  # one rounding step of the output
    print(f"rms_norm {shape} {dtype}: max abs diff {diff:.2e}")
    assert diff <= ulp * want.double().abs().max().item()


# ----------------------------------------------------------------------------------- rope
ROPE_CASES = [((1, 64, 512), None, False), ((1, 64, 512), None, True), ((1, 512), 160000.0, False),
              ((7, 512), 160000.0, False), ((3, 8, 128), 160000.0, False), ((5, 3, 70), None, True),
              ((2, 64), None, False)]


@pytest.mark.parametrize("shape,yarn_theta,inverse", ROPE_CASES)
def test_rope_matches_reference_bitwise(shape, yarn_theta, inverse, gen):
    """Same bits as the reference on the same GPU (angles, cosf/sinf, unfused products and sums),
    at positions up to a million, with the plain and the YaRN frequency tables."""
    from kernels.rope import rope
    yarn = {"factor": 16.0, "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1}
    inv_freq = ref.rope_inv_freq(64, yarn_theta or 10000.0, yarn if yarn_theta else None).to(DEV)
    x = (torch.randn(*shape, generator=gen, device=DEV) * 4).to(torch.bfloat16)
    positions = torch.randint(0, 1 << 20, (shape[0],), generator=gen, device=DEV)
    positions[0] = 0
    got, want = rope(x, positions, inv_freq, inverse), ref.rope(x, positions, inv_freq, inverse)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), f"max abs diff {(got.float() - want.float()).abs().max().item()}"
    xf = x.float()
    assert torch.equal(rope(xf, positions, inv_freq, inverse), ref.rope(xf, positions, inv_freq, inverse))


# ------------------------------------------------------------------------------------ mHC
MHC_CASES = [(1, 4, 4096, torch.bfloat16), (5, 4, 4096, torch.bfloat16), (3, 4, 640, torch.float32),
             (2, 2, 256, torch.bfloat16), (300, 4, 4096, torch.bfloat16), (64, 4, 640, torch.float32),
             (2048, 4, 4096, torch.bfloat16), (77, 2, 256, torch.bfloat16), (100, 4, 320, torch.float32)]
# from the fifth: prefill chunks, whose mix runs in tiles of tokens (kernels.mhc.MIX_TILED_TOKENS;
# chunks of 512 and 256 channels; a last tile part empty)


def mhc_params(n: int, d: int, gen: torch.Generator):
    cols = 2 * n + n * n
    fn = torch.randn(cols, n * d, generator=gen, device=DEV) * 0.02
    scale = torch.cat([torch.full((k,), v, device=DEV) for k, v in ((n, 0.7), (n, 1.3), (n * n, 2.0))])
    base = torch.randn(cols, generator=gen, device=DEV) * 0.5
    return fn, scale, base


@pytest.mark.parametrize("s,n,d,dtype", MHC_CASES)
def test_hc_pre_matches_reference(s, n, d, dtype, gen):
    from kernels.mhc import hc_pre
    streams = (torch.randn(s, n, d, generator=gen, device=DEV) * 3).to(dtype)
    fn, scale, base = mhc_params(n, d, gen)
    got = hc_pre(streams, fn, scale, base, n, 1e-6, 1e-6)
    want = ref.hc_pre(streams, fn, scale, base, n, 1e-6, 1e-6)
    for name, g, w in zip(("x", "post", "comb_logits"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        err = rel_err(g, w)
        print(f"hc_pre {name} S={s} n={n} D={d} {dtype}: rel err {err:.2e}")
        assert err < (4e-3 if name == "x" and dtype == torch.bfloat16 else 1e-4), name


def mix_streams(out, streams, post, comb):
    """HCPost's mix with a given (projected) comb: the reference's formula after its Sinkhorn."""
    mixed = torch.einsum("sjk,sjd->skd", comb, streams.float())
    return (post.unsqueeze(-1) * out.unsqueeze(1) + mixed).to(streams.dtype)


@pytest.mark.parametrize("s,n,d,dtype", MHC_CASES)
def test_hc_post_matches_reference(s, n, d, dtype, gen):
    """The kernel projects the comb logits with the Sinkhorn warp macro (the same bits as
    `sinkhorn_alone`), then mixes within one output rounding; `early` (projection before the PDL
    wait) changes no bit; against the pure reference within Sinkhorn's bound."""
    from kernels.mhc import hc_post
    streams = (torch.randn(s, n, d, generator=gen, device=DEV) * 3).to(dtype)
    out = torch.randn(s, d, generator=gen, device=DEV).to(dtype)
    post = torch.rand(s, n, generator=gen, device=DEV) * 2
    logits = torch.randn(s, n, n, generator=gen, device=DEV) * 3
    got = hc_post(out, streams, post, logits, 20, 1e-6)
    assert torch.equal(hc_post(out, streams, post, logits, 20, 1e-6, early=True), got)
    want = mix_streams(out, streams, post, sinkhorn_alone(logits, 20, 1e-6))
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.double() - want.double()).abs()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
    print(f"hc_post S={s} n={n} D={d} {dtype}: max abs diff {diff.max().item():.2e}")
    assert (diff <= ulp * want.double().abs() + 1e-6).all()  # at most one rounding step of the output
    pure = ref.hc_post(out, streams, post, logits, 20, 1e-6)
    bound = ulp * pure.double().abs() + 1e-5 * streams.double().abs().sum(dim=1, keepdim=True) + 1e-6
    assert ((got.double() - pure.double()).abs() <= bound).all()


@pytest.mark.parametrize("s,n,d,dtype", MHC_CASES)
def test_hc_post_pre_is_hc_post_then_hc_pre_bit_for_bit(s, n, d, dtype, gen):
    """The decode step's fused post + next pre (two launches under MIX_TILED_TOKENS tokens when
    D is whole 256-channel chunks, the two ops otherwise) gives the bits of the two ops, `early`
    or not."""
    from kernels.mhc import hc_post, hc_post_pre, hc_pre
    streams = (torch.randn(s, n, d, generator=gen, device=DEV) * 3).to(dtype)
    out = torch.randn(s, d, generator=gen, device=DEV).to(dtype)
    post = torch.rand(s, n, generator=gen, device=DEV) * 2
    logits = torch.randn(s, n, n, generator=gen, device=DEV) * 3
    fn, scale, base = mhc_params(n, d, gen)
    new = hc_post(out, streams, post, logits, 20, 1e-6)
    want = (new, *hc_pre(new, fn, scale, base, n, 1e-6, 1e-6))
    for early in (False, True):
        got = hc_post_pre(out, streams, post, logits, 20, 1e-6, fn, scale, base, 1e-6, early=early)
        for name, g, w in zip(("streams", "x", "post", "comb_logits"), got, want):
            assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), (name, early)


@pytest.mark.parametrize("s,n,d,dtype", MHC_CASES)
@pytest.mark.parametrize("indexed", [False, True])
def test_moe_post_pre_is_moe_combine_then_hc_post_pre_bit_for_bit(s, n, d, dtype, indexed, gen):
    """The decode and chunk steps' MoE output summed inside the fused post + next pre gives the
    bits of `moe_combine` then `hc_post_pre` (k = 6 choices: fp32 in routing order, or bf16 cells
    with their rows; a -0.0 cell sum keeps its sign), `early` or not; and the reference's values."""
    from kernels.mhc import hc_post_pre, moe_post_pre
    from kernels.moe_combine import moe_combine
    k = 6
    streams = (torch.randn(s, n, d, generator=gen, device=DEV) * 3).to(dtype)
    # the decode step's routed outputs are fp32, a chunk step's cells bf16
    routed = torch.randn(s, k, d, generator=gen, device=DEV).to(torch.bfloat16 if indexed else torch.float32)
    routed[:, :, :8] = -0.0  # with a -0.0 shared: the sum must stay -0.0
    shared = torch.randn(s, d, generator=gen, device=DEV).to(torch.bfloat16)
    shared[:, :8] = -0.0
    rows = None
    if indexed:  # the cells in another order, as a chunk step's grouped-by-expert calls leave them
        perm = torch.randperm(s * k, generator=gen, device=DEV)
        cells = torch.empty(s * k, d, dtype=routed.dtype, device=DEV)
        cells[perm] = routed.reshape(s * k, d)
        routed, rows = cells, perm.reshape(s, k)
    post = torch.rand(s, n, generator=gen, device=DEV) * 2
    logits = torch.randn(s, n, n, generator=gen, device=DEV) * 3
    fn, scale, base = mhc_params(n, d, gen)
    out = moe_combine(routed, shared, dtype, rows)
    assert torch.signbit(out[:, :8]).all()
    want = hc_post_pre(out, streams, post, logits, 20, 1e-6, fn, scale, base, 1e-6)
    for early in (False, True):
        got = moe_post_pre(routed, shared, rows, streams, post, logits, 20, 1e-6, fn, scale, base, 1e-6, early=early)
        for name, g, w in zip(("streams", "x", "post", "comb_logits"), got, want):
            assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), (name, early)
    pure = ref.moe_post_pre(routed, shared, rows, streams, post, logits, 20, 1e-6, fn, scale, base, 1e-6)
    assert torch.equal(ref.moe_combine(routed, shared, dtype, rows), out)
    bound = 2.0 ** -7 * pure[0].double().abs() + 1e-5 * streams.double().abs().sum(dim=1, keepdim=True) + 1e-4
    assert ((got[0].double() - pure[0].double()).abs() <= bound).all()


def test_moe_post_pre_rejects_parts_that_do_not_fit(gen):
    from kernels.toolkit import KernelInputError
    from kernels.mhc import moe_post_pre
    streams = torch.randn(1, 4, 4096, device=DEV).to(torch.bfloat16)
    fn, scale, base = mhc_params(4, 4096, gen)
    post, logits = torch.rand(1, 4, device=DEV), torch.rand(1, 4, 4, device=DEV)
    routed = torch.randn(1, 6, 4096, device=DEV).to(torch.bfloat16)
    with pytest.raises(KernelInputError, match="shared .* does not fit"):
        moe_post_pre(routed, routed[:, 0, :100], None, streams, post, logits, 20, 1e-6, fn, scale, base, 1e-6)
    with pytest.raises(KernelInputError, match="rows"):
        moe_post_pre(routed[0], routed[:, 0], torch.zeros(1, 6, dtype=torch.int32, device=DEV), streams, post,
                     logits, 20, 1e-6, fn, scale, base, 1e-6)


def test_mhc_rejects_bad_shapes(gen):
    from kernels.toolkit import KernelInputError
    from kernels.mhc import hc_post, hc_pre
    streams = torch.randn(1, 4, 4096, device=DEV).to(torch.bfloat16)
    fn, scale, base = mhc_params(4, 4096, gen)
    with pytest.raises(KernelInputError, match="do not fit"):
        hc_pre(streams, fn[:, :100], scale, base, 4, 1e-6, 1e-6)
    with pytest.raises(KernelInputError, match="do not fit"):
        hc_post(streams[:, 0], streams, torch.rand(1, 3, device=DEV), torch.rand(1, 4, 4, device=DEV), 20, 1e-6)


@pytest.mark.parametrize("m", [1, 3, 20])
def test_fp8_gemm_quantized_equals_fp8_gemm(m, gen):
    """Pre-quantised activations (the shared expert's w2 after swiglu_quant) give fp8_gemm's bits,
    through the GEMV (row buckets padded with zero codes) and the prefill path."""
    from kernels.act_quant import act_quant
    from kernels.fp8_gemm import fp8_gemm, fp8_gemm_quantized
    w, s = fp8_weight(4096, 2048, gen)
    x = activations(m, 2048, gen)
    got = fp8_gemm_quantized(*act_quant(x, 128), w, s)
    assert got.shape == (m, 4096) and torch.equal(got, fp8_gemm(x, w, s))
    assert rel_err(got, ref.fp8_gemm_quantized(*ref.act_quant(x, 128), w, s)) < 4e-3
    # the weight's scales converted once (engine.numerics.FP8Weight): the same bits
    s32 = ref.e8m0_to_float(s)
    assert torch.equal(fp8_gemm_quantized(*act_quant(x, 128), w, s, s32), got)
    assert torch.equal(fp8_gemm(x, w, s, s32), got)


def test_fp8_gemm_rejects_prepared_scales_of_another_shape(gen):
    from kernels.toolkit import KernelInputError
    from kernels.fp8_gemm import fp8_gemm
    w, s = fp8_weight(4096, 2048, gen)
    with pytest.raises(KernelInputError, match="w_scale_f32"):
        fp8_gemm(activations(40, 2048, gen), w, s, ref.e8m0_to_float(s).t().contiguous())


# ------------------------------------------------------------------------- indexer scores
@pytest.mark.parametrize("s,h,d,t", [(1, 64, 128, 700), (3, 64, 128, 129), (2, 4, 32, 10), (1, 64, 128, 1)])
def test_indexer_scores_matches_reference(s, h, d, t, gen):
    """Real decode shape (64 heads × 128, 700 entries), prefill rows, the tiny model's 4 heads
    (padded to a tensor-core tile), a single entry; -inf exactly where the reference has it."""
    from kernels.indexer_scores import indexer_scores
    q = torch.randn(s, h, d, generator=gen, device=DEV).to(torch.bfloat16)
    keys = torch.randn(t, d, generator=gen, device=DEV).to(torch.bfloat16)
    w = torch.randn(s, h, generator=gen, device=DEV) * h ** -0.5
    visible = torch.randint(0, t + 1, (s,), generator=gen, device=DEV)
    visible[0] = t  # one query sees every entry
    got = indexer_scores(q, keys, w, visible, d ** -0.5)
    want = ref.indexer_scores(q, keys, w, visible, d ** -0.5)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    err = rel_err(got[fin], want[fin]) if fin.any() else 0.0
    print(f"indexer_scores S={s} H={h} D={d} T={t}: rel err {err:.2e}")
    assert err < 1e-5


# ------------------------------------------------------------------------------ norm_rope
NORM_ROPE_CASES = [((1, 64, 512), False, 0), ((1, 512), True, 448), ((5, 512), True, 448),
                   ((2, 3, 96), True, 64), ((3, 1, 128), False, 0), ((1, 1100), True, 0)]


@pytest.mark.parametrize("shape,weighted,lead", NORM_ROPE_CASES)
def test_norm_rope_matches_reference(shape, weighted, lead, gen):
    """q (64 heads, no weight), kv (weighted, QDQ8 of the 448 nope dims), prefill rows, odd
    widths, and a row too wide for one CTA (the reference path). The normed values equal the
    reference's up to one bf16 rounding step (fp32 summation order), which can move a QDQ8 code
    by one step in rare elements; everything else matches to that rounding step."""
    from kernels.norm_rope import norm_rope
    d = shape[-1]
    half = 32 if d >= 128 else 16
    inv_freq = ref.rope_inv_freq(2 * half, 10000.0).to(DEV)
    x = (torch.randn(*shape, generator=gen, device=DEV) * 3).to(torch.bfloat16)
    w = torch.rand(d, generator=gen, device=DEV) + 0.5 if weighted else None
    positions = torch.randint(0, 1 << 16, (shape[0],), generator=gen, device=DEV)
    got = norm_rope(x, w, 1e-6, positions, inv_freq, lead)
    want = ref.norm_rope(x, w, 1e-6, positions, inv_freq, lead)
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.double() - want.double()).abs()
    far = diff > 2.0 ** -7 * want.double().abs() + 1e-6  # beyond one bf16 rounding step
    print(f"norm_rope {shape} lead={lead}: rel err {rel_err(got, want):.2e}, {int(far.sum())} elements "
          "beyond one bf16 step")
    assert rel_err(got, want) < 1e-2
    assert not far[..., lead:].any()  # unrounded channels: one rounding step at most
    assert far.float().mean() < 0.01  # QDQ8 codes moved by the normed values' last bit: rare


@pytest.mark.parametrize("shape,rows", [((1, 512), [5]), ((3, 512), [7, 0, 2]), ((1, 1100), [1])])
def test_norm_rope_writes_buffer_rows_in_place(shape, rows, gen):
    """With out/rows the kernel writes token s to out[rows[s]] (the KV window row), bitwise what
    it returns without them, and leaves every other row as it was (the last case: the reference
    path, a row too wide for one CTA)."""
    from kernels.toolkit import KernelInputError
    from kernels.norm_rope import norm_rope
    d = shape[-1]
    inv_freq = ref.rope_inv_freq(64, 10000.0).to(DEV)
    x = (torch.randn(*shape, generator=gen, device=DEV) * 3).to(torch.bfloat16)
    w = torch.rand(d, generator=gen, device=DEV) + 0.5
    positions = torch.randint(0, 1 << 16, (shape[0],), generator=gen, device=DEV)
    want = norm_rope(x, w, 1e-6, positions, inv_freq, 448)
    buf = torch.randn(8, d, generator=gen, device=DEV).to(torch.bfloat16)
    before = buf.clone()
    idx = torch.tensor(rows, device=DEV)
    assert norm_rope(x, w, 1e-6, positions, inv_freq, 448, buf, idx) is None
    assert torch.equal(buf[idx], want)
    untouched = torch.ones(8, dtype=torch.bool, device=DEV)
    untouched[idx] = False
    assert torch.equal(buf[untouched], before[untouched])
    with pytest.raises(KernelInputError, match="out"):
        norm_rope(x, w, 1e-6, positions, inv_freq, 448, buf.float(), idx)


@pytest.mark.parametrize("shape,weighted", [((1, 4096), True), ((1, 1024), True), ((7, 4096), False),
                                            ((3, 256), True)])
def test_rms_norm_quant_matches_reference(shape, weighted, gen):
    """y within one rounding step of the reference norm; q and s exactly act_quant of the kernel's
    own y."""
    from kernels.rms_norm_quant import rms_norm_quant
    x = (torch.randn(*shape, generator=gen, device=DEV) * 3).to(torch.bfloat16)
    w = torch.rand(shape[-1], generator=gen, device=DEV) + 0.5 if weighted else None
    y, q, s = rms_norm_quant(x, w, 1e-6)
    want = ref.rms_norm(x, w, 1e-6)
    diff = (y.double() - want.double()).abs()
    print(f"rms_norm_quant {shape}: max abs diff {diff.max().item():.2e}")
    assert y.dtype == want.dtype and (diff <= 2.0 ** -7 * want.double().abs()).all()
    rq, rs = ref.act_quant(y, 128)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_rms_norm_quant_rejects_partial_blocks():
    """A width that is not a whole number of 128-channel FP8 blocks is refused by name."""
    from kernels.toolkit import KernelInputError
    from kernels.rms_norm_quant import rms_norm_quant
    with pytest.raises(KernelInputError, match="blocks of 128"):
        rms_norm_quant(torch.zeros(2, 200, dtype=torch.bfloat16, device=DEV), None, 1e-6)
