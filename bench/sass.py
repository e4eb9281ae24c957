"""The decode step's GEMV kernels counted in their compiled SASS, on a machine without a GPU.

    python -m bench.sass [--arch 9.0] [--kernel NAME ...] [--opcodes 10]

At decode's few experts the tensor-core GEMVs are limited by their instruction issue, not by
memory (the FP4 one-token kernel's sums replaced by an XOR ran at 81-88 % of copy;
docs/performance-log.md, 2026-12-01), and their time followed their instructions per warp, so
that count compares kernel variants before a GPU times them. Each kernel here is built by its
factory at the Flash decode shape and with the arguments the engine launches it with (the routed
experts' record layout from engine/pack.py), compiled by TileLang for --arch (nvcc: no GPU
needed) and disassembled (TileLang's `export_sass`, with nvdisasm or cuobjdump: CUDA's, on PATH
or under CUDA_HOME, or the `nvidia-cuda-nvdisasm` wheel's). TileLang is the `gpu` extra (`pip
install -e '.[gpu]'`).

Per kernel: the SASS instructions (the kernels unroll their loops over K, so each warp issues
about this many), the NOPs among them (padding), the tensor-core instructions, those
instructions per weight byte a warp reads (codes, from the kernel's tile), and the most frequent
opcodes. A kernel missing from TileLang's cache compiles here first (a few seconds).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# an instruction line of nvdisasm or `cuobjdump -sass`: /*offset*/ [predicate] OPCODE[.modifiers] operands ;
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)[.\s;]")
_TENSOR_CORE = {"HMMA", "IMMA", "QMMA", "HGMMA", "IGMMA", "QGMMA", "BMMA", "OMMA", "UTCHMMA", "UTCQMMA"}


@dataclass(frozen=True)
class Count:
    """One kernel's SASS: instructions, NOPs among them, tensor-core instructions, per opcode."""

    instructions: int
    nops: int
    tensor_core: int
    opcodes: collections.Counter


def count_sass(text: str) -> Count:
    """Count the instructions of one kernel's disassembly (nvdisasm or `cuobjdump -sass`), by
    opcode (modifiers and predicates dropped: `@!P0 IMAD.SHL.U32` counts as IMAD)."""
    ops = collections.Counter(m.group(1) for m in map(_INSTRUCTION.match, text.splitlines()) if m)
    return Count(sum(ops.values()), ops["NOP"], sum(n for op, n in ops.items() if op in _TENSOR_CORE), ops)


def find_disassembler() -> str:
    """A folder holding nvdisasm or cuobjdump (TileLang disassembles with either, from PATH): on
    PATH, under CUDA_HOME/CUDA_PATH, or the nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump wheels'."""
    tools = ("nvdisasm", "cuobjdump")
    folders = [str(Path(found).parent) for found in map(shutil.which, tools) if found]
    folders += [str(Path(os.environ[v]) / "bin") for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    try:
        import nvidia

        folders += [str(p) for root in nvidia.__path__ for p in sorted(Path(root).glob("cu*/bin"))]
    except ImportError:
        pass
    found = next((f for f in folders if any((Path(f) / t).is_file() for t in tools)), None)
    if found is None:
        raise SystemExit("bench.sass: neither nvdisasm nor cuobjdump found; put CUDA's bin on PATH, set CUDA_HOME, "
                         "or `pip install nvidia-cuda-nvdisasm`")
    return found


@dataclass(frozen=True)
class Kernel:
    """A thunk compiling one kernel, and the weight bytes each of its warps reads (codes only)."""

    build: Callable[[], object]
    warp_bytes: int


def decode_kernels(arch: tuple[int, int]) -> dict[str, Kernel]:
    """Name -> that kernel as a Flash decode step launches it on `arch`."""
    from converter.synth_config import flash_config
    from engine.config import ModelArgs
    from engine.pack import RecordLayout
    from kernels import fp4_mma_one_token as fp4_one, fp8_mma_one_token as fp8_one
    from kernels.fp8_gemm import fp8_gemv_kernel, gemv_tile

    from bench.kernels import FP8_DECODE_SHAPES

    args = ModelArgs.from_dict(flash_config(1), "flash")
    layout = RecordLayout.from_args(args)
    off = {name: f.offset for name, f in layout.fields.items()}
    row = layout.record_bytes
    dim, inter = args.dim, args.moe_inter_dim

    def routed(n: int, k: int, parts: tuple[str, ...], out_dtype: str, early: bool) -> Kernel:
        # kernels/fp4_moe.py's grouped_gemv, one token, slots looked up in the layer's table
        tiles, ksplit, depth = fp4_one.mma_tile(k)
        return Kernel(lambda: fp4_one.fp4_mma_one_token_kernel(
            n, k, row, tuple(off[f"{p}.weight"] for p in parts), row, tuple(off[f"{p}.scale"] for p in parts),
            tiles, ksplit, out_dtype, arch, True, early, depth), 16 * tiles * (k // ksplit) // 2)

    def fp8(n: int, k: int) -> Kernel:
        tile = fp8_one.mma_tile(n, k)  # kernels/fp8_gemm.py's one-token choice
        if tile is not None:
            tiles, ksplit, _ = tile
            return Kernel(lambda: fp8_one.fp8_mma_one_token_kernel(n, k, *tile, arch), 16 * tiles * (k // ksplit))
        rows, warps, ksplit = gemv_tile(n, k, arch)  # the CUDA-core GEMV: `rows` rows a warp, K / ksplit each
        return Kernel(lambda: fp8_gemv_kernel(1, n, k, rows, warps, ksplit, arch), rows * (k // ksplit))

    # routed w1|w3 follows the router (forked lanes: not early); w2 follows swiglu_quant (early)
    kernels = {"routed w1|w3": routed(inter, dim, ("w1", "w3"), "bfloat16", False),
               "routed w2": routed(dim, inter, ("w2",), "float32", True)}
    kernels.update({name: fp8(n, k) for name, n, k in FP8_DECODE_SHAPES})
    return kernels


def compile_and_count(build: Callable[[], object], scratch: Path) -> Count:
    """Compile one kernel (kernels/toolkit.py's Launcher) and count its SASS (TileLang's
    `export_sass`: the kernel's source compiled again with its own flags, then disassembled)."""
    path = scratch / "kernel.sass"
    path.unlink(missing_ok=True)
    build().kernel.export_sass(str(path))
    if not path.is_file():  # export_sass logs its failure instead of raising
        raise SystemExit("bench.sass: TileLang could not disassemble the kernel (its error is logged above)")
    return count_sass(path.read_text())


def count_kernels(arch: tuple[int, int], only: list[str] | None) -> dict[str, tuple[Count, int]]:
    """Name -> (its SASS count, the weight bytes a warp reads) of the decode kernels (`only` these)."""
    try:
        import tilelang  # noqa: F401
    except ImportError:
        raise SystemExit("bench.sass: TileLang is not installed: `pip install -e '.[gpu]'`") from None
    kernels = decode_kernels(arch)
    unknown = sorted(set(only or ()) - set(kernels))
    if unknown:
        raise SystemExit(f"bench.sass: no kernel {unknown}; choose from {sorted(kernels)}")
    counts = {}
    with tempfile.TemporaryDirectory(prefix="bench-sass-") as scratch:
        for name, kernel in kernels.items():
            if only and name not in only:
                continue
            counts[name] = compile_and_count(kernel.build, Path(scratch)), kernel.warp_bytes
            print(f"{name}: {counts[name][0].instructions:,} instructions", file=sys.stderr, flush=True)
    return counts


def table(counts: dict[str, tuple[Count, int]], opcodes: int) -> str:
    """Rows of (count, weight bytes a warp reads) per kernel name."""
    lines = ["| kernel | instructions | NOPs | tensor-core | per weight byte of a warp | most frequent opcodes |",
             "|---|---|---|---|---|---|"]
    for name, (c, warp_bytes) in counts.items():
        top = ", ".join(f"{op} {n}" for op, n in c.opcodes.most_common(opcodes))
        lines.append(f"| {name} | {c.instructions:,} | {c.nops} | {c.tensor_core} "
                     f"| {c.instructions / warp_bytes:.3f} | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sass", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="9.0", help="compute capability MAJOR.MINOR (default 9.0: the H200)")
    p.add_argument("--kernel", action="append", help="only this kernel (repeatable; default: all)")
    p.add_argument("--opcodes", type=int, default=10, help="most frequent opcodes shown per kernel")
    a = p.parse_args(argv)
    try:
        arch = tuple(int(v) for v in a.arch.split("."))
    except ValueError:
        arch = ()
    if len(arch) != 2:
        raise SystemExit(f"bench.sass: --arch takes MAJOR.MINOR (e.g. 9.0), got {a.arch!r}")
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = find_disassembler() + os.pathsep + path  # where TileLang looks, for this call
    try:
        counts = count_kernels(arch, a.kernel)
    finally:
        os.environ["PATH"] = path
    print(f"SASS for compute capability {arch[0]}.{arch[1]}, one token (decode), Flash shapes:")
    print(table(counts, a.opcodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
