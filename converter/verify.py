"""Re-check a converted directory against its manifest: sizes, then checksums piece by piece.

`python -m converter.verify DIR` prints every file's first problem (the corrupt header, tensor or
expert record, named) or "OK", exit status 0 when clean, 1 otherwise. The checksum scheme is in
engine/pack.py ("File entries").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

from engine import pack as layout

CHUNK = 1 << 23


def _pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise EOFError(f"unexpected end of file at byte {offset + done}")
        done += n


def _hash_range(fd: int, offset: int, nbytes: int, buf: memoryview) -> bytes:
    h = hashlib.sha256()
    pos = 0
    while pos < nbytes:
        k = min(len(buf), nbytes - pos)
        _pread_exact(fd, buf[:k], offset + pos)
        h.update(buf[:k])
        pos += k
    return h.digest()


def _check_pieces(path: Path, fd: int, entry: dict, tick: Callable[[int], None]) -> str | None:
    name = path.name
    hbytes = int(entry["header"]["bytes"])
    header = bytearray(hbytes)
    _pread_exact(fd, memoryview(header), 0)
    tree = hashlib.sha256()
    digest = hashlib.sha256(header).digest()
    if digest.hex() != entry["header"]["sha256"]:
        return f"{name}: the safetensors header is corrupt (checksum mismatch)"
    tree.update(digest)
    n = int.from_bytes(header[:8], "little")
    meta = json.loads(header[8:8 + n])
    meta.pop("__metadata__", None)
    buf = memoryview(bytearray(CHUNK))
    records = entry.get("records", [])
    for tname, t in sorted(meta.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = t["data_offsets"]
        if tname.endswith(".ffn.experts") and t["dtype"] == "U8":
            count, rbytes = t["shape"]
            if count != len(records):
                return f"{name}: {count} expert records but the manifest lists {len(records)}"
            rec = memoryview(bytearray(rbytes)) if rbytes > len(buf) else buf[:rbytes]
            for e in range(count):
                at = hbytes + begin + e * rbytes
                d = _hash_range(fd, at, rbytes, rec)
                if d.hex() != records[e]:
                    return (f"{name}: routed expert {e} of {tname[:-len('.ffn.experts')]} (record "
                            f"bytes {at}..{at + rbytes}) does not match its checksum; the file is "
                            "corrupt: rerun dsv4-convert with the same arguments to rewrite it")
                tree.update(d)
                tick(rbytes)
        else:
            want = entry["tensors"].get(tname)
            d = _hash_range(fd, hbytes + begin, end - begin, buf)
            if d.hex() != want:
                return (f"{name}: tensor {tname} does not match its checksum; the file is corrupt: "
                        "rerun dsv4-convert with the same arguments to rewrite it")
            tree.update(d)
            tick(end - begin)
    if "sha256-pieces:" + tree.hexdigest() != entry["checksum"]:
        return f"{name}: file checksum does not match the manifest (manifest edited or stale?)"
    return None


def check_file(path: Path, entry: dict, tick: Callable[[int], None] | None = None) -> str | None:
    """First problem of one output file against its manifest entry, or None if it is intact."""
    tick = tick or (lambda n: None)
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != entry.get("size"):
        return f"{path.name} is {size:,} bytes, the manifest says {entry.get('size'):,}"
    checksum = str(entry.get("checksum", ""))
    try:
        if checksum.startswith("sha256:"):
            ok = layout.sha256_file(path) == checksum
            tick(size)
            return None if ok else f"{path.name} does not match its checksum; the file is corrupt"
        if checksum.startswith("sha256-pieces:"):
            fd = os.open(path, os.O_RDONLY)
            try:
                return _check_pieces(path, fd, entry, tick)
            finally:
                os.close(fd)
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        return f"{path.name}: cannot be checked ({e!r}); the file or the manifest is corrupt"
    return f"{path.name}: unknown checksum kind {checksum[:20]!r} in the manifest"


def verify(path: str | os.PathLike, tick: Callable[[int], None] | None = None) -> list[str]:
    """Every file's first problem in the converted directory `path` (empty list = intact)."""
    root = Path(path)
    where = root / layout.MANIFEST
    try:
        manifest = layout.parse_manifest(json.loads(where.read_text(encoding="utf-8")), str(where))
    except (OSError, ValueError) as e:
        return [f"{where}: unreadable ({e})"]
    except layout.LayoutError as e:
        return [str(e)]
    problems = []
    for name, entry in sorted(manifest.files.items()):
        problem = check_file(root / name, entry, tick)
        if problem:
            problems.append(problem)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converter.verify",
                                 description="Re-check a dsv4-convert output directory.")
    ap.add_argument("dir", help="converted directory (holds manifest.json)")
    args = ap.parse_args(argv)
    try:
        manifest = layout.read_manifest(args.dir) if Path(args.dir, layout.MANIFEST).is_file() else None
    except layout.LayoutError:
        manifest = None  # sizes are reported one by one below
    problems = verify(args.dir)
    for p in problems:
        print(f"CORRUPT: {p}")
    if problems:
        return 1
    total = sum(int(e["size"]) for e in manifest.files.values()) if manifest else 0
    print(f"OK: {args.dir}: {len(manifest.files) if manifest else 0} files, {total / 1e9:.3f} GB "
          "match the manifest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
