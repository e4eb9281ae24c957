"""Streaming safetensors writer: header planned up front, tensors written one at a time.

On-disk contract (the safetensors format):
    [8 bytes little-endian u64 N][N bytes JSON header][data section]
The JSON header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the start of the data section) plus an optional "__metadata__" of
str -> str. safetensors requires the tensors to tile the data section exactly: no gaps between
them and no trailing bytes. Therefore `alignment` can only align the *start of the data
section* (the JSON header is padded with spaces); a tensor's offset is a multiple of
`alignment` exactly when the sizes of all tensors before it are. Callers that want aligned
tensors order their specs so that tensors whose byte size is a multiple of `alignment` come
first (see `aligned_first`).

The file is written to `<name>.tmp` and renamed to `<name>` only when every declared tensor was
written and the writer is closed without an exception; otherwise the temp file is removed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Iterable, Mapping, Sequence

import torch

# torch dtype -> (safetensors dtype string, bytes per element)
ST_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.float8_e4m3fn: ("F8_E4M3", 1),
    torch.float8_e8m0fnu: ("F8_E8M0", 1),
    torch.int8: ("I8", 1),
    torch.uint8: ("U8", 1),
    torch.int64: ("I64", 8),
    torch.bfloat16: ("BF16", 2),
    torch.float32: ("F32", 4),
}


class SafetensorsWriteError(ValueError):
    """A tensor spec or a written tensor does not fit the planned safetensors file."""


@dataclass(frozen=True)
class TensorSpec:
    """One planned tensor: name, torch dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def st_dtype(self) -> str:
        """The safetensors dtype string (e.g. "F8_E4M3")."""
        return ST_DTYPES[self.dtype][0]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ST_DTYPES[self.dtype][1]


def aligned_first(specs: Iterable[TensorSpec], alignment: int) -> list[TensorSpec]:
    """Stable reorder: specs whose byte size is a multiple of `alignment` first.

    Written in this order, every one of those tensors starts at an aligned offset.
    """
    specs = list(specs)
    return [s for s in specs if s.nbytes % alignment == 0] + [
        s for s in specs if s.nbytes % alignment != 0
    ]


def build_header(
    specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None, alignment: int = 8
) -> bytes:
    """Return the 8-byte length prefix + padded JSON header for `specs` (data in spec order)."""
    if alignment < 8 or alignment & (alignment - 1):
        raise SafetensorsWriteError(f"alignment must be a power of two >= 8, got {alignment}")
    header: dict[str, object] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise SafetensorsWriteError(f"__metadata__ must map str to str; bad keys: {bad}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for spec in specs:
        if spec.dtype not in ST_DTYPES:
            raise SafetensorsWriteError(
                f"tensor {spec.name!r}: unsupported dtype {spec.dtype}; "
                f"supported: {', '.join(str(d) for d in ST_DTYPES)}"
            )
        if spec.name in header or spec.name == "__metadata__":
            raise SafetensorsWriteError(f"duplicate or reserved tensor name {spec.name!r}")
        if any((not isinstance(d, int)) or d < 0 for d in spec.shape):
            raise SafetensorsWriteError(f"tensor {spec.name!r}: bad shape {spec.shape}")
        header[spec.name] = {
            "dtype": spec.st_dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % alignment)  # data section starts at a multiple of alignment
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order of `specs`.

    Usage:
        with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as w:
            for spec in specs:
                w.write(spec.name, make(spec))
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: Sequence[TensorSpec],
        metadata: Mapping[str, str] | None = None,
        alignment: int = 8,
    ) -> None:
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self.specs = list(specs)
        self._header = build_header(self.specs, metadata, alignment)
        self.data_start = len(self._header)
        self.offsets: dict[str, int] = {}  # absolute file offset of each tensor's first byte
        pos = self.data_start
        for spec in self.specs:
            self.offsets[spec.name] = pos
            pos += spec.nbytes
        self.file_size = pos
        self._next = 0
        self._file = None

    def __enter__(self) -> "SafetensorsWriter":
        self._file = open(self.tmp_path, "wb")
        self._file.write(self._header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must match the next spec exactly (name, dtype, shape)."""
        if self._file is None:
            raise SafetensorsWriteError(f"{self.path.name}: write() outside the `with` block")
        if self._next >= len(self.specs):
            raise SafetensorsWriteError(
                f"{self.path.name}: tensor {name!r} written but all {len(self.specs)} "
                "declared tensors are already written"
            )
        spec = self.specs[self._next]
        if name != spec.name:
            raise SafetensorsWriteError(
                f"{self.path.name}: expected tensor #{self._next} {spec.name!r}, got {name!r} "
                "(tensors must be written in the declared order)"
            )
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise SafetensorsWriteError(
                f"{self.path.name}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                f"declared {spec.dtype} {spec.shape}"
            )
        # [*shape] -> flat bytes; view(uint8) reinterprets without copying
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(flat.numpy()))
        self._next += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        if exc_type is not None:
            self.tmp_path.unlink(missing_ok=True)
            return
        if self._next != len(self.specs):
            self.tmp_path.unlink(missing_ok=True)
            missing = [s.name for s in self.specs[self._next : self._next + 3]]
            raise SafetensorsWriteError(
                f"{self.path.name}: closed after {self._next} of {len(self.specs)} tensors; "
                f"next missing: {missing}; no file was written"
            )
        os.replace(self.tmp_path, self.path)
