"""Where a decode token sits, as static device tensors: the position inputs of a decode step.

Every layer's one-token decode needs the same few index tensors derived from the position p:
the sliding window's ring rows in position order (p-W+1..p, -1 before position 0), the ring
row p mod W the token writes, and per compression ratio r the buffer row p mod r, the entry
p // r it completes, the count (p + 1) // r of entries visible to it and that entry's first
position (p // r) · r, where an emitted entry is rotated. Derived on the device
they cost several tiny launches per layer (hundreds per token on the real model); here the host
computes them once per step and uploads them in one copy. The tensors are views of one buffer
that never moves, so captured CUDA graphs read each step's values (engine.decode_graph).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FACTS = 4  # per compression ratio: row, entry, visible, first


class DecodePosition:
    """Static device views of a decode token's position facts; `set(p)` fills them.

    pos [1]; window_row [1]; window_rows [1, W]; row[r], entry[r], visible[r], first[r] [1] for
    every compression ratio r > 0 (all int64)."""

    def __init__(self, window: int, ratios: Iterable[int], device: torch.device | str):
        self.window = window
        self.ratios = tuple(sorted({r for r in ratios if r}))
        base = 2 + window
        self._buf = torch.full((base + FACTS * len(self.ratios),), -1, dtype=torch.long, device=device)
        self.pos, self.window_row = self._buf[0:1], self._buf[1:2]
        self.window_rows = self._buf[2:base].view(1, window)
        self.row, self.entry, self.visible, self.first = {}, {}, {}, {}
        for i, r in enumerate(self.ratios):
            o = base + FACTS * i
            self.row[r], self.entry[r], self.visible[r], self.first[r] = (self._buf[o + j:o + j + 1]
                                                                          for j in range(FACTS))
        self.host: int | None = None  # the position last set

    def values(self, p: int) -> list[int]:
        """The buffer's contents for position p, in layout order."""
        if p < 0:
            raise ValueError(f"a decode position is >= 0, got {p}")
        w = self.window
        out = [p, p % w] + [q % w if q >= 0 else -1 for q in range(p - w + 1, p + 1)]
        for r in self.ratios:
            out += [p % r, p // r, (p + 1) // r, p // r * r]
        return out

    def set(self, p: int) -> None:
        """Upload position p's facts (one host-to-device copy, ordered on the current stream)."""
        upload(self._buf, self.values(p))
        self.host = p


def upload(buf: torch.Tensor, values: list[int]) -> None:
    """Copy `values` into the int64 buffer `buf` without waiting for the device: one
    host-to-device copy, ordered on the current stream."""
    host = torch.tensor(values, dtype=torch.long)
    if buf.is_cuda:
        host = host.pin_memory()  # the caching host allocator keeps it until the copy is done
    buf.copy_(host, non_blocking=True)
