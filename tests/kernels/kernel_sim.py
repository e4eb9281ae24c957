"""CPU replays of the GPU kernels' bit moves and MMA fragments, for the layout tests.

`decode_e4m3_words`, `decode_e2m1_words` and `decode_e4m3_pairs` perform the moves of
kernels/lowbit.py's and kernels/fp4_mma_few_tokens.py's CUDA `SOURCE` in torch, `e8m0_pick` (with
`byte_perm`) kernels/fp4_mma_one_token.py's scale pick; `mma_m16n8k16` is one
m16n8k16 MMA assembled from every lane's fragment registers (the PTX fragment layout).
"""

import torch


def _halves(bits: torch.Tensor) -> torch.Tensor:
    """uint32 words held in int64 [..] -> their two fp16 halves as fp32 [.., 2] (low half first)."""
    h = torch.stack((bits & 0xFFFF, bits >> 16), dim=-1)  # [.., 2] 16-bit patterns
    return h.to(torch.int16).view(torch.float16).float()  # int16 keeps the low 16 bits


def decode_e4m3_words(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] of e4m3 codes -> fp32 [..., 4W] (values times 2^-8): the moves of
    kernels/lowbit.py's SOURCE in torch."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    even = _halves(((w & 0x007F007F) << 7) | ((w & 0x00800080) << 8))  # channels 0, 2
    odd = _halves(((w >> 1) & 0x3F803F80) | (w & 0x80008000))  # channels 1, 3
    return torch.stack((even, odd), dim=-1).flatten(-3)  # [.., W, half, even/odd] -> [.., 4W]


def _byte_perm_hi(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """__byte_perm(v, 0, ..): byte `lo` of v to byte 1, byte `hi` to byte 3, zeros elsewhere."""
    return (((v >> (8 * lo)) & 0xFF) << 8) | (((v >> (8 * hi)) & 0xFF) << 24)


def byte_perm(x, y, s: int):
    """__byte_perm(x, y, s) on uint32 words (ints or int64 tensors; int32 values are read as their
    bits): byte n of the result is byte (nibble n of s) of the eight bytes x (0..3), y (4..7).
    Selectors with a nibble's bit 3 set (prmt's sign replication) are not modelled."""
    assert not s & 0x8888, "sign-replicating selectors are not modelled"
    xy = ((y & 0xFFFFFFFF) << 32) | (x & 0xFFFFFFFF)
    return sum(((xy >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def e8m0_pick(word: torch.Tensor, sel: int, extra: int) -> torch.Tensor:
    """kernels/fp4_mma_one_token.py's `dsv4_e8m0_pick` in torch: scale words (int64 tensor) -> the
    fp32 of bits (__byte_perm(word, 0, sel) + extra) << 23, mod 2^32."""
    bits = ((byte_perm(word, 0, sel) + extra) << 23) & 0xFFFFFFFF
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # the same 32 bits


def e4m3_word_pairs(word: torch.Tensor) -> list:
    """One e4m3 word -> its two fp16x2 pairs as the FP8 MMA kernels form them
    (`dsv4_e4m3x4_to_f16x2`): [(channel 0, channel 2), (channel 1, channel 3)], values times 2^-8."""
    c = decode_e4m3_words(word.view(1)).double()  # [4] in channel order
    return [(c[0], c[2]), (c[1], c[3])]


def fp8_block_mma(words: torch.Tensor, row0: int, kb: int, b_of, a_pairs=e4m3_word_pairs) -> torch.Tensor:
    """The eight MMAs of the FP8 tensor-core GEMVs over 128-channel block kb of the 16-row tile at
    row0 of weight words [n, k/4] (rows past n read row n - 1): lane (gi, ti) loads word
    col = 32·kb + 16s + 4ti + v of rows gi and gi + 8, whose two pairs (`a_pairs`: the fp16 ones of
    `dsv4_fp8_a_fragment` unless given) are its A fragment, and `b_of(gi, col)` gives its B pairs
    for that word -> D [16, 8] fp64, summed over the 8 MMAs."""
    n = words.shape[0]
    d = torch.zeros(16, 8, dtype=torch.float64)
    for s in range(2):
        for v in range(4):  # word v of span s: one MMA
            a_regs, b_regs = [], []
            for lane in range(32):
                gi, ti = lane // 4, lane % 4
                col = 32 * kb + 16 * s + 4 * ti + v
                h0, h1 = (a_pairs(words[min(row0 + 8 * h + gi, n - 1), col]) for h in (0, 1))
                a_regs.append([h0[0], h1[0], h0[1], h1[1]])
                b_regs.append(b_of(gi, col))
            d += mma_m16n8k16(a_regs, b_regs)
    return d


def store_tile_sums(y: torch.Tensor, total: torch.Tensor, row0: int) -> None:
    """The FP8 few-token tensor-core kernels' store: the CTA at row0's summed lane results total
    [tiles, cols, 4, 32] ([t, u, 2h + j, lane]: row row0 + 16t + 8h + gi, token 8u + 2ti + j) into
    y [m, n], rows past n and tokens past m skipped."""
    m, n = y.shape
    tiles, cols = total.shape[:2]
    for t in range(tiles):
        for u in range(cols):
            for c in range(4):
                for lane in range(32):
                    gi, ti = lane // 4, lane % 4
                    row, tok = row0 + 16 * t + 8 * (c // 2) + gi, 8 * u + 2 * ti + c % 2
                    if row < n and tok < m:
                        y[tok, row] = total[t, u, c, lane]


def decode_e2m1_words(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] of e2m1 codes (record order) -> fp32 [..., 8W] (values times 2^-14):
    kernels/lowbit.py SOURCE's moves in torch."""
    x = words.to(torch.int64) & 0xFFFFFFFF
    ev = x & 0x8E8E8E8E  # channels 0, 2, 4, 6
    od = ((x >> 3) & 0x0E0E0E0E) | ((x << 7) & 0x80808080)  # channels 1, 3, 5, 7
    pairs = [_byte_perm_hi(ev, 0, 2), _byte_perm_hi(od, 0, 2), _byte_perm_hi(ev, 1, 3), _byte_perm_hi(od, 1, 3)]
    h = torch.stack([_halves(p) for p in pairs], dim=-2)  # [.., W, 4 pairs, 2 halves]: channel 4 * half + pair
    return h.transpose(-1, -2).flatten(-3)


def decode_e4m3_pairs(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., 2W] of e4m3 codes (two words = 8 channels) -> fp32 [..., 8W] in channel
    order (values times 2^-8), through the moves of `dsv4_e4m3x8_to_f16x2` (kernels/fp4_mma_few_tokens.py's
    SOURCE) in torch: pair p of a word pair holds channels (p, p + 4), low half first."""
    w = (words.to(torch.int64) & 0xFFFFFFFF).unflatten(-1, (-1, 2))  # [.., W, (channels 0-3, 4-7)]
    lo, hi = w[..., 0], w[..., 1]
    pairs = []
    for p in range(4):
        b = (((lo >> (8 * p)) & 0xFF) << 8) | (((hi >> (8 * p)) & 0xFF) << 24)  # __byte_perm: bytes 1 and 3
        bits = ((b >> 1) & 0x3F803F80) | (b & 0x80008000)
        pairs.append(torch.stack((bits & 0xFFFF, bits >> 16), dim=-1))  # [.., W, 2 halves]
    h = torch.stack(pairs, dim=-2).to(torch.int16).view(torch.float16).float()  # [.., W, 4 pairs, 2 halves]
    return h.transpose(-1, -2).flatten(-3)  # channel 4 * half + pair


def word_pairs(channels: torch.Tensor) -> torch.Tensor:
    """8 decoded channels -> the 4 fp16x2 pairs (p, p + 4) a word becomes: [4, 2]."""
    return torch.stack((channels[:4], channels[4:]), dim=-1)


def mma_m16n8k16(a_regs, b_regs) -> torch.Tensor:
    """D [16, 8] of one m16n8k16 from every lane's registers: a_regs[lane] = 4 pairs
    (a0a1, a2a3, a4a5, a6a7), b_regs[lane] = 2 pairs (b0b1, b2b3)."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    b = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        gi, ti = lane // 4, lane % 4
        for e in range(2):
            a[gi, 2 * ti + e] = a_regs[lane][0][e]
            a[gi + 8, 2 * ti + e] = a_regs[lane][1][e]
            a[gi, 2 * ti + 8 + e] = a_regs[lane][2][e]
            a[gi + 8, 2 * ti + 8 + e] = a_regs[lane][3][e]
            b[2 * ti + e, gi] = b_regs[lane][0][e]
            b[2 * ti + 8 + e, gi] = b_regs[lane][1][e]
    return a @ b
