"""kernels/grouped_mma_few_tokens.py's data layout, replayed on the CPU: each lane's weight words of rows gi and
gi + 8 as bf16 A fragments (channels (c, c+1) and (c+2, c+3)), its B words of token 8u + gi read
from the row's group, the eight MMAs of a 128-channel block per column of 8 tokens (PTX m16n8k16
fragments), the scale each result takes and where it is stored, against the exact grouped
product. It checks the layout's logic, not the GPU code itself; plus the bf16 conversion's
exactness for every code and `mma_tile`'s rules."""

import pytest
import torch

from kernels import lowbit
from kernels import reference as ref
from kernels.grouped_mma_few_tokens import DEPTH, mma_tile

from kernel_sim import decode_e4m3_words, fp8_block_mma, store_tile_sums


def bf16_of_fp32_upper_half(f: torch.Tensor) -> torch.Tensor:
    """`__byte_perm(f0, f1, 0x7632)`'s halves: the upper 16 bits of each fp32, as a value."""
    return ((f.view(torch.int32) >> 16) << 16).view(torch.float32)


def test_every_e4m3_code_is_its_bf16_exactly():
    codes = torch.arange(256, dtype=torch.int64)
    codes = codes[(codes & 0x7F) != 0x7F]
    words = codes.to(torch.int32)  # one code in byte 0 of each word
    f = decode_e4m3_words(words.view(-1, 1))[:, 0]  # fp32 of value * 2^-8 (lowbit's fp16, widened)
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * 2.0 ** -lowbit.E4M3_SHIFT
    assert torch.equal(f, want)
    assert torch.equal(bf16_of_fp32_upper_half(f), f)  # no bit below the upper half
    assert torch.equal(f.to(torch.bfloat16).float(), f)


def bf16_word_pairs(word: torch.Tensor) -> list:
    """One e4m3 word -> its two bf16x2 pairs as `dsv4_e4m3x4_to_bf16x2` forms them: [(channel 0,
    channel 1), (channel 2, channel 3)], values times 2^-8."""
    c = bf16_of_fp32_upper_half(decode_e4m3_words(word.view(1))).double()  # [4] in channel order
    return [(c[0], c[1]), (c[2], c[3])]


def bf16_x_pairs(row: torch.Tensor, c: int) -> list:
    """A token's B pairs for the word of channels c .. c + 3: its two bf16x2 words as they lie in
    memory, [(c, c + 1), (c + 2, c + 3)]."""
    v = row[c:c + 4].double()
    return [(v[0], v[1]), (v[2], v[3])]


def emulate(w: torch.Tensor, ws: torch.Tensor, x: torch.Tensor, groups: int, tiles: int, ksplit: int):
    """The kernel's arithmetic: W [n, k] e4m3 (uint8) of `groups` row groups, its e8m0 block scales
    [ceil(n/128), k/128] (uint8), activations x [m, groups·k] bf16 -> fp64 [m, n]."""
    n, k, m = w.shape[0], w.shape[1], x.shape[0]
    words = w.contiguous().view(torch.int32)  # [n, k/4]
    blocks, cta_rows = k // 128, 16 * tiles
    per, cols = blocks // ksplit, -(-m // 8)
    y = torch.full((m, n), float("nan"), dtype=torch.float64)
    for bn in range(n // cta_rows):
        row0 = bn * cta_rows
        c0 = (row0 // (n // groups)) * k  # the group's first activation channel
        red = torch.zeros(ksplit, tiles, cols, 4, 32, dtype=torch.float64)
        for warp in range(ksplit):
            for i in range(per):
                kb = warp * per + i
                for t in range(tiles):
                    for u in range(cols):  # lane gi's B: token 8u + gi's channels of word col, as stored
                        d = fp8_block_mma(words, row0 + 16 * t, kb, lambda gi, col, u=u: bf16_x_pairs(
                            x[min(8 * u + gi, m - 1)], c0 + 4 * col), bf16_word_pairs)
                        scale = 2.0 ** (int(ws[min(row0 + 16 * t, n - 1) // 128, kb]) - 127 + lowbit.E4M3_SHIFT)
                        for lane in range(32):
                            gi, ti = lane // 4, lane % 4
                            for c in range(4):
                                red[warp, t, u, c, lane] += d[gi + 8 * (c // 2), 2 * ti + c % 2] * scale
        store_tile_sums(y, red.sum(0), row0)  # warp 0 adds the others in warp order
    return y


@pytest.mark.parametrize("m,groups,r,k,tiles,ksplit", [(2, 2, 16, 256, 1, 2), (9, 2, 32, 384, 2, 3),
                                                       (16, 3, 16, 256, 1, 1)])
def test_layout_computes_the_grouped_product(m, groups, r, k, tiles, ksplit):
    gen = torch.Generator().manual_seed(m + r + k)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # every e4m3 code but the NaNs
    n = groups * r
    w = codes[torch.randint(0, codes.numel(), (n, k), generator=gen)]
    ws = torch.randint(110, 140, ((n + 127) // 128, k // 128), generator=gen, dtype=torch.uint8)
    x = (torch.randn(m, groups * k, generator=gen)
         * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen).float())).to(torch.bfloat16)
    got = emulate(w, ws, x, groups, tiles, ksplit)
    wd = ref.dequant_fp8_block(w.view(torch.float8_e4m3fn), ws.view(torch.float8_e8m0fnu)).double()
    exact = torch.einsum("sgi,gri->sgr", x.double().view(m, groups, k), wd.view(groups, r, k)).reshape(m, n)
    assert torch.isfinite(got).all()  # every (token, row) stored once
    assert ((got - exact).abs() <= 1e-9 * exact.abs().max()).all()  # exact products, fp64 sums here


def test_tile_rules():
    assert mma_tile(8192, 4096, 8) == (2, 8, DEPTH)  # Flash's wo_a: 8 groups of 1024 rows
    assert mma_tile(2 * 48, 384, 2) == (1, 1, DEPTH)  # too few rows for 2-tile CTAs
    assert mma_tile(3 * 40, 256, 3) is None  # a group's 40 rows are not whole 16-row tiles
    assert mma_tile(8192, 4000, 8) is None and mma_tile(8192, 4096, 3) is None
    assert mma_tile(64, 128 * 4 * 33, 1) is None  # more blocks than 32 warps take
