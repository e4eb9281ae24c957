"""The live figures of an engine: `Gauges` measure the expert cache and the memory budget now;
`StepMeter` turns step results into step updates (windowed tok/s and expert read bandwidth, the last
step's timing, and a memory budget that is re-measured at most every MEMORY_REFRESH_S).

Both are owned by `engine.engine.Engine`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Callable, Iterable

import torch

from engine.config import ModelArgs
from engine.memory import memory_budget
from engine.memory_plan import MemoryPlan
from engine.runtime import StepResult
from engine.stats import CacheSnapshot, MemoryBudget, StepStats, StepTiming, cache_snapshot

RATE_WINDOW = 32  # decode steps in the windowed tok/s and read bandwidth
# Step updates re-measure the memory budget at most this often: a measurement reads /proc (unified
# memory) or queries the CUDA driver and sums every session's state, ~1 ms on this project's CPU
# machine, as long as a whole decode step on the H200.
MEMORY_REFRESH_S = 0.25


class Gauges:
    """The expert cache's figures and the memory budget of one engine, measured when asked."""

    def __init__(self, experts, args: ModelArgs, device: torch.device, plan: MemoryPlan,
                 weights_bytes: int, sessions: Iterable) -> None:
        self.experts, self.args, self.device, self.plan = experts, args, device, plan
        self._weights_bytes, self._sessions = weights_bytes, sessions

    def cache(self) -> CacheSnapshot:
        return cache_snapshot(self.experts.cache, self.args, self.experts.usage.layer_uses, self.experts.tier,
                              self.experts.fill)

    def memory(self) -> MemoryBudget:
        """The MemoryBudget now (engine.memory): `sessions` hold the state."""
        cache = self.cache()
        state = sum(s.nbytes() for s in list(self._sessions))
        budget = memory_budget(self.device, weights=self._weights_bytes, expert_cache=cache.capacity_bytes,
                               state=state, workspace=self.plan.workspace)  # the plan's estimate
        return replace(budget, plan=self.plan.summary())


class StepMeter:
    """Turns step results into `StepStats`; `now()` gives the figures without a new step."""

    def __init__(self, cache_snapshot: Callable[[], CacheSnapshot], memory: Callable[[], object]) -> None:
        self._cache_snapshot, self._measure_memory = cache_snapshot, memory
        self._step_s: deque[float] = deque(maxlen=RATE_WINDOW)  # recent decode step times
        self._reads: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)  # (time, bytes read)
        self._last = (0, 0, StepTiming(), None)  # (tokens, position, timing, ttft) of the last step
        self._phase = "eager"  # how the last step ran: "eager" or "graph replay"
        self._memory: tuple[float, object] | None = None  # (perf_counter, MemoryBudget) of step updates

    def start_turn(self, position: int) -> None:
        """A turn starts at `position`: no step of it has run yet."""
        self._last = (0, position, StepTiming(), None)

    def decode_step(self, seconds: float) -> None:
        """One decode step took `seconds` (token to token), for the windowed tok/s."""
        self._step_s.append(seconds)

    def refresh(self) -> None:
        """Measure the memory budget now, for the step updates of the next MEMORY_REFRESH_S: called
        while the device runs a prompt's last chunk, so that its update, on the path of the
        turn's first token, does not measure."""
        self._memory = (time.perf_counter(), self._measure_memory())

    def step(self, res: StepResult, position: int, ttft: float | None) -> StepStats:
        """The update after step `res`, the state now at `position`."""
        self._last = (res.tokens, position, res.timing, ttft)
        self._phase = "graph replay" if res.graphed else "eager"
        if self._memory is None or time.perf_counter() - self._memory[0] >= MEMORY_REFRESH_S:
            self.refresh()
        return self._stats(self._memory[1])

    def now(self) -> StepStats:
        """The last step's figures with the cache and memory measured now."""
        return self._stats(self._measure_memory())

    def _stats(self, memory) -> StepStats:
        tokens, position, timing, ttft = self._last
        cache = self._cache_snapshot()
        self._reads.append((time.perf_counter(), cache.bytes_read))
        (t0, b0), (t1, b1) = self._reads[0], self._reads[-1]
        steps = list(self._step_s)
        return StepStats(phase=self._phase, tokens=tokens, position=position, timing=timing,
                         tok_per_s=len(steps) / sum(steps) if steps else 0.0, ttft_s=ttft, cache=cache,
                         memory=memory, read_bytes_per_s=(b1 - b0) / (t1 - t0) if t1 > t0 else 0.0)
