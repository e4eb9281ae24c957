"""kernels/fp4_mma_one_token.py's data layout, replayed on the CPU: each lane's group words, the zeroed B
columns, the eight MMAs of a 128-channel block (PTX m16n8k16 fragments, as in
tests/test_fp4_mma_layout.py), the scale each D column takes and the lanes that sum a row,
against the reference FP4 GEMM. It checks the layout's logic, not the GPU code itself."""

import pytest
import torch

from kernels import lowbit
from kernels import reference as ref
from kernels.fp4_mma_one_token import MAX_BLOCKS, mma_tile, scale_vector, supports

from kernel_sim import byte_perm, decode_e2m1_words, decode_e4m3_pairs, e8m0_pick, mma_m16n8k16, word_pairs

SELECTOR = 0x4440  # a lane's __byte_perm selector, with the byte's place in its low nibble
SHIFT = lowbit.E4M3_SHIFT + lowbit.E2M1_SHIFT  # codes carry 2^-14, activations 2^-8: 2^22 into the scale


def emulate(w: torch.Tensor, ws: torch.Tensor, q: torch.Tensor, sa: torch.Tensor, tiles: int, ksplit: int):
    """The kernel's arithmetic for one part and group: W [n, k/2] e2m1, its e8m0 scales [n, k/32]
    (uint8), one token's activations q [k] e4m3 (uint8) with scales sa [k/128] -> fp64 [n]."""
    n, k = w.shape[0], q.shape[0]
    words = w.contiguous().view(torch.int32)  # [n, k/8]
    swords = ws.contiguous().view(torch.int32).to(torch.int64)  # [n, k/128]
    qwords = q.contiguous().view(torch.int32)  # [k/4]
    blocks = k // 128
    y = torch.zeros(n, dtype=torch.float64)
    for bn in range(-(-n // (16 * tiles))):
        partial = torch.zeros(ksplit, tiles, 32, 4, dtype=torch.float64)
        for warp in range(ksplit):
            for i in range(blocks // ksplit):
                kb = warp * (blocks // ksplit) + i
                # the CTA's B pairs of group qg: words 2w, 2w + 1 of the group's eight
                act = [[word_pairs(decode_e4m3_pairs(qwords[32 * kb + 8 * qg + 2 * wd:32 * kb + 8 * qg + 2 * wd + 2])
                               .double()) for wd in range(4)] for qg in range(4)]
                zero = torch.zeros(4, 2, dtype=torch.float64)
                b = [act[lane % 4] if lane // 4 == lane % 4 else [zero] * 4 for lane in range(32)]
                for t in range(tiles):
                    d = torch.zeros(16, 8, dtype=torch.float64)
                    for wd in range(4):  # word wd of each lane's group, rows gi and gi + 8
                        h = []
                        for lane in range(32):
                            rows = [min(bn * 16 * tiles + 16 * t + 8 * hh + lane // 4, n - 1) for hh in (0, 1)]
                            col = 16 * kb + 4 * (lane % 4) + wd
                            h.append([word_pairs(decode_e2m1_words(words[r, col:col + 1]).double()) for r in rows])
                        d += mma_m16n8k16([[h[i][0][0], h[i][1][0], h[i][0][1], h[i][1][1]] for i in range(32)],
                                  [[b[i][wd][0], b[i][wd][1]] for i in range(32)])
                        d += mma_m16n8k16([[h[i][0][2], h[i][1][2], h[i][0][3], h[i][1][3]] for i in range(32)],
                                  [[b[i][wd][2], b[i][wd][3]] for i in range(32)])
                    assert not d[:, 4:].any()  # columns 4..7: no group
                    for lane in range(32):
                        gi, ti = lane // 4, lane % 4
                        for hh in (0, 1):
                            row = min(bn * 16 * tiles + 16 * t + 8 * hh + gi, n - 1)
                            for j in (0, 1):  # the lane's selector picks byte (2ti + j) % 4 of the word
                                ws = e8m0_pick(swords[row, kb], SELECTOR | (2 * ti + j) % 4, SHIFT)
                                scale = (ws * sa[kb].float()).double().item()  # one fp32 product (FMUL)
                                partial[warp, t, lane, 2 * hh + j] += d[gi + 8 * hh, 2 * ti + j] * scale
        acc = partial.sum(0)  # the warps' partial sums, added in warp order
        for t in range(tiles):
            for lane in range(0, 32, 4):  # lane ti = 0 of each quad, after the shuffle with ti = 1
                for hh in (0, 1):
                    row = bn * 16 * tiles + 16 * t + 8 * hh + lane // 4
                    if row < n:
                        y[row] = acc[t, lane, 2 * hh:2 * hh + 2].sum() + acc[t, lane + 1, 2 * hh:2 * hh + 2].sum()
    return y


@pytest.mark.parametrize("n,k,tiles,ksplit", [(40, 512, 1, 2), (32, 256, 2, 1), (24, 384, 2, 3)])
def test_one_token_layout_computes_the_fp4_gemm(n, k, tiles, ksplit):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    ws = torch.randint(117, 131, (n, k // 32), generator=gen, dtype=torch.uint8)
    x = torch.randn(1, k, generator=gen) * 4.0
    q, sa = ref.act_quant(x, 128)
    got = emulate(w, ws, q[0].view(torch.uint8), sa[0], tiles, ksplit)
    exact = (ref.act_dequant(q, sa, 128).double() @ ref.dequant_fp4(
        w.view(torch.int8), ws.view(torch.float8_e8m0fnu)).double().T)[0]
    assert ((got - exact).abs() <= 1e-9 * got.abs().max()).all()  # exact products, fp64 sums here


def test_scale_pick_gives_the_bits_of_the_shift_and_mask():
    """Each byte 0..255 at each of the four places of a scale word, through the lane's selector
    (`dsv4_e8m0_pick`): the fp32 bits of ((word >> 8p) & 0xFF) + 22) << 23 mod 2^32, what the kernel
    built before (lowbit.e8m0_bits_to_float) -- bytes 0 and 233..255 included (2^-105; then
    inf and wrapped bits, as before) -- and 2^(byte - 105) over the bytes 1..232 in range."""
    gen = torch.Generator().manual_seed(0)
    byte = torch.arange(256, dtype=torch.int64)
    for place in range(4):
        rest = torch.randint(0, 2 ** 32, (256,), generator=gen, dtype=torch.int64) & ~(0xFF << 8 * place)
        word = rest | (byte << 8 * place)
        word = word - ((word >> 31) << 32)  # as the kernel's int32 scale words (sign bit set in some)
        got = e8m0_pick(word, SELECTOR | place, SHIFT).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        assert torch.equal(got, ((((word >> 8 * place) & 0xFF) + SHIFT) << 23) & 0xFFFFFFFF)
        ws = e8m0_pick(word, SELECTOR | place, SHIFT)[1:233].double()
        assert torch.equal(ws, torch.exp2(byte[1:233].double() - 127 + SHIFT))
    assert byte_perm(0x8844CC11, 0x7F, 0x3210) == 0x8844CC11 and byte_perm(0x8844CC11, 0x7F, 0x7654) == 0x7F
    assert byte_perm(0x8844CC11, 0, 0x4443) == 0x88 and byte_perm(0x8844CC11, 0x7F, 0x4404) == 0x7F7F117F


def test_one_token_tile_keeps_a_warps_blocks_in_registers():
    assert mma_tile(4096) == (2, 4, 4) and mma_tile(2048) == (2, 2, 2)  # decode's w1+w3 and w2
    assert mma_tile(7168) == (2, 7, 4) and mma_tile(384) == (2, 1, 4) and mma_tile(256) == (2, 2, 2)
    for k in range(128, 16384, 128):
        tile = mma_tile(k)
        if tile is not None:
            assert (k // 128) % tile[1] == 0 and k // 128 // tile[1] <= MAX_BLOCKS
    assert mma_tile(17 * 128) is None and not supports(17 * 128, (0,), 4096)  # 17 blocks: no even split
    assert not supports(4096, (2,), 4096)  # scales must start 4-byte aligned


def test_scale_vector_keeps_every_scale_load_aligned():
    """A warp's scale words go in loads of 4, 2 or 1 words: the widest that divides its blocks and
    that every part's offset, the arena row and the weight row (K/128 words) are aligned to."""
    assert scale_vector(4096, 4, (0, 16), 64) == 4  # decode's w1+w3: 8 blocks per warp
    assert scale_vector(4096, 4, (0, 8), 64) == 2 and scale_vector(4096, 4, (4,), 64) == 1  # offsets
    assert scale_vector(4096, 4, (0,), 68) == 1  # an arena row of 17 words
    assert scale_vector(1024, 4, (0,), 64) == 2 and scale_vector(384, 1, (0,), 64) == 1  # 2, 3 blocks
    assert scale_vector(1536, 3, (0,), 64) == 4 and scale_vector(1536, 6, (0,), 64) == 2  # 12 blocks
