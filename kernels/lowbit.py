"""Decoding FP8 (e4m3) and FP4 (e2m1) codes to fp32 with integer bit moves, for the GEMV kernels.

The hardware conversion `cvt.rn.f16x2.e4m3x2` (and the byte extraction TileLang emits around
it, one code at a time) runs on the H200's narrow conversion pipe; at decode shapes that pipe,
not memory, bounded the FP8 and FP4 GEMVs. Here a 32-bit word of codes becomes two fp16x2
words with a few shifts and masks (integer pipe), and the fp16 -> fp32 widening is a full-rate
instruction. Both placements are exact, up to a power of two that the kernels fold into the
block scales:

* e4m3 (s eeee mmm, bias 7) -> fp16 (s eeeee mmmmmmmmmm, bias 15): the seven magnitude bits go
  to fp16 bits 7..13 and the sign to bit 15, so the fp16 is exactly the e4m3 value times 2^-8
  (e4m3 subnormals land on fp16 subnormals). Bytes 0 and 2 of a word form one fp16x2 word,
  bytes 1 and 3 the other. The e4m3 NaN codes (0x7F, 0xFF) become finite numbers: weights and
  quantised activations never hold them.
* e2m1 (s ee m) -> fp16: the three magnitude bits go to fp16 bits 9..11 and the sign to bit 15,
  which is exactly the e2m1 value times 2^-14. A word holds channels 0..7 in record order
  (kernels/reference.py: byte j holds channel 2j's sign at bit 7 and magnitude at bits 1..3,
  channel 2j+1's magnitude at bits 4..6 and sign at bit 0), so one mask places the even
  channels and two shifts the odd ones: 9 instructions per word with the byte permutes that
  pair channels j and j + 4 into fp16x2 words, against 11 for the official nibble order.

`SOURCE` holds the CUDA device functions (imported into a TileLang kernel with
`T.import_source`, called through the helpers below), and the one fp16 MMA that the tensor-core
GEMVs (kernels/fp4_mma_one_token.py, kernels/fp8_mma_one_token.py) feed the decoded words to. tests/kernels/kernel_sim.py
performs the same bit moves in torch, so the CPU tests pin the layout (tests/kernels/test_lowbit.py: every
code) and the GPU tests the kernels against the reference.
"""

E4M3_SHIFT = 8  # the fp16 that an e4m3 code becomes is its value times 2^-E4M3_SHIFT
E2M1_SHIFT = 14  # the fp16 that an e2m1 code becomes is its value times 2^-E2M1_SHIFT

SOURCE = r"""
#include <cuda_fp16.h>

// 4 e4m3 codes (byte 0 = channel 0) -> h[0] = the fp16x2 of channels (0, 2), h[1] = that of
// (1, 3) (low half first), values times 2^-8, exactly.
__device__ __forceinline__ void dsv4_e4m3x4_to_f16x2(unsigned w, unsigned* h) {
  h[0] = ((w & 0x007F007Fu) << 7) | ((w & 0x00800080u) << 8);  // channels 0, 2
  h[1] = ((w >> 1) & 0x3F803F80u) | (w & 0x80008000u);        // channels 1, 3
}

// 4 e4m3 codes (byte 0 = channel 0) -> out[0..3] = value * 2^-8, exactly.
__device__ __forceinline__ void dsv4_e4m3x4_to_f32(unsigned w, float* out) {
  unsigned h[2];
  dsv4_e4m3x4_to_f16x2(w, h);
  float2 e = __half22float2(*reinterpret_cast<__half2*>(&h[0]));
  float2 o = __half22float2(*reinterpret_cast<__half2*>(&h[1]));
  out[0] = e.x; out[1] = o.x; out[2] = e.y; out[3] = o.y;
}

// One m16n8k16 MMA, fp16 in, fp32 out, on this lane's fragments: A (a0..a3), B (b0, b1), D
// (d[0..3]). `first`: D = A·B (no cleared D to add the products to); else D += A·B. Not
// volatile: the MMA has no side effects, so ptxas may interleave MMAs of independent tiles.
template <bool first>
__device__ __forceinline__ void dsv4_mma_f16(unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                             unsigned b0, unsigned b1, float* d) {
  float c[4] = {first ? 0.f : d[0], first ? 0.f : d[1], first ? 0.f : d[2], first ? 0.f : d[3]};
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// 16 e4m3 codes (4 words) -> out[0..15] = value * 2^-8.
__device__ __forceinline__ void dsv4_e4m3x16_to_f32(const int* w, float* out) {
#pragma unroll
  for (int j = 0; j < 4; ++j) dsv4_e4m3x4_to_f32((unsigned)w[j], out + 4 * j);
}

// sum_c a[c] * e4m3(w)[c] * 2^-8 over 16 channels (4 words), fp32 products and sums.
__device__ __forceinline__ float dsv4_dot_e4m3x16(const int* w, const float* a) {
  float f[16];
  dsv4_e4m3x16_to_f32(w, f);
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < 16; ++c) s = fmaf(a[c], f[c], s);
  return s;
}

// 8 e2m1 codes (one word, record order) -> h[p] = the fp16x2 of channels (p, p + 4) (low half
// first), values times 2^-14. Each code's magnitude goes to bits 1..3 and its sign to bit 7 of
// its byte (even channels in `ev`, where record order already holds them; odd ones in `od`); a
// byte permute then moves two such bytes, 16 bits apart, into the high bytes of an fp16x2 (bits
// 9..11 and 15), zero-filling the low bytes.
__device__ __forceinline__ void dsv4_e2m1x8_to_f16x2(unsigned x, unsigned* h) {
  unsigned ev = x & 0x8E8E8E8Eu;                                       // channels 0, 2, 4, 6
  unsigned od = ((x >> 3) & 0x0E0E0E0Eu) | ((x << 7) & 0x80808080u);  // channels 1, 3, 5, 7
  h[0] = __byte_perm(ev, 0u, 0x2404u);  // channels 0, 4
  h[1] = __byte_perm(od, 0u, 0x2404u);  // channels 1, 5
  h[2] = __byte_perm(ev, 0u, 0x3414u);  // channels 2, 6
  h[3] = __byte_perm(od, 0u, 0x3414u);  // channels 3, 7
}

// sum_c a[c] * e2m1(w)[c] * 2^-14 over 32 channels (4 words, record order), fp32 sums.
__device__ __forceinline__ float dsv4_dot_e2m1x32(const int* w, const float* a) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    unsigned h[4];
    dsv4_e2m1x8_to_f16x2((unsigned)w[j], h);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      float2 f = __half22float2(*reinterpret_cast<__half2*>(&h[p]));
      s = fmaf(a[8 * j + p], f.x, s);
      s = fmaf(a[8 * j + p + 4], f.y, s);
    }
  }
  return s;
}
"""


def import_source(T, *extra: str) -> None:
    """Make SOURCE's device functions, and those of the `extra` sources, callable in the TileLang
    kernel being defined (a kernel has one imported source)."""
    T.import_source(SOURCE + "".join(extra))


def e8m0_bits_to_float(T, byte, extra_exp: int = 0):
    """2^(byte - 127 + extra_exp) as fp32, built from its bits (TileLang expression)."""
    return T.reinterpret((T.Cast("uint32", byte) + T.uint32(extra_exp)) << T.uint32(23), "float32")


def e4m3x16_to_f32(T, words, out) -> None:
    """out[0..15] (fp32 local) = the 16 e4m3 codes of int32 words[0..3] times 2^-8."""
    T.evaluate(T.call_extern("handle", "dsv4_e4m3x16_to_f32", T.address_of(words), T.address_of(out)))


def dot_e4m3x16(T, words, acts):
    """fp32 expression: sum over 16 channels of acts[c] times e4m3 code c of words[0..3], times 2^-8."""
    return T.call_extern("float32", "dsv4_dot_e4m3x16", T.address_of(words), T.address_of(acts))


def dot_e2m1x32(T, words, acts):
    """fp32 expression: sum over 32 channels of acts[c] times e2m1 code c of words[0..3], times 2^-14."""
    return T.call_extern("float32", "dsv4_dot_e2m1x32", T.address_of(words), T.address_of(acts))
