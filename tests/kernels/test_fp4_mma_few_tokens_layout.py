"""kernels/fp4_mma_few_tokens.py's data layout, replayed on the CPU: every lane's words, fragments, scales and
outputs as the kernel indexes them, the two MMAs of a scale group done as matrix products from the
PTX m16n8k16 fragment layout (TileLang's cuda/intrinsics/layout/mma_layout.py agrees), against
the reference FP4 GEMM. It checks the layout's logic (which channel sits at which k position in A
and in B, which scale each result takes, where each result lands), not the GPU code itself."""

import pytest
import torch

from kernels import lowbit
from kernels import reference as ref
from kernels.fp4_mma_few_tokens import GROUPS_PER_STEP, mma_tile

from kernel_sim import decode_e2m1_words, decode_e4m3_pairs, mma_m16n8k16, word_pairs


def emulate(w: torch.Tensor, ws: torch.Tensor, q: torch.Tensor, sa: torch.Tensor, tiles: int, ksplit: int):
    """The kernel's arithmetic for one part and group: W [n, k/2] e2m1, its e8m0 scales [n, k/32]
    (uint8), activations q [m, k] e4m3 (uint8) with scales sa [m, k/128] -> fp64 [m, n]."""
    n, m, k = w.shape[0], q.shape[0], q.shape[1]
    words = w.contiguous().view(torch.int32)  # [n, k/8]
    swords = ws.contiguous().view(torch.int32).to(torch.int64)  # [n, k/128]
    qwords = q.contiguous().view(torch.int32)  # [m, k/4]
    blocks = k // 128
    cols = -(-m // 8)  # columns of 8 tokens, each through its own two MMAs per group
    y = torch.zeros(m, n, dtype=torch.float64)
    for bn in range(-(-n // (16 * tiles))):
        partial = torch.zeros(ksplit, tiles, 32, 4 * cols, dtype=torch.float64)
        for warp in range(ksplit):
            for kr in range(blocks // ksplit):
                kb = warp * (blocks // ksplit) + kr
                for qg in range(GROUPS_PER_STEP):
                    group = kb * GROUPS_PER_STEP + qg
                    for u in range(cols):
                        ap = []  # each lane's activation pairs (token min(8u + gi, m - 1))
                        for lane in range(32):
                            tok = min(8 * u + lane // 4, m - 1)
                            aw = qwords[tok, 8 * group + 2 * (lane % 4): 8 * group + 2 * (lane % 4) + 2]
                            ap.append(word_pairs(decode_e4m3_pairs(aw).double()))
                        for t in range(tiles):
                            h = []  # each lane's pairs of rows gi and gi + 8
                            for lane in range(32):
                                rows = [min(bn * 16 * tiles + 16 * t + 8 * hh + lane // 4, n - 1) for hh in (0, 1)]
                                h.append([word_pairs(decode_e2m1_words(words[r, 4 * group + lane % 4:
                                                                               4 * group + lane % 4 + 1]).double())
                                          for r in rows])
                            d = mma_m16n8k16([[h[i][0][0], h[i][1][0], h[i][0][1], h[i][1][1]] for i in range(32)],
                                             [[ap[i][0], ap[i][1]] for i in range(32)])
                            d += mma_m16n8k16([[h[i][0][2], h[i][1][2], h[i][0][3], h[i][1][3]] for i in range(32)],
                                              [[ap[i][2], ap[i][3]] for i in range(32)])
                            for lane in range(32):
                                gi, ti = lane // 4, lane % 4
                                for hh in (0, 1):
                                    row = min(bn * 16 * tiles + 16 * t + 8 * hh + gi, n - 1)
                                    byte = (int(swords[row, kb]) >> (8 * qg)) & 0xFF
                                    scale = 2.0 ** (byte - 127 + lowbit.E4M3_SHIFT + lowbit.E2M1_SHIFT)
                                    for j in (0, 1):
                                        s = sa[min(8 * u + 2 * ti + j, m - 1), kb].item()
                                        partial[warp, t, lane, 4 * u + 2 * hh + j] += (
                                            d[gi + 8 * hh, 2 * ti + j] * scale * s)
        acc = partial.sum(0)  # the warps' partial sums, added in warp order
        for t in range(tiles):
            for lane in range(32):
                gi, ti = lane // 4, lane % 4
                for hh in (0, 1):
                    row = bn * 16 * tiles + 16 * t + 8 * hh + gi
                    for u in range(cols):
                        for j in (0, 1):
                            if row < n and 8 * u + 2 * ti + j < m:
                                y[8 * u + 2 * ti + j, row] = acc[t, lane, 4 * u + 2 * hh + j]
    return y


@pytest.mark.parametrize("m,n,k,tiles", [(1, 40, 512, 1), (3, 32, 256, 2), (8, 16, 384, 1), (16, 24, 256, 2),
                                         (11, 16, 256, 1)])
def test_mma_layout_computes_the_fp4_gemm(m, n, k, tiles):
    gen = torch.Generator().manual_seed(n + k + m)
    w = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    ws = torch.randint(117, 131, (n, k // 32), generator=gen, dtype=torch.uint8)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen).float())
    q, sa = ref.act_quant(x, 128)
    got = emulate(w, ws, q.view(torch.uint8), sa, tiles, mma_tile(k)[1])
    want = ref.fp4_gemm_dequantized(ref.act_dequant(q, sa, 128), w.view(torch.int8),
                                    ws.view(torch.float8_e8m0fnu)).double()
    # exact products, sums in another order: equal to fp32 rounding before the bf16 output
    assert torch.allclose(got.to(torch.bfloat16).double(), want, rtol=1e-2, atol=0)
    assert ((got - ref.act_dequant(q, sa, 128).double() @ ref.dequant_fp4(
        w.view(torch.int8), ws.view(torch.float8_e8m0fnu)).double().T).abs()
        <= 1e-9 * got.abs().max()).all()
