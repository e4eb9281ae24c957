"""Several source trees' full-depth benchmarks, alternating on one machine: an A/B comparison.

    python -m bench.ab --tree old=/tmp/old --tree new=. [--rounds 2] [--out DIR] \
        -- --workdir /tmp/dsv4fd --shares 1 --tokens 32 --prompts 16

A change to the decode step is judged against the tree before it on the same machine, because
runs differ by more than most changes (one tree's graphed step measured 5.75-6.43 ms across the
machines of 2026-12-04; docs/performance-log.md). Each round runs `python -m
bench.full_depth ARGS --json FILE` once per tree, in the order the trees are given, from that
tree's folder (so its engine, kernels and bench are the ones imported); every run shares
full_depth's --workdir, hence one synthetic pack and one TileLang kernel cache (kernels are keyed
by their source, so trees with different kernels do not mix). A tree is a folder holding
bench/full_depth.py: a checkout, or a copy made with `git archive REV | tar x -C DIR`.

After every run it prints the table so far: one row per run (its HBM copy rate, `Engine.generate`'s
decode rate and median step at the first prompt, the graphed step timed on its own and its share
of the roofline measured in that run, the follow-up turn's TTFT, each prompt's prefill rate),
then each tree's median over its runs and the difference from the first tree's. A run that fails
is listed as failed (its output's tail on stderr) and the others go on, so a call cut short by
its time limit keeps what it measured. Only the first share of `--shares` is tabulated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.full_depth import roofline_ms


@dataclass(frozen=True)
class Figures:
    """One run's figures: its first share's, at its first prompt unless said otherwise."""

    hbm_gb_s: float  # the HBM copy rate measured in the run
    decode_tok_s: float  # Engine.generate
    median_step_ms: float
    graphed_step_ms: float  # timed on its own
    roofline_ms: float  # the bytes a token touches at this run's copy rate
    followup_ttft_ms: tuple[float, float]  # the short and the long follow-up turn
    prefill_tok_s: tuple[float, ...]  # one per prompt

    @staticmethod
    def of(report: dict) -> Figures:
        """From bench.full_depth's --json report."""
        run, ceil = report["runs"][0], report["ceilings"]
        first = run["prompts"][0]
        return Figures(hbm_gb_s=ceil["hbm_copy"] / 1e9, decode_tok_s=first["decode_tok_s"],
                       median_step_ms=first["median_step_ms"], graphed_step_ms=run["graphed_step_ms"],
                       roofline_ms=roofline_ms(report["bytes_per_token"], ceil),
                       followup_ttft_ms=(1e3 * run["followup"]["ttft_s"], 1e3 * run["followup_long"]["ttft_s"]),
                       prefill_tok_s=tuple(p["prefill_tok_s"] for p in run["prompts"]))


@dataclass(frozen=True)
class Run:
    """One benchmark process: its place in the order, its tree, and its figures (None: it failed)."""

    order: int
    tree: str
    figures: Figures | None


def parse_tree(spec: str) -> tuple[str, Path]:
    """'NAME=DIR' -> (NAME, DIR), DIR holding bench/full_depth.py."""
    name, sep, folder = spec.partition("=")
    if not sep or not name or not folder:
        raise SystemExit(f"bench.ab: --tree takes NAME=DIR (e.g. old=/tmp/old), got {spec!r}")
    path = Path(folder).resolve()
    if not (path / "bench" / "full_depth.py").is_file():
        raise SystemExit(f"bench.ab: tree {name!r} at {path} has no bench/full_depth.py; give a checkout or a "
                         "`git archive REV | tar x -C DIR` copy")
    return name, path


def run_tree(name: str, tree: Path, args: list[str], out: Path, order: int) -> Run:
    """One full_depth process from `tree` with `args`, its report kept in `out`."""
    report = out / f"{order:02d}-{name}.json"
    cmd = [sys.executable, "-m", "bench.full_depth", *args, "--json", str(report)]
    proc = subprocess.run(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode or not report.is_file():
        sys.stderr.write(f"bench.ab: run {order} ({name}) failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n")
        return Run(order, name, None)
    return Run(order, name, Figures.of(json.loads(report.read_text())))


def table(runs: list[Run], names: list[str]) -> str:
    """The runs' rows, then each tree's medians and their differences from the first tree's."""
    lines = ["| order | tree | HBM copy GB/s | decode tok/s | median step ms | graphed step ms (% roofline) "
             "| follow-up TTFT ms (short / long) | prefill tok/s per prompt |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        f = r.figures
        if f is None:
            lines.append(f"| {r.order} | {r.tree} | failed | | | | | |")
            continue
        lines.append(f"| {r.order} | {r.tree} | {f.hbm_gb_s:,.0f} | {f.decode_tok_s:.1f} | {f.median_step_ms:.2f} "
                     f"| {f.graphed_step_ms:.2f} ({100 * f.roofline_ms / f.graphed_step_ms:.0f} %) "
                     f"| {f.followup_ttft_ms[0]:.0f} / {f.followup_ttft_ms[1]:.0f} "
                     f"| {', '.join(f'{v:,.0f}' for v in f.prefill_tok_s)} |")
    medians = {}
    for name in names:
        done = [r.figures for r in runs if r.tree == name and r.figures is not None]
        if done:
            medians[name] = (len(done), statistics.median(f.decode_tok_s for f in done),
                             statistics.median(f.median_step_ms for f in done),
                             statistics.median(f.graphed_step_ms for f in done))
    if medians:
        lines += ["", "| tree | runs | decode tok/s (median) | median step ms (median) | graphed step ms (median) |",
                  "|---|---|---|---|---|"]
        base = medians.get(names[0])
        for name, (n, tok, step, graphed) in medians.items():
            diff = (("", "", "") if base is None or name == names[0] else
                    (f" ({tok - base[1]:+.1f})", f" ({step - base[2]:+.2f})", f" ({graphed - base[3]:+.2f})"))
            lines.append(f"| {name} | {n} | {tok:.1f}{diff[0]} | {step:.2f}{diff[1]} | {graphed:.2f}{diff[2]} |")
        if base is not None and len(medians) > 1:
            lines.append(f"(differences from {names[0]}'s medians)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=DIR",
                   help="a source tree to run, in round order (at least two)")
    p.add_argument("--rounds", type=int, default=2, help="runs per tree, alternating (default 2)")
    p.add_argument("--out", help="keep every run's full_depth JSON report here (default: a temporary folder)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench.full_depth's arguments")
    a = p.parse_args(argv)
    trees = [parse_tree(spec) for spec in a.tree]
    names = [name for name, _ in trees]
    if len(trees) < 2 or len(set(names)) != len(names):
        raise SystemExit(f"bench.ab: give at least two trees with distinct names, got {names}")
    if a.rounds < 1:
        raise SystemExit(f"bench.ab: --rounds must be at least 1, got {a.rounds}")
    args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    if "--json" in args:
        raise SystemExit("bench.ab: leave --json out of full_depth's arguments (use --out to keep the reports)")
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as scratch:
        out = Path(a.out) if a.out else Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        runs = []
        for _ in range(a.rounds):
            for name, tree in trees:
                print(f"bench.ab: run {len(runs) + 1}, {name} ({tree})", flush=True)
                runs.append(run_tree(name, tree, args, out, len(runs) + 1))
                print(table(runs, names), flush=True)
    return 0 if all(r.figures is not None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
