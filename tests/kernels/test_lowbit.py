"""The bit layouts of kernels/lowbit.py: every e4m3 and e2m1 code decodes exactly (CPU port)."""

import torch

from kernels import lowbit
from kernels import reference as ref

from kernel_sim import decode_e2m1_words, decode_e4m3_pairs, decode_e4m3_words


def test_every_e4m3_code_decodes_to_its_value_times_2_pow_minus_8():
    codes = torch.arange(256, dtype=torch.uint8)  # 64 words, byte 0 of each word = lowest channel
    got = decode_e4m3_words(codes.view(torch.int32))
    want = codes.view(torch.float8_e4m3fn).float() * 2.0 ** -lowbit.E4M3_SHIFT
    finite = ~torch.isnan(want)
    assert finite.sum() == 254  # 0x7F and 0xFF are NaN in e4m3fn: never weights or activations
    assert torch.equal(got[finite], want[finite])
    assert got[1] == 2.0 ** -9 * 2.0 ** -8  # smallest subnormal survives as an fp16 subnormal
    assert got[0x7E] == 448 * 2.0 ** -8 and got[0xFE] == -448 * 2.0 ** -8


def test_every_e2m1_pair_decodes_to_its_values_times_2_pow_minus_14():
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)  # every byte in every word position
    got = decode_e2m1_words(codes.view(torch.int32))
    want = ref.unpack_fp4(codes.view(torch.int8)).float() * 2.0 ** -lowbit.E2M1_SHIFT
    assert got.shape == want.shape == (2048,)
    assert torch.equal(got, want)
    assert set((got * 2.0 ** lowbit.E2M1_SHIFT).tolist()) == set(ref.FP4_VALUES.tolist()) | set(
        (-ref.FP4_VALUES).tolist())


def test_decoded_dot_with_scale_matches_dequantised_product():
    # what the GEMV kernels compute for one 32-channel group: decoded codes, then the shifts undone
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (32,), generator=gen, dtype=torch.uint8)
    a[a & 0x7F == 0x7F] = 0  # no NaN codes
    w = torch.randint(0, 256, (16,), generator=gen, dtype=torch.uint8)
    af = decode_e4m3_words(a.view(torch.int32)).double()
    wf = decode_e2m1_words(w.view(torch.int32)).double()
    got = (af * wf).sum() * 2.0 ** (lowbit.E4M3_SHIFT + lowbit.E2M1_SHIFT)
    want = (a.view(torch.float8_e4m3fn).double() * ref.unpack_fp4(w.view(torch.int8)).double()).sum()
    assert got == want


def test_every_e4m3_code_decodes_into_the_mma_pairs():
    # kernels/fp4_mma_few_tokens.py's activation pairs (p, p + 4): every code in every byte position
    codes = torch.arange(256, dtype=torch.uint8).repeat(8)  # 512 words = 256 word pairs
    got = decode_e4m3_pairs(codes.view(torch.int32))
    want = codes.view(torch.float8_e4m3fn).float() * 2.0 ** -lowbit.E4M3_SHIFT
    finite = ~torch.isnan(want)
    assert got.shape == want.shape == (2048,)
    assert torch.equal(got[finite], want[finite])
