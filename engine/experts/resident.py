"""ResidentExperts: the provider of an official checkpoint, every expert resident in its shards."""

from __future__ import annotations

from dataclasses import fields
from typing import Callable, Iterable, Iterator

import torch

from engine.experts.provider import ExpertProvider
from engine.experts.weights import ExpertWeights


class ResidentExperts(ExpertProvider):
    """Experts read directly from an official checkpoint (every expert resident, no arena, no
    cache); each expert's weights are put into record order as it is handed out, and copied to
    `device` when one is given (a GPU run over host-mapped shards)."""

    def __init__(self, fetch: Callable[[int, int], dict[str, torch.Tensor]], n_layers: int, n_experts: int,
                 top_k: int, device: torch.device | str | None = None):
        """`fetch(layer, e) -> dict` of the six official tensors (e.g. TensorIndex.get_expert)."""
        super().__init__(n_layers, n_experts, top_k)
        self.fetch = fetch
        self.device = None if device is None or torch.device(device).type == "cpu" else torch.device(device)

    def _experts(self, layer: int, ids: Iterable[int]) -> Iterator[tuple[int, ExpertWeights]]:
        for e in dict.fromkeys(int(i) for i in ids):
            with self.usage.waiting():  # the read: from the mapped shards (and to the device)
                w = ExpertWeights.from_official(self.fetch(layer, e))
                if self.device is not None:
                    w = ExpertWeights(**{f.name: getattr(w, f.name).to(self.device) for f in fields(w)})
            yield e, w

    def prefetch(self, layer: int, ids: Iterable[int], fence: object | None = None) -> None:
        """Nothing to do: every expert is already addressable."""

    def all_resident(self) -> bool:
        return True
