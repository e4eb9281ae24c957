"""Where the time goes at full depth, per operation, through the app's own `Engine` (CUDA).

    python -m bench.op_profile [--layers 43] [--experts 24] [--prefill 2048] [--chunks 256,2048]
                               [--followup 8] [--top 25] [--syncs] [--host N] [--workdir /tmp/dsv4fd]
                               [--timeline [N]] [--steps-before 3]

Builds (or reuses) the pack of bench/full_depth.py, loads it with every expert resident
(`Engine.load` with the engine's default prefill chunk, whatever `--chunks` says, so the kernel
hints apply: its load time and phases are printed, so on a fresh machine this also measures the
cold warm-up), then profiles with torch.profiler, each after one unprofiled run:

1. a prefill of `--prefill` tokens in chunks of each `--chunks` size (wall tok/s, GPU busy,
   kernels by GPU time);
2. a follow-up prefill of `--followup` tokens after 128 (the TTFT of a short next turn), and
   when it is a graphed chunk step, that step eagerly (its kernels by GPU time);
3. the one-token decode step: eagerly (every kernel by GPU time and launch count) and replayed
   from the CUDA graphs (wall time, and the kernels the profiler sees inside the replay).
   `--timeline [N]` adds the replayed step's timeline: the time with no kernel running, one, or
   more at once, and every kernel of N layers (default 1) from the middle one on in start order
   (stream, start, duration, the gap since the previous kernel of its stream ended), with each
   kind's time over the step.

`--syncs` adds, for the first prefill chunk size, every source line (engine/, kernels/) that
synchronises the host with the device in a chunk (`torch.cuda.set_sync_debug_mode`), with its
count; `--host N` the N Python functions of most own host time in that prefill (cProfile).

Figures are per call; "busy" is the sum of kernel times, so busy < wall means the GPU idled
(host work, launches, synchronisations).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def cuda_kernels(prof) -> list:
    """The profile's CUDA kernel events (torch.profiler key averages), one per kernel name."""
    from torch.autograd import DeviceType

    return [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]


def kernel_table(prof, calls: int, top: int | None, host_top: int = 8) -> list[str]:
    """GPU busy time and launches per call, the `top` kernels by GPU time (None: every one) and
    the `host_top` host ops by self CPU time, as printable lines."""
    kernels = cuda_kernels(prof)
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / calls
    lines = [f"  GPU busy {busy:.2f} ms per call, {sum(e.count for e in kernels) / calls:.0f} kernels per call"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        ms = e.self_device_time_total / 1e3 / calls
        lines.append(f"  {ms:9.3f} ms {100 * ms / busy if busy else 0:5.1f} %  x{e.count / calls:6.0f}  {e.key[:100]}")
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    lines.append("  host, by self CPU time (includes waits in synchronisations):")
    for e in host[:host_top]:
        lines.append(f"  {e.self_cpu_time_total / 1e3 / calls:9.3f} ms  x{e.count / calls:6.0f}  {e.key[:100]}")
    return lines


def profiled(label: str, fn, calls: int, top: int, timeline_layers: int = 0, shown: int = 1) -> float:
    """Run fn once unprofiled, then `calls` times under the profiler; prints wall and the table
    (and with `timeline_layers` > 0 the last call's timeline, `timeline`, with `shown` layers'
    kernels). Returns the wall seconds of one call (from the profiled runs, synchronised)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / calls
    print(f"\n== {label}: wall {1e3 * wall:.2f} ms per call", flush=True)
    print("\n".join(kernel_table(prof, calls, top)), flush=True)
    if timeline_layers:
        print("\n".join(timeline(kernel_spans(prof), calls, timeline_layers, shown)), flush=True)
    return wall


@dataclass(frozen=True)
class Span:
    """One kernel's run on the device: name, stream, start and end in microseconds."""

    name: str
    stream: int
    start: float
    end: float


def kernel_spans(prof) -> list[Span]:
    """The profile's kernels in start order (its Chrome trace's "kernel" events)."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    spans = [Span(e["name"], stream_id(e.get("tid", 0)), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
             for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(spans, key=lambda s: s.start)


def stream_id(tid) -> int:
    """A Chrome trace's kernel "tid" (the stream: 7, or "stream 7") as an int (-1 if none)."""
    digits = "".join(ch for ch in str(tid) if ch.isdigit())
    return int(digits) if digits else -1


def occupancy(spans: list[Span]) -> dict[int, float]:
    """Microseconds from the first kernel's start to the last one's end during which 0, 1, 2, ...
    kernels ran at once."""
    edges = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans])
    time_at: dict[int, float] = {}
    running, prev = 0, edges[0][0] if edges else 0.0
    for t, step in edges:
        time_at[running] = time_at.get(running, 0.0) + t - prev
        running, prev = running + step, t
    return time_at


def last_call(spans: list[Span], calls: int) -> list[Span]:
    """The kernels of the last of `calls` calls in `spans` (start order): those after the longest
    of the calls - 1 longest stretches with no kernel running (the host's work between calls)."""
    gaps, end = [], float("-inf")
    for i, s in enumerate(spans):
        if i:
            gaps.append((s.start - end, i))
        end = max(end, s.end)
    cuts = sorted(gaps)[-(calls - 1):] if calls > 1 else []
    return spans[max((i for _, i in cuts), default=0):]


def timeline(spans: list[Span], calls: int, layers: int, shown: int = 1) -> list[str]:
    """The last of `calls` calls in `spans` (`last_call`; a model step of `layers` layers): how
    long 0, 1, 2+ kernels ran at once, each kernel kind's time, and the kernels of `shown` layers
    from the middle one on (an even number shows both kinds of compressed layer) in start order
    with their stream, start, duration and the gap since their stream's previous kernel."""
    step = last_call(spans, calls)
    if not step:
        return ["  timeline: the profile holds no kernels"]
    t0, t1 = step[0].start, max(s.end for s in step)
    at = occupancy(step)
    lines = [f"  timeline of the last call: {t1 - t0:.1f} us from the first kernel's start to the last's end, "
             f"{len(step)} kernels; no kernel {at.get(0, 0.0):.1f} us, one {at.get(1, 0.0):.1f} us, "
             f"two or more {sum(v for k, v in at.items() if k >= 2):.1f} us"]
    kinds: dict[str, list[float]] = {}
    for s in step:
        kinds.setdefault(s.name[:60], []).append(s.end - s.start)
    lines.append("  kernel kinds by time in the call (count, sum us, median us):")
    for name, d in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:30]:
        lines.append(f"  {len(d):5d} {sum(d):9.1f} {sorted(d)[len(d) // 2]:7.2f}  {name}")
    mid = layers // 2
    first, last = len(step) * mid // layers, len(step) * min(mid + shown, layers) // layers
    about = f"layer {mid}" if shown == 1 else f"layers {mid}..{min(mid + shown, layers) - 1}"
    lines.append(f"  kernels {first}..{last - 1} (about {about}): stream, start us (from the "
                 "first shown), duration us, gap us since its stream's previous kernel ended")
    prev_end: dict[int, float] = {}
    for s in step[:first]:
        prev_end[s.stream] = max(prev_end.get(s.stream, s.end), s.end)
    base = step[first].start
    for s in step[first:last]:
        gap = s.start - prev_end[s.stream] if s.stream in prev_end else float("nan")
        lines.append(f"  {s.stream:4d} {s.start - base:9.2f} {s.end - s.start:8.2f} {gap:8.2f}  {s.name[:70]}")
        prev_end[s.stream] = max(prev_end.get(s.stream, s.end), s.end)
    return lines


REPO = str(Path(__file__).resolve().parents[1])


def repo_frame(frames) -> str:
    """Where `frames` (traceback.FrameSummary, outermost first) are in this repository: the
    innermost engine/ frame, then the innermost kernels/ frame after " > " when there is one
    ("?" if neither)."""
    found: dict[str, str] = {}
    for f in reversed(list(frames)):
        text = f"{f.filename}({f.lineno}): {f.name}".replace(REPO + "/", "")
        for top in ("engine/", "kernels/"):
            if text.startswith(top):
                found.setdefault(top, text)
    return " > ".join(found[t] for t in ("engine/", "kernels/") if t in found) or "?"


def sync_sites(fn) -> list[str]:
    """Every repository line that synchronises the host with the device during one call of fn,
    with its count (`torch.cuda.set_sync_debug_mode("warn")`)."""
    import traceback
    import warnings

    counts: dict[str, int] = {}

    def seen(message, category, filename, lineno, file=None, line=None) -> None:
        site = repo_frame(traceback.extract_stack()[:-1])
        counts[site] = counts.get(site, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen  # restored by catch_warnings on exit
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines = [f"  {sum(counts.values())} host synchronisations per call, by source line:"]
    lines += [f"  {n:6d}  {site}" for site, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return lines


def host_calls(fn, top: int) -> list[str]:
    """The `top` functions of most own host time in one call of fn (cProfile, after the device
    has caught up; the profiler's own overhead inflates every figure alike)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return ["  host calls of one call, by own time:"] + ["  " + line for line in text.getvalue().splitlines()
                                                         if line.strip()]


def timed(fn, calls: int = 3) -> float:
    """Median synchronised wall seconds of fn (after one unmeasured call)."""
    fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.op_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=24)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--chunks", type=lambda v: [int(x) for x in v.split(",")], default=[256, 2048])
    p.add_argument("--followup", type=int, default=8)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--workdir", default="/tmp/dsv4fd")
    p.add_argument("--syncs", action="store_true", help="list the lines that synchronise with the device in a "
                   "prefill chunk")
    p.add_argument("--host", type=int, default=0, metavar="N",
                   help="the N Python functions of most own host time in one prefill (the first chunk size), "
                   "by cProfile: where a host-bound chunk's launches come from")
    p.add_argument("--steps-before", type=int, default=3, metavar="N",
                   help="decode steps replayed before the profiled ones (which then start at position 128 + N: "
                        "whether the last, the timeline's, completes a compressor window depends on it)")
    p.add_argument("--timeline", type=int, nargs="?", const=1, default=0, metavar="LAYERS",
                   help="the replayed decode step's kernel timeline and the kernels of LAYERS layers (default 1) "
                   "from the middle one on, in order")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.op_profile needs a CUDA GPU", file=sys.stderr)
        return 2

    from bench.full_depth import build_pack
    from engine.config import EngineConfig
    from engine.engine import Engine
    from kernels.backend import compiled_kernels

    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    pack = build_pack(workdir, a.layers, a.experts)
    # the engine's own prefill chunk, not --chunks': its kernel shapes are those of the shipped hints
    # and of a bench.full_depth run's manifest, so a cold cache compiles them in parallel
    config = EngineConfig(device="cuda", backend="tilelang", max_seq_len=a.max_seq_len)
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    last = [None, t0]

    def progress(pr) -> None:
        now = time.perf_counter()
        if last[0] is not None:
            phases[last[0]] = phases.get(last[0], 0.0) + now - last[1]
        last[0], last[1] = pr.phase, now
        if pr.done in (0, pr.total) or pr.phase != "loading weights":
            print(f"  [{now - t0:7.1f} s] {pr.phase} {pr.done}/{pr.total} {pr.message}", file=sys.stderr, flush=True)

    eng = Engine.load(pack, config, progress=progress)
    load_s = time.perf_counter() - t0
    if last[0] is not None:
        phases[last[0]] = phases.get(last[0], 0.0) + time.perf_counter() - last[1]
    print(f"load {load_s:.1f} s, {compiled_kernels()} kernel variants; phases: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()), flush=True)

    with torch.inference_mode():  # as the engine runs its steps (the runner's buffers are inference tensors)
        profile_all(a, eng)
    print(f"\npeak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    eng.close()
    return 0


def profile_all(a, eng) -> None:
    """The profiles of the module docstring, on a loaded engine."""
    from engine.chunk_position import CHUNK_SLOTS
    from engine.decode_graph import DecodeRunner
    from kernels.backend import compiled_kernels

    runtime, model = eng.runtime, eng.model
    # enough tokens for the prefill and for the follow-up's 128 + `followup`
    ids = [int(i) for i in torch.randint(1000, 60000, (max(a.prefill, 128 + a.followup),),
                                         generator=torch.Generator().manual_seed(0))]

    for chunk in a.chunks:
        def prefill(chunk=chunk):
            state = model.new_state()
            for _ in runtime.prefill(state, ids[:a.prefill], chunk):
                pass
        k0 = compiled_kernels()
        wall = timed(prefill)
        print(f"\nprefill {a.prefill} tokens in chunks of {chunk}: {wall:.3f} s = {a.prefill / wall:.0f} tok/s "
              f"({compiled_kernels() - k0} kernel variants built by its first run)", flush=True)
        profiled(f"prefill {a.prefill} tokens, chunks of {chunk}", prefill, 1, a.top)
        if a.syncs and chunk == a.chunks[0]:
            print("\n".join(sync_sites(prefill)), flush=True)
        if a.host and chunk == a.chunks[0]:
            print("\n".join(host_calls(prefill, a.host)), flush=True)

    base = model.new_state()
    for _ in runtime.prefill(base, ids[:128], a.chunks[0]):
        pass
    follow = ids[128:128 + a.followup]

    def followup():
        state = base.clone()
        runtime.step(state, follow)
    print(f"\nfollow-up prefill of {a.followup} tokens after 128: {1e3 * timed(followup, 5):.1f} ms", flush=True)
    profiled(f"follow-up prefill of {a.followup} tokens", followup, 3, a.top)

    eager = DecodeRunner(model, runtime.experts, whole=True, graphs=False)
    if eager.can_chunk() and 1 < a.followup <= CHUNK_SLOTS:
        def chunk_step():
            eager.chunk(base.clone(), follow)
        profiled(f"chunk step of {a.followup} tokens, eager (the kernels of its graph)", chunk_step, 3, a.top)
        eager.settle()

    state = base.clone()
    runtime.reserve(state, state.pos + 64)
    token = torch.tensor([5], device=eng.device)
    profiled("decode step, eager (same kernels as the graph)", lambda: eager.step(state, token), 4, 60)
    runner = runtime.runner
    if runner is not None:
        state2 = base.clone()
        runtime.reserve(state2, state2.pos + 64)
        for _ in range(a.steps_before):
            runner.step(state2, token)
        profiled("decode step, CUDA graph replay", lambda: runner.step(state2, token), 8, 40,
                 a.layers if a.timeline else 0, max(a.timeline, 1))
        runner.settle()


if __name__ == "__main__":
    raise SystemExit(main())
