"""Memory budget accounting: where the bytes of the machine's memory pool go.

Two kinds of machine are told apart:

* unified memory (a CPU-only run, or a GPU sharing the system RAM such as GB10): the pool is
  the system RAM (`/proc/meminfo` MemTotal); `MemAvailable` is what can still be had (page
  cache is reclaimable and counted in it) and `Cached` is reported as `page_cache`;
* a discrete CUDA GPU: the pool is the device memory (`torch.cuda.mem_get_info`), split with
  the caching allocator's counters.

The parts always add up to the total (see `memory_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.stats import MemoryBudget

PART_NAMES = ("resident weights", "expert cache", "session state", "workspace", "framework", "other", "free")


@dataclass(frozen=True)
class MemInfo:
    """The three /proc/meminfo numbers the budget needs, in bytes."""

    total: int
    available: int
    cached: int


def read_meminfo(path: str | Path = "/proc/meminfo") -> MemInfo:
    """MemTotal, MemAvailable and Cached from /proc/meminfo (kB values) in bytes."""
    values: dict[str, int] = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                values[key] = int(fields[0]) * 1024
    except OSError as exc:
        raise RuntimeError(f"cannot read {path} ({exc}); memory accounting needs Linux /proc") from None
    if "MemTotal" not in values:
        raise RuntimeError(f"{path} has no MemTotal line")
    total = values["MemTotal"]
    return MemInfo(total=total, available=values.get("MemAvailable", values.get("MemFree", 0)),
                   cached=values.get("Cached", 0))


def process_rss(path: str | Path = "/proc/self/status") -> int:
    """Resident set size of this process in bytes (0 if unknown)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def is_unified(device: str | torch.device) -> bool:
    """True for CPU runs and for CUDA devices that share system memory (integrated, e.g. GB10)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))


def memory_budget(device: str | torch.device, *, weights: int, expert_cache: int, state: int,
                  workspace: int, meminfo: MemInfo | None = None, rss: int | None = None) -> MemoryBudget:
    """The budget of `device`'s memory pool; the parts add up to `total` exactly.

    Unified: free = min(MemAvailable, what is left after our parts); framework = this process's
    RSS beyond the parts we account for (torch, Python, the tokenizer); other = everything else
    in use (other processes, the kernel). Discrete CUDA: workspace = allocated tensors beyond
    weights, cache and state; framework = allocator slack (reserved - allocated) plus memory held
    outside the allocator (CUDA context, other processes).
    """
    weights, expert_cache, state, workspace = (max(0, int(v)) for v in (weights, expert_cache, state, workspace))
    if is_unified(device):
        info = meminfo or read_meminfo()
        ours = weights + expert_cache + state + workspace
        rss = process_rss() if rss is None else rss
        framework = max(0, min(rss - ours, info.total - ours))
        used = ours + framework
        free = max(0, min(info.available, info.total - used))
        other = info.total - used - free
        parts = (weights, expert_cache, state, workspace, framework, other, free)
        if other < 0:  # our parts alone exceed the pool (e.g. mmapped weights counted twice)
            parts = _scale_to(parts[:-2], info.total) + (0, 0)
        return MemoryBudget(unified=True, total=info.total, parts=tuple(zip(PART_NAMES, parts)),
                            page_cache=info.cached)
    device = torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    known = weights + expert_cache + state
    workspace = max(0, allocated - known)
    framework = max(0, total - free - known - workspace)
    parts = (weights, expert_cache, state, workspace, framework, 0, free)
    if sum(parts) != total:  # our estimate of `known` exceeds what the allocator holds
        parts = _scale_to(parts[:-1], total - free) + (free,)
    return MemoryBudget(unified=False, total=total, parts=tuple(zip(PART_NAMES, parts)))


def _scale_to(parts: tuple[int, ...], total: int) -> tuple[int, ...]:
    """Shrink `parts` proportionally so they sum to `total` exactly (largest part absorbs rounding)."""
    s = sum(parts)
    if s <= 0:
        return tuple(0 for _ in parts[:-1]) + (total,)
    scaled = [p * total // s for p in parts]
    scaled[scaled.index(max(scaled))] += total - sum(scaled)
    return tuple(scaled)
