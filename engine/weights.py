"""Opening a model directory: configuration, resident weights and the routed-expert source.

Two layouts are understood:
* an official HF checkpoint (config.json + model.safetensors.index.json + shards): every
  tensor is read zero-copy from the shards' mmaps, except that a routed expert's FP4 weights are
  copied into record order each time the expert is used (engine.experts.resident.ResidentExperts);
* a converted "expert pack" directory (manifest.json; see engine/pack.py): resident
  tensors keep their official names; routed experts are streamed (engine/experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.checkpoint import INDEX_NAME, CheckpointError, TensorIndex
from engine.config import ModelArgs
from engine.experts.hint_gate import HintGate
from engine.experts.provider import ExpertProvider
from engine.experts.resident import ResidentExperts


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
    host_cache: int = 0  # bytes of the pinned host-RAM tier actually allocated (engine/experts/host_tier.py)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()
        self.index.close()


class CountedWeights:
    """The getter a model is built from, counting what it hands out: `get(name)` returns the
    tensor (as placed by the wrapped getter) and `nbytes` is the bytes of the distinct names
    read so far — after building a model, its resident weights as stored (the memory plan's
    `weights` figure, and the memory pane's), counted once at load instead of by walking objects."""

    def __init__(self, get: Callable[[str], torch.Tensor]):
        self._get = get
        self._bytes: dict[str, int] = {}

    def __call__(self, name: str) -> torch.Tensor:
        t = self._get(name)
        self._bytes.setdefault(name, t.nbytes)
        return t

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())


def expert_prefix(args: ModelArgs, layer: int) -> tuple[str, int]:
    """Official name prefix of a logical layer's experts: the MTP block is layer n_layers."""
    return ("mtp", 0) if layer == args.n_layers else ("layers", layer)


def open_official(path: str | Path, device: str | torch.device = "cpu") -> ModelFiles:
    """Open an official-format checkpoint with every expert resident (read from the mmaps,
    copied to `device` per use when it is not the CPU)."""
    path = Path(path)
    args = ModelArgs.from_dir(path)
    index = TensorIndex.open(path)

    def fetch(layer: int, e: int) -> dict[str, torch.Tensor]:
        prefix, idx = expert_prefix(args, layer)
        return index.get_expert(idx, e, prefix)

    experts = ResidentExperts(fetch, args.n_layers, args.n_routed_experts, args.n_activated_experts, device)
    return ModelFiles(path=path, args=args, index=index, get=index.get, experts=experts)


def open_converted(path: str | Path, cache_bytes: int | None = None, policy: str = "lfu",
                   io_threads: int = 2, o_direct: bool = False, device: str = "cpu",
                   host_cache_bytes: int | None = None, fill_tier: bool = False,
                   hint_gate: HintGate | None = None) -> ModelFiles:
    """Open a converted (expert-pack) directory: routed experts streamed through a cache of
    `cache_bytes` (None = room for the whole pool: every expert of the main layers, the MTP
    block's packed experts excluded, since the engine does not run the block) by positional reads
    (engine/experts/store.py).
    Resident tensors come from the mmaps; on the CPU `get` returns copies, so that a model built
    from them never reads a mapping that a truncated file would turn into SIGBUS.

    With a device arena smaller than the pool, `host_cache_bytes` (capped to the pool) of host
    RAM become a HostTier behind it (engine/experts/host_tier.py; halved until it can be pinned,
    `ModelFiles.host_cache` says what was); on the CPU the arena is the only tier and the
    setting is unused. Reads use O_DIRECT when `o_direct` asks for it, and when the tier that
    could be pinned holds every record: the tier then reads each record once, and the page cache
    would only hold a second copy (a smaller tier keeps buffered reads, so that the misses
    falling past it find the page cache). `fill_tier`: fill the tier's free slots from the disk
    in the background (engine/experts/tier_fill.py).

    Starts `io_threads` named I/O threads; `ModelFiles.close()` stops them.
    """
    from engine.experts.arena import ExpertArena
    from engine.experts.cache import ExpertCache
    from engine.experts.host_tier import pinned_tier
    from engine.experts.io_pool import IOPool
    from engine.experts.streaming import StreamingExperts
    from engine.experts.store import ExpertStore
    from engine.pack import LayoutError, read_manifest

    path = Path(path)
    try:
        manifest = read_manifest(path)
    except LayoutError as e:
        raise CheckpointError(str(e)) from None
    args = ModelArgs.from_dict(manifest.config, str(path / "manifest.json"))
    pool_bytes = manifest.pool_bytes(args.n_layers)
    budget = pool_bytes if cache_bytes is None else cache_bytes
    cache = ExpertCache(budget, manifest.record.record_bytes,
                        num_layers=max(u.layer for u in manifest.units) + 1,
                        num_experts=manifest.count, policy=policy, pool_layers=args.n_layers)
    arena = ExpertArena(cache.capacity_slots, manifest.record, cache.num_layers, manifest.count,
                        device)
    index = TensorIndex.open(path)
    store = ExpertStore(path, manifest, o_direct=o_direct)
    pool = IOPool(io_threads).start()
    tier = None
    if host_cache_bytes and not arena.on_host and cache.capacity_slots < cache.pool:
        tier = pinned_tier(store, min(host_cache_bytes, pool_bytes), num_layers=cache.num_layers,
                           policy=policy)
        if tier is not None and tier.slots >= cache.pool:
            store.use_direct_reads()
    provider = StreamingExperts(store, arena, cache, pool, n_layers=args.n_layers, top_k=args.n_activated_experts,
                                tier=tier, hint_gate=hint_gate)
    if fill_tier:
        provider.fill_tier()
    get = index.get if torch.device(device).type != "cpu" else (lambda name: index.get(name).clone())
    return ModelFiles(path=path, args=args, index=index, get=get, experts=provider,
                      converted=True, closers=[provider.close], host_cache=0 if tier is None else tier.nbytes)


def open_model(path: str | Path, cache_bytes: int | None = None, policy: str = "lfu",
               io_threads: int = 2, o_direct: bool = False, device: str = "cpu",
               host_cache_bytes: int | None = None, fill_tier: bool = False,
               hint_gate: HintGate | None = None) -> ModelFiles:
    """Open either layout: a converted directory (manifest.json) streams its experts with the
    given cache settings; an official checkpoint keeps every expert resident (settings unused)."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return open_converted(path, cache_bytes, policy, io_threads, o_direct, device, host_cache_bytes,
                              fill_tier, hint_gate)
    if (path / INDEX_NAME).is_file():
        return open_official(path, device)
    raise _not_a_model(path)


def _not_a_model(path: Path) -> CheckpointError:
    if path.is_dir() and any(path.glob("layer_*.safetensors*")):
        return CheckpointError(f"{path}: a conversion that did not finish (no manifest.json); rerun "
                               "dsv4-convert with the same arguments to complete it")
    return CheckpointError(f"{path}: neither a converted model (manifest.json) nor an official "
                           f"checkpoint ({INDEX_NAME}); point at one of them")


def model_footprint(path: str | Path):
    """engine.memory_plan.ModelFootprint of the model at `path`, read from headers only (no tensor
    is loaded, no arena allocated): the memory plan is made from it before `open_model`."""
    from engine.pack import LayoutError, read_manifest
    from engine.memory_plan import footprint_of

    path = Path(path)
    manifest = None
    if (path / "manifest.json").is_file():
        try:
            manifest = read_manifest(path)
        except LayoutError as e:
            raise CheckpointError(str(e)) from None
        args = ModelArgs.from_dict(manifest.config, str(path / "manifest.json"))
    elif (path / INDEX_NAME).is_file():
        args = ModelArgs.from_dir(path)
    else:
        raise _not_a_model(path)
    with TensorIndex.open(path) as index:
        return footprint_of(args, index, manifest)
