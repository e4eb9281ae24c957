"""Linear layers over checkpoint weights (spec §B.4 "which tensors are used how").

Weights arrive in their on-disk formats and are prepared for the numerics mode once, at
construction (engine/numerics.py: exact dequantises them, native keeps the FP8 bytes for the
backend); the layers hold the prepared weight and call the mode's op.
"""

from __future__ import annotations

import torch

from engine.numerics import Numerics, Quantized


class FP8Linear:
    """y = x · Wᵀ for an FP8 e4m3 weight with 128×128 e8m0 block scales.

    exact: fp32 on the dequantised weight. native: FP8-quantised activations (pow2 scales per
    128 channels), fp32 accumulation, bf16 output — the official FP8 GEMM.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, numerics: Numerics):
        self.numerics = numerics
        self.out_features, self.in_features = weight.shape
        self.w = numerics.fp8_weight(weight, scale)

    def __call__(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        """x [..., K], or a `Numerics.quantize`d [M, K] (its quantisation reused) -> [..., N]."""
        return self.numerics.fp8_linear(self.w, x)


class FP8Linears:
    """Several FP8 linears that read the same input, in order: the numerics may stack them into
    one GEMM (native, when the block scales stack), whose result is split back (contiguous)."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]], numerics: Numerics):
        self.numerics = numerics
        self.groups = numerics.fp8_groups(parts)  # [(prepared weight, rows of each part)]

    def __call__(self, x: torch.Tensor | Quantized) -> list[torch.Tensor]:
        """x as for `FP8Linear` -> each part's output [M, N_i]."""
        outs = []
        for w, rows in self.groups:
            y = self.numerics.fp8_linear(w, x)
            if len(rows) == 1:
                outs.append(y)
                continue
            start = 0
            for n in rows:
                outs.append(y[:, start:start + n].contiguous())
                start += n
        return outs


class GroupedOutProj:
    """The grouped output projection wo_a (§C.4 steps 14–15): group g of heads -> its own rows.

    exact: fp32 on the dequantised weight. native: bf16 activations, not quantised, times the
    weight as bf16 (the official convert.py dequantises it; exact), fp32 accumulation — the
    backend's `grouped_linear`, which keeps the FP8 bytes (half the bf16 copy's).
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, groups: int, numerics: Numerics):
        self.numerics, self.groups = numerics, groups
        self.w = numerics.grouped_weight(weight, scale, groups)

    def __call__(self, o: torch.Tensor) -> torch.Tensor:
        """o [S, H*D] -> [S, G*R] (native: bf16 result)."""
        return self.numerics.grouped_linear(self.w, o, self.groups)
