"""ExpertStore: reads routed-expert records of a converted directory (engine/pack.py).

One record = one `os.preadv` of `record_bytes` at a 4 KiB-aligned file offset, straight into the
caller's buffer (an arena slot or a staging buffer); never through a mapping, so a file that
shrinks under a running engine gives an error, not SIGBUS. A short read is continued where it
stopped; end of file (a truncated file) and I/O errors (EIO, retried twice) raise
ExpertReadError naming the file, the layer, the expert and the fix.

Integrity: the first time each record is read it is checked against its sha256 in the manifest
(`files[<file>]["records"]`, written by the converter), in the calling thread (the I/O
threads); a mismatch raises ExpertChecksumError naming the layer and expert. A manifest without
per-record digests (hand-made or older) skips the check and says so in `checksum_note`. With `o_direct=True` the files are opened
with O_DIRECT (bypassing the page cache; buffers must be 4 KiB aligned, see `aligned_empty`);
when the filesystem refuses O_DIRECT (e.g. EINVAL at open or at the first read) the store falls
back to buffered reads and says why in `o_direct_note`. Safe to call from several I/O threads at
once (pread has no shared file position).
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from pathlib import Path

import torch

from engine.pack import ALIGNMENT, Manifest
from engine.checkpoint import read_header


class ExpertReadError(OSError):
    """An expert record could not be read (message names the layer, expert and file)."""


class ExpertChecksumError(ExpertReadError):
    """An expert record's bytes do not match the manifest's checksum (the file is corrupt)."""


EIO_RETRIES = 2  # further attempts after an EIO before giving up on a record


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
        self._digests: dict[int, list[str]] = {}  # layer -> sha256 hex per record
        self._verified: set[tuple[int, int]] = set()  # records whose checksum has passed
        for unit in manifest.units:
            path = self.root / unit.file
            info = {t.name: t for t in read_header(path).tensors}.get(unit.tensor)
            if info is None or info.shape != (self.count, self.record_bytes) or info.offset % ALIGNMENT:
                raise ExpertReadError(f"{path}: packed experts tensor {unit.tensor!r} is missing, "
                                      f"misshapen or unaligned; the conversion is corrupt: run "
                                      f"`dsv4-convert --verify {self.root}`")
            self._where[unit.layer] = (path, info.offset)
            records = manifest.files.get(unit.file, {}).get("records")
            if isinstance(records, list) and len(records) == self.count:
                self._digests[unit.layer] = [str(d) for d in records]
        self.checksums = len(self._digests) == len(self._where)
        self.checksum_note = ("sha256 of each record, checked on its first read" if self.checksums else
                              "the manifest has no per-record checksums: records are not checked; "
                              "convert the checkpoint again to add them")
        if not self.checksums:
            self._digests.clear()
        self._fds: dict[int, int] = {}
        self._retired: list[int] = []
        if o_direct:
            self.use_direct_reads()
        if not self._fds:
            self._open(0)

    def use_direct_reads(self) -> None:
        """Read with O_DIRECT from now on, or say in `o_direct_note` why not (the platform or the
        filesystem refuses it: buffered reads then). Call it before reads are in flight (at open,
        e.g. once the host tier's size is known)."""
        if self.o_direct:
            return
        if not hasattr(os, "O_DIRECT"):
            self.o_direct_note = "O_DIRECT is not available on this platform; using buffered reads"
            return
        buffered = self._fds  # open already when called after __init__; kept if O_DIRECT is refused
        try:
            self._open(os.O_DIRECT)
        except OSError as e:
            self.o_direct_note = f"the filesystem refused O_DIRECT at open ({e.strerror}); using buffered reads"
            return
        self._retired.extend(buffered.values())
        self.o_direct, self.o_direct_note = True, "active"

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

    def _pread(self, fd: int, out: memoryview, offset: int) -> int:
        """One positional read into `out` at `offset`; the byte count (0 at end of file)."""
        return os.preadv(fd, [out], offset)

    def read_into(self, layer: int, expert: int, out: memoryview) -> None:
        """Read record (layer, expert) into `out` (writable, `record_bytes` long), checking it
        against the manifest the first time (module docstring)."""
        if layer not in self._where or not 0 <= expert < self.count:
            raise ExpertReadError(f"no expert record ({layer}, {expert}) in {self.root}")
        if len(out) != self.record_bytes:
            raise ValueError(f"buffer is {len(out)} bytes, a record is {self.record_bytes}")
        path, base = self._where[layer]
        offset = base + expert * self.record_bytes
        done, eio = 0, 0
        while done < self.record_bytes:
            try:
                n = self._pread(self._fds[layer], out[done:], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and self.o_direct:
                    with self._lock:
                        if self.o_direct:
                            self._reopen_buffered(f"O_DIRECT read failed ({e.strerror}); "
                                                  "unaligned buffer or unsupported filesystem")
                    continue
                if e.errno == errno.EIO and eio < EIO_RETRIES:
                    eio += 1
                    continue
                raise ExpertReadError(f"reading expert {expert} of layer {layer} from {path} at byte "
                                      f"{offset + done} failed: {e.strerror or e}; the disk or the file is "
                                      f"failing: check it with `dsv4-convert --verify {self.root}`") from e
            if n == 0:
                raise ExpertReadError(f"{path} ends before expert {expert} of layer {layer} "
                                      f"(byte {offset + done}); the file is truncated: rerun "
                                      "dsv4-convert to repair it")
            done += n
        if self._digests and (layer, expert) not in self._verified:
            if hashlib.sha256(out).hexdigest() != self._digests[layer][expert]:
                raise ExpertChecksumError(f"expert {expert} of layer {layer} in {path} does not match its "
                                          f"checksum in the manifest: the file is corrupt; run `dsv4-convert "
                                          f"--verify {self.root}` and rerun dsv4-convert to repair it")
            with self._lock:
                self._verified.add((layer, expert))

    def close(self) -> None:
        for fd in list(self._fds.values()) + self._retired:
            os.close(fd)
        self._fds.clear()
        self._retired.clear()
