"""TileLang hadamard_qdq4 vs kernels/reference.py on the GPU, bit for bit (CUDA only; skipped elsewhere).

The reference runs on the same GPU, so both sides use torch's CUDA rules (a division by a Python
scalar is a product with the fp32 reciprocal); the kernel must equal it exactly (torch.equal).
"""

import math

import pytest
import torch

from kernels import reference as ref
from kernels.toolkit import KernelInputError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of the e2m1 grid


@pytest.fixture
def gen():
    return torch.Generator(device=DEV).manual_seed(1234)


def assert_same(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    bad = got != want
    if bad.any():
        where = tuple(i.item() for i in bad.nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} of {want.numel()} values differ, max abs diff "
                             f"{(got.float() - want.float()).abs().max().item():.4g}; first at {where}: "
                             f"got {got[where].item()!r}, want {want[where].item()!r}")


def run(x: torch.Tensor, block: int = 32):
    from kernels.hadamard_qdq4 import hadamard_qdq4
    assert_same(hadamard_qdq4(x, block), ref.hadamard_qdq4(x, block))


def tie_rows(d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows a·e0 + b·e1 whose transform (D = 4^k: exact) alternates ±6·2^k (the block amax, so
    s = 2^k) and ±T·2^k for each e2m1 tie T: every second value is a rounding tie."""
    r = math.isqrt(d)
    a = torch.tensor([3 * r + r * t / 2 for t in E2M1_TIES], device=DEV)  # (a + b)/r = 6, (a - b)/r = T
    b = 6 * r - a
    x = torch.zeros(len(E2M1_TIES), d, device=DEV)
    x[:, 0], x[:, 1] = a, b
    sign = torch.randint(0, 2, (len(E2M1_TIES), 1), generator=gen, device=DEV) * 2 - 1
    mag = torch.exp2(torch.randint(-20, 10, (len(E2M1_TIES), 1), generator=gen, device=DEV).float())
    return (x * sign * mag).to(dtype)


# --------------------------------------------------------------------------------- random inputs
@pytest.mark.parametrize("shape,dtype", [((1, 64, 128), torch.bfloat16), ((7, 128), torch.bfloat16),
                                         ((3, 128), torch.float32), ((2, 5, 64), torch.bfloat16),
                                         ((1, 256), torch.bfloat16), ((4096, 128), torch.float32),
                                         ((9, 32), torch.float16), ((3, 1024), torch.bfloat16)])
def test_matches_reference_exactly(shape, dtype, gen):
    """Rows of very different magnitudes; a zero input block; a zero row (amax below the floor)."""
    mag = torch.exp2(torch.randint(-20, 10, shape[:-1] + (1,), generator=gen, device=DEV).float())
    x = torch.randn(*shape, generator=gen, device=DEV) * mag
    x = x.reshape(-1, shape[-1])
    x[0, :32] = 0.0
    if x.shape[0] > 1:
        x[-1] = 0.0
    run(x.reshape(shape).to(dtype))


def test_non_contiguous_input(gen):
    x = torch.randn(128, 6, generator=gen, device=DEV).to(torch.bfloat16).T  # [6, 128], strided
    run(x)


# ------------------------------------------------------------------------------------ edge values
@pytest.mark.parametrize("d,dtype", [(64, torch.float32), (64, torch.bfloat16), (256, torch.bfloat16),
                                     (256, torch.float16)])
def test_e2m1_ties(d, dtype, gen):
    x = tie_rows(d, dtype, gen)
    t = ref.hadamard(x).float().reshape(-1, d)  # check the construction: ties are really hit
    assert (t[:, 1].abs() / t[:, 0].abs() * 6 == torch.tensor(E2M1_TIES, device=DEV)).all()
    run(x)


@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float32)])
def test_zero_output_block(d, dtype, gen):
    """x_0 = x_{D/2}: the transform's second half is exactly zero (amax 0: the scale floor)."""
    x = torch.zeros(4, d, device=DEV)
    x[:, 0] = x[:, d // 2] = torch.randn(4, generator=gen, device=DEV)
    run(x.to(dtype))


def test_tiny_and_huge_fp32(gen):
    """Scales at the 2^-126 floor (subnormal inputs and outputs) and near the fp32 range's top."""
    x = torch.randn(6, 64, generator=gen, device=DEV)
    x *= torch.tensor([2.0 ** -140, 2.0 ** -128, 2.0 ** -120, 1e-38, 2.0 ** 100, 2.0 ** 120], device=DEV)[:, None]
    run(x)


def test_division_by_sqrt_d_rule():
    """A bf16 row whose transform lands on an e2m1 tie only with torch's CUDA rule for `y / sqrt(D)`
    (y · fl(1/fl(sqrt D))); with a real division by fl(sqrt D) it rounds the other way. The row
    was found by a CPU search over all fp32 sums: y = 39.50959... (element 0) -> h = 3.5."""
    x = torch.zeros(2, 128, device=DEV)
    x[:, :3] = torch.tensor([39.5, 0.00958251953125, 7.62939453125e-06], device=DEV)
    x[1] *= -1
    x = x.to(torch.bfloat16)
    y = x.float()
    for h in (1, 2, 4, 8, 16, 32, 64):  # reference.hadamard's butterflies, then a real division
        src = y.reshape(2, 128 // (2 * h), 2, h)
        y = torch.stack((src[..., 0, :] + src[..., 1, :], src[..., 0, :] - src[..., 1, :]), -2).reshape(2, 128)
    real_div = ref.qdq4((y / torch.tensor(math.sqrt(128), device=DEV)).to(torch.bfloat16), 32)
    assert not torch.equal(real_div, ref.hadamard_qdq4(x, 32)), \
        "torch no longer multiplies by the reciprocal here: switch the kernel's 1/sqrt(D) step to a division"
    run(x)


# ----------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("shape,dtype,block", [((4, 96), torch.bfloat16, 32), ((4, 128), torch.int32, 32),
                                               ((4, 2048), torch.bfloat16, 32), ((4, 64), torch.bfloat16, 128),
                                               ((4, 128), torch.float64, 32), ((), torch.float32, 32)])
def test_rejects_bad_input(shape, dtype, block):
    from kernels.hadamard_qdq4 import hadamard_qdq4
    with pytest.raises(KernelInputError):
        hadamard_qdq4(torch.ones(shape, dtype=dtype, device=DEV), block)
