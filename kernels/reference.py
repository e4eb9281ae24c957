"""Pure-torch reference versions of every numeric primitive of DeepSeek-V4 (spec §B.4, §C.0).

These run the CPU path and are the oracle for the GPU kernels, which keep the same signatures.

Data layouts (contract):
* FP8 weight `w` [N, K] float8_e4m3fn with `scale` [ceil(N/128), ceil(K/128)] float8_e8m0fnu
  (a multiplier): W[n, k] = w[n, k] * scale[n // 128, k // 128].
* FP4 weight `packed` [N, K/2] int8/uint8, e2m1 codes (sign, 2 exponent bits, 1 mantissa bit)
  in RECORD ORDER (converted expert records, hence every ExpertWeights): byte (n, j) holds
  elements a = (n, 2j) and b = (n, 2j+1) as bit 7 = sign of a, bits 4..6 = magnitude of b,
  bits 1..3 = magnitude of a, bit 0 = sign of b (the GPU kernels decode it in 9 integer
  instructions per 8 codes instead of 11, kernels/lowbit.py). The official checkpoint's OFFICIAL
  ORDER (a the low nibble, b the high nibble, sign in each nibble's bit 3) converts losslessly
  both ways (`fp4_record_order`, `fp4_official_order`). `scale` [N, K/32] e8m0:
  W[n, k] = v * scale[n, k // 32].
* Activation quantisation: per row and `block` channels, s = 2^ceil(log2(max(amax, 1e-4) / 448)),
  q = e4m3(clamp(x / s, ±448)); the scale is returned as float32 (an exact power of two).
* Index tensors for sparse attention use -1 for "absent".
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 code -> value (bit 3 is the sign), spec §B.2.
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
# A routed expert's tensors (§B), in checkpoint, expert-record and `routed_expert` argument order.
EXPERT_FIELDS = ("w1.weight", "w1.scale", "w3.weight", "w3.scale", "w2.weight", "w2.scale")


# ----------------------------------------------------------------------------------- weights
def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 scales (value = 2^(byte - 127)) to float32."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.to(torch.float32)
    e = scale.view(torch.uint8).to(torch.int32) - 127
    return torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e)


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """FP8 e4m3 weight with 128×128 block scales -> float32 [N, K]."""
    n, k = w.shape
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return w.to(torch.float32) * s


def fp4_record_order(packed: torch.Tensor) -> torch.Tensor:
    """FP4 bytes in official order -> the same codes in record order (a new uint8 tensor)."""
    b = packed.view(torch.uint8)
    return ((b & 0x08) << 4) | (b & 0x70) | ((b & 0x07) << 1) | (b >> 7)


def fp4_official_order(packed: torch.Tensor) -> torch.Tensor:
    """FP4 bytes in record order -> the same codes in official order (a new uint8 tensor)."""
    b = packed.view(torch.uint8)
    return ((b >> 4) & 0x08) | (b & 0x70) | ((b >> 1) & 0x07) | ((b & 0x01) << 7)


def fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] FP4 bytes in record order -> uint8 e2m1 codes [..., K] (bit 3 the sign)."""
    b = packed.view(torch.uint8)
    a = ((b >> 1) & 0x07) | ((b >> 4) & 0x08)  # element 2j
    c = ((b >> 4) & 0x07) | ((b & 0x01) << 3)  # element 2j + 1
    return torch.stack((a, c), dim=-1).flatten(-2)  # [..., K/2, 2] -> [..., K]


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] FP4 bytes in record order -> float32 values [N, K] (unscaled)."""
    codes = fp4_codes(packed)
    # decoded from the bits (sign | 2 exponent bits | 1 mantissa bit) rather than looked up in
    # FP4_VALUES: no host-to-device copy, so the reference path can be captured in a CUDA graph
    e = ((codes >> 1) & 3).float()
    m = (codes & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1 + 0.5 * m))  # exact: powers of two
    return torch.where(codes >= 8, -mag, mag)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 weight [N, K/2] (record order) with 1×32 e8m0 scales [N, K/32] -> float32 [N, K]."""
    return unpack_fp4(packed) * e8m0_to_float(scale).repeat_interleave(block, dim=-1)


def fp4_pair_table(device: torch.device) -> torch.Tensor:
    """[256] int32: for each FP4 byte, the bf16 bits of its two values (element 2j in the low
    half, 2j+1 in the high half, in record order), so that an int32 lookup viewed as bf16 is the
    byte's two values in order (little-endian)."""
    b = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).unsqueeze(-1)
    codes = fp4_codes(b).long()  # [256, 2]
    bits = FP4_VALUES.to(device=device, dtype=torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    pair = bits[codes]  # [256, 2]
    return pair[:, 0] | (pair[:, 1] << 16)


def dequant_fp4_bf16(w: torch.Tensor, w_scale: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """FP4 weight [..., N, K/2] with 1×32 e8m0 scales [..., N, K/32] -> bf16 [..., N, K],
    exactly (an e2m1 value times a power of two fits bf16): one lookup per byte in `table`
    (`fp4_pair_table(w.device)`, built here when not given), then the group's power of two."""
    wb = w.contiguous().view(torch.uint8)
    k = 2 * wb.shape[-1]
    table = fp4_pair_table(w.device) if table is None else table
    pairs = table.index_select(0, wb.reshape(-1).to(torch.int32))  # [numel] int32
    v = pairs.view(torch.bfloat16).view(*wb.shape[:-1], k // 32, 32)
    e = (w_scale.contiguous().view(torch.uint8).to(torch.int32) - 127).to(torch.bfloat16).unsqueeze(-1)
    return torch.ldexp(v, e).view(*wb.shape[:-1], k)


def fp4_dequant_slots(arena: torch.Tensor, w_offs: tuple[int, ...], s_offs: tuple[int, ...], n: int, k: int,
                      slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """FP4 weights read from arena rows, dequantised exactly to bf16: arena uint8 [S, R], slots
    [G] int32 -> bf16 [G, P·n, k] (into `out` when given), where rows p·n..(p+1)·n of group g are
    the weight [n, k/2] (record order) at byte w_offs[p] of row slots[g], scaled by its e8m0
    scales [n, k/32] at byte s_offs[p] (e.g. an expert's w1 and w3 stacked: one GEMM for both)."""
    rows = arena.index_select(0, slots.long())
    g = rows.shape[0]
    table = fp4_pair_table(arena.device)
    out = torch.empty(g, len(w_offs) * n, k, dtype=torch.bfloat16, device=arena.device) if out is None else out
    for p, (w, s) in enumerate(zip(w_offs, s_offs)):
        out[:, p * n:(p + 1) * n] = dequant_fp4_bf16(rows[:, w:w + n * k // 2].view(g, n, k // 2),
                                                     rows[:, s:s + n * k // 32].view(g, n, k // 32), table)
    return out


# ------------------------------------------------------------------------------- activations
def pow2_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """ue8m0 scale: 2^ceil(log2(max(amax, floor) / qmax)), an exact power of two (float32)."""
    s = amax.float().clamp_min(floor) / qmax
    mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1)
    # s is a power of two iff mant == 0.5: then it stays as is; otherwise round up.
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(s), exp)


def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`block` FP8 quantisation with power-of-two scales.

    x [..., K] (K % block == 0) -> (q [..., K] float8_e4m3fn, s [..., K/block] float32).
    """
    k = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], k // block, block)  # [..., K/block, block]
    s = pow2_scale(xb.abs().amax(-1), FP8_MAX, 1e-4)
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), s


def act_dequant(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Inverse of act_quant -> float32."""
    k = q.shape[-1]
    qb = q.float().reshape(*q.shape[:-1], k // block, block)
    return (qb * s.unsqueeze(-1)).reshape(q.shape)


def fp8_dequant_bf16(q: torch.Tensor, s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """e4m3 codes times block scales, exactly in bf16 (an e4m3 value times a power of two fits):
    q [M, K] float8_e4m3fn, s [ceil(M/rows), K/cols] fp32 -> bf16 [M, K], element (i, j) =
    q[i, j] · s[i // rows, j // cols]. (rows, cols) = (1, 128): act_quant's output, the bf16 input
    of prefill's GEMMs; (128, 128): an FP8 weight's blocks."""
    m, k = q.shape
    two = s.to(torch.bfloat16)  # powers of two: exact in bf16
    if m % rows == 0 and k % cols == 0:
        return (q.to(torch.bfloat16).view(m // rows, rows, k // cols, cols) * two[:, None, :, None]).view(m, k)
    return q.to(torch.bfloat16) * two.repeat_interleave(rows, 0)[:m].repeat_interleave(cols, 1)[:, :k]


def qdq8(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """FP8 storage simulation (§C.0 QDQ8): round through e4m3 with a pow2 scale per block; keeps dtype."""
    q, s = act_quant(x, block)
    return act_dequant(q, s, block).to(x.dtype)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-6, 6] to the nearest e2m1 value, ties to even mantissa."""
    a = v.abs()
    # Grid spacing: 0.5 below 2, 1 in [2, 4), 2 in [4, 6]. round() is half-to-even on the
    # scaled value, which is exactly "ties to the even code" (0.25->0, 0.75->1, 2.5->2, 5->4).
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    r = torch.round(a / step) * step
    return torch.copysign(r.clamp(max=FP4_MAX), v)


def qdq4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 storage simulation (§C.0 QDQ4): e2m1 with a pow2 scale per 32 channels; keeps dtype."""
    k = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], k // block, block)
    s = pow2_scale(xb.abs().amax(-1), FP4_MAX, FP4_MAX * 2.0 ** -126).unsqueeze(-1)
    y = e2m1_round((xb / s).clamp(-FP4_MAX, FP4_MAX)) * s
    return y.reshape(x.shape).to(x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform (Sylvester order) over the last dim (a power of two)."""
    n = x.shape[-1]
    y = x.float()
    bufs = [torch.empty(x.shape, dtype=torch.float32, device=x.device) for _ in range(2 if n > 2 else 1)]
    h, i = 1, 0
    while h < n:  # each butterfly stage writes the other buffer: 2 ops, no stack
        src = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)  # pairs of half-blocks
        dst = bufs[i].view(*x.shape[:-1], n // (2 * h), 2, h)
        torch.add(src[..., 0, :], src[..., 1, :], out=dst[..., 0, :])
        torch.sub(src[..., 0, :], src[..., 1, :], out=dst[..., 1, :])
        y, h, i = bufs[i], 2 * h, (i + 1) % len(bufs)
    return torch.div(y, math.sqrt(n), out=torch.empty(x.shape, dtype=x.dtype, device=x.device))


def hadamard_qdq4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """The indexer's native storage rounding (§C.0): Hadamard rotation of the last dim, then QDQ4
    in blocks of `block`; keeps x's dtype. One backend op (TileLang: one launch)."""
    return qdq4(hadamard(x), block)


# ------------------------------------------------------------------------------------- GEMMs
ROW_STABLE_M = 4  # CPU products of fewer rows than this are padded (`matmul`)


def _row_stable(product, a: torch.Tensor) -> torch.Tensor:
    """product(a) for a [M, ...] whose rows do not depend on M (`matmul`): on the CPU, an `a` of
    fewer than ROW_STABLE_M rows is padded with zero rows, and the padding's rows dropped again."""
    m = a.shape[0]
    if a.device.type != "cpu" or m >= ROW_STABLE_M:
        return product(a)
    padded = a.new_zeros((ROW_STABLE_M, *a.shape[1:]))
    padded[:m] = a
    return product(padded)[:m]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] with rows that do not depend on M, so that a token's product is the
    same in a prefill chunk and in a one-token decode step. On the CPU, MKL multiplies fewer than
    4 rows along another code path that rounds differently (AMD Zen 4, fp32, MKL_CBWR=AUTO,STRICT:
    a row alone differs in the last bits from the same row among 24, which a later FP8
    quantisation can turn into a 3 % difference in the logits); such an `a` is padded with zero
    rows to ROW_STABLE_M. Other devices multiply as given."""
    return _row_stable(lambda x: x @ b, a)


def grouped_matmul(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u [S, G, K] times each group's w [G, R, K] -> [S, G, R] (fp32 accumulation), rows
    independent of S as in `matmul`."""
    return _row_stable(lambda x: torch.einsum("sgi,gri->sgr", x, w), u)


def bf16_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times a bf16 weight w [N, K] -> fp32 [M, N]: the official fp32 matmul of both
    operands widened (each product of two bf16 values is exact in fp32; the sums are fp32), rows
    independent of M as in `matmul`."""
    return matmul(x.float(), w.float().T)


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             w_scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """Official FP8 linear: FP8-quantised activations × FP8 block-scaled weights, fp32 accumulate.

    x [M, K] -> bf16 [M, N]. Equal to dequant(act_quant(x)) @ dequant(w).T. `w_scale_f32`:
    w_scale's values in fp32 (`e8m0_to_float`), prepared once by a caller for the CUDA kernels'
    block-scaled GEMM; it changes nothing here.
    """
    q, s = act_quant(x, 128)
    return matmul(act_dequant(q, s, 128), dequant_fp8_block(w, w_scale).T).to(torch.bfloat16)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, groups: int,
                   w_scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped output projection wo_a (§C.4 steps 14–15) as the official code runs it: the
    FP8 weight [G·R, K] dequantised to bf16 (exact), bf16 activations x [S, G·K] (group g: channels
    g·K..), fp32 accumulation -> bf16 [S, G·R] (group g: rows g·R.. of the weight). `w_scale_f32`
    (the scales' fp32 values, prepared once for the CUDA kernels) changes nothing here."""
    s, n = x.shape[0], w.shape[0]
    wd = dequant_fp8_block(w, w_scale).to(x.dtype).view(groups, n // groups, -1)  # [G, R, K]
    u = x.view(s, groups, -1)  # [S, G, K]
    return grouped_matmul(u, wd).reshape(s, n)


def compressor_project(x: torch.Tensor, w: torch.Tensor, ape: torch.Tensor, row: torch.Tensor,
                       buf_kv: torch.Tensor, buf_gate: torch.Tensor) -> None:
    """A compressor's decode projection (§C.5): x [M, D] times the bf16 weight w [2C, D] (wkv's
    rows, then wgate's) in fp32; kv into rows `row` [M] of buf_kv [r, C], gate logits plus
    ape[row] into the same rows of buf_gate (both fp32, written in place)."""
    c = buf_kv.shape[1]
    buf_kv.index_copy_(0, row, bf16_gemm(x, w[:c]))
    buf_gate.index_copy_(0, row, bf16_gemm(x, w[c:]) + ape[row])


def pool_windows(win_kv: torch.Tensor, win_gate: torch.Tensor) -> torch.Tensor:
    """Gated pooling (§C.5): windows win_kv, win_gate [n, slots, d] fp32 -> [n, d] fp32, each
    channel's kv summed over the slots with the softmax of its gate logits over the slots."""
    weights = torch.softmax(win_gate.transpose(1, 2), dim=-1).transpose(1, 2)  # the fast CUDA softmax: last dim
    return (win_kv * weights).sum(dim=1)


def compressor_pool(win_kv: torch.Tensor, win_gate: torch.Tensor, prev_kv: torch.Tensor | None,
                    prev_gate: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """n consecutive completed windows of a compressor (§C.5) -> their pooled entries [n, d] in
    `dtype` (before each entry's norm and rotation). win_kv, win_gate [n, r, C] fp32: the windows'
    kv and gate logits (ape added). Without overlap (prev None) C = d and window i's slots are its
    r rows; with overlap (prev_kv, prev_gate [r, d] fp32: the first halves of the window before
    window 0) C = 2d and window i's 2r slots are the first halves of the window before it
    (win[i - 1, :, :d], prev for i = 0), then its own second halves win[i, :, d:]; prev then takes
    the last window's first halves win[n - 1, :, :d] (in place; n = 0 leaves it). `pool_windows`
    of those slots."""
    if win_kv.shape[0] == 0:
        return win_kv.new_empty(0, win_kv.shape[2] if prev_kv is None else prev_kv.shape[1], dtype=dtype)
    if prev_kv is None:
        kv, gate = win_kv, win_gate
    else:
        d = prev_kv.shape[1]
        kv = torch.cat((torch.cat((prev_kv.unsqueeze(0), win_kv[:-1, :, :d])), win_kv[:, :, d:]), dim=1)
        gate = torch.cat((torch.cat((prev_gate.unsqueeze(0), win_gate[:-1, :, :d])), win_gate[:, :, d:]), dim=1)
        prev_kv.copy_(win_kv[-1, :, :d])
        prev_gate.copy_(win_gate[-1, :, :d])
    return pool_windows(kv, gate).to(dtype)


def fp4_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Official FP4 expert linear: FP8-quantised activations × FP4 (1×32 scaled) weights -> bf16."""
    return fp4_gemm_dequantized(act_dequant(*act_quant(x, 128), 128), w, w_scale)


def fp4_gemm_dequantized(xd: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`fp4_gemm` from its activations' exact FP8 values xd = act_dequant(q, s) (fp32) -> bf16."""
    return matmul(xd, dequant_fp4(w, w_scale).T).to(torch.bfloat16)


def head_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The output head: x [M, D] × weight [V, D] (bf16 on disk) in fp32 -> logits [M, V] fp32."""
    return matmul(x.float(), w.float().T)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU: gate clamped above at `limit`, up clamped to ±limit (§C.7 step 4)."""
    return torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)


def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, route_scale: float,
             hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router (§C.7 steps 1–3): scores = sqrt(softplus(x · weightᵀ)) in fp32 (x [N, D],
    weight [E, D] fp32); the experts are the top k of scores + bias (the bias selects, it does not
    weigh; ties -> lowest index), or `hash_ids` [N, k] on hash layers (bias None); weights = the
    chosen scores normalised to sum 1 (+1e-20 against a sqrt-softplus underflow), times
    route_scale -> (ids [N, k] int64, weights [N, k] fp32)."""
    scores = torch.nn.functional.softplus(matmul(x.float(), weight.T)).sqrt()  # [N, E]
    idx = hash_ids if bias is None else topk_desc(scores + bias, k)
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * route_scale


def fp8_gemm_quantized(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       w_scale_f32: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_gemm` on activations already quantised by `act_quant` (q [M, K] e4m3, s [M, K/128])
    -> bf16 [M, N]: fp8_gemm(x) == fp8_gemm_quantized(*act_quant(x, 128), w, w_scale).
    `w_scale_f32` as in `fp8_gemm` (unused here)."""
    return matmul(act_dequant(q, s, 128), dequant_fp8_block(w, w_scale).T).to(torch.bfloat16)


def swiglu_quant(g: torch.Tensor, u: torch.Tensor, weights: torch.Tensor | None, limit: float,
                 block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8-quantised input of an expert's w2 (§C.7 step 4): act_quant of
    (swiglu(g, u, limit) · weights) rounded to bf16. g, u [M, I] (bf16 or fp32, widened), routing
    weights [M] or None (the shared expert) -> (q [M, I] e4m3, s [M, I/block] fp32)."""
    h = swiglu(g.float(), u.float(), limit)
    if weights is not None:
        h = h * weights.float().unsqueeze(-1)
    return act_quant(h.to(torch.bfloat16), block)


def moe_combine(routed: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE layer's output: routed [N, k, D] summed over k in routing order (fp32, a fixed
    order whatever order the experts arrived in), plus shared [N, D], rounded once into dtype.
    With `rows` [N, k] (int64), routed is the cells [G, D] in any order (a prefill's, grouped by
    expert) and (token n, choice j) is row rows[n, j] of it."""
    if rows is not None:
        routed = routed.index_select(0, rows.reshape(-1)).view(*rows.shape, routed.shape[-1])
    y = routed[:, 0].float()
    for j in range(1, routed.shape[1]):
        y = y + routed[:, j].float()
    return torch.add(y, shared.float(), out=torch.empty(y.shape, dtype=dtype, device=y.device))


def fp4_moe(x: torch.Tensor, arena: torch.Tensor, fields: dict, slots: torch.Tensor, weights: torch.Tensor,
            limit: float, groups: list | None = None, rows: torch.Tensor | None = None, run: int = 1) -> torch.Tensor:
    """Routed experts read from arena slots, one per row: x [G, D] (bf16), arena uint8
    [slots, record_bytes], `fields` {"w1.weight": f, ...} with byte `.offset` and `.shape`
    (engine.pack.FieldLayout), slots int [G], routing weights [G] -> bf16 [G, D] (w2's bf16
    outputs as they are; `fp4_moe_quantized` stores the same values widened):
    row g = w2(swiglu(w1 x_g, w3 x_g) · weights[g]) of the expert in slot slots[g].
    With `rows` [G] int64, x is the tokens [N, D] and cell g reads row rows[g] of it (each token
    quantised once). `groups` is a schedule for the CUDA kernels (kernels/fp4_moe.py), and so is
    `run` (the cells come in runs of `run` consecutive cells that share their slot: G a multiple
    of it); they change nothing here."""
    if rows is not None:
        x = x.index_select(0, rows)
    return fp4_moe_quantized(*act_quant(x, 128), arena, fields, slots, weights, limit).to(torch.bfloat16)


def fp4_moe_quantized(q: torch.Tensor, s: torch.Tensor, arena: torch.Tensor, fields: dict, slots: torch.Tensor,
                      weights: torch.Tensor, limit: float, table: torch.Tensor | None = None,
                      early: bool = False, run: int = 1) -> torch.Tensor:
    """`fp4_moe` on activations quantised by act_quant: q [A, D] e4m3, s [A, D/128] fp32, A = G
    (row g for slot g) or 1 (one row for every slot) -> fp32 [G, D]. With `table` [E] (a layer's
    arena slot table), `slots` are expert ids and expert e is read from slot max(table[e], 0).
    `early` and `run` are scheduling hints for the CUDA kernels (kernels/fp4_moe.py); they change
    nothing here."""
    if table is not None:
        slots = table.index_select(0, slots.long()).clamp_min(0)
    xd = act_dequant(q, s, 128)  # [A, D] fp32: the activations' exact FP8 values
    recs = arena.index_select(0, slots.long())  # [G, record_bytes]: no host sync

    def field(g: int, name: str) -> torch.Tensor:
        f = fields[name]
        return recs[g, f.offset:f.offset + math.prod(f.shape)].view(f.shape)  # 1-byte elements

    out = []
    for g in range(slots.shape[0]):
        w1, s1, w3, s3, w2, s2 = (field(g, n) for n in EXPERT_FIELDS)
        xg = xd[g:g + 1] if xd.shape[0] > 1 else xd
        out.append(expert_down(fp4_gemm_dequantized(xg, w1, s1), fp4_gemm_dequantized(xg, w3, s3), w2, s2,
                               weights[g:g + 1], limit))
    return torch.cat(out) if out else xd.new_zeros(0, xd.shape[-1])


def routed_expert(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                  w2: torch.Tensor, s2: torch.Tensor, weight: torch.Tensor, limit: float,
                  gemm=fp4_gemm) -> torch.Tensor:
    """One routed expert in native numerics on its tokens x [N, D] with routing weights [N]:
    w2(swiglu(w1 x, w3 x) · weight) with the FP4 GEMM `gemm` (a backend's, or the reference);
    the routing weight scales h before the bf16 rounding and w2 (§C.7 step 4) -> fp32 [N, D]."""
    return expert_down(gemm(x, w1, s1), gemm(x, w3, s3), w2, s2, weight, limit, gemm)


def expert_down(g: torch.Tensor, u: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, weight: torch.Tensor,
                limit: float, gemm=fp4_gemm) -> torch.Tensor:
    """The rest of a routed expert from its w1 and w3 outputs g, u [N, I] (bf16): SwiGLU, times
    the routing weight [N], rounded to bf16, through w2 (FP4 GEMM `gemm`) -> fp32 [N, D]."""
    h = swiglu(g.float(), u.float(), limit)
    h = (h * weight.float().unsqueeze(1)).to(torch.bfloat16)
    return gemm(h, w2, s2).float()


# -------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(rope_dim: int, theta: float, yarn: dict | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies [rope_dim/2] (fp32), optionally YaRN-blended (§C.0).

    `yarn` = {"factor", "original_seq_len", "beta_fast", "beta_slow"}; no mscale anywhere.
    Computed the way transformers does (fp32 pow), so both agree bit for bit.
    """
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    extrapolation = 1.0 / pos_freqs
    if yarn is None:
        return extrapolation
    interpolation = 1.0 / (yarn["factor"] * pos_freqs)

    def corr(rotations: float) -> float:
        return rope_dim * math.log(yarn["original_seq_len"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(yarn["beta_fast"])), 0)
    high = min(math.ceil(corr(yarn["beta_slow"])), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original frequency: pairs below `low` keep it entirely
    return interpolation * (1 - keep) + extrapolation * keep


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len(positions), rope_dim/2] in fp32."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2·cos.shape[-1] channels of x; leading channels untouched.

    x [S, ..., D]; cos/sin [S, R/2] broadcast over the middle dims. Pairs (2i, 2i+1) rotate by
    +angle (or -angle with `inverse`). Computed in fp32, returned in x's dtype.
    """
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    tail = x[..., -r:].float().unflatten(-1, (r // 2, 2))  # [..., R/2, (re, im)]
    tc, ts = tail * c.unsqueeze(-1), tail * s.unsqueeze(-1)  # (re·cos, im·cos), (re·sin, im·sin)
    out = torch.empty_like(x)
    out[..., :-r] = x[..., :-r]
    rot = out[..., -r:].unflatten(-1, (r // 2, 2))  # written in place: no stack, cast or cat
    # fp32 products and sums, rounded once into x's dtype; the inverse rotation (angle -a) has
    # the signs folded in, which gives exactly what negating sin would
    if inverse:
        torch.add(tc[..., 0], ts[..., 1], out=rot[..., 0])
        torch.sub(tc[..., 1], ts[..., 0], out=rot[..., 1])
    else:
        torch.sub(tc[..., 0], ts[..., 1], out=rot[..., 0])
        torch.add(ts[..., 0], tc[..., 1], out=rot[..., 1])
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` of x [S, ..., D] at positions [S] (angles positions · inv_freq): the op the
    backends implement (TileLang: one launch, cos/sin computed in the kernel)."""
    cos, sin = rope_cos_sin(positions, inv_freq)
    return apply_rope(x, cos, sin, inverse)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
              inv_freq: torch.Tensor, round_lead: int = 0, out: torch.Tensor | None = None,
              rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """RMSNorm of x [S, ..., D] (weight [D] or None), then RoPE at positions [S] (the attention's
    q and kv, §C.4); `round_lead` > 0: QDQ8 (block 64) of the leading round_lead channels, the
    native KV storage rounding of the nope dims. Keeps x's dtype. One backend op. With `out` [R, ..., D]
    and `rows` [S]: token s is written to out[rows[s]] (in place; the KV window) and None returned."""
    y = rope(rms_norm(x, weight, eps), positions, inv_freq)
    if round_lead:
        y = torch.cat((qdq8(y[..., :round_lead], 64), y[..., round_lead:]), dim=-1)
    if out is None:
        return y
    out.index_copy_(0, rows, y.to(out.dtype))
    return None


# --------------------------------------------------------------------------------- mHC, norms
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (weight in fp32), cast back to x's dtype (§C.0)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm of x [M, K], and its FP8 quantisation for the FP8 linears that read it:
    (y in x's dtype, q e4m3, s [M, K/128] fp32) = (y, *act_quant(y, 128))."""
    y = rms_norm(x, weight, eps)
    return (y, *act_quant(y, 128))


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic projection of [..., n, n] logits (§C.3 step 6): row softmax + eps, then
    column normalisation, then `iters - 1` rounds of row then column normalisation."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n: int,
           hc_eps: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC HCPre (§C.3): streams [S, n, D] -> (block input x [S, D] in the streams' dtype,
    post [S, n] fp32, comb_logits [S, n, n] fp32: the residual mix's logits, which `hc_post`
    projects by Sinkhorn where it uses them). fn [2n + n², n·D], scale and base [2n + n²] (scale
    spread over the mix columns: pre, post, comb)."""
    sf = streams.float()
    m = matmul(rms_norm(sf.flatten(1), None, eps), fn.T)  # [S, 2n + n²], stream 0 first
    z = m * scale + base
    gates = torch.sigmoid(z[:, :2 * n])  # pre and post columns in one launch
    pre = gates[:, :n] + hc_eps
    post = 2 * gates[:, n:]
    x = (pre.unsqueeze(-1) * sf).sum(dim=1)
    return x.to(streams.dtype), post, z[:, 2 * n:].reshape(-1, n, n)  # row-major n×n


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb_logits: torch.Tensor, iters: int,
            hc_eps: float, early: bool = False) -> torch.Tensor:
    """mHC HCPost: comb = sinkhorn(comb_logits, iters, hc_eps) (§C.3 step 6), then new stream k =
    post_k · out + Σ_j comb[j, k] · stream_j, fp32 math, rounded once into the streams' dtype.
    out [S, D], streams [S, n, D], post [S, n], comb_logits [S, n, n] (`hc_pre`'s). `early`
    (kernels only): the kernel may read comb_logits before its predecessor kernel completes
    (kernels/pdl.py: they were written before that predecessor)."""
    comb = sinkhorn(comb_logits, iters, hc_eps)
    mixed = torch.einsum("sjk,sjd->skd", comb, streams.float())
    # bf16 `out` widens exactly inside the product
    new = torch.empty(mixed.shape, dtype=streams.dtype, device=streams.device)
    return torch.add(post.unsqueeze(-1) * out.unsqueeze(1), mixed, out=new)


def hc_post_pre(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb_logits: torch.Tensor, iters: int,
                hc_eps: float, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
                early: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_post` of one sub-block, then `hc_pre` of the next (its fn, scale, base; n and hc_eps
    shared) on the new streams -> (new streams [S, n, D], x [S, D], post [S, n], comb_logits
    [S, n, n]): what the decode step does between a sub-block's last kernel and the next one's
    first, as one op (`early` as in `hc_post`)."""
    new = hc_post(out, streams, post, comb_logits, iters, hc_eps, early)
    return (new, *hc_pre(new, fn, scale, base, streams.shape[1], hc_eps, eps))


def moe_post_pre(routed: torch.Tensor, shared: torch.Tensor, rows: torch.Tensor | None, streams: torch.Tensor,
                 post: torch.Tensor, comb_logits: torch.Tensor, iters: int, hc_eps: float, fn: torch.Tensor,
                 scale: torch.Tensor, base: torch.Tensor, eps: float,
                 early: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's output from its parts (`moe_combine` of routed and shared, with `rows` as
    there, rounded once into the streams' dtype), then `hc_post_pre` of it: what the decode
    step does between a MoE layer's expert kernels and the next block's attention, as one op."""
    out = moe_combine(routed, shared, streams.dtype, rows)
    return hc_post_pre(out, streams, post, comb_logits, iters, hc_eps, fn, scale, base, eps, early)


# -------------------------------------------------------------------------- top-k, attention
def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Lightning-indexer scores (§C.6): q [S, H, D], keys [T, D], per-head weights [S, H] fp32,
    visible [S] (entries complete at each query) -> [S, T] fp32: Σ_h weights · relu(q · k) ·
    scale, -inf for entries at or after visible."""
    dots = torch.relu(torch.einsum("shd,td->sht", q.float(), keys.float())) * scale
    scores = (dots * weights.unsqueeze(-1)).sum(dim=1)  # [S, T]
    invisible = torch.arange(keys.shape[0], device=q.device).unsqueeze(0) >= visible.unsqueeze(1)
    return scores.masked_fill(invisible, float("-inf"))


def topk_desc(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Deterministic top-k indices along the last dim: highest score first, ties -> lowest index.

    torch.topk leaves tie order unspecified; a stable descending sort does not. Use this for
    every discrete selection (experts, indexer) so prefill, chunked prefill and decode agree.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def indexer_weights(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """The lightning indexer's per-head weights in native numerics (§C.6): x [S, D] times the bf16
    weights_proj w [IH, D] in fp32, rounded to bf16 (the official bf16 matmul), widened and
    times `scale` (n_heads^-1/2) -> fp32 [S, IH]."""
    return bf16_gemm(x, w).to(torch.bfloat16).float() * scale


def sparse_index(window_rows: torch.Tensor, order: torch.Tensor, visible: torch.Tensor, k: int, offset: int,
                 width: int) -> torch.Tensor:
    """A decode query's key rows for sparse attention, int64 [S, W + width]: the window's rows
    window_rows [S, W], then the first k (<= width) entry slots of `order` [S, N] (best first)
    moved by `offset` (entry rows follow the window's in the key buffer) where below `visible`
    [S] (the entries complete at the query) and -1 elsewhere, then -1 up to `width`."""
    picks = order[:, :k]
    chosen = torch.where(picks < visible.unsqueeze(1), picks + offset, -1)
    pad = picks.new_full((picks.shape[0], width - k), -1)
    return torch.cat((window_rows, chosen, pad), dim=1)


def index_picks(scores: torch.Tensor, window_rows: torch.Tensor, visible: torch.Tensor, k: int, offset: int,
                width: int) -> torch.Tensor:
    """A CSA query's key rows from its index scores [S, N] fp32 (best first, ties -> the lower
    slot: `topk_desc`), int64 [S, W + width]: `sparse_index` of the first k (<= min(N, width))
    slots in that order, with the window's rows window_rows [S, W] and `visible` [S]."""
    return sparse_index(window_rows, topk_desc(scores, k), visible, k, offset, width)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                     scale: float, inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention with a learned sink over a per-query set of shared K=V rows (§C.4 steps 10–12).

    q [S, H, D], kv [T, D] (key and value are the same row), idx [S, K] int64 rows of kv, -1 =
    absent, sink [H] fp32 -> out [S, H, D] in q's dtype (computed in fp32, rounded once). One
    softmax over the selected rows whose denominator also holds exp(sink_h); the sink carries
    no value. `inverse_rope` = (positions [S], inv_freq): the rounded output is then rotated back
    by the queries' RoPE angles (§C.4's inverse rotation before wo_a), one backend op.
    """
    valid = idx >= 0
    rows = kv[idx.clamp_min(0)].float()  # [S, K, D]
    logits = torch.einsum("shd,skd->shk", q.float(), rows) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_col = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    full = torch.cat((logits, sink_col), dim=-1)  # [S, H, K+1]
    full = full - full.amax(-1, keepdim=True)
    p = torch.softmax(full, dim=-1)[..., :-1]
    out = torch.einsum("shk,skd->shd", p, rows).to(q.dtype)
    return out if inverse_rope is None else rope(out, *inverse_rope, inverse=True)
