"""kernels/swiglu_quant.py and kernels/moe_combine.py vs kernels/reference.py (CUDA only).

Both kernels must match the reference bit for bit when the reference runs on the same GPU:
the quantised codes and scales of swiglu_quant, the combined output of moe_combine.
"""

import pytest
import torch

from kernels import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
# per-row magnitudes: rows past the clamp, ordinary rows, and rows whose amax falls under the
# 1e-4 scale floor
ROW_MAGS = (8.0, 1.0, 2.0 ** -3, 2.0 ** -8, 16.0, 2.0 ** -11)


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(4321)


def _ordinal(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (sign | magnitude) -> integers ordered like the values."""
    c = codes.view(torch.uint8).to(torch.int32)
    return torch.where(c >= 128, -(c & 0x7F), c)


def _assert_same_codes(q: torch.Tensor, want: torch.Tensor) -> None:
    assert q.dtype == want.dtype == torch.float8_e4m3fn and q.shape == want.shape
    if not torch.equal(q.view(torch.uint8), want.view(torch.uint8)):
        dist = (_ordinal(q) - _ordinal(want)).abs()
        raise AssertionError(f"{int((dist != 0).sum())} of {q.numel()} codes differ, max code distance "
                             f"{int(dist.max())}")


def _gate_up(m: int, inter: int, dtype: torch.dtype, sliced: bool, gen: torch.Generator):
    mag = torch.tensor([ROW_MAGS[i % len(ROW_MAGS)] for i in range(m)], device=DEV).unsqueeze(1)
    gu = (torch.randn(m, 2 * inter, generator=gen, device=DEV) * mag).to(dtype)
    if sliced:  # column halves of one [M, 2I] tensor: strided rows
        return gu[:, :inter], gu[:, inter:]
    return gu[:, :inter].contiguous(), gu[:, inter:].contiguous()


@pytest.mark.parametrize("m,inter,dtype,weighted,sliced", [
    (6, 2048, torch.bfloat16, True, True),  # routed experts of decode
    (1, 2048, torch.bfloat16, False, True),  # the shared expert
    (3, 384, torch.float32, True, True),  # odd block count
    (6, 2048, torch.bfloat16, True, False),  # contiguous g and u
])
def test_swiglu_quant_matches_reference_exactly(m, inter, dtype, weighted, sliced, gen):
    from kernels.swiglu_quant import swiglu_quant
    limit = 10.0
    g, u = _gate_up(m, inter, dtype, sliced, gen)
    weights = torch.rand(m, generator=gen, device=DEV) if weighted else None
    q, s = swiglu_quant(g, u, weights, limit)
    q_ref, s_ref = ref.swiglu_quant(g, u, weights, limit)
    assert s.shape == s_ref.shape == (m, inter // 128) and s.dtype == torch.float32
    assert torch.equal(s, s_ref), f"{int((s != s_ref).sum())} of {s.numel()} scales differ"
    _assert_same_codes(q, q_ref)


def test_swiglu_quant_other_limit_and_block(gen):
    """A limit that is not exact in fp32 and 64-channel blocks."""
    from kernels.swiglu_quant import swiglu_quant
    g, u = _gate_up(4, 384, torch.bfloat16, True, gen)
    weights = torch.rand(4, generator=gen, device=DEV)
    q, s = swiglu_quant(g, u, weights, 7.3, 64)
    q_ref, s_ref = ref.swiglu_quant(g, u, weights, 7.3, 64)
    assert torch.equal(s, s_ref)
    _assert_same_codes(q, q_ref)


@pytest.mark.parametrize("n,k,d,routed_dtype,shared_dtype,dtype", [
    (1, 6, 4096, torch.float32, torch.bfloat16, torch.bfloat16),  # decode
    (5, 6, 4096, torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (2, 3, 100, torch.float32, torch.float32, torch.float32),  # odd D
    (3, 1, 100, torch.float32, torch.bfloat16, torch.float32),  # one expert
])
def test_moe_combine_matches_reference_exactly(n, k, d, routed_dtype, shared_dtype, dtype, gen):
    from kernels.moe_combine import moe_combine
    # per-expert magnitudes far apart, so that any other summation order rounds differently
    mag = torch.exp2(torch.randint(-8, 8, (n, k, 1), generator=gen, device=DEV).float())
    routed = (torch.randn(n, k, d, generator=gen, device=DEV) * mag).to(routed_dtype)
    shared = torch.randn(n, d, generator=gen, device=DEV).to(shared_dtype)
    out = moe_combine(routed, shared, dtype)
    want = ref.moe_combine(routed, shared, dtype)
    assert out.dtype == want.dtype == dtype and out.shape == want.shape == (n, d)
    assert torch.equal(out, want), f"{int((out != want).sum())} of {out.numel()} outputs differ"


@pytest.mark.parametrize("n,k,d", [(728, 6, 4096), (3, 2, 100)])
def test_moe_combine_reads_cells_in_place_exactly(n, k, d, gen):
    """A prefill's cells grouped by expert ([N·k, D] bf16) with the row of each (token, choice):
    the same bits as the reference, and as combining the cells put back in (token, choice) order."""
    from kernels.moe_combine import moe_combine
    mag = torch.exp2(torch.randint(-8, 8, (n * k, 1), generator=gen, device=DEV).float())
    cells = (torch.randn(n * k, d, generator=gen, device=DEV) * mag).to(torch.bfloat16)
    rows = torch.randperm(n * k, generator=gen, device=DEV).view(n, k)
    shared = torch.randn(n, d, generator=gen, device=DEV).to(torch.bfloat16)
    out = moe_combine(cells, shared, torch.bfloat16, rows)
    assert torch.equal(out, ref.moe_combine(cells, shared, torch.bfloat16, rows))
    assert torch.equal(out, moe_combine(cells[rows.reshape(-1)].view(n, k, d), shared, torch.bfloat16))
    from kernels.toolkit import KernelInputError
    with pytest.raises(KernelInputError, match="rows"):
        moe_combine(cells, shared, torch.bfloat16, rows.int())


def test_swiglu_quant_rejects_bad_inputs():
    from kernels.toolkit import KernelInputError
    from kernels.swiglu_quant import swiglu_quant
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV)
    w = torch.ones(2, device=DEV)
    with pytest.raises(KernelInputError, match="shape"):
        swiglu_quant(x, x[:, :128], w, 10.0)  # mismatched shapes
    with pytest.raises(KernelInputError, match="multiple of block"):
        swiglu_quant(x[:, :200], x[:, :200], w, 10.0)  # I not a multiple of 128
    with pytest.raises(KernelInputError, match="bf16"):
        swiglu_quant(x.double(), x.double(), w, 10.0)
    with pytest.raises(KernelInputError, match="bf16"):
        swiglu_quant(x, x.float(), w, 10.0)  # g and u of different dtypes
    with pytest.raises(KernelInputError, match="weights"):
        swiglu_quant(x, x, torch.ones(3, device=DEV), 10.0)
    with pytest.raises(KernelInputError, match="CUDA"):
        swiglu_quant(x.cpu(), x.cpu(), None, 10.0)


def test_moe_combine_rejects_bad_inputs():
    from kernels.toolkit import KernelInputError
    from kernels.moe_combine import moe_combine
    routed = torch.zeros(2, 6, 128, device=DEV)
    shared = torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(KernelInputError, match="shared"):
        moe_combine(routed, shared[:, :64], torch.bfloat16)  # mismatched D
    with pytest.raises(KernelInputError, match="shared"):
        moe_combine(routed, shared[:1], torch.bfloat16)  # mismatched N
    with pytest.raises(KernelInputError, match="routed"):
        moe_combine(routed[:, 0], shared, torch.bfloat16)  # no expert dim
    with pytest.raises(KernelInputError, match="out dtype"):
        moe_combine(routed, shared, torch.float64)
    with pytest.raises(KernelInputError, match="routed dtype"):
        moe_combine(routed.to(torch.int32), shared, torch.bfloat16)
