"""ResidentExperts: the provider of an official checkpoint, every expert resident in its shards."""

from __future__ import annotations

from typing import Iterable, Iterator

from engine.experts.weights import ExpertWeights


class ResidentExperts:
    """ExpertProvider over experts read directly from an official checkpoint (every expert
    resident); each expert's weights are put into record order as it is handed out."""

    def __init__(self, fetch):
        """`fetch(layer, e) -> dict` of the six official tensors (e.g. TensorIndex.get_expert)."""
        self._fetch = fetch

    def experts(self, layer: int, ids: Iterable[int]) -> Iterator[tuple[int, ExpertWeights]]:
        for e in ids:
            yield e, ExpertWeights.from_official(self._fetch(layer, e))

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """Nothing to do: every expert is already addressable."""
