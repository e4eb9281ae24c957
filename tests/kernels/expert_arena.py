"""Test helper: an expert arena of random FP4 experts (engine/experts/arena.py's record layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Field:
    """One tensor of a record: byte offset and shape in bytes (as engine.pack.FieldLayout)."""

    offset: int
    shape: tuple[int, int]


def expert_arena(slots: int, inter: int, dim: int, gen: torch.Generator, device: str = "cpu"):
    """uint8 [slots, record] records holding w1, w1.scale, w3, w3.scale, w2, w2.scale back to back
    (records padded to 4 KiB, scale exponents 2^-9..2^0) -> (data, fields, expert(slot) -> the
    slot's tensors viewed as int8 codes and e8m0 scales)."""
    shapes = {"w1.weight": (inter, dim // 2), "w1.scale": (inter, dim // 32), "w3.weight": (inter, dim // 2),
              "w3.scale": (inter, dim // 32), "w2.weight": (dim, inter // 2), "w2.scale": (dim, inter // 32)}
    fields, off = {}, 0
    for name, shp in shapes.items():
        fields[name] = Field(off, shp)
        off += shp[0] * shp[1]
    record = -(-off // 4096) * 4096
    data = torch.randint(0, 256, (slots, record), generator=gen, device=device, dtype=torch.uint8)
    for name, f in fields.items():  # sane exponents for the scale fields
        if name.endswith("scale"):
            n = f.shape[0] * f.shape[1]
            data[:, f.offset:f.offset + n] = torch.randint(118, 128, (slots, n), generator=gen, device=device,
                                                           dtype=torch.uint8)

    def expert(slot):
        t = {name: data[slot, f.offset:f.offset + f.shape[0] * f.shape[1]].view(f.shape) for name, f in fields.items()}
        return {k: (v.view(torch.float8_e8m0fnu) if k.endswith("scale") else v.view(torch.int8)) for k, v in t.items()}
    return data, fields, expert
