"""The expert-provider interfaces: what the model and the decode runner ask of expert sources."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import fields
from typing import Callable, Iterator, Protocol, runtime_checkable

import torch

from engine.experts.weights import ExpertWeights


class ExpertProvider(Protocol):
    """Supplies routed experts to the MoE (resident dict, or the streaming cache)."""

    def experts(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        """Yield (expert id, weights) once for every id in `ids`, in any order."""
        ...

    def prefetch(self, layer: int, ids: list[int]) -> None:
        """Hint: `layer` will need these experts soon (hash layers know them from token ids)."""
        ...


@runtime_checkable
class ArenaProvider(Protocol):
    """The expert provider side the runner needs (engine.experts.streaming.StreamingExperts)."""

    arena: object  # engine.experts.arena.ExpertArena

    def load_all(self, on_unit: Callable[[int, int], None] | None = None) -> bool: ...

    def all_resident(self) -> bool: ...

    def acquire(self, layer: int, ids: list[int]) -> None: ...

    def release(self, layer: int) -> None: ...

    def prefetch(self, layer: int, ids: list[int]) -> None: ...

    def record(self, layer: int, ids: list[int]) -> None: ...


class InstrumentedProvider:
    """An ExpertProvider wrapper counting uses per (layer, expert) and timing waits and compute."""

    def __init__(self, inner: ExpertProvider, n_layers: int) -> None:
        self.inner = inner
        self.uses: Counter[tuple[int, int]] = Counter()  # all-time uses per (layer, expert)
        self.layer_uses = [0] * n_layers
        self.wait_s = 0.0  # cumulative seconds inside the provider producing experts

    @property
    def cache(self):
        """The provider's ExpertCache, or None when every expert is resident."""
        return getattr(self.inner, "cache", None)

    def experts(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        it = iter(self.inner.experts(layer, ids))
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self.wait_s += time.perf_counter() - t0
                return
            self.wait_s += time.perf_counter() - t0
            self._count(layer, int(item[0]))
            yield item

    def prefetch(self, layer: int, ids: list[int]) -> None:
        self.inner.prefetch(layer, ids)

    def note_uses(self, layer: int, ids: list[int]) -> None:
        """Count uses made without `experts` (the CUDA-graph decode reads the arena directly)."""
        for e in dict.fromkeys(ids):
            self._count(layer, int(e))

    def _count(self, layer: int, expert: int) -> None:
        self.uses[(layer, expert)] += 1
        if 0 <= layer < len(self.layer_uses):
            self.layer_uses[layer] += 1


class DeviceExperts:
    """An ExpertProvider wrapper that copies each expert's tensors to `device` (for providers that
    hand out host tensors, e.g. the official layout's mmapped experts, on a GPU run)."""

    def __init__(self, inner: ExpertProvider, device: torch.device) -> None:
        self.inner, self.device = inner, device

    def experts(self, layer: int, ids: list[int]) -> Iterator[tuple[int, ExpertWeights]]:
        for e, w in self.inner.experts(layer, ids):
            yield e, ExpertWeights(**{f.name: getattr(w, f.name).to(self.device) for f in fields(w)})

    def prefetch(self, layer: int, ids: list[int]) -> None:
        self.inner.prefetch(layer, ids)
