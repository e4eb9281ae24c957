"""Conversion benchmark: synthesise a flash-size checkpoint, convert it, compare with the disk.

    python -m bench.convert [--workdir DIR] [--layers 2] [--device cpu|cuda] [--keep]

Writes the checkpoint of `dsv4-synth --preset flash --layers N` (real dims; 2 layers + MTP +
globals = 12.8 GB) under --workdir (default: a new temp dir), drops it from the page cache,
converts it in a child process (so the peak RSS printed is the converter's alone), then measures
the sequential read speed of the same disk on the largest shard (O_DIRECT, or buffered after
posix_fadvise DONTNEED when O_DIRECT is refused). Prints conversion GB/s (source bytes / wall
time), disk read GB/s, their ratio and the converter's peak RSS. Refuses to start without room
for the source and the output (2.05 x the source size).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from converter.synth import SynthOptions, flash_config, plan_tensors, tiny_config, write_checkpoint


def drop_cache(path: Path) -> None:
    """Write back and evict a file's pages so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_speed(path: Path, chunk: int = 16 << 20) -> tuple[float, str]:
    """Sequential read GB/s of `path` from the disk (not the page cache), and how it was read."""
    buf = mmap.mmap(-1, chunk)  # page aligned, as O_DIRECT needs
    mv = memoryview(buf)
    how = "O_DIRECT"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        os.preadv(fd, [mv], 0)
    except OSError:
        drop_cache(path)
        fd, how = os.open(path, os.O_RDONLY), "buffered after POSIX_FADV_DONTNEED"
    try:
        size, pos = path.stat().st_size, 0
        t0 = time.perf_counter()
        while pos < size:
            n = os.preadv(fd, [mv], pos)
            if n <= 0:
                break
            pos += n
        return pos / (time.perf_counter() - t0) / 1e9, how
    finally:
        os.close(fd)


def _status_kb(field: str) -> int:
    """A kB field of /proc/self/status (e.g. VmRSS, RssAnon, RssFile); 0 if absent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def convert_child(src: str, out: str) -> None:
    """Runs in the child: convert and print timing and memory figures as JSON."""
    from converter.convert import convert

    base = _status_kb("VmRSS")  # after importing torch and the converter
    t0 = time.perf_counter()
    convert(src, out, resume=False)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "base_kb": base,
                      "anon_kb": _status_kb("RssAnon"), "file_kb": _status_kb("RssFile"),
                      # VmHWM is this process image's own peak; ru_maxrss is not: Linux carries
                      # the parent's peak (the synthesis, ~1.3 GB) across fork + exec into it.
                      "peak_kb": _status_kb("VmHWM")}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.convert", description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", help="where to write the checkpoint and the output (default: temp)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--preset", choices=["flash", "tiny"], default="flash",
                    help="tiny only for a quick smoke run of this script")
    ap.add_argument("--device", default="cpu", help="torch device drawing the synthetic weights")
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    ap.add_argument("--child", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        convert_child(*a.child)
        return 0
    cfg = (flash_config if a.preset == "flash" else tiny_config)(a.layers)
    options = SynthOptions(seed=0, n_shards=None if a.preset == "flash" else 2, tokenizer=False,
                           device=a.device)
    src_bytes = sum(math.prod(p.shape) * p.dtype.itemsize for p in plan_tensors(cfg, options))
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="dsv4-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    need = int(src_bytes * 2.05)
    if free < need:
        print(f"bench/convert: refusing: {work} has {free / 1e9:.1f} GB free, the benchmark needs "
              f"{need / 1e9:.1f} GB (source {src_bytes / 1e9:.1f} GB + output); use --workdir",
              file=sys.stderr)
        return 2
    src, out = work / "hf", work / "converted"
    try:
        t0 = time.perf_counter()
        write_checkpoint(src, cfg, options)
        print(f"synthesised {a.preset} --layers {a.layers}: {src_bytes / 1e9:.2f} GB in "
              f"{time.perf_counter() - t0:.1f} s ({src})")
        shards = sorted(src.glob("model-*.safetensors"))
        for shard in shards:
            drop_cache(shard)
        res = subprocess.run([sys.executable, "-m", "bench.convert", "--child", str(src), str(out)],
                             capture_output=True, text=True, check=False)
        if res.returncode:
            print(res.stdout + res.stderr, file=sys.stderr)
            return 1
        child = json.loads(res.stdout.strip().splitlines()[-1])
        conv = src_bytes / child["seconds"] / 1e9
        largest = max(shards, key=lambda p: p.stat().st_size)
        disk, how = disk_read_speed(largest)
        out_bytes = sum(f.stat().st_size for f in out.iterdir())
        print(f"conversion: {src_bytes / 1e9:.2f} GB -> {out_bytes / 1e9:.2f} GB in "
              f"{child['seconds']:.1f} s = {conv:.2f} GB/s (source bytes / wall time)")
        print(f"disk sequential read ({how}, {largest.name}, {largest.stat().st_size / 1e9:.2f} GB): "
              f"{disk:.2f} GB/s")
        print(f"conversion / disk read: {conv / disk:.2f}")
        print(f"converter peak RSS: {child['peak_kb'] / 1024:.0f} MiB (VmHWM; "
              f"{child['base_kb'] / 1024:.0f} MiB after imports; at exit anon "
              f"{child['anon_kb'] / 1024:.0f} MiB, file-backed {child['file_kb'] / 1024:.0f} MiB)")
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(src, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            if not a.workdir:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
