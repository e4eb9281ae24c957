"""Disk read rate per queue depth: O_DIRECT into aligned buffers against buffered reads.

    python bench/disk_queue_depth.py                      # 4 GiB temp file in the temp dir
    python bench/disk_queue_depth.py --dir /nvme/scratch  # the temp file on the disk to measure
    python bench/disk_queue_depth.py --file PACK/layer_10.safetensors --read 2G
    python bench/disk_queue_depth.py --size 64M --block 1M --depths 1,2,4   # quick run

Reads blocks of `--block` bytes (default: one real DeepSeek-V4-Flash expert record,
RecordLayout.from_args(ModelArgs()), 13,369,344 bytes) at block-aligned offsets of the file, in
a seeded random order (expert misses are scattered records), once per queue depth and mode.
Depth N = N named threads ("dsv4-qd-0".., engine.experts.io_pool.IOPool), each doing
`os.preadv` into its own page-aligned buffer, as the expert store's readers do. Before every
run the file's pages are dropped from the page cache (posix_fadvise DONTNEED), so buffered reads
come from the disk too. A temp file (when no --file is given) is written once, fsynced, dropped
from the page cache, and deleted at the end.

The chosen depth is the smallest whose O_DIRECT rate is within `--knee` (5 %) of the best
O_DIRECT rate: more reads in flight than that only add threads and buffers.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import ModelArgs  # noqa: E402
from engine.experts.io_pool import IOPool  # noqa: E402
from engine.pack import ALIGNMENT, RecordLayout  # noqa: E402

DEPTHS = "1,2,4,8,16,32"
MODES = ("direct", "buffered")


class QueueDepthError(Exception):
    """Bad arguments or a file that cannot be measured (message names the fix)."""


@dataclass(frozen=True)
class Run:
    """One measured pass: `blocks` reads of `block` bytes at `depth` reads in flight."""

    mode: str  # "direct" (O_DIRECT) or "buffered"
    depth: int
    blocks: int
    bytes_asked: int
    bytes_read: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


def parse_size(text: str) -> int:
    """"4G", "64M", "512K", "4096" -> bytes (binary units)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, IndexError):
        raise QueueDepthError(f"size {text!r} is not a byte count like 4G, 64M or 1048576") from None
    if value <= 0:
        raise QueueDepthError(f"size {text!r} must be positive")
    return value


def parse_depths(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise QueueDepthError(f"--depths {text!r} must be a comma-separated list of integers") from None
    if not depths or min(depths) < 1:
        raise QueueDepthError(f"--depths {text!r} needs at least one depth, each >= 1")
    return depths


def drop_cache(path: str | os.PathLike) -> None:
    """Write back and drop `path`'s pages from the page cache (needs no privileges)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_file(path: str | os.PathLike, size: int, chunk: int = 64 * 2**20, seed: int = 0) -> None:
    """Write `size` bytes of incompressible data, fsync it, and drop it from the page cache."""
    pattern = random.Random(seed).randbytes(min(chunk, size))
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(pattern))
            f.write(pattern[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    drop_cache(path)


def _read_block(fd: int, buffers, offset: int, block: int) -> int:
    """Read one block at `offset` into a free buffer (short reads continued); bytes read."""
    buf = buffers.pop()
    try:
        view, done = memoryview(buf), 0
        while done < block:
            n = os.preadv(fd, [view[done:block]], offset + done)
            if n == 0:
                break  # end of file
            done += n
        return done
    finally:
        buffers.append(buf)


def measure(path: str | os.PathLike, block: int, depth: int, mode: str, blocks: int,
            seed: int = 0) -> Run:
    """Read `blocks` distinct blocks of `path` (seeded random order) with `depth` threads."""
    if mode not in MODES:
        raise QueueDepthError(f"mode must be one of {MODES}, got {mode!r}")
    size = os.path.getsize(path)
    if blocks < 1 or blocks * block > size:
        raise QueueDepthError(f"{path} holds {size // block} blocks of {block} bytes; asked for {blocks}")
    offsets = [i * block for i in range(size // block)]
    random.Random(seed).shuffle(offsets)
    offsets = offsets[:blocks]
    drop_cache(path)
    flags = os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise QueueDepthError(f"cannot open {path} ({mode}): {e.strerror}; put the file on a disk "
                              "filesystem that supports O_DIRECT (--dir or --file)") from None
    buffers = [mmap.mmap(-1, block) for _ in range(depth)]  # page-aligned, one per thread
    try:
        with IOPool(depth, name="dsv4-qd") as pool:
            start = time.perf_counter()
            futures = [pool.submit(_read_block, fd, buffers, off, block) for off in offsets]
            done = sum(f.result() for f in futures)
            seconds = time.perf_counter() - start
    except OSError as e:
        raise QueueDepthError(f"reading {path} ({mode}) failed: {e.strerror or e}; "
                              "for O_DIRECT the filesystem must support it") from None
    finally:
        os.close(fd)
        for b in buffers:
            b.close()
    return Run(mode, depth, blocks, blocks * block, done, seconds)


def choose_depth(runs: Sequence[Run], knee: float = 0.05) -> int:
    """Smallest depth whose O_DIRECT rate is within `knee` of the best O_DIRECT rate."""
    direct = sorted((r for r in runs if r.mode == "direct"), key=lambda r: r.depth)
    if not direct:
        raise QueueDepthError("no O_DIRECT run to choose a depth from")
    best = max(r.gb_per_s for r in direct)
    return next(r.depth for r in direct if r.gb_per_s >= (1 - knee) * best)


def format_table(runs: Sequence[Run]) -> str:
    """One row per depth: GB/s and bytes for O_DIRECT and buffered reads."""
    by = {(r.depth, r.mode): r for r in runs}
    head = (f"{'depth':>5} | {'O_DIRECT GB/s':>13} {'bytes read':>14} | "
            f"{'buffered GB/s':>13} {'bytes read':>14}")
    lines = [head, "-" * len(head)]
    for depth in sorted({r.depth for r in runs}):
        cells = []
        for mode in MODES:
            r = by.get((depth, mode))
            cells.append(f"{r.gb_per_s:13.3f} {r.bytes_read:14d}" if r else f"{'-':>13} {'-':>14}")
        lines.append(f"{depth:5d} | {cells[0]} | {cells[1]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", help="measure this existing file (read only) instead of a temp file")
    ap.add_argument("--dir", default=None, help="where the temp file goes (default: the temp dir)")
    ap.add_argument("--size", default="4G", help="temp file size (default 4G)")
    ap.add_argument("--read", default=None, help="bytes read per run (default: the whole file)")
    ap.add_argument("--block", default=None,
                    help="read size, a multiple of 4096 (default: one expert record of the real model)")
    ap.add_argument("--depths", default=DEPTHS)
    ap.add_argument("--knee", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    made = None
    try:
        block = parse_size(args.block) if args.block else RecordLayout.from_args(ModelArgs()).record_bytes
        if block % ALIGNMENT:
            raise QueueDepthError(f"--block {block} must be a multiple of {ALIGNMENT} bytes for O_DIRECT")
        depths = parse_depths(args.depths)
        if args.file:
            path = Path(args.file)
            if not path.is_file():
                raise QueueDepthError(f"--file {path} does not exist")
        else:
            size = parse_size(args.size)
            fd, name = tempfile.mkstemp(prefix="dsv4-qd-", suffix=".bin", dir=args.dir)
            os.close(fd)
            made = path = Path(name)
            t = time.perf_counter()
            write_file(path, size - size % block, seed=args.seed)
            print(f"wrote {path} ({os.path.getsize(path)} bytes) in {time.perf_counter() - t:.1f} s, "
                  "dropped from the page cache")
        total = os.path.getsize(path) // block
        blocks = min(total, parse_size(args.read) // block) if args.read else total
        if blocks < 1:
            raise QueueDepthError(f"{path} is smaller than one {block}-byte block; "
                                  "give a larger --size or --read")
        print(f"{path}: {blocks} random blocks of {block} bytes per run ({blocks * block / 2**30:.2f} GiB), "
              "page cache dropped before each run")
        runs = []
        for depth in depths:
            for mode in MODES:
                runs.append(measure(path, block, depth, mode, blocks, seed=args.seed))
        print(format_table(runs))
        chosen = choose_depth(runs, args.knee)
        rate = {(r.depth, r.mode): r.gb_per_s for r in runs}
        best_buf = max((r for r in runs if r.mode == "buffered"), key=lambda r: r.gb_per_s)
        verdict = "O_DIRECT" if rate[chosen, "direct"] >= best_buf.gb_per_s else "buffered"
        print(f"chosen depth: {chosen} (O_DIRECT {rate[chosen, 'direct']:.3f} GB/s, within "
              f"{args.knee:.0%} of the best); best buffered: {best_buf.gb_per_s:.3f} GB/s at depth "
              f"{best_buf.depth}; faster: {verdict}")
    except QueueDepthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if made is not None:
            made.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
