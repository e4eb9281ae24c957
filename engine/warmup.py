"""The warm-up at load: every shape bucket a chat can reach runs once, so that every kernel is
compiled (or loaded from TileLang's on-disk cache) before the first prompt, never during a chat.

On scratch states (discarded afterwards):

1. prefill chunks of every length in `engine.buckets.chunk_buckets(prefill_chunk)`;
2. for every compressed-cache capacity up to `max_seq_len` (`engine.buckets.capacity_buckets`),
   the one-token decode step (the graph runner's path on CUDA) at positions whose steps complete
   no window, a ratio-4 window, and ratio-4 and ratio-128 windows at once — the three control
   flows of a decode step (`Transformer.emitting`).

With the torch reference backend nothing compiles, so `plan_warmup(..., full=False)` keeps only
one short prefill and one decode step (the CPU path's first-call costs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.buckets import capacity_buckets, chunk_buckets, chunk_lengths
from engine.config import EngineConfig, ModelArgs

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

    def describe(self) -> str:
        if self.kind == "prefill":
            return f"prefill chunk of {self.tokens} tokens"
        return f"decode steps, compressed caches of {self.capacity} entries"


def plan_warmup(args: ModelArgs, config: EngineConfig, full: bool) -> list[WarmupStep]:
    """The steps of the warm-up (see the module docstring)."""
    if not full:
        return [WarmupStep("prefill", tokens=1), WarmupStep("decode", capacity=0)]
    steps = [WarmupStep("prefill", tokens=n) for n in chunk_buckets(config.prefill_chunk)]
    ratio = min((r for r in args.compress_ratios[:args.n_layers] if r), default=0)
    caps = capacity_buckets(config.max_seq_len, ratio) if ratio else [0]
    return steps + [WarmupStep("decode", capacity=c) for c in caps]


def run_warmup(steps: list[WarmupStep], runtime, model, token: int, max_seq_len: int,
               progress: Callable[[int, int, str], None]) -> None:
    """Run `steps` on scratch states through `runtime` (engine.runtime.Runtime); `progress(done,
    total, what)` is called before each step and once at the end."""
    base = None
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
            continue
        if base is None:
            base = model.new_state()
            start = min(DECODE_BASE, max_seq_len - DECODE_STEPS)
            for n in chunk_lengths(start, 64):
                runtime.step(base, [token] * n)
        state = base.clone()
        ratio_4_last = (step.capacity - 1) * 4  # the last position whose entry fits `capacity`
        runtime.reserve(state, min(ratio_4_last, max_seq_len))
        for _ in range(min(DECODE_STEPS, max_seq_len - state.pos)):
            runtime.step(state, [token])
        runtime.settle()
    progress(total, total, "kernels ready")
