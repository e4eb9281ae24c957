"""kernels/moe_gate.py vs kernels/reference.py on the GPU (CUDA only; skipped elsewhere).

The kernel's logits differ from the reference's only in fp32 summation order, so the routing
weights agree to ~1e-6 relative and the expert ids agree exactly except where the reference's
own biased scores nearly tie at a place that decides a slot (such rows are skipped, and must be
rare). Exact ties (identical weight rows, equal biases) must go to the lowest index, as in the
reference's stable sort.
"""

import pytest
import torch

from kernels import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
NEAR = 1e-5  # relative gap under which two biased scores may legitimately swap
W_RTOL = 1e-5


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(2468)


def _gate(*args, **kwargs):
    from kernels.moe_gate import moe_gate
    return moe_gate(*args, **kwargs)


def _inputs(n: int, e: int, d: int, dtype: torch.dtype, gen: torch.Generator, bias_std: float = 0.05):
    x = torch.randn(n, d, generator=gen, device=DEV).to(dtype)
    weight = torch.randn(e, d, generator=gen, device=DEV) * d ** -0.5
    bias = torch.randn(e, generator=gen, device=DEV) * bias_std
    return x, weight, bias


def _exact_inputs(n: int, e: int, d: int, gen: torch.Generator):
    """Small integers (x) and multiples of 2^-10 (weight): every product and partial sum is exact
    in fp32, so the logits, and hence the keys, are the same bits in any summation order."""
    x = torch.randint(-2, 3, (n, d), generator=gen, device=DEV).to(torch.bfloat16)
    weight = torch.randint(-2, 3, (e, d), generator=gen, device=DEV).float() * 2.0 ** -10
    return x, weight, torch.randn(e, generator=gen, device=DEV) * 0.05


def _near_tie_rows(x, weight, bias, k: int) -> torch.Tensor:
    """Rows where two of the reference's top k + 1 biased scores are within NEAR relative: there a
    different fp32 summation order may legitimately change the ids or their slot order."""
    key = torch.nn.functional.softplus(x.float() @ weight.T).sqrt() + bias
    top = key.sort(dim=-1, descending=True).values[:, :k + 1]
    gaps = (top[:, :-1] - top[:, 1:]).abs() <= NEAR * top[:, :-1].abs()
    return gaps.any(dim=-1)


def _check(x, weight, bias, k, route_scale, hash_ids=None, exact_keys=False):
    """Compare with the reference; `exact_keys`: the logits are exact (`_exact_inputs`), so no
    row may be skipped as a near tie."""
    idx, w = _gate(x, weight, bias, k, route_scale, hash_ids)
    idx_r, w_r = ref.moe_gate(x, weight, bias, k, route_scale, hash_ids)
    n = x.shape[0]
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (n, k)
    assert idx.device == w.device == x.device
    if bias is None:
        assert torch.equal(idx, hash_ids)
        skip = torch.zeros(n, dtype=torch.bool, device=DEV)
    else:
        skip = _near_tie_rows(x, weight, bias, k) & (not exact_keys)
        assert int(skip.sum()) <= max(1, n // 20), f"{int(skip.sum())} of {n} rows near-tie: too many"
        assert torch.equal(idx[~skip], idx_r[~skip]), \
            f"ids differ in {int((idx != idx_r)[~skip].any(-1).sum())} of {int((~skip).sum())} decided rows"
        assert ((idx.sort(-1).values[:, 1:] != idx.sort(-1).values[:, :-1]).all()), "an expert chosen twice"
    same = (idx == idx_r).all(dim=-1)
    rel = ((w - w_r).abs() / w_r.abs())[same]
    assert rel.numel() and rel.max().item() < W_RTOL, f"max weight rel err {rel.max().item():.3g}"
    return idx, w


@pytest.mark.parametrize("n,e,d,k,dtype", [
    (1, 256, 4096, 6, torch.bfloat16),  # decode
    (5, 256, 4096, 6, torch.bfloat16),  # a partial token tile
    (16, 256, 4096, 6, torch.bfloat16),  # two token tiles, the largest GEMV batch
    (40, 256, 4096, 6, torch.bfloat16),  # prefill: cuBLAS logits
    (1, 16, 128, 4, torch.bfloat16),  # the tiny model (hidden 128)
    (7, 16, 256, 4, torch.bfloat16),
    (3, 256, 4096, 6, torch.float32),  # fp32 x
    (2, 256, 640, 6, torch.float16),  # D not a multiple of warps × 128: the last warp idles
    (3, 1000, 512, 8, torch.bfloat16),  # several experts per select thread, E not a power of two
])
def test_biased_matches_reference(n, e, d, k, dtype, gen):
    x, weight, bias = _inputs(n, e, d, dtype, gen)
    _check(x, weight, bias, k, 2.5)


@pytest.mark.parametrize("n,e,d,k", [(1, 256, 4096, 6), (5, 256, 4096, 6), (3, 16, 128, 4), (20, 256, 4096, 6)])
def test_hash_matches_reference(n, e, d, k, gen):
    x, weight, _ = _inputs(n, e, d, torch.bfloat16, gen)
    hash_ids = torch.rand(n, e, generator=gen, device=DEV).argsort(dim=-1)[:, :k]  # distinct per row
    _check(x, weight, None, k, 1.5, hash_ids)


@pytest.mark.parametrize("n,e,d,k", [(1, 256, 4096, 6), (5, 256, 4096, 6), (16, 16, 128, 4), (40, 256, 4096, 6)])
def test_exact_logits_give_the_same_ids_in_every_row(n, e, d, k, gen):
    x, weight, bias = _exact_inputs(n, e, d, gen)
    _check(x, weight, bias, k, 2.5, exact_keys=True)


def test_large_logits_and_wide_bias(gen):
    """Logits past the softplus threshold (20) and far below zero; a bias that decides."""
    x, weight, bias = _inputs(4, 256, 4096, torch.float32, gen, bias_std=2.0)
    _check(x * 40, weight, bias, 6, 2.5)


def test_exact_ties_go_to_the_lowest_index(gen):
    e, d, k, n = 256, 4096, 6, 3
    x, weight, bias = _exact_inputs(n, e, d, gen)

    def ids(*values):
        return torch.tensor(values, device=DEV).expand(n, k)

    # 1) zero weights, zero bias: every key equal -> experts 0..k-1 in order, equal weights
    zero_w, zero_b = torch.zeros_like(weight), torch.zeros_like(bias)
    idx, w = _check(x, zero_w, zero_b, k, 2.5, exact_keys=True)
    assert torch.equal(idx, ids(*range(k)))
    assert torch.allclose(w, torch.full_like(w, 2.5 / k), rtol=1e-6)
    # 2) zero weights, four experts with an equal larger bias: them in order, then 0 and 1
    b = zero_b.clone()
    b[[9, 40, 41, 200]] = 0.5
    idx, _ = _check(x, zero_w, b, k, 2.5, exact_keys=True)
    assert torch.equal(idx, ids(9, 40, 41, 200, 0, 1))
    # 3) eight identical weight rows with an equal dominant bias: the lowest six of them
    group = [3, 17, 64, 65, 128, 200, 201, 255]
    wt, b = weight.clone(), bias.clone()
    wt[group] = weight[5]
    b[group] = 5.0
    idx, _ = _check(x, wt, b, k, 2.5, exact_keys=True)
    assert torch.equal(idx, ids(*group[:k]))
    # 4) one clear winner, then a tie across the slot boundary
    b[100] = 9.0
    idx, _ = _check(x, wt, b, k, 2.5, exact_keys=True)
    assert torch.equal(idx, ids(100, *group[:k - 1]))


def test_deterministic_and_misaligned_inputs(gen):
    n, e, d, k = 5, 256, 4096, 6
    x, weight, bias = _inputs(n, e, d, torch.bfloat16, gen)
    buf = torch.empty(n * d + 1, dtype=x.dtype, device=DEV)
    xm = buf[1:].view(n, d)  # 2-byte offset: copied onto an aligned base
    xm.copy_(x)
    a = _gate(x, weight, bias, k, 2.5)
    b = _gate(xm, weight, bias, k, 2.5)
    c = _gate(x.T.contiguous().T, weight, bias, k, 2.5)  # column-major: made contiguous
    for got in (b, c):
        assert torch.equal(a[0], got[0]) and torch.equal(a[1], got[1])
    _check(x[::2], weight, bias, k, 2.5)  # strided rows


def test_empty_batch():
    idx, w = _gate(torch.zeros(0, 128, device=DEV), torch.zeros(16, 128, device=DEV),
                   torch.zeros(16, device=DEV), 4, 1.0)
    assert idx.shape == w.shape == (0, 4) and idx.dtype == torch.int64


def test_rejects_bad_inputs():
    from kernels.toolkit import KernelInputError
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=DEV)
    weight = torch.zeros(16, 256, device=DEV)
    bias = torch.zeros(16, device=DEV)
    hash_ids = torch.zeros(2, 4, dtype=torch.int64, device=DEV)
    with pytest.raises(KernelInputError, match="weight"):
        _gate(x, weight[:, :128], bias, 4, 1.0)  # D mismatch
    with pytest.raises(KernelInputError, match="fp32"):
        _gate(x, weight.to(torch.bfloat16), bias, 4, 1.0)
    with pytest.raises(KernelInputError, match=r"x \[N, D\]"):
        _gate(x[0], weight, bias, 4, 1.0)  # x not [N, D]
    with pytest.raises(KernelInputError, match="bf16"):
        _gate(x.double(), weight, bias, 4, 1.0)
    with pytest.raises(KernelInputError, match=r"k \(17\)"):
        _gate(x, weight, bias, 17, 1.0)  # k > E
    with pytest.raises(KernelInputError, match=r"k \(0\)"):
        _gate(x, weight, bias, 0, 1.0)
    with pytest.raises(KernelInputError, match="multiple of 128"):
        _gate(x[:, :200], weight[:, :200], bias, 4, 1.0)
    with pytest.raises(KernelInputError, match=r"E \(1025\)"):
        _gate(x, torch.zeros(1025, 256, device=DEV), torch.zeros(1025, device=DEV), 4, 1.0)
    with pytest.raises(KernelInputError, match="bias"):
        _gate(x, weight, bias[:8], 4, 1.0)
    with pytest.raises(KernelInputError, match="hash_ids"):
        _gate(x, weight, None, 4, 1.0)  # neither bias nor hash_ids
    with pytest.raises(KernelInputError, match="hash_ids"):
        _gate(x, weight, None, 4, 1.0, hash_ids[:, :3])  # [N, k - 1]
    with pytest.raises(KernelInputError, match="hash_ids"):
        _gate(x, weight, None, 4, 1.0, hash_ids[:1])  # [N - 1, k]
    with pytest.raises(KernelInputError, match="hash_ids"):
        _gate(x, weight, None, 4, 1.0, hash_ids.float())
    with pytest.raises(KernelInputError, match="CUDA"):
        _gate(x.cpu(), weight.cpu(), bias.cpu(), 4, 1.0)
    with pytest.raises(KernelInputError, match="one device"):
        _gate(x, weight, bias.cpu(), 4, 1.0)
