"""Offline weight quantisation in the official DeepSeek-V4 on-disk formats (§B.2, §B.4).

* FP8: e4m3 values with one e8m0 scale per 128x128 block; weight [N, K] -> values
  float8_e4m3fn [N, K], scales float8_e8m0fnu [ceil(N/128), ceil(K/128)];
  W[n, k] = q[n, k] * s[n // 128, k // 128], s = 2^ceil(log2(amax_block / 448)).
* FP4: e2m1 codes with one e8m0 scale per 1x32 block of a row; weight [N, K] (K % 32 == 0)
  -> packed int8 [N, K/2] (element 2j in the LOW nibble of byte j, 2j+1 in the high nibble;
  code bit 3 = sign) and scales float8_e8m0fnu [N, K/32]; s = 2^ceil(log2(amax_block / 6)),
  value = nearest e2m1 code of W/s, ties to the even code.

Block amax is floored at AMAX_FLOOR so all-zero blocks get a finite scale. Scales are exact
powers of two, so W/s is exact and only the e4m3 / e2m1 rounding loses precision.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
AMAX_FLOOR = 1e-12

# e2m1 magnitudes by code 0..7; codes 8..15 are the negatives (bit 3 = sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _nearest_e2m1(v: float) -> int:
    """Nearest e2m1 code of v (|v| <= 6), ties to the even code; negative v sets the sign bit."""
    dist = [abs(abs(v) - m) for m in E2M1_VALUES]
    best = [c for c in range(8) if dist[c] == min(dist)]
    code = best[0] if len(best) == 1 else next(c for c in best if c % 2 == 0)
    return code | (8 if v < 0 else 0)


# Every midpoint between e2m1 magnitudes is a multiple of 0.25, so with y = 4x the code is
# constant on each integer y and on each open interval (j, j+1). floor(y) + ceil(y) + 48
# numbers these 97 cases over y in [-24, 24]; the table holds their codes (odd index =
# interval, represented by its centre).
_E2M1_LUT = tuple(_nearest_e2m1(i / 8) for i in range(-48, 49))


class QuantError(ValueError):
    """A weight cannot be quantised in the requested format (bad shape or values)."""


def _pow2_exponent_ceil(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive finite float32 x, as int32."""
    mantissa, exponent = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def _e8m0_from_exponent(e: torch.Tensor) -> torch.Tensor:
    """Scale 2^e (int exponent) as float8_e8m0fnu (stored byte = e + 127)."""
    if e.numel() and (int(e.min()) < -127 or int(e.max()) > 127):
        raise QuantError("scale exponent outside the e8m0 range [-127, 127]")
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _block_exponent(blocks: torch.Tensor, dims: tuple[int, ...], vmax: float, what: str):
    """Scale exponent per block: ceil(log2(max(amax, AMAX_FLOOR) / vmax)); amax over dims."""
    amax = torch.maximum(blocks.amax(dim=dims), blocks.amin(dim=dims).neg())  # no |w| copy
    if not torch.isfinite(amax).all():  # NaN/Inf propagate into the block amax
        raise QuantError(f"{what}: weight contains NaN or Inf")
    return _pow2_exponent_ceil(amax.clamp_min(AMAX_FLOOR) / vmax)


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], e8m0 scales [ceil(N/128), ceil(K/128)])."""
    if w.dim() != 2:
        raise QuantError(f"FP8 block quantisation needs a 2-D weight, got shape {tuple(w.shape)}")
    w = w.float()
    n, k = w.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    if (n, k) != (nb * FP8_BLOCK, kb * FP8_BLOCK):
        w = torch.nn.functional.pad(w, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    blocks = w.view(nb, FP8_BLOCK, kb, FP8_BLOCK)  # [N/128, 128, K/128, 128]
    exp = _block_exponent(blocks, (1, 3), FP8_MAX, "FP8 quantisation")  # [nb, kb]
    inv = torch.ldexp(torch.ones(nb, kb, device=w.device), -exp)[:, None, :, None]  # exact 1/s
    q = (blocks * inv).clamp_(-FP8_MAX, FP8_MAX).view(nb * FP8_BLOCK, kb * FP8_BLOCK)
    q = q[:n, :k].to(torch.float8_e4m3fn)
    return q, _e8m0_from_exponent(exp)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (uint8 0..15, ties to even) of x; |x| > 6 saturates to +-6."""
    return _e2m1_codes_of_4x((x * 4.0).clamp_(-24.0, 24.0))


def _e2m1_codes_of_4x(y: torch.Tensor) -> torch.Tensor:
    """Codes of y / 4 for y in [-24, 24] (not checked)."""
    idx = (torch.floor(y) + torch.ceil(y)).add_(48).to(torch.int64)
    return torch.tensor(_E2M1_LUT, dtype=torch.uint8, device=y.device)[idx]


def quantize_fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float (K % 32 == 0) -> (packed int8 [N, K/2], e8m0 scales [N, K/32])."""
    if w.dim() != 2 or w.shape[1] % FP4_BLOCK:
        raise QuantError(
            f"FP4 quantisation needs a 2-D weight with K % {FP4_BLOCK} == 0, got {tuple(w.shape)}"
        )
    w = w.float()
    n, k = w.shape
    blocks = w.view(n, k // FP4_BLOCK, FP4_BLOCK)  # [N, K/32, 32]
    exp = _block_exponent(blocks, (2,), FP4_MAX, "FP4 quantisation")  # [N, K/32]
    inv4 = torch.ldexp(torch.full_like(blocks[:, :, 0], 4.0), -exp)  # exact 4 / s
    codes = _e2m1_codes_of_4x((blocks * inv4.unsqueeze(2)).view(n, k))  # [N, K]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [N, K/2], low nibble = even element
    return packed.view(torch.int8), _e8m0_from_exponent(exp)
