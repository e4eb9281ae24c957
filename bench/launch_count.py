"""The torch ops one prefill chunk issues, counted by where they come from — on any device.

At 728 tokens a chunk is host-bound on the H200: the host issues about 7,800 launches while the
GPU works for about 130 ms (docs/performance-log.md, 2026-12-03). Almost every op counted here
is a kernel launch on CUDA, so this finds the launches to remove without a GPU:

* engine ops: torch ops that engine/ code issues itself (index building, concatenations, the
  compressor's pooling, ...), by source line;
* backend ops: torch ops issued inside a kernels/ function (on the CPU the whole reference; on
  CUDA the glue around each TileLang kernel, whose own launch is not a torch op), by function;
* synchronisations: reads of device values on the host (`.item()`, `.tolist()`, copies to the
  CPU).

Views and allocations (no kernel) are not counted. Usage:

    python -m bench.launch_count [--pack DIR] [--tokens 728] [--top 25]

Without --pack it builds the tiny model at full depth (43 layers, 24 experts) under
--workdir, on the CPU. Every expert is resident (the GPU's all-resident path); the chunk
counted follows one chunk of the same length (nothing is counted twice for a first call). On the
CPU keep --tokens small: the reference runs the routed experts cell by cell (64 tokens at 43
layers: about 4 minutes), and the engine's own ops do not grow with the length.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
ENGINE_DIR, KERNELS_DIR = ROOT / "engine", ROOT / "kernels"
NO_KERNEL = {"empty", "empty_strided", "empty_like", "lift_fresh", "set_", "resize_"}  # allocations, metadata
SYNCS = {"_local_scalar_dense", "item"}


@dataclass
class OpCounts:
    """What `count_ops` saw: own ops by (file:line, source), backend ops by function and by the
    kernels/ line that issued them (the innermost one), syncs."""

    own: collections.Counter = field(default_factory=collections.Counter)
    backend: collections.Counter = field(default_factory=collections.Counter)
    backend_lines: collections.Counter = field(default_factory=collections.Counter)
    syncs: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.own.values()) + sum(self.backend.values())


class _Counter(TorchDispatchMode):
    def __init__(self, counts: OpCounts, own: Path, backend: Path):
        super().__init__()
        self.counts, self.own_dir, self.backend_dir = counts, own, backend
        self.places: dict[str, Path] = {}  # a frame's file name -> its resolved path

    def _under(self, filename: str, root: Path) -> bool:
        path = self.places.get(filename)
        if path is None:
            path = self.places[filename] = Path(filename).resolve()
        return path.is_relative_to(root)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_KERNEL:
            return out
        # from the innermost frame out to the first under own_dir: the backend function called
        # from there, if any, is the last frame under backend_dir seen on the way
        own = inner = innermost = None
        frame = sys._getframe(1)
        while frame is not None:
            filename = frame.f_code.co_filename
            if self._under(filename, self.own_dir):
                own = frame
                break
            if self._under(filename, self.backend_dir):
                inner = frame
                innermost = innermost or frame
            frame = frame.f_back
        where = self._site(own.f_code.co_filename, own.f_lineno) if own is not None else "(outside)"
        if name in SYNCS or (name in ("_to_copy", "copy_") and _to_host(func, args, kwargs)):
            self.counts.syncs[where] += 1
        if inner is not None:
            self.counts.backend[inner.f_code.co_name] += 1
            site = self._site(innermost.f_code.co_filename, innermost.f_lineno)
            self.counts.backend_lines[f"{name} @ {site}"] += 1
        elif own is not None:
            self.counts.own[where] += 1
        return out

    def _site(self, filename: str, lineno: int) -> str:
        return f"{Path(filename).name}:{lineno} {linecache.getline(filename, lineno).strip()}"


def _to_host(func, args, kwargs) -> bool:
    """Whether a copy op moves device data to the CPU and waits for it (a synchronisation): not a
    non-blocking copy into pinned memory (it is queued, as `ExpertProvider.record_later` does)."""
    dst = (kwargs or {}).get("device")
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if func.overloadpacket.__name__ == "copy_":
        queued = (len(args) > 2 and args[2] or (kwargs or {}).get("non_blocking", False)) and args[0].is_pinned()
        return len(args) > 1 and args[1].device.type != "cpu" and args[0].device.type == "cpu" and not queued
    return src is not None and src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"


def count_ops(fn: Callable[[], object], own: Path = ENGINE_DIR, backend: Path = KERNELS_DIR) -> OpCounts:
    """Run fn() and count the torch ops it issues: ops whose innermost frame in `own` is the
    caller are attributed to that line, ops issued inside a function under `backend` to the
    outermost such function."""
    counts = OpCounts()
    with _Counter(counts, own.resolve(), backend.resolve()):
        fn()
    return counts


def tiny_pack(workdir: Path, layers: int = 43, experts: int = 24) -> Path:
    """The tiny model (with the real tokenizer's vocabulary) at `layers` deep, converted under
    workdir once."""
    from converter.convert import convert
    from converter.synth import SynthOptions, chat_tiny_config, write_checkpoint

    pack = workdir / f"pack_L{layers}_E{experts}_chat_tiny"
    if not (pack / "manifest.json").is_file():
        src = write_checkpoint(workdir / "ckpt", chat_tiny_config(layers, n_routed_experts=experts),
                               SynthOptions(seed=0))
        convert(src, pack, resume=False)
    return pack


def report(counts: OpCounts, layers: int, top: int, out=None) -> None:
    """Totals per layer, then the `top` engine lines and backend ops, then every synchronisation
    (to `out`, default stdout)."""
    out = out or sys.stdout
    own, back = sum(counts.own.values()), sum(counts.backend.values())
    print(f"torch ops: {own + back} ({(own + back) / layers:.1f} a layer): {own} issued by engine code "
          f"({own / layers:.1f} a layer), {back} inside backend ops; {sum(counts.syncs.values())} synchronisations",
          file=out)
    print(f"engine ops by line (top {top}):", file=out)
    for where, n in counts.own.most_common(top):
        print(f"  {n:6d}  {where[:110]}", file=out)
    print("backend ops' torch ops by op:", file=out)
    for name, n in counts.backend.most_common(top):
        print(f"  {n:6d}  {name}", file=out)
    print(f"backend ops by op and kernels/ line (top {top}):", file=out)
    for where, n in counts.backend_lines.most_common(top):
        print(f"  {n:6d}  {where[:120]}", file=out)
    for where, n in counts.syncs.most_common():
        print(f"  sync x{n}: {where[:110]}", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path, help="a converted model (default: the tiny model at full depth)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/dsv4-launch-count"))
    ap.add_argument("--tokens", type=int, default=728, help="the chunk's length")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.weights import model_footprint

    pack = a.pack or tiny_pack(a.workdir)
    cuda = a.device.startswith("cuda")
    config = EngineConfig(device=a.device, backend="tilelang" if cuda else "torch", numerics="native",
                          cache_bytes=model_footprint(pack).pool, prefill_chunk=max(a.tokens, 17))
    eng = Engine.load(pack, config, warmup=False)
    try:
        ids = [3 + i % (eng.model.args.vocab_size - 3) for i in range(2 * a.tokens)]
        state = eng.model.new_state()
        with torch.inference_mode():
            list(eng.runtime.prefill(state, ids[:a.tokens], a.tokens))  # the same length once, uncounted
            counts = count_ops(lambda: list(eng.runtime.prefill(state, ids[a.tokens:], a.tokens)))
        print(f"{pack.name}, one chunk of {a.tokens} tokens after one of the same length, {a.device}, "
              f"every expert resident:")
        report(counts, eng.model.args.n_layers, a.top)
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
