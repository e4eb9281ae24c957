"""Linear layers over checkpoint weights, in both numerics modes (spec §B.4 "which tensors are
used how").

Weights arrive in their on-disk formats and are dequantised once at construction (the CPU
reference path); `native` then quantises activations exactly as the official FP8 GEMM does.
"""

from __future__ import annotations

import torch

from engine.numerics import Numerics, Quantized
from kernels import reference as ref


class FP8Linear:
    """y = x · Wᵀ for an FP8 e4m3 weight with 128×128 e8m0 block scales.

    exact: fp32 on the dequantised weight. native: FP8-quantised activations (pow2 scales per
    128 channels), fp32 accumulation, bf16 output — the official FP8 GEMM.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, numerics: Numerics):
        self.numerics = numerics
        self.out_features, self.in_features = weight.shape
        if numerics.native:  # kept in the on-disk format for the backend's FP8 GEMM
            self.weight, self.scale = weight, scale
        else:
            self.w = ref.dequant_fp8_block(weight, scale)  # fp32 [N, K]

    def __call__(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        """x [..., K], or a `Numerics.quantize`d [M, K] (its quantisation reused) -> [..., N]."""
        if isinstance(x, Quantized):
            return self.numerics.backend.fp8_gemm_quantized(x.q, x.s, self.weight, self.scale)
        if not self.numerics.native:
            return x.float() @ self.w.T
        return self.numerics.backend.fp8_gemm(x, self.weight, self.scale)


class FloatLinear:
    """y = x · Wᵀ in fp32 for a BF16 weight (§B.4), exact numerics: the compressor's projections
    and the indexer's weights_proj. Native runs them through backend ops on the bf16 weights
    (`compressor_project`, `indexer_weights`)."""

    def __init__(self, weight: torch.Tensor):
        self.w = weight.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.w.T


class GroupedOutProj:
    """The grouped output projection wo_a (§C.4 steps 14–15): group g of heads -> its own rows.

    exact: fp32 on the dequantised weight. native: bf16 activations, not quantised, times the
    weight as bf16 (the official convert.py dequantises it; exact), fp32 accumulation — the
    backend's `grouped_linear`, which keeps the FP8 bytes (half the bf16 copy's).
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, groups: int, numerics: Numerics):
        self.numerics = numerics
        self.groups = groups
        if numerics.native:  # kept in the on-disk format for the backend
            self.weight, self.scale = weight, scale
        else:
            w = ref.dequant_fp8_block(weight, scale)  # fp32 [G*R, H*D/G]
            self.w = w.view(groups, -1, w.shape[-1])  # [G, R, H*D/G]

    def __call__(self, o: torch.Tensor) -> torch.Tensor:
        """o [S, H*D] -> [S, G*R] (native: bf16 result)."""
        if self.numerics.native:
            return self.numerics.backend.grouped_linear(o.to(torch.bfloat16), self.weight, self.scale, self.groups)
        s = o.shape[0]
        u = o.to(self.w.dtype).view(s, self.groups, -1)  # [S, G, H*D/G]
        return torch.einsum("sgi,gri->sgr", u, self.w).reshape(s, -1)
