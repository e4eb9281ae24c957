"""Opening a model directory: configuration, resident weights and the routed-expert source.

Two layouts are understood:
* an official HF checkpoint (config.json + model.safetensors.index.json + shards): every
  tensor, experts included, is read zero-copy from the shards' mmaps;
* a converted "expert pack" directory (manifest.json; see converter/layout.py): resident
  tensors keep their official names; routed experts are streamed (engine/experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.checkpoint import TensorIndex
from engine.config import ModelArgs
from engine.moe import ExpertProvider, ResidentExperts


@dataclass
class ModelFiles:
    """An opened model directory. `close()` releases mmaps and any I/O threads."""

    path: Path
    args: ModelArgs
    index: TensorIndex
    get: Callable[[str], torch.Tensor]
    experts: ExpertProvider
    converted: bool = False
    closers: list = field(default_factory=list)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()
        self.index.close()


def expert_prefix(args: ModelArgs, layer: int) -> tuple[str, int]:
    """Official name prefix of a logical layer's experts: the MTP block is layer n_layers."""
    return ("mtp", 0) if layer == args.n_layers else ("layers", layer)


def open_official(path: str | Path) -> ModelFiles:
    """Open an official-format checkpoint with every expert resident (read from the mmaps)."""
    path = Path(path)
    args = ModelArgs.from_dir(path)
    index = TensorIndex.open(path)

    def fetch(layer: int, e: int) -> dict[str, torch.Tensor]:
        prefix, idx = expert_prefix(args, layer)
        return index.get_expert(idx, e, prefix)

    return ModelFiles(path=path, args=args, index=index, get=index.get, experts=ResidentExperts(fetch))
