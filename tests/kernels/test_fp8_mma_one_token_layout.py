"""kernels/fp8_mma_one_token.py's data layout, replayed on the CPU: each lane's 16-byte loads of rows gi and
gi + 8, the fp16x2 pairs a word becomes, the eight MMAs of a 128-channel block (PTX m16n8k16
fragments, as in tests/test_fp4_mma_layout.py) with every lane's B holding its own activations,
the block scales each tile takes and the lanes that store a row, against the reference FP8 GEMM.
It checks the layout's logic, not the GPU code itself; plus `mma_tile`'s rules."""

import pytest
import torch

from kernels import lowbit
from kernels import reference as ref
from kernels.fp8_mma_one_token import BLOCKS_PER_WARP, MAX_K, mma_tile

from kernel_sim import e4m3_word_pairs, fp8_block_mma


def emulate(w: torch.Tensor, ws: torch.Tensor, q: torch.Tensor, sa: torch.Tensor, tiles: int, ksplit: int):
    """The kernel's arithmetic: W [n, k] e4m3 (uint8), its e8m0 block scales [ceil(n/128), k/128]
    (uint8), one token's activations q [k] e4m3 (uint8) with scales sa [k/128] -> fp64 [n]."""
    n, k = w.shape[0], q.shape[0]
    words = w.contiguous().view(torch.int32)  # [n, k/4]
    qwords = q.contiguous().view(torch.int32)  # [k/4]
    blocks = k // 128
    per = blocks // ksplit
    y = torch.full((n,), float("nan"), dtype=torch.float64)
    for bn in range(-(-n // (16 * tiles))):
        row0 = bn * 16 * tiles
        red = torch.zeros(ksplit, tiles, 2, 8, dtype=torch.float64)  # what lanes ti = 0 leave in shared
        for warp in range(ksplit):
            acc = torch.zeros(32, tiles, 2, dtype=torch.float64)
            for i in range(per):
                kb = warp * per + i
                for t in range(tiles):
                    d = fp8_block_mma(words, row0 + 16 * t, kb,  # every lane: its own activations
                                      lambda gi, col: e4m3_word_pairs(qwords[col]))
                    assert torch.equal(d, d[:, :1].expand(16, 8))  # every column holds the row sums
                    byte = int(ws[min(row0 + 16 * t, n - 1) // 128, kb])
                    scale = 2.0 ** (byte - 127 + 2 * lowbit.E4M3_SHIFT) * sa[kb].item()
                    for lane in range(32):
                        gi, ti = lane // 4, lane % 4
                        for h in (0, 1):
                            acc[lane, t, h] += d[gi + 8 * h, 2 * ti] * scale
            for lane in range(0, 32, 4):  # lanes ti = 0
                red[warp, :, :, lane // 4] = acc[lane]
        total = red.sum(0)  # warp 0 adds the others in warp order
        for t in range(tiles):
            for h in (0, 1):
                for gi in range(8):
                    row = row0 + 16 * t + 8 * h + gi
                    if row < n:
                        y[row] = total[t, h, gi]
    return y


@pytest.mark.parametrize("n,k,tiles,ksplit", [(40, 512, 1, 2), (24, 384, 2, 3), (136, 256, 2, 1)])
def test_one_token_layout_computes_the_fp8_gemm(n, k, tiles, ksplit):
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # every e4m3 code but the NaNs
    w = codes[torch.randint(0, codes.numel(), (n, k), generator=gen)]
    ws = torch.randint(110, 140, ((n + 127) // 128, k // 128), generator=gen, dtype=torch.uint8)
    x = torch.randn(1, k, generator=gen) * 4.0
    q, sa = ref.act_quant(x, 128)
    got = emulate(w, ws, q[0].view(torch.uint8), sa[0], tiles, ksplit)
    exact = (ref.act_dequant(q, sa, 128).double() @ ref.dequant_fp8_block(
        w.view(torch.float8_e4m3fn), ws.view(torch.float8_e8m0fnu)).double().T)[0]
    assert torch.isfinite(got).all()  # every row stored once
    assert ((got - exact).abs() <= 1e-9 * exact.abs().max()).all()  # exact products, fp64 sums here


def test_one_token_tile_rules():
    # the engine's decode shapes: 6-8 MB weights load everything before the wait, larger ones 2 ahead
    assert mma_tile(1536, 4096) == (1, 8, 0)  # wq_a|wkv: too few rows for 2-tile CTAs
    assert mma_tile(8192, 1024) == (2, 2, 0) and mma_tile(4096, 2048) == (2, 4, 0)
    assert mma_tile(4096, 4096) == (2, 8, 2) and mma_tile(32768, 1024) == (2, 2, 2)
    assert mma_tile(4096, 8192) is None  # wo_b: the CUDA-core GEMV
    assert mma_tile(200, 384) == (1, 1, 0) and mma_tile(64, 100) is None
    for k in range(128, MAX_K + 1, 128):
        tiles, ksplit, depth = mma_tile(4096, k)
        blocks = k // 128
        assert blocks % ksplit == 0 and blocks // ksplit <= BLOCKS_PER_WARP and ksplit <= 32
        assert all(blocks % s or blocks // s > BLOCKS_PER_WARP for s in range(1, ksplit))  # the fewest warps
        assert tiles == 2 and depth == (0 if 4096 * k <= 8 << 20 else 2)
