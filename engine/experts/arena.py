"""ExpertArena: the device memory that holds resident routed experts, in fixed-size slots.

Allocated once: `data` is uint8 [slots, record_bytes] on the target device (on the CPU, 4 KiB
aligned so O_DIRECT reads can land in a slot directly). The slot table `table` int32
[units, experts] maps (layer, expert) -> slot or -1, for kernels that look experts up on the
device. `assign`/`clear` only note the change on the host; `sync_table` applies every noted
change in one host->device copy and one scatter on the current stream (a streamed decode step
admits ~60 experts: two kernel launches each cost more host time than the step's copies), and
reading `table` syncs first. The ExpertWeights of every slot are built once as zero-copy views
into the slot bytes at the record layout's field offsets, so nothing is allocated on the decode
path.
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
        self._table = torch.full((units, experts), -1, dtype=torch.int32, device=self.device)
        self._writes: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot or -1, not yet in _table
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

    @property
    def table(self) -> torch.Tensor:
        """The slot table int32 [units, experts] (slot or -1), every `assign`/`clear` applied."""
        if self._writes:
            self.sync_table()
        return self._table

    def assign(self, layer: int, expert: int, slot: int) -> None:
        """(layer, expert) lives in `slot` (applied to `table` by the next `sync_table`)."""
        self._writes[layer, expert] = slot

    def clear(self, layer: int, expert: int) -> None:
        """(layer, expert) is not resident (applied to `table` by the next `sync_table`)."""
        self._writes[layer, expert] = -1

    def sync_table(self) -> None:
        """Apply the noted writes to the table: one copy of [positions, slots] int32 to the
        device and one scatter, on the current stream (work enqueued after it sees them)."""
        if not self._writes:
            return
        experts = self._table.shape[1]
        n = len(self._writes)
        flat = torch.tensor([layer * experts + expert for layer, expert in self._writes]
                            + list(self._writes.values()), dtype=torch.int32)
        self._writes = {}
        if self.device.type != "cpu":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        self._table.view(-1).index_put_((flat[:n],), flat[n:])
