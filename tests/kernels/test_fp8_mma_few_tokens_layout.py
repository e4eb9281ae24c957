"""kernels/fp8_mma_few_tokens.py's data layout, replayed on the CPU: each lane's 16-byte loads of rows gi and
gi + 8, the A fragment a word becomes, the eight MMAs of a 128-channel block per column of 8
tokens (PTX m16n8k16 fragments) with lane gi's B holding token 8u + gi's activations, the
scales each (row, token) result takes and where it is stored, against the reference FP8 GEMM.
It checks the layout's logic, not the GPU code itself; plus `mma_tile`'s rules."""

import pytest
import torch

from kernels import lowbit
from kernels import reference as ref
from kernels.fp8_mma_few_tokens import BLOCKS_PER_WARP, DEPTH, mma_tile

from kernel_sim import e4m3_word_pairs, fp8_block_mma, store_tile_sums


def emulate(w: torch.Tensor, ws: torch.Tensor, q: torch.Tensor, sa: torch.Tensor, tiles: int, ksplit: int):
    """The kernel's arithmetic: W [n, k] e4m3 (uint8), its e8m0 block scales [ceil(n/128), k/128]
    (uint8), activations q [m, k] e4m3 (uint8) with scales sa [m, k/128] -> fp64 [m, n]."""
    n, m, k = w.shape[0], q.shape[0], q.shape[1]
    words = w.contiguous().view(torch.int32)  # [n, k/4]
    qwords = q.contiguous().view(torch.int32)  # [m, k/4]
    blocks = k // 128
    per = blocks // ksplit
    cols = -(-m // 8)
    y = torch.full((m, n), float("nan"), dtype=torch.float64)
    for bn in range(-(-n // (16 * tiles))):
        row0 = bn * 16 * tiles
        red = torch.zeros(ksplit, tiles, cols, 4, 32, dtype=torch.float64)  # every lane's sums in shared
        for warp in range(ksplit):
            acc = torch.zeros(tiles, cols, 4, 32, dtype=torch.float64)
            for i in range(per):
                kb = warp * per + i
                for t in range(tiles):
                    for u in range(cols):
                        d = fp8_block_mma(words, row0 + 16 * t, kb,  # lane gi's B: token 8u + gi
                                          lambda gi, col: e4m3_word_pairs(qwords[min(8 * u + gi, m - 1), col]))
                        byte = int(ws[min(row0 + 16 * t, n - 1) // 128, kb])
                        wscale = 2.0 ** (byte - 127 + 2 * lowbit.E4M3_SHIFT)
                        for lane in range(32):
                            gi, ti = lane // 4, lane % 4
                            for c in range(4):
                                tok = min(8 * u + 2 * ti + c % 2, m - 1)
                                acc[t, u, c, lane] += d[gi + 8 * (c // 2), 2 * ti + c % 2] * (
                                    wscale * sa[tok, kb].item())
            red[warp] = acc
        store_tile_sums(y, red.sum(0), row0)  # warp 0 adds the others in warp order
    return y


@pytest.mark.parametrize("m,n,k,tiles,ksplit", [(2, 40, 512, 1, 2), (16, 24, 384, 2, 3), (11, 136, 256, 2, 1),
                                                (4, 16, 256, 1, 2)])
def test_few_tokens_layout_computes_the_fp8_gemm(m, n, k, tiles, ksplit):
    gen = torch.Generator().manual_seed(n + k + m)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # every e4m3 code but the NaNs
    w = codes[torch.randint(0, codes.numel(), (n, k), generator=gen)]
    ws = torch.randint(110, 140, ((n + 127) // 128, k // 128), generator=gen, dtype=torch.uint8)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen).float())
    q, sa = ref.act_quant(x, 128)
    got = emulate(w, ws, q.view(torch.uint8), sa, tiles, ksplit)
    exact = ref.act_dequant(q, sa, 128).double() @ ref.dequant_fp8_block(
        w.view(torch.float8_e4m3fn), ws.view(torch.float8_e8m0fnu)).double().T
    assert torch.isfinite(got).all()  # every (token, row) stored once
    assert ((got - exact).abs() <= 1e-9 * exact.abs().max()).all()  # exact products, fp64 sums here


def test_few_tokens_tile_rules():
    # the chunk step's shapes: every K up to wo_b's 8192 takes the tensor cores
    assert mma_tile(1536, 4096) == (1, 8, DEPTH)  # wq_a|wkv: too few rows for 2-tile CTAs
    assert mma_tile(32768, 1024) == (2, 2, DEPTH) and mma_tile(4096, 8192) == (2, 16, DEPTH)
    assert mma_tile(64, 100) is None and mma_tile(64, 128 * 4 * 33) is None  # over 32 warps
    for k in range(128, 8192 + 1, 128):
        blocks = k // 128
        if mma_tile(4096, k) is None:  # e.g. 37 blocks: one warp each would take 37 warps
            assert all(blocks % s or blocks // s > BLOCKS_PER_WARP for s in range(1, 33))
            continue
        tiles, ksplit, depth = mma_tile(4096, k)
        assert blocks % ksplit == 0 and blocks // ksplit <= BLOCKS_PER_WARP and ksplit <= 32
        assert all(blocks % s or blocks // s > BLOCKS_PER_WARP for s in range(1, ksplit))  # the fewest warps
