"""The warm-up at load: every shape bucket a chat can reach runs once, so that every kernel is
compiled (or loaded from TileLang's on-disk cache) before the first prompt, never during a chat.

On scratch states (discarded afterwards):

1. prefill chunks of every length in `engine.buckets.chunk_buckets(prefill_chunk)` (with a graph
   runner, only those longer than SHORT_PREFILL, and one of SHORT_PREFILL + 1 tokens: shorter
   chunks replay the decode step);
2. for every compressed-cache capacity up to `max_seq_len` (`engine.buckets.capacity_buckets`),
   the one-token decode step (the graph runner's path on CUDA) at positions whose steps complete
   no window, a ratio-4 window, and ratio-4 and ratio-128 windows at once — the three control
   flows of a decode step (`Transformer.emitting`; through a bounded cache whose steps are guessed
   whole, each both layer by layer and guessed) — on a state whose caches have exactly that
   capacity (the smallest one, too small for the position where every window completes, runs
   just below its last position: the first decode steps of a short chat), then, where the
   runtime runs graphed chunk steps (every expert resident, or guessed whole through a bounded
   cache), one chunk step on a state of that capacity (a short prompt's or a follow-up turn's
   prefill replays its graph).

With the torch reference backend nothing compiles, so `plan_warmup(..., full=False)` keeps only
one short prefill and one decode step (the CPU path's first-call costs).

On the TileLang backend (`warm_up_kernels`), the first full warm-up for a kernel manifest key
(engine/kernel_manifest.py) first compiles, in parallel, the kernel hints for the engine's shapes
(the hint files shipped with the engine and the other manifests in TileLang's cache), then runs
the steps (which find those kernels built) and writes the manifest of the kernels built; a later
load replays the manifest first (each kernel loaded from TileLang's on-disk cache, in parallel,
"loading kernels k/n"), then runs the same steps ("warming up"), which find every kernel built:
what else a step pays on first use belongs to the process (the decode graphs of every cache
capacity, cuBLAS's per-shape setup). With the kernels built and the steps left to the first
turns (H200, 43 layers), fresh conversations decoded at 58 tok/s instead of 140 while they
captured their graphs.
A manifest that cannot be used is reported in one progress message, and the full warm-up runs
and rewrites it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from engine.buckets import chunk_buckets, chunk_lengths, decode_capacities, decode_ratio
from engine.config import EngineConfig, ModelArgs
from engine.runtime import SHORT_PREFILL
from engine.sampling import Sampler, SamplingParams, checked
from engine.events import LoadProgress
from engine.kernel_manifest import (ManifestError, built_calls, hint_sources, kernels_source_digest, manifest_key,
                                    manifest_path, read_hints, read_manifest, replay, shape_key, tilelang_cache_dir,
                                    write_manifest)

# A base position whose next five decode steps complete: a ratio-4 window (123), none (124..126),
# ratio-4 and ratio-128 windows (127).
DECODE_BASE = 123
DECODE_STEPS = 5


@dataclass(frozen=True)
class WarmupStep:
    """One unit of warm-up work: a prefill chunk of `tokens` on a fresh state, or the decode
    steps on a state whose compressed caches are grown to `capacity` entries (ratio-4 layers)."""

    kind: str  # "prefill" or "decode"
    tokens: int = 0
    capacity: int = 0
    base: int = 0  # decode: the position the steps start from (a state prefilled that far)
    last: int = 0  # decode: the position the state's caches are reserved for (capacity entries)

    def describe(self) -> str:
        if self.kind == "prefill":
            return f"prefill chunk of {self.tokens} tokens"
        return f"decode steps, compressed caches of {self.capacity} entries"


def plan_warmup(args: ModelArgs, config: EngineConfig, full: bool, graphed_short: bool = False) -> list[WarmupStep]:
    """The steps of the warm-up (see the module docstring). `graphed_short`: prefill chunks of at
    most SHORT_PREFILL tokens replay the decode step (engine/runtime.py, a graph runner exists),
    so their buckets are left out: the decode steps compile what they need. (On a fresh H200
    those buckets, 16 tokens and fewer, took 262 of the 385 s of the first load's compiles.)"""
    if not full:
        return [WarmupStep("prefill", tokens=1), WarmupStep("decode", capacity=0)]
    steps = [WarmupStep("prefill", tokens=n) for n in chunk_buckets(config.prefill_chunk)
             if not (graphed_short and n <= SHORT_PREFILL)]
    if graphed_short and config.prefill_chunk > SHORT_PREFILL:
        # the shortest eager chunk: its routed experts take the grouped GEMV (too few cells per
        # expert for the dequantising path, which the longer buckets' repeated token takes)
        steps.append(WarmupStep("prefill", tokens=SHORT_PREFILL + 1))
    capacities = decode_capacities(args, config.max_seq_len)
    if not capacities:
        return steps + [WarmupStep("decode", capacity=0)]
    ratio = decode_ratio(args)
    decode = []
    for cap in capacities:
        last = min((cap - 1) * ratio, config.max_seq_len)  # reserving for this position makes `cap` entries
        # DECODE_BASE's steps complete every kind of window; a capacity too small for their
        # entries runs its last steps before growing (windows of the smallest ratio, and none)
        fits = (DECODE_BASE + DECODE_STEPS) // ratio <= cap
        base = DECODE_BASE if fits else max(0, cap * ratio - DECODE_STEPS)
        decode.append(WarmupStep("decode", capacity=cap, base=base, last=last))
    return steps + decode


def run_warmup(steps: list[WarmupStep], runtime, model, token: int, max_seq_len: int,
               progress: Callable[[int, int, str], None]) -> None:
    """Run `steps` on scratch states through `runtime` (engine.runtime.Runtime); `progress(done,
    total, what)` is called before each step and once at the end."""
    bases = {}  # base position -> a state prefilled that far
    total = len(steps)
    for i, step in enumerate(steps):
        progress(i, total, step.describe())
        if step.kind == "prefill":
            runtime.step(model.new_state(), [token] * step.tokens)
            continue
        if step.capacity == 0:  # the short form: one decode step after one token
            state = model.new_state()
            runtime.step(state, [token])
            runtime.step(state, [token])
            _chunk_step(runtime, model, token, 0)
            continue
        start = min(step.base, max_seq_len - DECODE_STEPS)
        if start not in bases:
            bases[start] = model.new_state()
            for n in chunk_lengths(start, 64):
                runtime.step(bases[start], [token] * n)
        state = bases[start].clone()
        runtime.reserve(state, step.last)
        # through a bounded cache steps run layer by layer or guessed whole: both modes' graph sets
        for guess in ((False, True) if runtime.guesses_steps() else (None,)):
            scratch = state.clone() if guess is False else state
            for _ in range(min(DECODE_STEPS, max_seq_len - scratch.pos)):
                if guess is None:
                    runtime.step(scratch, [token])
                else:
                    runtime.warm_step(scratch, token, guess)
            runtime.settle()
        _chunk_step(runtime, model, token, step.last)
    progress(total, total, "kernels ready")


def _chunk_step(runtime, model, token: int, last: int) -> None:
    """One graphed chunk step (engine.decode_graph.DecodeRunner.chunk), when the runtime runs
    them at all (`Runtime.warm_chunk`: through a bounded cache, guessed whole whatever the guess
    policy says), on a fresh state with the caches of the decode steps before it (reserved up to
    `last`): its graph is captured on their home, the one a conversation of that capacity replays."""
    state = model.new_state()
    runtime.reserve(state, last)
    if runtime.warm_chunk(state, token):
        runtime.settle()


# Threads replaying a manifest (each call: a kernel module built into a TileLang program, then
# TileLang's cache lookup and library load). Not measured against 1 (sequential) on a GPU yet.
REPLAY_WORKERS = 4
COMPILING = "compiling kernels"
LOADING = "loading kernels"
PRECOMPILING = "precompiling kernels"
WARMING = "warming up"


def warm_sampling(runtime, vocab_size: int, device: torch.device) -> None:
    """Run the decode loop's per-token work once outside the model, on a row of zero logits:
    greedy and filtered sampling (engine/sampling.py), the finiteness check and the read of the
    chosen id (`Runtime.read`). On CUDA their kernels' modules load on first launch and the first
    read allocates its pinned buffer: without this the first turn after a load paid that in its
    first decode step."""
    logits = torch.zeros(1, vocab_size, device=device)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_p=0.95, top_k=40, seed=0)):
        chosen = Sampler(params, device)(logits)
        runtime.read(checked(chosen, logits))()


def precompile_workers() -> int:
    """Threads compiling kernel hints: one per CPU (a compile is mostly the CUDA compiler, a
    child process), at most 16."""
    return max(1, min(16, os.cpu_count() or 1))


@dataclass(frozen=True)
class KernelManifest:
    """Where the manifest for one engine's kernels lives (`path`), its `key`, the kernel factories
    (qualified name -> kernels.toolkit.KernelFactory) it records and replays, what a replay
    thread runs before each call (`worker_setup`: the engine makes the loading thread's CUDA device
    current), and the engine's shape key and hint files (a first full warm-up compiles the hints
    for its shapes in parallel first)."""

    path: Path
    key: str
    factories: Mapping[str, object]
    worker_setup: Callable[[], None] | None = None
    shape: str = ""  # kernel_manifest.shape_key: hints are read for it
    hints: tuple[Path, ...] = ()  # files of hints (kernel_manifest.hint_sources)


def engine_manifest(args: ModelArgs, config: EngineConfig, converted: bool, device: torch.device,
                    resident: bool, steps: list[WarmupStep]) -> KernelManifest:
    """The manifest of an engine on the TileLang backend: the kernels package's factories, in
    TileLang's cache folder (tilelang_cache_dir), keyed for this model, config, GPU and TileLang,
    for a resident or a streamed expert cache (`resident`) and for the full warm-up's `steps`."""
    import tilelang

    from kernels.backend import kernel_factories, kernel_modules
    from kernels.toolkit import cuda_arch

    key = manifest_key(args, config, converted, cuda_arch(device), tilelang.__version__, kernels_source_digest(),
                       resident, tuple(dataclasses.astuple(step) for step in steps))
    current = torch.cuda.current_device()
    cache = tilelang_cache_dir()
    path = manifest_path(cache, key)
    return KernelManifest(path, key, kernel_factories(kernel_modules()), lambda: torch.cuda.set_device(current),
                          shape_key(args, config, converted, cuda_arch(device), tilelang.__version__),
                          tuple(p for p in hint_sources(cache) if p != path))


def warm_up_kernels(steps: list[WarmupStep], run: Callable[[Callable[[int, int, str], None]], None],
                    manifest: KernelManifest, report: Callable[[LoadProgress], None],
                    workers: int = REPLAY_WORKERS, hint_workers: int | None = None) -> bool:
    """Build every kernel of the engine before the first prompt. When `manifest` exists: replay it
    on `workers` threads ("loading kernels" progress) and return True. Otherwise, or when the
    replay fails (one progress message says why): the kernel hints for the engine's shapes are
    compiled on `hint_workers` threads (default `precompile_workers()`; "precompiling kernels"
    progress; a hint that fails is skipped), then `run(progress)` runs `steps` (run_warmup;
    "compiling kernels" progress: what the hints missed), the manifest of every kernel the
    factories have built is written, and False is returned."""
    if manifest.path.is_file():
        try:
            calls = read_manifest(manifest.path, manifest.key, manifest.factories)
            try:
                replay(calls, manifest.factories, workers,
                       lambda done, total: report(LoadProgress(LOADING, done, total, "kernels",
                                                               "kernels ready" if done == total else
                                                               "from TileLang's cache")),
                       manifest.worker_setup)
            except ManifestError as err:
                raise ManifestError(f"kernel manifest {manifest.path}: {err}") from err
            return True
        except ManifestError as err:
            report(LoadProgress(COMPILING, 0, len(steps), "shapes", f"{err}; running the full warm-up instead"))
    hints = read_hints(manifest.hints, manifest.shape, manifest.factories) if manifest.shape else []
    if hints:
        failed: list[str] = []
        replay(hints, manifest.factories, precompile_workers() if hint_workers is None else hint_workers,
               lambda done, total: report(LoadProgress(PRECOMPILING, done, total, "kernels",
                                                       "hints compiled" if done == total else "kernel hints")),
               manifest.worker_setup, failed)
        if failed:
            report(LoadProgress(PRECOMPILING, len(hints), len(hints), "kernels",
                                f"{len(failed)} kernel hint(s) failed and were skipped (first: {failed[0]})"))
    run(lambda done, total, what: report(LoadProgress(COMPILING, done, total, "shapes", what)))
    try:
        write_manifest(manifest.path, manifest.key, built_calls(manifest.factories), manifest.shape)
    except (OSError, ManifestError) as err:
        report(LoadProgress(COMPILING, len(steps), len(steps), "shapes",
                            f"the kernel manifest {manifest.path} was not written ({err}); the next load "
                            "runs the full warm-up again"))
    return False
