"""The two numerics modes of one model (DESIGN §3).

* `exact`: fp32 everywhere on dequantised weights, no quantisation simulation. Matches
  transformers' DeepseekV4ForCausalLM loaded in fp32.
* `native`: the official serving numerics: bf16 residual streams and activations, FP8
  activation quantisation before every FP8/FP4 linear, QDQ8 of the KV "nope" dims, Hadamard +
  QDQ4 in the indexer, wo_a in bf16 without activation quantisation (the official convert.py
  dequantises its FP8 weight to bf16, which is exact; the backend reads the FP8 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import reference as ref
from kernels.backend import Backend, torch_backend


@dataclass(frozen=True)
class Quantized:
    """An activation x [M, K] with its FP8 quantisation (act_quant, blocks of 128: q e4m3, s fp32),
    computed once for the several FP8 linears that read it (native numerics)."""

    x: torch.Tensor
    q: torch.Tensor
    s: torch.Tensor


def unquantized(x: "torch.Tensor | Quantized") -> torch.Tensor:
    """The activation itself, whether or not it carries its quantisation."""
    return x.x if isinstance(x, Quantized) else x


@dataclass(frozen=True)
class Numerics:
    """`native` selects the mode; `backend` executes native's quantised ops (exact needs none)."""

    native: bool
    backend: Backend = field(default_factory=torch_backend)

    @classmethod
    def named(cls, name: str, backend: Backend | None = None) -> "Numerics":
        if name not in ("exact", "native"):
            raise ValueError(f"numerics must be 'exact' or 'native', got {name!r}")
        return cls(native=name == "native", backend=backend or torch_backend())

    @property
    def name(self) -> str:
        return "native" if self.native else "exact"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm (§C.0): native runs the backend's (one fused launch on CUDA), exact the reference."""
        return self.backend.rms_norm(x, weight, eps) if self.native else ref.rms_norm(x, weight, eps)

    def quantize(self, x: "torch.Tensor | Quantized") -> "Quantized | torch.Tensor":
        """x [M, K] for several FP8 linears: native quantises it once (the backend's act_quant;
        an already `Quantized` x passes), exact passes it on (no activation quantisation)."""
        if not self.native or isinstance(x, Quantized):
            return x
        return Quantized(x, *self.backend.act_quant(x, 128))

    def norm_quantized(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> "Quantized | torch.Tensor":
        """RMSNorm of x [M, K] for FP8 linears (and other readers of `.x`): native normalises and
        quantises in one backend op, exact normalises."""
        return Quantized(*self.backend.rms_norm_quant(x, weight, eps)) if self.native else ref.rms_norm(x, weight, eps)

    @property
    def dtype(self) -> torch.dtype:
        """Storage dtype of activations, residual streams and KV."""
        return torch.bfloat16 if self.native else torch.float32
