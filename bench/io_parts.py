"""A layer's expert misses made resident, by how many parts each record's read is split into.

    python -m bench.io_parts --pack DIR [--device cuda] [--threads 8] [--parts 1,2,4,8]
                             [--misses 1,2,4,6] [--reps 20] [--o-direct]

For every (misses, read_parts) pair it times `StreamingExperts.acquire(layer, ids)` on `misses`
experts that are not resident (the cache is flushed before each call): the reads from the store
(the page cache, after one untimed pass over every record; the disk with --o-direct) and, on a
GPU, the uploads from pinned staging buffers into the arena. That is the path of the layered CUDA
graph decode at every layer whose routed experts miss. Prints the median per call and the
resulting GB/s. DIR is a converted directory (`dsv4-convert`); `python -m bench.decode_engine`
leaves a Flash-shaped one (12.75 MiB records) in /tmp/dsv4b/flash4-pack.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from converter.layout import read_manifest
from engine.weights import open_converted


def _warm_page_cache(pack: Path) -> None:
    """Read every file of the pack once, so that buffered reads come from the page cache."""
    for f in sorted(pack.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def _time_acquire(files, layer: int, misses: int, reps: int, rng: random.Random, cuda: bool) -> float:
    """Median seconds of `acquire(layer, ids)` on `misses` experts that are not resident."""
    p = files.experts
    times = []
    for _ in range(reps):
        p.flush()
        ids = rng.sample(range(p.store.count), misses)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        p.acquire(layer, ids)  # returns once every part is read and (on a GPU) uploaded
        times.append(time.perf_counter() - t)
        p.release(layer)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pack", required=True, help="a converted directory")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=8, help="I/O threads (EngineConfig.io_threads)")
    p.add_argument("--parts", default="1,2,4,8", help="comma-separated read_parts values")
    p.add_argument("--misses", default="1,2,4,6", help="comma-separated misses per call")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--o-direct", action="store_true", help="bypass the page cache (O_DIRECT)")
    a = p.parse_args(argv)
    pack = Path(a.pack)
    if not (pack / "manifest.json").is_file():
        raise SystemExit(f"bench.io_parts: {pack} is not a converted directory (no manifest.json); "
                         "convert a checkpoint with dsv4-convert or run bench.decode_engine first")
    parts = [int(v) for v in a.parts.split(",")]
    misses = [int(v) for v in a.misses.split(",")]
    record = read_manifest(pack).record.record_bytes
    if not a.o_direct:
        _warm_page_cache(pack)
    cuda = torch.device(a.device).type == "cuda"
    print(f"{pack}: records of {record / 2**20:.2f} MiB, {a.threads} I/O threads, device {a.device}, "
          f"{'O_DIRECT' if a.o_direct else 'page cache'}; median of {a.reps} calls")
    print("| misses | " + " | ".join(f"read_parts {n}" for n in parts) + " |")
    print("|---" * (len(parts) + 1) + "|")
    rng = random.Random(0)
    results: dict[tuple[int, int], float] = {}
    for n in parts:
        files = open_converted(pack, cache_bytes=max(misses) * record, io_threads=a.threads, o_direct=a.o_direct,
                               device=a.device, read_parts=n)
        try:
            layer = files.experts.store.layers()[0]
            _time_acquire(files, layer, max(misses), 2, rng, cuda)  # untimed: staging, streams
            for k in misses:
                results[k, n] = _time_acquire(files, layer, k, a.reps, rng, cuda)
        finally:
            files.close()
    for k in misses:
        cells = [f"{1e3 * results[k, n]:.2f} ms ({k * record / results[k, n] / 1e9:.1f} GB/s)" for n in parts]
        print(f"| {k} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
