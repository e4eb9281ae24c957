"""The yardstick: the user's path at full depth, through the app's own `Engine`, on a CUDA GPU.

    python -m bench.full_depth [--experts 24] [--layers 43] [--shares 1,0.5,0.25]
                               [--prompts 16,128,724,2048] [--tokens 64] [--workdir /tmp/dsv4fd]
                               [--routing-trace shared/traces/route_W130.csv]
                               [--timing-pack [--base-experts 24]]

1. builds (once per workdir) a synthetic checkpoint with DeepSeek-V4-Flash's real dimensions,
   `--layers` layers and `--experts` routed experts per layer (`dsv4-synth --preset flash`,
   random weights drawn on the GPU), converts it (`dsv4-convert`) and deletes the source. Per
   token the engine touches the real model's bytes (top-6 of any expert count);
2. measures the ceilings in the same run: HBM device-to-device copy, pinned host-to-device copy;
3. runs each configuration in a fresh process (`Engine.load` + `Engine.generate`, native numerics,
   TileLang kernels, CUDA graphs), with TileLang's kernel cache in the workdir: the first process
   finds it empty (cold load: compiles), the later ones load from it (warm load); once loaded,
   the heap is frozen as the app does (app/heap.py: full GC passes then skip the engine). Per
   process: load time and its warm-up, kernel variants compiled during the chat (should be 0),
   then one fresh session per prompt length: TTFT, prefill tok/s, decode tok/s as `Engine.generate`
   reports it (each step's time in the JSON); a follow-up turn's TTFT, decode rate and expert
   reads per second; the graphed decode step timed on its own, with the expert bytes it reads and
   their rate (against pinned H2D); the hit rate (prefetched experts count as hits) and the
   prefetch counters; the graph sets captured; peak device memory against the memory plan, and
   the device's memory in use (CUDA graphs hold memory outside the allocator). `--host-profile
   N` adds the host's top N calls (cProfile) over 8 more graphed steps, and `--trace DIR` a
   torch.profiler Chrome trace of 4 more (summarised by `python -m bench.step_trace`);
4. prints one table; `--json FILE` also writes every figure.

`--routing-trace FILE` forces the experts of layers >= 3 from a route CSV (engine/routing_override.py)
so that cache behaviour is realistic: TIMING ONLY, the generated text is meaningless (the run says so).
Forced layers get no router lookahead hints unless `--lookahead-accuracy A` gives them a stand-in
right a share A of the time; `--no-lookahead` turns the hints off everywhere.

`--timing-pack` runs on a timing-only pack (bench/timing_pack.py) with `--experts` per layer made
from the `--base-experts` pack: its expert records are file holes (zeros, no disk blocks), so 43
layers x 256 real-size experts fit a small disk. TIMING ONLY (the run says so): every expert
computes zero, and a record read from the "disk" is a hole the kernel zero-fills, so misses
served from the disk tier time the page-cache/memory path, not a drive. The H200 run of issue 27:

    python -m bench.full_depth --experts 256 --timing-pack --shares 0.25,0.5 \
        --routing-trace ../shared/traces/route_W130.csv

The per-token bytes are the resident weights (all but the embedding and the MTP block) plus 6
experts a layer; the roofline is those bytes at the copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

GiB = 2**30


# ----------------------------------------------------------------------------- build

def build_pack(workdir: Path, layers: int, experts: int, tiny: bool = False) -> Path:
    """The converted pack under workdir (built once; the source checkpoint is deleted after): the
    real dimensions, synthesised on the GPU, or with `tiny` the tiny model's, on the CPU and
    without the MTP block (bench.lookahead_replay: it counts reads, records of a few KiB do)."""
    from converter.convert import convert
    from converter.synth import SynthOptions, flash_config, tiny_config, write_checkpoint

    pack = workdir / (f"pack_L{layers}_E{experts}" + ("_tiny" if tiny else ""))
    if (pack / "manifest.json").is_file():
        return pack
    src = workdir / "hf"
    t0 = time.perf_counter()
    if tiny:
        write_checkpoint(src, tiny_config(layers, n_routed_experts=experts), SynthOptions(with_mtp=False))
    else:
        write_checkpoint(src, flash_config(layers, n_routed_experts=experts), SynthOptions(seed=0, n_shards=None,
                                                                                          device="cuda"))
    t1 = time.perf_counter()
    convert(src, pack)
    t2 = time.perf_counter()
    shutil.rmtree(src)
    print(f"built {pack}: synth {t1 - t0:.0f} s, convert {t2 - t1:.0f} s", flush=True)
    return pack


def timing_pack(workdir: Path, layers: int, base_experts: int, experts: int) -> Path:
    """The timing-only pack with `experts` per layer (bench/timing_pack.py) under workdir, made
    (once) from the real `base_experts` pack; says TIMING ONLY."""
    from bench.timing_pack import TIMING_NOTE, disk_usage, make_timing_pack

    base = build_pack(workdir, layers, base_experts)
    t0 = time.perf_counter()
    pack = make_timing_pack(base, workdir / f"timing_L{layers}_E{experts}_from{base_experts}", experts)
    size, used = disk_usage(pack)
    print(f"{TIMING_NOTE}: {pack}, {experts} experts per layer ({time.perf_counter() - t0:.0f} s), "
          f"{size / GiB:.1f} GiB apparent, {used / GiB:.1f} GiB on disk; records read from the disk tier are "
          "holes (zero-filled by the kernel, no drive I/O)", flush=True)
    return pack


def ceilings() -> dict:
    """HBM copy and pinned host-to-device bandwidth (bytes/s), measured now."""
    from bench.kernels import copy_bandwidth, median_seconds

    dev = torch.device("cuda")
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    h2d = (1 << 30) / median_seconds(lambda: dst.copy_(host, non_blocking=True), 10)
    return {"hbm_copy": copy_bandwidth(dev), "h2d_pinned": h2d}


# ----------------------------------------------------------------------------- one process

def _text_of(tokenizer, n: int) -> str:
    """A user message of about n tokens."""
    base = ("The quick brown fox jumps over the lazy dog while seventeen sailors sing about the "
            "northern sea, counting waves and stars until the morning bell. ")
    ids = tokenizer.encode(base * (n // 20 + 2))[:max(1, n)]
    return tokenizer.decode(ids)


def _graphed_step_ms(eng, session, sync, steps: int = 32, profile: cProfile.Profile | None = None,
                     trace: Path | None = None) -> tuple[float, float, float]:
    """(median wall time of one decode step in ms, expert bytes read per step, those bytes per
    second of step time): decode steps replayed through the runner on a clone of the session's
    state, each on the greedy token of the step before (a chat's routing: one token repeated
    routes alike every step and would hit the cache more), the device synchronised after each
    (no other host work between steps); the reads are the expert cache's over the steps after
    the first two (nothing else runs meanwhile). `profile` (cProfile) records the host's calls
    during 8 more steps, after the timed ones (the profiler slows the host down); `trace` writes
    a torch.profiler Chrome trace of 4 more steps (host calls, kernels, copies) to that file."""
    runtime = eng.runtime
    state = session.state.clone()
    runtime.reserve(state, state.pos + steps + 15)
    token = torch.tensor([eng.tokenizer.bos_id], device=eng.device)
    times, read = [], []

    def step() -> torch.Tensor:
        return runtime.step(state, token).logits.argmax().reshape(1)

    for _ in range(steps + 2):
        snap = eng.stats().cache
        read.append(snap.bytes_read if snap is not None else 0)
        sync()
        t = time.perf_counter()
        token = step()
        sync()
        times.append(1e3 * (time.perf_counter() - t))
    runtime.settle()
    snap = eng.stats().cache
    per_step = ((snap.bytes_read if snap is not None else 0) - read[2]) / steps
    if profile is not None:
        profile.enable()
        for _ in range(8):
            token = step()
            sync()
        profile.disable()
        runtime.settle()
    if trace is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
        with torch_profile(activities=activities, with_stack=True) as prof:  # with the Python calls
            for _ in range(4):
                token = step()
                sync()
        runtime.settle()
        prof.export_chrome_trace(str(trace))
    return statistics.median(times[2:]), per_step, per_step / (1e-3 * statistics.fmean(times[2:]))


def _captures(eng) -> int:
    """Decode graph sets captured so far (0 when decoding eagerly)."""
    runner = eng.runtime.runner
    return runner.captures if runner is not None else 0


def _guesses(eng) -> tuple[int, int, int, int]:
    """(steps guessed whole through the bounded cache, of those redone layer by layer, of the
    guesses the prefill chunk steps, of those redone) so far (engine/step_guess.py; zeros without
    guessing)."""
    runner = eng.runtime.runner
    g = runner.guesses if runner is not None else None
    return (g.guesses, g.wrong, g.chunks, g.chunks_wrong) if g is not None else (0, 0, 0, 0)


class PhaseClock:
    """Seconds spent in each load phase (LoadProgress.phase), from the progress callbacks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._phase: str | None = None
        self._t = time.perf_counter()

    def enter(self, phase: str | None) -> None:
        now = time.perf_counter()
        if self._phase is not None:
            self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + now - self._t
        self._phase, self._t = phase, now


def child(a) -> dict:
    """One configuration in this (fresh) process; returns its figures."""
    from app.heap import HeapFreeze
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.events import TurnFinished
    from engine.sampling import SamplingParams
    from engine.weights import model_footprint
    from kernels.backend import built_kernels, compiled_kernels

    from bench.timing_pack import TIMING_NOTE, is_timing_pack

    pack = Path(a.pack)
    pool = model_footprint(pack).pool
    timing_only = is_timing_pack(pack)
    if timing_only:
        print(f"  {pack}: {TIMING_NOTE}", file=sys.stderr, flush=True)
    cache = None if a.share >= 1.0 else int(pool * a.share)
    cuda = a.device == "cuda"  # the CPU runs only check this script (torch reference, no graphs)
    config = EngineConfig(device=a.device, backend="tilelang" if cuda else "torch", cache_bytes=cache,
                          max_seq_len=a.max_seq_len, io_threads=a.io_threads, routing_trace=a.routing_trace,
                          host_cache_bytes=None if a.host_cache_gb is None else int(a.host_cache_gb * GiB),
                          fill_host_tier=not a.no_tier_fill, lookahead_prefetch=not a.no_lookahead,
                          routing_lookahead=a.lookahead_accuracy, guess_whole_steps=not a.no_guess)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = PhaseClock()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    def progress(p) -> None:
        clock.enter(p.phase)
        print(f"  [{time.perf_counter() - t0:7.1f} s] {p.phase} {p.done}/{p.total} {p.message}", file=sys.stderr,
              flush=True)

    eng = Engine.load(pack, config, progress=progress)
    load_s = time.perf_counter() - t0
    HeapFreeze().freeze()  # as every front end does once its engine is built (app/heap.py)
    clock.enter(None)
    routing = eng.model.routing.note if eng.model.routing is not None else None
    if routing is not None:
        print(f"  {routing}", file=sys.stderr, flush=True)
    out = {"share": a.share, "timing_only": timing_only, "host_cache_bytes": eng.plan.host_cache, "load_s": load_s, "phases": clock.seconds, "kernels_after_load": compiled_kernels(),
           "routing": routing, "plan": eng.plan.lines(), "plan_total": eng.plan.total,
           "plan_framework": eng.plan.framework,
           "cache_bytes": eng.plan.cache, "pool_bytes": eng.plan.pool, "prompts": []}
    built = built_kernels()
    greedy = SamplingParams(temperature=0.0, max_tokens=a.tokens)
    cache0 = eng.stats().cache
    bytes_read0 = cache0.bytes_read if cache0 else 0
    session = None
    for n in a.prompts:
        session = eng.new_session()
        t_turn = time.perf_counter()
        captures, guessed = _captures(eng), _guesses(eng)
        now = eng.stats().cache
        tier = now.tier if now else None  # how full the host tier is now
        events = list(eng.generate(session, _text_of(eng.tokenizer, n), greedy))
        guesses = [after - before for after, before in zip(_guesses(eng), guessed)]  # this turn's
        print(f"  {n}-token prompt: {time.perf_counter() - t_turn:.1f} s, {compiled_kernels()} kernel variants, "
              f"{_captures(eng) - captures} graph captures, "
              f"{guesses[0]} steps guessed whole ({guesses[1]} redone; {guesses[2]} of them chunk steps, "
              f"{guesses[3]} redone)"
              + (f", host tier {tier.entries}/{tier.capacity_entries} records at its start" if tier else ""),
              file=sys.stderr, flush=True)
        fin = events[-1]
        if not isinstance(fin, TurnFinished):
            raise SystemExit(f"bench.full_depth: the {n}-token turn failed: {fin}")
        st = fin.stats
        steps = sorted(st.step_ms)
        out["prompts"].append({"n": n, "prompt_tokens": st.prompt_tokens, "ttft_s": st.ttft_s,
                               "prefill_s": st.prefill_s, "prefill_tok_s": st.prefill_tokens / st.prefill_s,
                               "completion_tokens": st.completion_tokens, "decode_tok_s": st.tok_per_s,
                               "median_step_ms": steps[len(steps) // 2] if steps else float("nan"),
                               "step_ms": [round(x, 3) for x in st.step_ms],
                               "hit_rate": st.cache.hit_rate if st.cache else 1.0,
                               "tier_entries_at_start": tier.entries if tier else None,
                               "graph_captures": _captures(eng) - captures,
                               "guessed": guesses[0], "guessed_wrong": guesses[1],
                               "guessed_chunks": guesses[2], "guessed_chunks_wrong": guesses[3]})
    before, guessed = eng.stats().cache, _guesses(eng)
    follow = list(eng.generate(session, "And then?", greedy))[-1]
    follow_chunks = [after - before for after, before in zip(_guesses(eng)[2:], guessed[2:])]
    after = eng.stats().cache
    follow_read = (after.bytes_read - before.bytes_read) if after else 0
    if after is not None and after.tier is not None:  # the follow-up's misses: RAM hits, reads from the disk
        t0, t1 = before.tier, after.tier
        out["tier_followup"] = {"ram_hits": t1.ram_hits - t0.ram_hits, "disk_reads": t1.disk_reads - t0.disk_reads,
                                "tier_hit_rate_run": t1.hit_rate}
        print(f"  host tier, follow-up turn: {out['tier_followup']['ram_hits']} RAM hits, "
              f"{out['tier_followup']['disk_reads']} disk reads; over the run {t1.ram_hits} / {t1.disk_reads}",
              file=sys.stderr, flush=True)
    print(f"  follow-up turn: TTFT {1e3 * follow.stats.ttft_s:.1f} ms, of which its {follow.stats.prefill_tokens} "
          f"new tokens' steps {1e3 * follow.stats.prefill_s:.1f} ms ({follow_chunks[0]} chunk steps guessed whole, "
          f"{follow_chunks[1]} redone)", file=sys.stderr, flush=True)
    fsteps = sorted(follow.stats.step_ms)
    out["followup"] = {"new_tokens": follow.stats.prefill_tokens, "ttft_s": follow.stats.ttft_s,
                       "reused": follow.stats.reused_tokens, "decode_tok_s": follow.stats.tok_per_s,
                       "median_step_ms": fsteps[len(fsteps) // 2] if fsteps else float("nan"),
                       # expert reads of the whole turn (its few prompt tokens replay decode steps)
                       "prefill_s": follow.stats.prefill_s, "decode_s": follow.stats.decode_s,
                       "read_gb": follow_read / 1e9,
                       "read_gb_s": follow_read / 1e9 / (follow.stats.prefill_s + follow.stats.decode_s)}
    # the bound covers follow-ups of up to 32 new tokens: one more turn, of about that many
    longer = list(eng.generate(session, _text_of(eng.tokenizer, a.followup_tokens), greedy))[-1]
    out["followup_long"] = {"new_tokens": longer.stats.prefill_tokens, "ttft_s": longer.stats.ttft_s,
                            "prefill_s": longer.stats.prefill_s}
    print(f"  longer follow-up turn: TTFT {1e3 * longer.stats.ttft_s:.1f} ms, of which its "
          f"{longer.stats.prefill_tokens} new tokens' prefill {1e3 * longer.stats.prefill_s:.1f} ms",
          file=sys.stderr, flush=True)
    out["kernels_during_chat"] = compiled_kernels() - out["kernels_after_load"]
    out["compiled_in_chat"] = sorted(built_kernels() - built)
    for name in out["compiled_in_chat"]:
        print(f"  compiled during the chat: {name}", file=sys.stderr, flush=True)
    if a.host_profile:  # one more follow-up turn to its first token, profiled (the table's turn was not)
        profile = cProfile.Profile()
        profile.enable()
        again = list(eng.generate(session, "Go on.", SamplingParams(temperature=0.0, max_tokens=1)))[-1]
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(a.host_profile)
        out["followup_host_profile"] = text.getvalue()
        print(f"  host calls of another follow-up turn ({again.stats.prefill_tokens} new tokens, TTFT "
              f"{1e3 * again.stats.ttft_s:.1f} ms profiled), by cumulative time:\n{text.getvalue()}",
              file=sys.stderr, flush=True)
    profile = cProfile.Profile() if a.host_profile else None
    trace = Path(a.trace) / f"trace_{a.share:g}.json" if a.trace else None
    out["graphed_step_ms"], step_bytes, step_rate = _graphed_step_ms(eng, session, sync, profile=profile, trace=trace)
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(a.host_profile)
        out["host_profile"] = text.getvalue()
        print(f"  host calls during 8 graphed steps (by own time):\n{text.getvalue()}", file=sys.stderr,
              flush=True)
    snap = eng.stats().cache
    if snap is not None:
        out["hit_rate"] = snap.hit_rate
        out["miss_gb"] = (snap.bytes_read - bytes_read0) / 1e9  # the whole run: prefill, decode, graphed steps
        out["step_read_gb"] = step_bytes / 1e9  # per graphed step
        out["miss_gb_s"] = step_rate / 1e9  # expert reads per second of graphed decode steps
        prefetch = eng.experts.prefetch_stats()
        out["prefetch"] = {src: dataclasses.asdict(stats) | {"accuracy": stats.accuracy}
                           for src, stats in prefetch.items()}
        for stats in prefetch.values():
            print(f"  {stats.line()}", file=sys.stderr, flush=True)
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    if cuda:  # the device's own count: CUDA graphs and kernel modules are outside the allocator's
        free, total = torch.cuda.mem_get_info()
        out["device_used"] = total - free
    out["graph_captures"] = _captures(eng)
    out["guessed"], out["guessed_wrong"], out["guessed_chunks"], out["guessed_chunks_wrong"] = _guesses(eng)
    out["peak_reserved"] = torch.cuda.max_memory_reserved() if cuda else 0
    out["peak_allocated"] = torch.cuda.max_memory_allocated() if cuda else 0
    out["info"] = {k: v for k, v in eng.info.items() if k != "memory_plan"}
    before_close = allocated()
    eng.close()
    out["allocated_after_close"] = allocated()
    out["allocated_before_close"] = before_close
    if cuda and out["allocated_after_close"]:
        out["alive_after_close"] = _live_cuda_tensors()
        print(f"  still allocated after close: {out['alive_after_close']}", file=sys.stderr, flush=True)
    return out


def _live_cuda_tensors(top: int = 6) -> list[str]:
    """The largest CUDA tensors still reachable (shape, dtype, MiB, who refers to them)."""
    import gc

    found = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            size = obj.untyped_storage().nbytes()
            owners = sorted({type(r).__name__ for r in gc.get_referrers(obj)} - {"list", "frame"})
            found.append((size, f"{tuple(obj.shape)} {obj.dtype} {size / 2**20:.0f} MiB <- {','.join(owners)}"))
    found.sort(key=lambda t: -t[0])
    return [text for _, text in found[:top]]


# ----------------------------------------------------------------------------- table

def bytes_per_token(pack: Path) -> int:
    """Resident weights a decode token reads (all but the embedding and MTP) + 6 experts a layer."""
    from engine.checkpoint import TensorIndex
    from engine.config import ModelArgs

    manifest = json.loads((pack / "manifest.json").read_text())
    args = ModelArgs.from_dict(manifest["config"], "manifest")
    with TensorIndex.open(pack) as idx:
        resident = sum(idx.info(n).nbytes for n in idx.names()
                       if not n.endswith(".ffn.experts") and not n.startswith("mtp.") and n != "embed.weight")
    return resident + args.n_layers * args.n_activated_experts * manifest["experts"]["record_bytes"]


def roofline_ms(per_token: int, ceil: dict) -> float:
    """The decode roofline: the bytes a token touches at the HBM copy rate `ceilings()` measured."""
    return 1e3 * per_token / ceil["hbm_copy"]


def table(results: list[dict], ceil: dict, per_token: int) -> str:
    roof_ms = roofline_ms(per_token, ceil)
    lines = (["TIMING ONLY (timing pack): experts are zeros, outputs meaningless; disk-tier misses read file holes", ""]
             if any(r.get("timing_only") for r in results) else [])
    lines += [f"HBM copy {ceil['hbm_copy'] / 1e9:.0f} GB/s, pinned H2D {ceil['h2d_pinned'] / 1e9:.1f} GB/s; "
             f"{per_token / 1e9:.2f} GB touched per token -> roofline {roof_ms:.2f} ms/token",
             "",
             "| cache | load s (kernels) | prompt | TTFT s | prefill tok/s | decode tok/s (Engine.generate) "
             "| median step ms | graphed step ms (% roofline) | follow-up: TTFT ms, decode tok/s "
             "| hit rate; steps guessed whole (redone) "
             "| graphed step reads: GB, GB/s (% of H2D); follow-up turn's reads GB/s (% of H2D) "
             "| peak GiB / plan GiB | compiles in chat |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        peak = r["peak_reserved"] / GiB
        plan = (r["plan_total"] - r["plan_framework"]) / GiB
        for i, p in enumerate(r["prompts"]):
            first = i == 0
            lines.append(
                f"| {100 * r['share']:.0f} % {r.get('label', '')} | "
                + (f"{r['load_s']:.1f} ({r['kernels_after_load']})" if first else "")
                + f" | {p['prompt_tokens']} | {p['ttft_s']:.3f} | {p['prefill_tok_s']:.0f} | {p['decode_tok_s']:.1f} "
                f"| {p['median_step_ms']:.2f} | "
                + (f"{r['graphed_step_ms']:.2f} ({100 * roof_ms / r['graphed_step_ms']:.0f} %)" if first else "")
                + " | " + (f"{1e3 * r['followup']['ttft_s']:.0f} ({r['followup']['new_tokens']} new), "
                           f"{r['followup']['decode_tok_s']:.1f}; {1e3 * r['followup_long']['ttft_s']:.0f} "
                           f"({r['followup_long']['new_tokens']} new)" if first else "")
                + f" | {p['hit_rate']:.3f}"
                + (f"; {p['guessed']} ({p['guessed_wrong']})" if p.get("guessed") else "") + " | "
                + (f"{r.get('step_read_gb', 0.0):.2f}, {r.get('miss_gb_s', 0.0):.1f} "
                   f"({100 * 1e9 * r.get('miss_gb_s', 0.0) / ceil['h2d_pinned']:.0f} %); "
                   f"{r['followup']['read_gb_s']:.1f} ({100 * 1e9 * r['followup']['read_gb_s'] / ceil['h2d_pinned']:.0f} %)"
                   if first else "")
                + " | " + (f"{peak:.1f} / {plan:.1f}" if first else "")
                + " | " + (f"{r['kernels_during_chat']}" if first else "") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--experts", type=int, default=24, help="routed experts per layer in the synthetic pack")
    p.add_argument("--shares", type=lambda v: [float(x) for x in v.split(",")], default=[1.0, 0.5, 0.25],
                   help="expert cache sizes as shares of the expert pool (1 = resident)")
    p.add_argument("--prompts", type=lambda v: [int(x) for x in v.split(",")], default=[16, 128, 724, 2048])
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per turn")
    p.add_argument("--followup-tokens", type=int, default=27,
                   help="message tokens of the second follow-up turn (with the chat template's: about 32 new)")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--host-cache-gb", type=float, help="cap on the pinned host-RAM tier, up to the whole pool "
                   "(default: the whole pool when free host RAM allows); misses beyond it are read from the pack")
    p.add_argument("--no-tier-fill", action="store_true",
                   help="fill the host-RAM tier on demand only (no background fill after load)")
    p.add_argument("--no-lookahead", action="store_true",
                   help="no router lookahead prefetch (EngineConfig.lookahead_prefetch off): its reads against "
                        "the misses it saves")
    p.add_argument("--no-guess", action="store_true",
                   help="streamed steps always layer by layer (EngineConfig.guess_whole_steps off), not guessed "
                        "whole when their experts look resident")
    p.add_argument("--workdir", default="/tmp/dsv4fd")
    p.add_argument("--warm-repeat", action="store_true", help="run the first configuration twice (cold, then warm)")
    p.add_argument("--json", help="also write every figure to this file")
    p.add_argument("--routing-trace", metavar="FILE", help="force the experts of layers >= 3 from this route CSV "
                   "(../shared/traces): timing only, the generated text is meaningless")
    p.add_argument("--lookahead-accuracy", type=float, metavar="A",
                   help="with --routing-trace: forced layers get router lookahead hints from a stand-in right a "
                        "share A of the time (engine/routing_override.py); without it they get none")
    p.add_argument("--timing-pack", action="store_true",
                   help="TIMING ONLY: --experts per layer in a pack whose expert records are file holes (zeros), "
                        "made from the --base-experts pack (bench/timing_pack.py); outputs are meaningless")
    p.add_argument("--base-experts", type=int, default=24,
                   help="with --timing-pack: experts per layer of the real pack it is made from")
    p.add_argument("--tilelang-cache", help="TileLang's kernel cache folder (default: WORKDIR/tilelang-cache, "
                   "empty on a fresh machine, so the first process compiles)")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="profile the host's calls (cProfile) during 8 graphed steps after the timed ones; "
                        "print the top N by own time")
    p.add_argument("--trace", metavar="DIR", help="write a torch.profiler Chrome trace of 4 decode steps per "
                   "configuration to DIR/trace_SHARE.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pack", help=argparse.SUPPRESS)
    p.add_argument("--share", type=float, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return 0
    if a.lookahead_accuracy is not None and (not a.routing_trace or not 0.0 <= a.lookahead_accuracy <= 1.0):
        raise SystemExit("bench.full_depth: --lookahead-accuracy takes a share in [0, 1] and needs --routing-trace "
                         "(without a trace the router's own lookahead runs)")
    if a.routing_trace:  # fail before building anything; the child maps it onto the model
        from engine.routing_override import RoutingTraceError, read_route_csv

        try:
            read_route_csv(a.routing_trace)
        except RoutingTraceError as err:
            raise SystemExit(f"bench.full_depth: {err}") from None
        print(f"routing forced from {a.routing_trace}: timing only", flush=True)
    if not torch.cuda.is_available():
        raise SystemExit("bench.full_depth needs a CUDA GPU")
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if a.timing_pack:
        pack = timing_pack(workdir, a.layers, a.base_experts, a.experts)
    else:
        pack = build_pack(workdir, a.layers, a.experts)
    ceil = ceilings()
    per_token = bytes_per_token(pack)
    print(f"ceilings: HBM copy {ceil['hbm_copy'] / 1e9:.0f} GB/s, pinned H2D {ceil['h2d_pinned'] / 1e9:.1f} GB/s",
          flush=True)
    cache_dir = a.tilelang_cache or str(workdir / "tilelang-cache")
    env = dict(os.environ, TILELANG_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    cache_path = Path(cache_dir)
    first = "warm kernels" if cache_path.is_dir() and any(cache_path.iterdir()) else "cold kernels"
    runs = [(a.shares[0], first)] + ([(a.shares[0], "warm kernels")] if a.warm_repeat else []) + [
        (s, "") for s in a.shares[1:]]
    results = []
    for share, label in runs:
        cmd = [sys.executable, "-m", "bench.full_depth", "--child", "--pack", str(pack), "--share", str(share),
               "--prompts", ",".join(map(str, a.prompts)), "--tokens", str(a.tokens),
               "--max-seq-len", str(a.max_seq_len), "--io-threads", str(a.io_threads),
               "--host-profile", str(a.host_profile), "--followup-tokens", str(a.followup_tokens)]
        if a.host_cache_gb is not None:
            cmd += ["--host-cache-gb", str(a.host_cache_gb)]
        if a.no_tier_fill:
            cmd += ["--no-tier-fill"]
        if a.no_lookahead:
            cmd += ["--no-lookahead"]
        if a.no_guess:
            cmd += ["--no-guess"]
        if a.trace:
            Path(a.trace).mkdir(parents=True, exist_ok=True)
            cmd += ["--trace", a.trace]
        if a.routing_trace:
            cmd += ["--routing-trace", str(Path(a.routing_trace).resolve())]
        if a.lookahead_accuracy is not None:
            cmd += ["--lookahead-accuracy", str(a.lookahead_accuracy)]
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)  # stderr: its progress, shown
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not found:
            sys.stderr.write(proc.stdout[-4000:])
            raise SystemExit(f"bench.full_depth: the {share:.0%} run failed (rc {proc.returncode})")
        r = json.loads(found[-1][len("RESULT "):])
        r["label"] = (label + (" forced routing" if a.routing_trace else "")
                      + (f" lookahead stand-in {a.lookahead_accuracy:.0%}" if a.lookahead_accuracy is not None else "")
                      + (" TIMING PACK" if a.timing_pack else "") + (" no tier fill" if a.no_tier_fill else "")
                      + (" no lookahead" if a.no_lookahead else "") + (" no guessed steps" if a.no_guess else ""))
        r["timing_only"] = a.timing_pack
        r["process_s"] = time.perf_counter() - t
        results.append(r)
        print(f"{share:.0%} {label}: process {r['process_s']:.0f} s, load {r['load_s']:.1f} s "
              f"({', '.join(f'{k} {v:.1f} s' for k, v in r['phases'].items())}), "
              f"kernels {r['kernels_after_load']} at load, {r['kernels_during_chat']} during the chat; "
              f"{r['graph_captures']} graph sets captured, {r['guessed']} steps guessed whole "
              f"({r['guessed_wrong']} redone layer by layer; {r['guessed_chunks']} of them prefill chunk steps, "
              f"{r['guessed_chunks_wrong']} redone), device memory in use {r.get('device_used', 0) / GiB:.2f} GiB "
              f"(allocator's peak reserved {r['peak_reserved'] / GiB:.2f}); "
              f"allocated {r['allocated_before_close'] / GiB:.2f} GiB before close, "
              f"{r['allocated_after_close'] / GiB:.3f} after", flush=True)
        if r["routing"]:
            print(r["routing"], flush=True)
        print("\n".join(r["plan"]), flush=True)
        print()
        print(table(results, ceil, per_token), flush=True)  # after every run: a cut-short bench keeps its rows
        if a.json:
            Path(a.json).write_text(json.dumps({"ceilings": ceil, "bytes_per_token": per_token, "runs": results},
                                               indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
