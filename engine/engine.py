"""The engine facade: load a model, run chat sessions, report statistics.

    eng = Engine.load(model_dir, EngineConfig(...), progress=print)
    sess = eng.new_session(system="You are helpful.")
    for ev in eng.generate(sess, "Hi", SamplingParams(temperature=0), cancel=threading.Event()):
        ...  # TextDelta / StepUpdate / TurnFinished / EngineFailure

A turn renders the whole conversation, reuses the longest kept prefix of processed tokens
(engine.session) and prefills only the rest, in chunks of `EngineConfig.prefill_chunk`; then it
decodes one token per step until EOS, `max_tokens` or the context limit. Outcomes:

* success: the session gains the user message and the assistant message; the completion's ids
  are kept (the final sampled token, usually EOS, is processed at the start of the next turn);
* cancelled while decoding: the partial answer is kept as the assistant message with its ids
  (finish_reason "cancelled"); cancelled during prefill: the assistant message is empty and the
  state is rolled back to the turn's start (the next turn prefills the missing prompt);
* failure (context limit, an exception in the model): EngineFailure, session exactly as before.

The engine starts no threads of its own; the expert provider's I/O threads (streaming layout)
are stopped by `close()`.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator
from weakref import WeakSet

import torch

from engine.chat import ChatTokenizer, Message, ThinkingSplitter, bundled_tokenizer_dir, parse_completion
from engine.chat import THINK_START, render_messages
from engine.config import EngineConfig
from engine.events import EngineFailure, Event, LoadProgress, StepUpdate, TurnFinished
from engine.memory import memory_budget, tensor_bytes
from engine.memory_plan import MemoryPlan, make_plan, probe_machine
from engine.model import Transformer
from engine.numerics import Numerics
from engine.decode_graph import make_runner
from engine.runtime import Runtime
from engine.sampling import Sampler, SamplingParams
from engine.session import Session, SessionError, Snapshot
from engine.stats import CacheSnapshot, StepStats, TurnStats, cache_snapshot
from engine.step_meter import StepMeter
from engine.warmup import plan_warmup, run_warmup

ProgressFn = Callable[[LoadProgress], None]


class EngineError(RuntimeError):
    """The engine cannot be used as asked (closed, model directory unusable)."""


def plan_memory(path: str | Path, config: EngineConfig) -> MemoryPlan:
    """The memory plan for the model at `path` on config.device (engine.memory_plan), made from the
    files' headers before anything is allocated; raises MemoryPlanError when it cannot fit."""
    from engine.weights import model_footprint

    return make_plan(model_footprint(path), config, probe_machine(config.device))


class CorruptModelError(EngineError):
    """The model computed non-finite logits: its weights are most likely corrupt."""


def _non_finite(path: Path, converted: bool, generated: int) -> str:
    check = (f"check it with `dsv4-convert --verify {path}`; if that finds nothing, the checkpoint it was "
             "converted from is damaged: download it again and run dsv4-convert again (it converts "
             "what changed)") if converted else (
             f"the checkpoint at {path} is damaged: download it again")
    return (f"the logits after {generated} generated tokens are not finite (NaN or inf): the model's "
            f"weights are most likely corrupt; {check}")


def open_model_files(path: str | Path, config: EngineConfig, plan: MemoryPlan):
    """engine.weights.ModelFiles for `path`: a converted directory (manifest.json) streams its
    experts through a cache of plan.cache bytes on config.device; an official checkpoint keeps every
    expert resident in its mmapped shards (copied to a GPU per use)."""
    from engine.weights import open_model

    return open_model(path, cache_bytes=plan.cache, policy=config.cache_policy,
                      io_threads=config.io_threads, o_direct=plan.direct_reads, device=config.device,
                      host_cache_bytes=plan.host_cache)


class Engine:
    """One loaded model, its tokenizer and expert provider; runs turns of `Session`s."""

    def __init__(self, files, model: Transformer, tokenizer: ChatTokenizer, config: EngineConfig,
                 plan: MemoryPlan | None = None, progress: ProgressFn | None = None) -> None:
        self.files, self.model, self.tokenizer, self.config = files, model, tokenizer, config
        self.plan = plan or plan_memory(files.path, config)
        self.args = files.args
        self.device = torch.device(config.device)
        self._lock = threading.RLock()
        self.experts = files.experts  # engine.experts.provider.ExpertProvider: the model gets it as it is
        self._trace = None
        if config.trace_path:  # record every routing decision as JSONL (engine/experts/trace.py)
            from engine.experts.trace import RoutingTrace, TraceWriter

            self._trace = TraceWriter(config.trace_path)
        log = RoutingTrace(self._trace) if self._trace is not None else None
        loaded = None if progress is None else (
            lambda done, total: progress(LoadProgress("loading experts", done, total, "layers", "into the GPU arena")))
        runner = make_runner(model, self.experts, self.device, config.cuda_graphs, self._graph_routes, loaded)
        self.runtime = Runtime(model, self.experts, self.device, self._lock, log, runner)
        self._sessions: WeakSet[Session] = WeakSet()
        self._closed = False
        self._weights_bytes = tensor_bytes(model)
        self._meter = StepMeter(self._cache_snapshot, self.memory)

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path, config: EngineConfig | None = None, progress: ProgressFn | None = None,
             warmup: bool = True) -> "Engine":
        """Open `path` (converted or official layout), build the model, warm it up."""
        config = config or EngineConfig()
        report = progress or (lambda p: None)
        path = Path(path)
        if not path.is_dir():
            raise EngineError(f"model directory {path} does not exist; convert a checkpoint with "
                              "dsv4-convert or use --demo")
        plan = plan_memory(path, config)
        report(LoadProgress("memory plan", 1, 1, "plan", "; ".join(line.strip() for line in plan.lines()[1:])))
        files = open_model_files(path, config, plan)
        try:
            n = files.args.n_layers
            report(LoadProgress("loading", 0, n, "layers", f"building the model from {path}"))
            device = torch.device(config.device)
            from engine.routing_override import forced_routing
            from kernels.backend import make_backend

            numerics = Numerics.named(config.numerics, make_backend(config.backend, device))
            routing = forced_routing(config.routing_trace, files.args, device)  # timing only (None: the router)
            model = Transformer(lambda name: files.get(name).to(device), files.args, numerics, routing=routing)
            report(LoadProgress("loading", n, n, "layers", "model built"))
            tok_dir = path if (path / "tokenizer.json").is_file() else bundled_tokenizer_dir()
            tokenizer = ChatTokenizer.from_dir(tok_dir)
            if tokenizer.vocab_size > files.args.vocab_size:
                raise EngineError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
                                  f"vocab_size is {files.args.vocab_size}; the checkpoint does not fit it")
            engine = cls(files, model, tokenizer, config, plan, progress)
        except BaseException:
            files.close()
            raise
        if warmup:
            try:
                engine.warm_up(report)
            except BaseException:
                engine.close()
                raise
        return engine

    def warm_up(self, progress: ProgressFn | None = None) -> None:
        """Run every shape bucket once on scratch states (engine/warmup.py): with the TileLang
        kernels this compiles each of them, or loads it from TileLang's on-disk cache, so that
        nothing compiles during a chat; with the torch reference, one short prefill and decode."""
        self._open()
        full = self.config.backend == "tilelang"
        phase = "compiling kernels" if full else "warm-up"
        report = progress or (lambda p: None)
        steps = plan_warmup(self.args, self.config, full)

        def step(done: int, total: int, what: str) -> None:
            report(LoadProgress(phase, done, total, "shapes", what))

        run_warmup(steps, self.runtime, self.model, self.tokenizer.bos_id, self.config.max_seq_len, step)

    @property
    def info(self) -> dict:
        self._open()
        a, runner = self.args, self.runtime.runner
        decode = "eager" if runner is None or not runner.graphs else "CUDA graphs"
        return {"model": self.files.path.name, "path": str(self.files.path), "n_layers": a.n_layers,
                "n_experts": a.n_routed_experts, "demo": (a.dim, a.n_layers) != (4096, 43),
                "device": str(self.device), "numerics": self.config.numerics, "vocab_size": a.vocab_size,
                "max_seq_len": self.config.max_seq_len,
                "experts": "streaming" if self.experts.cache is not None else "resident",
                "backend": self.config.backend, "decode": decode,
                "decode_note": runner.capture_error if runner is not None else None,
                "memory_plan": self.plan.lines()}

    def close(self) -> None:
        """Stop the expert provider's threads, release the model files, and give back every byte
        the engine holds: the weights, the expert arena, the CUDA graphs and their pools, and the
        states of its sessions (which can no longer be used). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._trace is not None:
                self._trace.close()
            if self.runtime.runner is not None:
                self.runtime.runner.close()  # CUDA graphs hold their memory pools while they live
            self.files.close()
            for session in list(self._sessions):
                session.release()
            self._sessions.clear()
            self.runtime = self.model = self.experts = self._meter = None
            self.files.experts = None
        gc.collect()  # the model's modules hold reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------- sessions
    def new_session(self, system: str | None = None, history: list[Message] | tuple = ()) -> Session:
        """A fresh session; `history` (user/assistant messages) is prefilled with the first turn."""
        session = Session(self.model.new_state, system, history, owner=self)
        self._sessions.add(session)
        return session

    def _open(self) -> None:
        if self._closed:
            raise EngineError("the engine is closed")

    def _check(self, session: Session) -> None:
        self._open()
        if session.owner is not self:
            raise SessionError("this session belongs to another engine")

    def generate(self, session: Session, user_text: str, params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Answer `user_text` in `session`; yields events, the last one TurnFinished or EngineFailure."""
        self._check(session)
        return self._turn(session, list(session.messages), user_text, params, cancel or threading.Event())

    def regenerate(self, session: Session, params: SamplingParams,
                   cancel: threading.Event | None = None) -> Iterator[Event]:
        """Drop the last answer and answer the last user message again (same events)."""
        self._check(session)
        msgs = session.messages
        if len(msgs) < 2 or msgs[-1].role != "assistant" or msgs[-2].role != "user":
            raise SessionError("nothing to regenerate: the conversation does not end with an answer")
        return self._turn(session, msgs[:-2], msgs[-2].content, params, cancel or threading.Event())

    def undo(self, session: Session) -> None:
        """Drop the last user message and its answer; the state rewinds to a snapshot."""
        self._check(session)
        users = [i for i, m in enumerate(session.messages) if m.role == "user"]
        if not users:
            raise SessionError("nothing to undo")
        with self._lock:
            session.rewind(session.messages[:users[-1]])

    # ---------------------------------------------------------------------------- a turn
    def _turn(self, session: Session, base: list[Message], user_text: str, params: SamplingParams,
              cancel: threading.Event) -> Iterator[Event]:
        t_start = time.perf_counter()
        tok, limit = self.tokenizer, self.config.max_seq_len
        user = Message("user", user_text)
        prompt_text = render_messages(session.conversation(base + [user]), params.thinking)
        plan = session.plan(prompt_text, tok.encode)
        if plan.prompt_tokens >= limit:
            yield EngineFailure(f"the conversation would be {plan.prompt_tokens} tokens, over the context limit "
                                f"of {limit} tokens (max_seq_len): start a new conversation or raise max_seq_len")
            return
        turn_start = session.live.copy() if plan.from_live and session.live.length else None
        work = session.start(plan)
        self._meter.start_turn(work.state.pos)
        committed = False
        try:
            prefill_s, logits = yield from self._prefill(session, work, plan, prompt_text, params, cancel)
            if logits is None:  # cancelled during prefill: state as before the turn, messages kept
                back = turn_start if plan.from_live else plan.base
                session.commit(back.copy() if back is not None and back.length else self._empty(),
                               base + [user, Message("assistant", "")])
                committed = True
                yield TurnFinished(self._turn_stats(plan, [], prefill_s, [], 0.0, "cancelled"), "", "")
                return
            if turn_start is not None:
                session.keep(turn_start)  # the end of the previous turn: undo comes back here
            if plan.suffix:
                work.text, work.logits = prompt_text, logits
                session.keep(work.copy())  # after the prompt: regenerate starts here
                work.logits = None
            completion, step_ms, ttft, finish = yield from self._decode(work, plan, params, cancel, logits, t_start)
            completion_text = tok.decode(completion)
            reasoning, content = parse_completion(completion_text, params.thinking)
            work.text = prompt_text + completion_text
            session.commit(work, base + [user, Message("assistant", content, reasoning)])
            committed = True
            yield TurnFinished(self._turn_stats(plan, completion, prefill_s, step_ms, ttft, finish), reasoning, content)
        except Exception as exc:  # the model failed: the session is left as it was (finally)
            if not committed:
                yield EngineFailure(f"the turn failed: {type(exc).__name__}: {exc}")
        finally:
            if not committed and plan.from_live:  # failed or abandoned: roll the live state back
                session.live = turn_start.copy() if turn_start is not None else self._empty()

    def _empty(self) -> Snapshot:
        return Snapshot("", [], self.model.new_state())

    def _prefill(self, session: Session, work: Snapshot, plan, prompt_text: str, params: SamplingParams,
                 cancel: threading.Event):
        """Run plan.suffix into work (chunked); returns (seconds, last logits or None if cancelled).

        In thinking mode the final `<think>` runs as its own step after a snapshot, so that the
        next turn (which drops this turn's reasoning) can resume right before it."""
        suffix, think = plan.suffix, self.tokenizer.think_start_id
        parts = [suffix]
        if params.thinking and len(suffix) > 1 and suffix[-1] == think and prompt_text.endswith(THINK_START):
            parts = [suffix[:-1], suffix[-1:]]
        seconds, logits = 0.0, plan.base.logits
        for i, part in enumerate(parts):
            done = 0
            for res in self.runtime.prefill(work.state, part, self.config.prefill_chunk, cancel):
                work.ids += part[done:done + res.tokens]
                done += res.tokens
                seconds += res.seconds
                logits = res.logits
                yield StepUpdate(self._meter.step(res, work.state.pos, None))
            if done < len(part):
                return seconds, None
            if i == 0 and len(parts) == 2:
                work.pending, work.logits = [], logits
                work.text = prompt_text[: -len(THINK_START)]
                session.keep(work.copy())
        work.pending, work.logits = [], None
        return seconds, logits

    def _decode(self, work: Snapshot, plan, params: SamplingParams, cancel: threading.Event,
                logits: torch.Tensor, t_start: float):
        """Sample and run one token per step; yields text deltas and step stats.

        Each sampled token is launched as the next step before the host reads it (one transfer
        per token, waiting for the sampler only), and the sampler is queued on a step's logits
        before that step has run, so the device always holds the next step while the host
        detokenises, reports and queues the one after. The token that reaches the length limit
        is not run: it is left in work.pending. An EOS has been run by then (its logits are
        dropped; the next turn would run it first anyway). The state's caches are first grown for
        the whole turn, so that no step in it re-captures the decode graphs. Returns (completion
        ids, step times in ms, ttft s, finish reason)."""
        tok = self.tokenizer
        sampler = Sampler(params, logits.device)
        splitter = ThinkingSplitter(tok, params.thinking)
        max_new = min(params.max_tokens, self.config.max_seq_len - plan.prompt_tokens)
        self.runtime.reserve(work.state, work.state.pos + max_new)  # no growth mid-turn
        completion: list[int] = []
        step_ms: list[float] = []
        ttft, finish = 0.0, "cancelled"
        ahead = None  # the step launched on the last sampled token; `logits` are its output
        t0 = time.perf_counter()
        try:
            while not cancel.is_set():
                chosen = sampler(logits)  # queued after the step that writes `logits`
                last = len(completion) + 1 >= max_new  # this token ends the turn, whatever it is
                # its copy to the host starts first; -1 if the logits row is not finite (same copy)
                value = self.runtime.read(torch.where(torch.isfinite(logits).all(), chosen, -1))
                ran, ahead = ahead, (None if last else self.runtime.launch(work.state, chosen.reshape(1)))
                token = value()  # the one host transfer per token: `ran` has run by now
                if token < 0:
                    raise CorruptModelError(_non_finite(self.files.path, self.files.converted, len(completion)))
                completion.append(token)
                if ahead is not None:
                    work.ids.append(token)
                if ran is not None:
                    res = self.runtime.finish(ran)
                    now = time.perf_counter()
                    step_ms.append(1e3 * (now - t0))
                    self._meter.decode_step(now - t0)
                    t0 = now
                    yield StepUpdate(self._meter.step(res, work.state.pos - (ahead is not None), ttft))
                if len(completion) == 1:
                    ttft = time.perf_counter() - t_start
                yield from splitter.push(token)
                if token == tok.eos_id or last:
                    finish = "eos" if token == tok.eos_id else (
                        "max_tokens" if len(completion) >= params.max_tokens else "context")
                    if ahead is None:
                        work.pending = [token]
                    break
                logits = ahead.logits
        finally:
            if ahead is not None:  # the EOS's step, or a step left running when the turn was closed
                self.runtime.finish(ahead)
            self.runtime.settle()  # the last replayed step's routes (usage counts, trace)
        yield from splitter.flush()
        return completion, step_ms, ttft, finish

    def _turn_stats(self, plan, completion: list[int], prefill_s: float, step_ms: list[float], ttft: float,
                    finish: str) -> TurnStats:
        decode_s = sum(step_ms) / 1e3
        return TurnStats(prompt_tokens=plan.prompt_tokens, completion_tokens=len(completion), prefill_s=prefill_s,
                         decode_s=decode_s, ttft_s=ttft, tok_per_s=len(step_ms) / decode_s if decode_s else 0.0,
                         finish_reason=finish, cache=self._cache_snapshot(), step_ms=tuple(step_ms),
                         prefill_tokens=len(plan.suffix), reused_tokens=plan.reused)

    # ---------------------------------------------------------------------------- cache control
    def flush_cache(self) -> int:
        """Evict every unpinned expert; returns how many (0 when every expert is resident)."""
        self._open()
        with self._lock:
            self.runtime.settle()  # a replayed step's routes name experts that must still be resident
            return len(self.experts.flush())

    def pin(self, keys: list[tuple[int, int]]) -> None:
        """Keep these (layer, expert) pairs resident through flushes (their reads start now).
        All or none: raises ExpertCacheError, pinning nothing, when the pins would leave fewer
        free slots than one layer's routed experts need."""
        for layer, expert in keys:
            if not (0 <= layer < self.args.n_layers and 0 <= expert < self.args.n_routed_experts):
                raise SessionError(f"no expert {layer}:{expert} (layers 0-{self.args.n_layers - 1}, "
                                   f"experts 0-{self.args.n_routed_experts - 1})")
        with self._lock:
            self._open()
            self.experts.pin(keys)

    def pin_hot(self, n: int) -> list[tuple[int, int]]:
        """Pin the n most used experts; returns them."""
        self._open()
        with self._lock:
            keys = self.experts.hottest(n)
            self.pin(keys)
            return keys

    def unpin(self, keys: list[tuple[int, int]] | None = None) -> None:
        """Unpin these experts, or all of them (None)."""
        self._open()
        with self._lock:
            self.experts.unpin(keys)

    def cache_contents(self) -> list[tuple[int, int, bool, int]]:
        """(layer, expert, pinned, uses) of every resident expert, sorted; uses are all-time."""
        self._open()
        with self._lock:
            return self.experts.contents()

    # ---------------------------------------------------------------------------- statistics
    def stats(self) -> StepStats:
        """A snapshot now: cache, memory, and the last step's timing."""
        self._open()
        return self._meter.now()

    def _graph_routes(self, layer: int, position: int, ids: list[int]) -> None:
        """Routing decisions of a graph-replayed step, for the trace if recording (the provider
        counts their uses itself)."""
        if self.runtime.log is not None:
            self.runtime.log("experts", layer, position, torch.tensor([ids]))

    def _cache_snapshot(self) -> CacheSnapshot:
        return cache_snapshot(self.experts.cache, self.args, self.experts.usage.layer_uses)

    def workspace_bytes(self) -> int:
        """Estimate of transient memory of the largest step: a prefill chunk's residual streams and
        temporaries (8 stream-sized fp32 buffers) plus one row of logits."""
        a = self.args
        return self.config.prefill_chunk * a.hc_mult * a.dim * 4 * 8 + a.vocab_size * 4

    def memory(self):
        """The MemoryBudget now (engine.memory)."""
        self._open()
        cache = self._cache_snapshot()
        state = sum(s.nbytes() for s in list(self._sessions))
        budget = memory_budget(self.device, weights=self._weights_bytes, expert_cache=cache.capacity_bytes,
                               state=state, workspace=self.workspace_bytes())
        return replace(budget, plan=self.plan.summary())
