"""Where a decode step's time goes: a summary of the Chrome trace `bench.full_depth --trace` writes.

    python -m bench.step_trace /tmp/trace/trace_0.5.json[.gz] [--steps 3] [--top 25]
                               [--children "streaming.py: _prefetch"]

The trace (torch.profiler with Python stacks, so the host runs ~2x slower than unprofiled) holds
the runner's steps (`engine/runtime.py(N): step` on the engine thread), the device's kernels and
memory copies, and the host's Python calls. For each of the first `--steps` steps it prints:

- the step's wall time and, on the device, the time some kernel ran (compute), the time a large
  host->device copy ran (expert records: copies of more than 20 us), both at once, and neither
  (the device waited for the host);
- then, over those steps, the host calls by inclusive time per step (`--top`), and with
  `--children NAME` the direct callees of the calls whose name ends with NAME.

A streamed step whose "neither" is large is host-bound; "both" measures how much the expert
copies overlap the compute.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

STEP = re.compile(r"engine/runtime\.py\(\d+\): step")
LINE = re.compile(r"\(\d+\)")  # "file.py(123): name" -> "file.py: name"
BIG_COPY_US = 20.0  # host->device copies longer than this are expert records (the slot table's are ~4 us)
HOST_CATS = ("python_function", "cpu_op", "cuda_runtime")


class TraceError(Exception):
    """The file is not a Chrome trace of runner steps."""


@dataclass(frozen=True)
class StepSummary:
    """One step, in ms: wall time; device busy computing, copying expert records, both, neither."""

    wall: float
    compute: float
    copy: float
    both: float
    copies: int

    @property
    def neither(self) -> float:
        return self.wall - (self.compute + self.copy - self.both)


def read_events(path: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace file, gzipped or not."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace {p} does not exist")
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TraceError(f"{p} is not a Chrome trace ({err}); write one with bench.full_depth --trace DIR") from None
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Time during which some span of `first` and some span of `second` are both open."""
    points = sorted([(a, 1, 0) for a, _ in first] + [(b, -1, 0) for _, b in first]
                    + [(a, 1, 1) for a, _ in second] + [(b, -1, 1) for _, b in second])
    open_, last, both = [0, 0], None, 0.0
    for t, delta, which in points:
        if last is not None and open_[0] > 0 and open_[1] > 0:
            both += t - last
        open_[which] += delta
        last = t
    return both


def _clip(spans: list[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    return [(max(x, a), min(y, b)) for x, y in spans if y > a and x < b]


def steps(events: list[dict]) -> list[dict]:
    """The runner's step events, in time order."""
    found = sorted((e for e in events if STEP.fullmatch(e.get("name", ""))), key=lambda e: e["ts"])
    if not found:
        raise TraceError("the trace holds no runner step (engine/runtime.py: step); "
                         "write one with bench.full_depth --trace DIR")
    return found


def summarise(events: list[dict], n_steps: int) -> list[StepSummary]:
    """The first `n_steps` steps' device-side summary (module docstring)."""
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "") and e["dur"] > BIG_COPY_US]
    out = []
    for s in steps(events)[:n_steps]:
        a, b = s["ts"], s["ts"] + s["dur"]
        k, c = _clip(kernels, a, b), _clip(copies, a, b)
        out.append(StepSummary(wall=(b - a) / 1e3, compute=_union(k) / 1e3, copy=_union(c) / 1e3,
                               both=_overlap(k, c) / 1e3, copies=len(c)))
    return out


def host_calls(events: list[dict], n_steps: int) -> dict[str, tuple[float, float]]:
    """Host calls on the engine thread during the first `n_steps` steps: name -> (inclusive ms per
    step, calls per step)."""
    chosen = steps(events)[:n_steps]
    tid = chosen[0]["tid"]
    ms, calls = Counter(), Counter()
    for e in events:
        if e.get("cat") in HOST_CATS and e.get("tid") == tid and any(
                s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in chosen):
            name = LINE.sub("", e["name"])
            ms[name] += e["dur"] / 1e3
            calls[name] += 1
    n = len(chosen)
    return {name: (ms[name] / n, calls[name] / n) for name in ms}


def children(events: list[dict], n_steps: int, suffix: str) -> dict[str, tuple[float, float]]:
    """The direct callees of the host calls whose name ends with `suffix` during the first
    `n_steps` steps: name -> (inclusive ms per step, calls per step)."""
    chosen = steps(events)[:n_steps]
    tid = chosen[0]["tid"]
    host = sorted((e for e in events if e.get("cat") in HOST_CATS and e.get("tid") == tid
                   and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in chosen)),
                  key=lambda e: (e["ts"], -e["dur"]))
    ms, calls = Counter(), Counter()
    for parent in (e for e in host if LINE.sub("", e["name"]).endswith(suffix)):
        a, b, end = parent["ts"], parent["ts"] + parent["dur"], float("-inf")
        for e in host:
            if e is parent or e["ts"] < a or e["ts"] + e["dur"] > b or e["ts"] < end:
                continue
            name = LINE.sub("", e["name"])
            ms[name] += e["dur"] / 1e3
            calls[name] += 1
            end = e["ts"] + e["dur"]  # a direct callee: later events inside it are its own callees
    n = len(chosen)
    return {name: (ms[name] / n, calls[name] / n) for name in ms}


def _table(rows: dict[str, tuple[float, float]], top: int) -> list[str]:
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    return [f"  {ms:8.2f} ms  x{n:6.0f}  {name}" for name, (ms, n) in ordered]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a Chrome trace of bench.full_depth --trace (.json or .json.gz)")
    p.add_argument("--steps", type=int, default=3, help="the first N steps (a later one may capture graphs)")
    p.add_argument("--top", type=int, default=25, help="host calls listed")
    p.add_argument("--children", metavar="NAME", help="also list the direct callees of the calls ending with NAME")
    a = p.parse_args(argv)
    try:
        events = read_events(a.trace)
        summary = summarise(events, a.steps)
        print("step ms: wall | device computing | copying expert records (copies) | both | neither")
        for s in summary:
            print(f"  {s.wall:8.2f} | {s.compute:8.2f} | {s.copy:8.2f} ({s.copies}) | {s.both:6.2f} | {s.neither:8.2f}")
        print(f"host calls over {len(summary)} steps, inclusive ms per step (profiled), calls per step:")
        print("\n".join(_table(host_calls(events, a.steps), a.top)))
        if a.children:
            print(f"direct callees of '{a.children}':")
            print("\n".join(_table(children(events, a.steps, a.children), a.top)))
    except TraceError as err:
        raise SystemExit(f"bench.step_trace: {err}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
