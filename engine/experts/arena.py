"""ExpertArena: the device memory that holds resident routed experts, in fixed-size slots.

Allocated once: `data` is uint8 [slots, record_bytes] on the target device (on the CPU, 4 KiB
aligned so O_DIRECT reads can land in a slot directly). The slot table `table` int32
[units, experts] maps (layer, expert) -> slot or -1, for kernels that look experts up on the
device. `assign`/`clear` write a host copy of the table (on the CPU, the table itself); on a
device, `sync_table` sends the host copy whole in one host->device copy on the current stream
(a streamed decode step syncs once per layer; a fresh pinned tensor and a scatter per sync took
~3 ms of host time a step at 43 layers on the H200, profiled), and reading `table` syncs first.
Each sync copies from its own pinned buffer of a small ring, reused only once its copy has run,
so a write made after a sync never reaches work enqueued before it. The ExpertWeights of every
slot are built once as zero-copy views into the slot bytes at the record layout's field
offsets, so nothing is allocated on the decode path.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.pack import RecordLayout
from engine.experts.store import aligned_empty
from engine.experts.weights import ExpertWeights


class ExpertArena:
    """Fixed slots of `record_bytes` each, plus the (layer, expert) -> slot table."""

    def __init__(self, slots: int, record: RecordLayout, units: int, experts: int,
                 device: str | torch.device = "cpu"):
        if slots < 1:
            raise ValueError(f"an expert arena needs at least one slot, got {slots}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.record = record
        nbytes = slots * record.record_bytes
        flat = (aligned_empty(nbytes) if self.device.type == "cpu"
                else torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        self.data = flat.view(slots, record.record_bytes)  # [slots, record_bytes]
        # the host copy every assign/clear writes (on the CPU it is the table itself)
        self._host_table = torch.full((units, experts), -1, dtype=torch.int32)
        self._host_view = self._host_table.numpy()
        self._table = self._host_table if self.device.type == "cpu" else self._host_table.to(self.device)
        self._dirty = False  # the host copy has writes the device table lacks
        self._ring: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # (pinned buffer, its last copy)
        self._next = 0
        self._weights = [ExpertWeights.from_fields(record.unpack(self.data[s])) for s in range(slots)]
        self._host = ([memoryview(self.data[s].numpy()) for s in range(slots)]
                      if self.device.type == "cpu" else None)

    def current_stream(self) -> torch.cuda.Stream:
        """The calling thread's current stream on the arena's CUDA device. By device index: a
        streamed decode step asks ~250 times, and a torch.device argument is resolved to its
        index on every call (~10 us of host time each, profiled)."""
        return torch.cuda.current_stream(self.device.index)

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    @property
    def on_host(self) -> bool:
        """True when slots are CPU memory that reads can target directly."""
        return self._host is not None

    def host_buffer(self, slot: int) -> memoryview:
        """Writable bytes of a slot (CPU arenas only): the destination of a store read."""
        if self._host is None:
            raise ValueError(f"the arena is on {self.device}; read into a staging buffer instead")
        return self._host[slot]

    def weights(self, slot: int) -> ExpertWeights:
        """Zero-copy views of the six expert tensors held in `slot`."""
        return self._weights[slot]

    @property
    def table(self) -> torch.Tensor:
        """The slot table int32 [units, experts] (slot or -1), every `assign`/`clear` applied."""
        if self._dirty:
            self.sync_table()
        return self._table

    def slots_of(self, layer: int, experts: list[int]) -> list[int]:
        """The slots of `experts` of `layer` (-1: not resident), from the host copy: no device read."""
        row = self._host_view[layer]
        return [int(row[e]) for e in experts]

    def rows_resident(self, rows: np.ndarray) -> np.ndarray:
        """For rows [L, k] of expert ids, row i of layer i: bool [L], whether each row's experts
        all have a slot (the host copy: what the device table holds after the next sync)."""
        return (self._host_view[np.arange(rows.shape[0])[:, None], rows] >= 0).all(axis=1)

    def assign(self, layer: int, expert: int, slot: int) -> None:
        """(layer, expert) lives in `slot` (on a device: from the next `sync_table` on)."""
        self._host_view[layer, expert] = slot
        self._dirty = self._table is not self._host_table

    def clear(self, layer: int, expert: int) -> None:
        """(layer, expert) is not resident (on a device: from the next `sync_table` on)."""
        self._host_view[layer, expert] = -1
        self._dirty = self._table is not self._host_table

    def sync_table(self, stream: torch.cuda.Stream | None = None) -> None:
        """Send the host copy to the device table: one host->device copy on the current stream
        (`stream`, when the caller knows it already), from a pinned ring buffer (work enqueued
        after it sees every write made so far)."""
        if not self._dirty:
            return
        self._dirty = False
        if len(self._ring) < _RING:
            self._ring.append((torch.empty_like(self._host_table).pin_memory(), None))
        i = self._next
        self._next = (i + 1) % _RING
        buf, last = self._ring[i]
        if last is not None:  # a ring's worth of syncs ago: long done, unless the device is far behind
            last.synchronize()
        buf.copy_(self._host_table)
        self._table.copy_(buf, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream if stream is not None else self.current_stream())
        self._ring[i] = (buf, done)


_RING = 8  # pinned table buffers per arena: a decode step syncs once per layer, and waits for each layer
