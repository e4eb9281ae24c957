"""Tile sweep of the FP8 and FP4 GEMVs at DeepSeek-V4-Flash decode shapes (M = 1).

Run on a CUDA machine:  python -m bench.gemv_tiles [--jobs 8]
For every shape it times each (rows per warp, warps per CTA, K split) candidate with
bench.kernels' method (CUDA graph over weight copies that exceed L2, median per call) and prints
the achieved bandwidth against the HBM copy bandwidth of the same run; `*` marks the tile the
kernel module picks for this GPU (TILE_PARAMS), so a better row says how to change the table.
Kernels are compiled in `--jobs` processes first (TileLang's disk cache keeps them).
"""

import argparse
import concurrent.futures as cf
import multiprocessing

import torch

from bench.kernels import _fp8, copies, copy_bandwidth, fp4_arena, slot_sets, time_rotating

FP8_SHAPES = [("wq_a", 1024, 4096), ("wkv", 512, 4096), ("wq_b", 32768, 1024), ("wo_b", 4096, 8192),
              ("shared w1/w3", 2048, 4096), ("indexer wq_b", 8192, 1024)]
FP4_SHAPES = [("expert w1/w3", 2048, 4096), ("expert w2", 4096, 2048)]
EXPERTS, ARENA_SLOTS = 6, 64


def fp8_candidates(n: int, k: int) -> list[tuple[int, int, int]]:
    """(rows, warps, ksplit) worth timing for an [n, k] FP8 weight."""
    out = []
    for rows in (1, 2, 4):
        for warps in (4, 8):
            for ksplit in (1, 2, 4):
                if ksplit <= warps and k // ksplit >= 512 and n // (rows * warps // ksplit) >= 64:
                    out.append((rows, warps, ksplit))
    return out


def fp4_candidates(n: int) -> list[tuple[int, int]]:
    return [(rows, warps) for rows in (1, 2, 4) for warps in (4, 8) if n // (rows * warps) >= 32]


def _fp4_record(n: int, k: int) -> int:
    return n * k // 2 + n * k // 32


def _fp4_args(n: int, k: int, tile: tuple[int, int], arch: tuple[int, int]) -> tuple:
    """fp4_gemv_kernel's arguments for one [n, k] weight per arena record (scales after it)."""
    rec = _fp4_record(n, k)
    return (1, n, k, rec, (0,), rec, (n * k // 2,), *tile, "bfloat16", arch)


def kernel_specs(arch: tuple[int, int], kinds: set[str]) -> list[tuple[str, tuple]]:
    """Every (factory name, arguments) the sweep of `kinds` ("fp8", "fp4") calls."""
    specs = [("fp8", (1, n, k, *t, arch)) for _, n, k in FP8_SHAPES if "fp8" in kinds for t in fp8_candidates(n, k)]
    for _, n, k in FP4_SHAPES if "fp4" in kinds else []:
        specs += [("fp4", _fp4_args(n, k, t, arch)) for t in fp4_candidates(n)]
    return specs


def compile_spec(spec: tuple[str, tuple]) -> None:
    """Compile one kernel (in a worker process; the result lands in TileLang's disk cache)."""
    from kernels.fp4_moe import fp4_gemv_kernel
    from kernels.fp8_gemm import fp8_gemv_kernel
    kind, args = spec
    (fp8_gemv_kernel if kind == "fp8" else fp4_gemv_kernel)(*args)


def precompile(specs, jobs: int) -> None:
    if jobs <= 1:
        for s in specs:
            compile_spec(s)
        return
    with cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(compile_spec, specs))


def sweep_fp8(dev, arch) -> list[tuple[str, int, float, bool]]:
    from kernels.act_quant import act_quant
    from kernels.fp8_gemm import fp8_gemv_kernel, gemv_tile
    from kernels.gemv import as_words, scale_bytes

    rows = []
    for name, n, k in FP8_SHAPES:
        nbytes = n * k + n * k // 16384
        ws = [_fp8(n, k, dev) for _ in range(copies(nbytes))]
        q, s = act_quant(torch.randn(1, k, device=dev).to(torch.bfloat16), 128)
        y = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        chosen = gemv_tile(n, k, arch)
        for t in fp8_candidates(n, k):
            kern = fp8_gemv_kernel(1, n, k, *t, arch)
            sec, graphed = time_rotating(ws, lambda w: kern(as_words(q), s, as_words(w[0]), scale_bytes(w[1]), y))
            mark = "*" if t == chosen else " "
            rows.append((f"{mark}fp8 {name} {n}x{k} rows={t[0]} warps={t[1]} ksplit={t[2]}",
                         nbytes + 3 * k + 2 * n, sec, graphed))
    return rows


def sweep_fp4(dev, arch) -> list[tuple[str, int, float, bool]]:
    from kernels.act_quant import act_quant
    from kernels.fp4_moe import fp4_gemv_kernel, gemv_tile
    from kernels.gemv import as_words

    rows = []
    for name, n, k in FP4_SHAPES:
        rec = _fp4_record(n, k)
        arena = fp4_arena(ARENA_SLOTS, n, k, dev)
        tables = slot_sets(ARENA_SLOTS, EXPERTS, dev)
        q, s = act_quant(torch.randn(EXPERTS, 1, k, device=dev).to(torch.bfloat16), 128)
        y = torch.empty(1, EXPERTS, 1, n, dtype=torch.bfloat16, device=dev)
        chosen = gemv_tile(n, arch)
        for t in fp4_candidates(n):
            kern = fp4_gemv_kernel(*_fp4_args(n, k, t, arch))
            sec, graphed = time_rotating(tables, lambda sl: kern(as_words(q), s, as_words(arena), arena, sl, y))
            mark = "*" if t == chosen else " "
            rows.append((f"{mark}fp4 x{EXPERTS} {name} {n}x{k} rows={t[0]} warps={t[1]}",
                         EXPERTS * (rec + 3 * k + 2 * n), sec, graphed))
    return rows


def main(argv=None) -> None:
    from bench.kernels import print_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=12, help="processes compiling kernels before timing")
    ap.add_argument("--kinds", default="fp8,fp4", help="comma-separated: fp8, fp4")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gemv_tiles needs a CUDA GPU")
    dev = torch.device("cuda")
    arch = torch.cuda.get_device_capability(dev)
    kinds = set(args.kinds.split(","))
    precompile(kernel_specs(arch, kinds), args.jobs)
    ceiling = copy_bandwidth(dev)
    print(torch.cuda.get_device_name(dev), f"sm_{arch[0]}{arch[1]}")
    print_table((sweep_fp8(dev, arch) if "fp8" in kinds else []) + (sweep_fp4(dev, arch) if "fp4" in kinds else []),
                ceiling)


if __name__ == "__main__":
    main()
