"""ExpertStore: reads routed-expert records of a converted directory (converter/layout.py).

One record = one `os.preadv` of `record_bytes` at a 4 KiB-aligned file offset, straight into the
caller's buffer (an arena slot or a staging buffer). With `o_direct=True` the files are opened
with O_DIRECT (bypassing the page cache; buffers must be 4 KiB aligned, see `aligned_empty`);
when the filesystem refuses O_DIRECT (e.g. EINVAL at open or at the first read) the store falls
back to buffered reads and says why in `o_direct_note`. Safe to call from several I/O threads at
once (pread has no shared file position).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import torch

from engine.pack import ALIGNMENT, Manifest
from engine.checkpoint import read_header


class ExpertReadError(OSError):
    """An expert record could not be read (message names the layer, expert and file)."""


def aligned_empty(nbytes: int, align: int = ALIGNMENT, pin_memory: bool = False) -> torch.Tensor:
    """A CPU uint8 tensor of `nbytes` whose first byte is `align`-aligned (for O_DIRECT)."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % align
    return raw[skip:skip + nbytes]


class ExpertStore:
    """Positional reads of expert records, one file descriptor per unit (layer or MTP)."""

    def __init__(self, root: str | os.PathLike, manifest: Manifest, o_direct: bool = False):
        self.root = Path(root)
        self.record_bytes = manifest.record.record_bytes
        self.count = manifest.count
        self.o_direct = False
        self.o_direct_note = "not requested" if not o_direct else ""
        self._lock = threading.Lock()  # guards the one-time O_DIRECT fallback
        self._where: dict[int, tuple[Path, int]] = {}  # layer -> (file, offset of record 0)
        for unit in manifest.units:
            path = self.root / unit.file
            info = {t.name: t for t in read_header(path).tensors}.get(unit.tensor)
            if info is None or info.shape != (self.count, self.record_bytes) or info.offset % ALIGNMENT:
                raise ExpertReadError(f"{path}: packed experts tensor {unit.tensor!r} is missing, "
                                      f"misshapen or unaligned; the conversion is corrupt: run "
                                      f"`python -m converter.verify {self.root}`")
            self._where[unit.layer] = (path, info.offset)
        self._fds: dict[int, int] = {}
        self._retired: list[int] = []
        if o_direct and not hasattr(os, "O_DIRECT"):
            self.o_direct_note = "O_DIRECT is not available on this platform; using buffered reads"
        elif o_direct:
            try:
                self._open(os.O_DIRECT)
                self.o_direct, self.o_direct_note = True, "active"
            except OSError as e:
                self._reopen_buffered(f"the filesystem refused O_DIRECT at open ({e.strerror})")
        if not self._fds:
            self._open(0)

    def _open(self, flags: int) -> None:
        fds = {}
        try:
            for layer, (path, _) in self._where.items():
                fds[layer] = os.open(path, os.O_RDONLY | flags)
        except OSError:
            for fd in fds.values():
                os.close(fd)
            raise
        self._fds = fds

    def _reopen_buffered(self, why: str) -> None:
        self._retired.extend(self._fds.values())  # closed in close(): other threads may hold them
        self._open(0)
        self.o_direct, self.o_direct_note = False, f"{why}; using buffered reads"

    def layers(self) -> list[int]:
        return sorted(self._where)

    def read_into(self, layer: int, expert: int, out: memoryview) -> None:
        """Read record (layer, expert) into `out` (writable, `record_bytes` long): one preadv."""
        if layer not in self._where or not 0 <= expert < self.count:
            raise ExpertReadError(f"no expert record ({layer}, {expert}) in {self.root}")
        if len(out) != self.record_bytes:
            raise ValueError(f"buffer is {len(out)} bytes, a record is {self.record_bytes}")
        path, base = self._where[layer]
        offset = base + expert * self.record_bytes
        done = 0
        while done < self.record_bytes:
            try:
                n = os.preadv(self._fds[layer], [out[done:]], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and self.o_direct:
                    with self._lock:
                        if self.o_direct:
                            self._reopen_buffered(f"O_DIRECT read failed ({e.strerror}); "
                                                  "unaligned buffer or unsupported filesystem")
                    continue
                raise ExpertReadError(f"reading expert {expert} of layer {layer} from {path} at "
                                      f"byte {offset}: {e.strerror or e}") from e
            if n == 0:
                raise ExpertReadError(f"{path} ends before expert {expert} of layer {layer} "
                                      f"(byte {offset + done}); the file is truncated: rerun "
                                      "dsv4-convert to repair it")
            done += n

    def close(self) -> None:
        for fd in list(self._fds.values()) + self._retired:
            os.close(fd)
        self._fds.clear()
        self._retired.clear()
