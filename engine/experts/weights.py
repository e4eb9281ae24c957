"""ExpertWeights: one routed expert's six tensors in its record format."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference as ref
from kernels.reference import EXPERT_FIELDS


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert in its record format: FP4 packed weights in record order
    (kernels/reference.py) + e8m0 1×32 scales."""

    w1: torch.Tensor
    w1_scale: torch.Tensor
    w3: torch.Tensor
    w3_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    @classmethod
    def from_fields(cls, t: dict[str, torch.Tensor]) -> "ExpertWeights":
        """The six tensors of a converted record (views, no copy)."""
        return cls(*(t[name] for name in EXPERT_FIELDS))

    @classmethod
    def from_official(cls, t: dict[str, torch.Tensor]) -> "ExpertWeights":
        """The six tensors as an official checkpoint stores them: the weights are copied into
        record order, the scales kept as they are."""
        return cls(*(ref.fp4_record_order(t[name]).view(t[name].dtype) if name.endswith(".weight") else t[name]
                     for name in EXPERT_FIELDS))
