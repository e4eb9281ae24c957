"""The prefill path of the routed experts on the tensor cores (kernels/fp4_moe.py:
`fp4_moe_dequantized`, `dequant_fp4_bf16`, `expert_spans`), on the CPU: it is pure torch apart
from the SwiGLU quantisation it is handed, so the reference's can be used here and the CUDA
run (tests/kernels/test_kernels_gpu.py) only adds the backend's."""

from __future__ import annotations

import pytest
import torch
from expert_arena import expert_arena

from kernels import reference as ref
from kernels.fp4_moe import dequant_fp4_bf16, expert_spans, fp4_moe_dequantized


def arena(slots: int, inter: int, dim: int, gen: torch.Generator):
    data, fields, _ = expert_arena(slots, inter, dim, gen)
    return data, fields


def test_dequant_fp4_bf16_is_the_reference_exactly():
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (3, 64, 128), generator=gen, dtype=torch.uint8)  # every byte value occurs
    s = torch.randint(100, 150, (3, 64, 8), generator=gen, dtype=torch.uint8)
    got = dequant_fp4_bf16(w, s)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 64, 256)
    for i in range(3):
        assert torch.equal(got[i].float(), ref.dequant_fp4(w[i], s[i]))


def test_expert_spans_group_cells_by_slot_in_a_stable_order():
    slots = torch.tensor([5, 1, 5, 0, 1, 5], dtype=torch.int32)
    order, spans = expert_spans(slots)
    assert order.tolist() == [3, 1, 4, 0, 2, 5]
    assert spans == [(0, 0, 1), (1, 1, 2), (5, 3, 3)]


@pytest.mark.parametrize("per_expert", [1, 20])
def test_fp4_moe_dequantized_matches_the_per_cell_reference(per_expert):
    """Every cell equals the reference's up to the GEMMs' fp32 summation order (bf16 outputs may
    differ by an ulp, which SwiGLU's bf16 rounding can widen): relative error per cell < 2e-2,
    most cells identical to the bf16 rounding of the reference."""
    gen = torch.Generator().manual_seed(1)
    inter, dim, limit = 256, 512, 10.0
    data, fields = arena(9, inter, dim, gen)
    slots = torch.randint(0, 9, (9 * per_expert,), generator=gen, dtype=torch.int32)
    mag = torch.exp2(torch.randint(-8, 4, (slots.shape[0], 1), generator=gen).float())
    x = (torch.randn(slots.shape[0], dim, generator=gen) * mag).to(torch.bfloat16)
    w = torch.rand(slots.shape[0], generator=gen)
    q, s = ref.act_quant(x, 128)
    order, spans = expert_spans(slots)
    got = fp4_moe_dequantized(q, s, data, fields, order, spans, w, limit)
    want = ref.fp4_moe_quantized(q, s, data, fields, slots, w, limit)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = ((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30))
    assert err.max().item() < 2e-2
    assert (got == want).all(dim=1).float().mean().item() > 0.5
