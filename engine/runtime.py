"""The prefill / decode loop around the model: chunked prefill, one-token steps, step timing.

`Runtime.step` runs one forward call (a prefill chunk or one decoded token) under the engine's
lock and `torch.inference_mode()`, and returns the last position's logits with the step's wall
time split into attention / MoE compute / expert wait / other. It is `launch` (queue the call on
the device, under the lock) then `finish` (wait for it, not for work queued after it): the
decode loop launches the next step on a sampled token before it reads that token on the host
(`read`), so the host's per-token work overlaps the device's; `settle` waits for launched work,
so that nothing (a flush) changes what a running step reads. `Runtime.prefill` yields one result
per chunk and stops between chunks when `cancel` is set; with a graph runner, a prompt of at most
GRAPHED_PREFILL tokens runs as graphed chunk steps of CHUNK_SLOTS tokens when every expert is
resident or a step guess is ready (`DecodeRunner.chunk`), and otherwise a chunk of at most
SHORT_PREFILL tokens runs as decode steps, one per token.

Timing split: the model's own `timer` sections give attention and the whole MoE (router,
shared and routed experts); the expert provider measures the time the host was blocked on
expert reads inside it (`ExpertProvider.usage.wait_s`: expert wait, taken out of the MoE figure,
or out of a replayed step's graph time; the provider's lookups, holds and hints stay in those);
mHC, embedding and the head are "other".
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import torch

from engine.buckets import chunk_lengths
from engine.chunk_position import CHUNK_SLOTS
from engine.experts.provider import ExpertProvider
from engine.state import SequenceState
from engine.stats import StepTiming


# Layers' expert uses (`ExpertProvider.record_later`) that a launch counts on the host while the
# device runs it: about 2 x 256 cache lookups of the real model, well within a decode step.
SETTLED_PER_LAUNCH = 2

# Prefill chunks this short replay the decode graphs token by token (`Runtime.prefill`) when no
# chunk step runs: 16 replayed steps at 43 layers (~7 ms each on the H200) beat one eager chunk
# (~300 ms of launches).
SHORT_PREFILL = 16
# Prompts of at most this many tokens prefill in graphed chunk steps (`DecodeRunner.chunk`: every
# expert resident, or guessed whole) instead of eager chunks: at 43 layers (H200) a chunk step of
# 16 tokens takes ~29 ms, an eager chunk of any length at least ~125 ms of launches, so four steps
# still win.
GRAPHED_PREFILL = 64


class StepTimer:
    """Accumulates named sections of one step (the model times "attention" and "moe")."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def section(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True)
class Launched:
    """A forward call queued on the device (`Runtime.launch`): its logits, once it has run (None:
    launched without them)."""

    logits: torch.Tensor | None
    tokens: int
    graphed: bool
    timer: StepTimer
    t0: float  # perf_counter at launch
    wait_s: float  # seconds blocked on expert reads while launching (ExpertUsage.wait_s)
    done: torch.cuda.Event | None = None  # recorded after the call's work (CUDA): finish waits for it alone


@dataclass(frozen=True)
class StepResult:
    """One forward call: last-position logits [V] fp32 (on the device), tokens, wall time."""

    logits: torch.Tensor
    tokens: int
    seconds: float
    timing: StepTiming
    graphed: bool = False  # replayed from CUDA graphs (no attention/MoE split inside)


class Runtime:
    """Runs forward calls of one model with its expert provider."""

    def __init__(self, model, experts: ExpertProvider, device: torch.device,
                 lock: threading.RLock, log=None, runner=None) -> None:
        self.model = model
        self.runner = runner  # engine.decode_graph.DecodeRunner for one-token steps, or None
        self.log = log  # optional selection observer passed to forward (e.g. a RoutingTrace)
        self.experts = experts
        self.device = torch.device(device)
        self.lock = lock

    def step(self, state: SequenceState, ids: Sequence[int] | torch.Tensor) -> StepResult:
        """Process `ids` (a prefill chunk, or one token) from state.pos; advances the state."""
        return self.finish(self.launch(state, ids))

    def launch(self, state: SequenceState, ids: Sequence[int] | torch.Tensor, logits: bool = True,
               defer_check: bool = False) -> Launched:
        """Queue the forward call of `step` on the device without waiting for it (on the CPU it
        has run when this returns); the state has advanced. `finish` waits for it. `ids` may be
        a device tensor (a sampled token that the host has not read). Without `logits`, a
        replayed one-token step skips the head (its Launched.logits is None): a prefill token
        whose logits nobody reads. With `defer_check` a one-token step guessed whole through a
        bounded cache is not checked before this returns (engine/decode_graph.py): `confirm`
        must come before the next launch and before a token drawn from its logits is trusted."""
        host = None if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        n = ids.numel() if host is None else len(host)
        timer = StepTimer()
        kwargs = {"timer": timer}
        if self.log is not None:
            kwargs["log"] = self.log
        with self.lock:  # whether a chunk step runs depends on the cache: decided where no flush can come between
            graphed = self.runner is not None and n == 1  # the runner takes the token (host id or tensor) itself
            chunked = not graphed and host is not None and self._chunks(n, host)  # one graphed chunk step
            graphed = graphed or chunked
            x = None if graphed else (ids.reshape(-1).to(self.device, torch.long) if host is None
                                      else self._to_device(host))
            wait0 = self.experts.usage.wait_s
            t0 = time.perf_counter()
            with torch.inference_mode():
                if chunked:
                    out = self.runner.chunk(state, host, logits)
                    out = None if out is None else out[0]
                elif graphed:  # a host token id spares the runner a device read
                    out = self.runner.step(state, ids if host is None else host[0], logits, defer=defer_check)
                    out = None if out is None else out[0]
                else:
                    out = self.model.forward(x, state, self.experts, last_only=True, **kwargs)[0]
            wait = self.experts.usage.wait_s - wait0
            done = None
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
            # the uses that earlier calls' MoEs counted on the device (record_later), counted on
            # the host while the device runs this call, a few layers' at a time: not between a
            # call and its first token, nor all at once before the next step's launch (a long
            # chunk of the real model records up to 43 × 256 uses); the provider's controls and
            # statistics settle them all first
            self.experts.settle_records(wait=False, most=SETTLED_PER_LAUNCH)
        return Launched(out, n, graphed, timer, t0, wait, done)

    def _to_device(self, host: list[int]) -> torch.Tensor:
        """Token ids to the device without waiting for the work queued there (a copy from pinned
        memory: one from pageable memory waits, and a prefill chunk could not be queued while
        the one before it runs)."""
        ids = torch.tensor(host, dtype=torch.long)
        if self.device.type != "cuda":
            return ids.to(self.device)
        return ids.pin_memory().to(self.device, non_blocking=True)

    def finish(self, launched: Launched) -> StepResult:
        """Wait for a launched call (not for work queued after it); its result, timed from its
        launch to this return."""
        if launched.done is not None:
            launched.done.synchronize()
        seconds = time.perf_counter() - launched.t0
        wait, timer = launched.wait_s, launched.timer
        if launched.graphed:  # no sections inside a replay: all but the expert wait is the graph's
            timing = StepTiming(expert_wait_ms=1e3 * wait, graph_ms=1e3 * max(0.0, seconds - wait))
        else:
            attention = timer.seconds.get("attention", 0.0)
            moe = max(0.0, timer.seconds.get("moe", 0.0) - wait)
            other = max(0.0, seconds - attention - moe - wait)
            timing = StepTiming(attention_ms=1e3 * attention, moe_ms=1e3 * moe, expert_wait_ms=1e3 * wait,
                                other_ms=1e3 * other)
        return StepResult(logits=launched.logits, tokens=launched.tokens, seconds=seconds, timing=timing,
                          graphed=launched.graphed)

    def confirm(self) -> torch.Tensor | None:
        """The verdict on the last step launched with `defer_check`, waiting for its blocks only:
        None when it stands (or none waits), else its logits [1, V], the step redone layer by
        layer because its guess was wrong (an expert it routed to was not resident): draw again
        from these, and drop whatever was drawn from the logits it returned."""
        with self.lock:
            return self.runner.confirm() if self.runner is not None else None

    def reserve(self, state: SequenceState, last: int) -> None:
        """Room in `state` for every position up to `last`: its compressed caches grow now, not in
        the middle of a decode (a growth gives the state new buffers, and the decode graphs are
        captured again on the first step of each emission pattern after it, ~25 ms each at 4 Flash
        layers)."""
        with self.lock:
            self.model.reserve(state, last)

    def read(self, token: torch.Tensor) -> Callable[[], int]:
        """Start copying a one-element tensor (a sampled token) to the host; returns a function
        that waits for that copy only, not for work queued after it, and gives the value."""
        if token.device.type != "cuda":
            value = int(token)
            return lambda: value
        host = torch.empty(1, dtype=token.dtype, pin_memory=True)
        host.copy_(token.reshape(1), non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(token.device))

        def value() -> int:
            done.synchronize()
            return int(host[0])
        return value

    def settle(self) -> None:
        """Wait for launched work, check a step launched with `defer_check` (a wrong guess is
        redone now; its logits wait for `confirm`) and count the last graph-replayed step's routes
        (engine.decode_graph.DecodeRunner.settle): before anything evicts experts, and when a
        turn ends."""
        with self.lock:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.experts.settle_records()
            if self.runner is not None:
                self.runner.settle()

    def prefill(self, state: SequenceState, ids: Sequence[int], chunk: int,
                cancel: threading.Event | None = None,
                on_queued: Callable[[], None] | None = None) -> Iterator[StepResult]:
        """Process `ids` in chunks of `chunk` tokens and the remainder in powers of two
        (engine.buckets.chunk_lengths: the kernels see a finite set of shapes), or a prompt of at
        most GRAPHED_PREFILL tokens in chunk steps, each chunk planned when it comes (`_next`),
        one result per chunk, in order. On CUDA each chunk is queued before the one before it is waited for, so
        the host's work for a chunk overlaps the device's for the previous one. Stops before
        queueing a chunk when `cancel` is set (the state then holds the chunks yielded: on CUDA,
        one more than had been yielded when it was set).
        `on_queued()` is called once the last chunk is queued, before it is waited for: work the
        caller queues then (a snapshot's copies of the state after `ids`) runs after it on the
        device, and its host time overlaps the chunk's device time instead of following it.
        """
        start, running, ahead = 0, None, self.device.type == "cuda"
        done_at = None  # perf_counter at the end of the chunk yielded last

        def finished(launched: Launched) -> StepResult:
            """`finish`, timed from the chunk's launch or from the end of the chunk before it if
            that is later (queued ahead, it ran after that one): the chunks' seconds add up to
            the prefill's wall time."""
            nonlocal done_at
            if done_at is not None and done_at > launched.t0:
                launched = replace(launched, t0=done_at)
            res = self.finish(launched)
            done_at = launched.t0 + res.seconds
            return res

        short = len(ids) <= GRAPHED_PREFILL  # chunk steps for a short prompt only
        while start < len(ids):
            if cancel is not None and cancel.is_set():
                break
            length = self._next(ids[start:], chunk, short)
            part = ids[start:start + length]
            launched = (self._graphed_tokens(state, part) if self._graphs_short(length, part)
                        else self.launch(state, part))
            if on_queued is not None and start + length == len(ids):
                on_queued()
            if running is not None:
                yield finished(running)
            running = launched
            start += length
            if not ahead:  # the CPU has run the chunk already: nothing to overlap
                yield finished(running)
                running = None
        if running is not None:
            yield finished(running)

    def chunk_tokens(self) -> int:
        """Token slots of a graphed chunk step when they run now (`DecodeRunner.chunk`), else 0."""
        return CHUNK_SLOTS if self._chunks(2) else 0

    def guesses_steps(self) -> bool:
        """Whether the runner streams through a bounded cache and guesses steps whole
        (engine/step_guess.py): its decode steps then run in two modes, each with its graph sets."""
        return self.runner is not None and self.runner.guesses is not None and not self.runner.prefer_whole

    def reset_guesses(self) -> None:
        """The runner's step-guess policy and counts as they started (`StepGuess.reset`: after the
        warm-up, which forces guesses on a repeated token), if it has one."""
        if self.runner is not None and self.runner.guesses is not None:
            self.runner.guesses.reset()

    def warm_step(self, state: SequenceState, token: int, guess: bool) -> None:
        """The warm-up's decode step of `token` at state.pos, guessed whole (`guess`) or layer by
        layer whatever the runner's policy says (`DecodeRunner.step`), its graph set captured if
        its home lacks it (a guess waits for the reads still pending first, `warm_chunk`). Needs
        `guesses_steps()`."""
        with self.lock, torch.inference_mode():
            if guess:
                self.experts.wait_reads()
            self.runner.step(state, token, logits=True, guess=guess)

    def warm_chunk(self, state: SequenceState, token: int) -> bool:
        """The warm-up's chunk step: CHUNK_SLOTS copies of `token` from state.pos in one graphed
        chunk step whenever the runner runs chunk steps at all, guessed whole through a bounded
        cache whatever its policy says (`DecodeRunner.chunk` with `force`), so that its kernels
        compile and its graphs are captured before the first turn (a read still pending, a
        hint's, is waited for first: a guess reads no slot being written) -> whether it ran."""
        with self.lock:
            self.experts.wait_reads()
            if not (self.runner is not None and self.runner.can_force_chunk()
                    and (self.runner.graphs or self.device.type != "cuda")):
                return False
            with torch.inference_mode():
                self.runner.chunk(state, [token] * CHUNK_SLOTS, logits=True, force=True)
        return True

    def _chunks(self, n: int, ids: Sequence[int] | None = None) -> bool:
        """`n` tokens (2..CHUNK_SLOTS; `ids`, when known) run as one graphed chunk step
        (`DecodeRunner.chunk`: every expert resident, or guessed whole), on CUDA while the runner has graphs (after a failed
        capture an eager chunk step costs more than replayed decode steps: 179 ms for 16 tokens at
        43 layers)."""
        return (self.runner is not None and 1 < n <= CHUNK_SLOTS and self.runner.can_chunk(ids)
                and (self.runner.graphs or self.device.type != "cuda"))

    def _next(self, rest: Sequence[int], chunk: int, short: bool) -> int:
        """The length of the next chunk of a prefill whose tokens left are `rest`: up to CHUNK_SLOTS
        of them in one chunk step when the prompt is `short` (at most GRAPHED_PREFILL tokens) and
        a chunk step runs now on them (`_chunks`: through a bounded cache, guessed whole, their
        hash-layer experts resident), else the first of `chunk_lengths(len(rest), chunk)`. Asked
        before each chunk: after a chunk step guessed wrong the rest of the prompt goes in eager
        chunks (chunk_lengths of a remainder is the rest of its plan), not token by token."""
        n = min(len(rest), CHUNK_SLOTS)
        if short and self._chunks(n, rest[:n]):
            return n
        return chunk_lengths(len(rest), chunk)[0]

    def _graphs_short(self, length: int, ids: Sequence[int] | None = None) -> bool:
        """A chunk of at most SHORT_PREFILL tokens (`ids`, when known) runs as that many decode
        steps of the graph runner when no chunk step runs (a follow-up turn's few new tokens: an
        eager chunk launches the whole depth's kernels one by one, a replay costs one decode step
        per token; and the GEMV kernels of short eager chunks, compiled per row count, are then
        never needed)."""
        return self.runner is not None and length <= SHORT_PREFILL and not self._chunks(length, ids)

    def _graphed_tokens(self, state: SequenceState, ids: Sequence[int]) -> Launched:
        """`ids` one token per replayed decode step, launched back to back, the head only for
        the last; one Launched for them (its logits, timed from the first launch)."""
        first = self.launch(state, ids[:1], logits=len(ids) == 1)
        last, wait = first, first.wait_s
        for i, token in enumerate(ids[1:], 2):
            last = self.launch(state, [token], logits=i == len(ids))
            wait += last.wait_s
        return replace(last, tokens=len(ids), t0=first.t0, wait_s=wait)
