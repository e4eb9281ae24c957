"""The prefill path of the routed experts on the tensor cores (kernels/fp4_moe.py:
`fp4_moe_dequantized`, `expert_spans`; `reference.dequant_fp4_bf16` and `fp4_dequant_slots`),
on the CPU: it is pure torch apart from the SwiGLU quantisation and the dequantisation it is
handed, so the reference's can be used here and the CUDA run (tests/kernels/test_kernels_gpu.py)
only adds the backend's."""

from __future__ import annotations

import pytest
import torch
from expert_arena import expert_arena

from kernels import reference as ref
from engine.moe import Cells, ExpertRuns
from kernels.fp4_moe import EXPERTS_PER_DEQUANT, expert_groups, expert_spans, fp4_moe_dequantized


def arena(slots: int, inter: int, dim: int, gen: torch.Generator):
    data, fields, _ = expert_arena(slots, inter, dim, gen)
    return data, fields


def test_dequant_fp4_bf16_is_the_reference_exactly():
    """Every byte value and a range of scales: bit for bit `dequant_fp4`'s values."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (3, 64, 128), generator=gen, dtype=torch.uint8)  # every byte value occurs
    s = torch.randint(100, 150, (3, 64, 8), generator=gen, dtype=torch.uint8)
    got = ref.dequant_fp4_bf16(w, s)
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
    got = fp4_moe_dequantized(q, s, data, fields, order, expert_groups(spans, q.device), w, limit)
    want = ref.fp4_moe_quantized(q, s, data, fields, slots, w, limit)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape  # w2's bf16 outputs, not widened
    got = got.float()
    err = ((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30))
    assert err.max().item() < 2e-2
    assert (got == want).all(dim=1).float().mean().item() > 0.5


def test_fp4_dequant_slots_reads_the_arena_rows_of_the_slots_and_stacks_the_parts():
    """Group g holds slot g's w1 then w3 (rows 0..n-1, n..2n-1), each `dequant_fp4` of the record's bytes."""
    gen = torch.Generator().manual_seed(2)
    inter, dim = 64, 128
    data, fields = arena(5, inter, dim, gen)
    slots = torch.tensor([3, 0, 3], dtype=torch.int32)
    off = {name: f.offset for name, f in fields.items()}
    got = ref.fp4_dequant_slots(data, (off["w1.weight"], off["w3.weight"]), (off["w1.scale"], off["w3.scale"]),
                                inter, dim, slots)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 2 * inter, dim)

    def field(slot, name):
        f = fields[name]
        return data[slot, f.offset:f.offset + f.shape[0] * f.shape[1]].view(f.shape)
    for g, slot in enumerate(slots.tolist()):
        for p, name in enumerate(("w1", "w3")):
            want = ref.dequant_fp4(field(slot, f"{name}.weight"), field(slot, f"{name}.scale"))
            assert torch.equal(got[g, p * inter:(p + 1) * inter].float(), want)


def test_fp4_moe_dequantized_splits_many_experts_into_groups():
    """More experts than EXPERTS_PER_DEQUANT: several grouped GEMMs, the same cells as one group."""
    gen = torch.Generator().manual_seed(3)
    inter, dim, limit = 128, 256, 10.0
    data, fields = arena(7, inter, dim, gen)
    slots = torch.randint(0, 7, (70,), generator=gen, dtype=torch.int32)
    x = torch.randn(70, dim, generator=gen).to(torch.bfloat16)
    w = torch.rand(70, generator=gen)
    q, s = ref.act_quant(x, 128)
    order, spans = expert_spans(slots)
    assert len(spans) == 7 < EXPERTS_PER_DEQUANT
    whole = fp4_moe_dequantized(q, s, data, fields, order, expert_groups(spans, q.device), w, limit)
    split = fp4_moe_dequantized(q, s, data, fields, order, expert_groups(spans, q.device, 3), w, limit)
    assert torch.equal(whole, split)


def test_expert_groups_cut_spans_into_groups_of_experts():
    spans = [(4, 0, 2), (0, 2, 1), (7, 3, 5)]
    groups = expert_groups(spans, torch.device("cpu"), 2)
    assert [(c0, c1, slots.tolist(), ends.tolist()) for c0, c1, slots, ends in groups] == [
        (0, 3, [4, 0], [2, 3]), (3, 8, [7], [5])]
    assert all(t.dtype == torch.int32 for _, _, slots, ends in groups for t in (slots, ends))


def test_every_expert_in_one_group_from_device_counts_equals_the_host_spans():
    """The MoE's sync-free form (`engine.moe.Cells.all_groups`): the cells sorted by expert id,
    one group of every expert of the layer whatever its count (an expert without cells is an
    empty span), the spans from the device counts: the same outputs as the host's spans of the
    used experts only, and the reference's up to the GEMMs' summation order."""
    gen = torch.Generator().manual_seed(4)
    inter, dim, limit, experts, k = 128, 256, 10.0, 8, 3
    data, fields = arena(experts + 2, inter, dim, gen)
    table = torch.randperm(experts + 2, generator=gen)[:experts].to(torch.int32)  # expert -> slot
    idx = torch.randint(0, experts, (48, k), generator=gen)  # 144 cells: the tensor cores' path
    idx[idx == 5] = 6  # expert 5 has no cells
    cells = Cells(idx, experts)
    assert cells.one_group and cells.all_groups(table)
    assert cells.counts.tolist()[5] == 0 and cells.counts.sum().item() == 48 * k
    assert torch.equal(cells.sorted_ids, idx.reshape(-1).sort(stable=True).values)
    # (token, choice) cell t·k + c lies at row rows[t, c] of the grouped order
    assert torch.equal(cells.order.index_select(0, cells.rows.reshape(-1)), torch.arange(48 * k))
    x = torch.randn(48, dim, generator=gen).to(torch.bfloat16)
    w = torch.rand(48, k, generator=gen)
    q, s = ref.act_quant(x.index_select(0, cells.order // k), 128)  # the cells' rows, grouped by expert
    ws = w.reshape(-1).index_select(0, cells.order)
    slots = table.index_select(0, cells.sorted_ids)
    every = fp4_moe_dequantized(q, s, data, fields, None, cells.all_groups(table), ws, limit)
    counts = cells.counts.tolist()
    used = [e for e, c in enumerate(counts) if c]
    spans = cells.groups(counts, table[used].tolist())
    assert len(spans) == 1 and spans[0][2].tolist() == table[used].tolist()
    only_used = fp4_moe_dequantized(q, s, data, fields, None, spans, ws, limit)
    assert torch.equal(every, only_used)
    # each token quantised once and its cells gathered (`rows`): the same bits
    tq, ts = ref.act_quant(x, 128)
    by_rows = fp4_moe_dequantized(tq, ts, data, fields, None, cells.all_groups(table), ws, limit, rows=cells.order // k)
    assert torch.equal(by_rows, every)
    want = ref.fp4_moe_quantized(q, s, data, fields, slots, ws, limit)
    err = ((every.float() - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30))
    assert err.max().item() < 2e-2


def test_cells_too_few_per_expert_take_the_grouped_gemv():
    """Fewer than GROUPED_MIN_PER_EXPERT cells per used expert: no groups (the grouped GEMV)."""
    idx = torch.arange(60).reshape(30, 2) % 20  # 3 cells for each of 20 experts
    cells = Cells(idx, 24)
    counts = cells.counts.tolist()
    assert cells.groups(counts, list(range(20))) == [] and cells.all_groups(torch.arange(24)) == []
    many = Cells(torch.arange(400).reshape(200, 2) % 20, 24)  # 20 cells each: the tensor cores
    assert len(many.groups(many.counts.tolist(), list(range(20)))) == 1
    assert len(many.all_groups(torch.arange(24, dtype=torch.int32))) == 1  # 400 >= 16 x 24 cells


def test_expert_runs_lay_each_experts_cells_out_in_one_run():
    """engine.moe.ExpertRuns: cell (n, j) of expert e lies in e's run of N cells at the number of
    tokens before n routed to e; each run cell names its token, unused cells token 0 and weight
    0; the reference's fp4_moe over the runs, combined through `rows`, equals it over the cells."""
    gen = torch.Generator().manual_seed(9)
    n, k, experts, inter, dim, limit = 16, 6, 24, 128, 256, 10.0
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n)])  # distinct per token
    runs = ExpertRuns(idx, experts)
    assert runs.run == n and runs.rows.shape == (n, k) and runs.tokens.shape == (experts * n,)
    for t in range(n):
        for j in range(k):
            e = int(idx[t, j])
            assert int(runs.rows[t, j]) == e * n + int((idx[:t] == e).sum())
            assert int(runs.tokens[runs.rows[t, j]]) == t
    assert runs.rows.unique().numel() == n * k  # no two cells share a run cell
    w = torch.rand(n, k, generator=gen)
    spread = runs.spread(w)
    assert torch.equal(spread.index_select(0, runs.rows.reshape(-1)), w.reshape(-1))
    assert spread.sum().item() == pytest.approx(w.sum().item()) and (spread > 0).sum() == n * k
    data, fields = arena(experts, inter, dim, gen)
    table = torch.randperm(experts, generator=gen).to(torch.int32)
    x = torch.randn(n, dim, generator=gen).to(torch.bfloat16)
    y = ref.fp4_moe(x, data, fields, table.repeat_interleave(n), spread, limit, [], runs.tokens, n)
    shared = torch.zeros(n, dim)
    got = ref.moe_combine(y, shared, torch.bfloat16, runs.rows)
    cells = ref.fp4_moe(x, data, fields, table.index_select(0, idx.reshape(-1)), w.reshape(-1), limit,
                        rows=torch.arange(n).repeat_interleave(k))
    assert torch.equal(got, ref.moe_combine(cells.view(n, k, dim), shared, torch.bfloat16))
