"""ExpertArena: the device memory that holds resident routed experts, in fixed-size slots.

Allocated once: `data` is uint8 [slots, record_bytes] on the target device (on the CPU, 4 KiB
aligned so O_DIRECT reads can land in a slot directly). The slot table `table` int32
[units, experts] maps (layer, expert) -> slot or -1, for kernels that look experts up on the
device. The ExpertWeights of every slot are built once as zero-copy views into the slot bytes at
the record layout's field offsets, so nothing is allocated on the decode path.
"""

from __future__ import annotations

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
        self.record = record
        nbytes = slots * record.record_bytes
        flat = (aligned_empty(nbytes) if self.device.type == "cpu"
                else torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        self.data = flat.view(slots, record.record_bytes)  # [slots, record_bytes]
        self.table = torch.full((units, experts), -1, dtype=torch.int32, device=self.device)
        self._weights = [ExpertWeights.from_fields(record.unpack(self.data[s])) for s in range(slots)]
        self._host = ([memoryview(self.data[s].numpy()) for s in range(slots)]
                      if self.device.type == "cpu" else None)

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

    def assign(self, layer: int, expert: int, slot: int) -> None:
        self.table[layer, expert] = slot

    def clear(self, layer: int, expert: int) -> None:
        self.table[layer, expert] = -1
