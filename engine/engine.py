"""The engine facade: load a model, run chat sessions, report statistics.

    eng = Engine.load(model_dir, EngineConfig(...), progress=print)
    sess = eng.new_session(system="You are helpful.")
    for ev in eng.generate(sess, "Hi", SamplingParams(temperature=0), cancel=threading.Event()):
        ...  # TextDelta / StepUpdate / TurnFinished / EngineFailure

A turn (prefill of what the session has not processed, then the pipelined decode loop) and its
outcomes are engine/turn.py's.

The engine keeps no threads of its own (the warm-up's kernel-replay threads, engine/warmup.py,
are joined before it returns); the expert provider's I/O threads (streaming layout) are stopped by
`close()`.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, Generator
from weakref import WeakSet

import torch

from engine.chat import ChatTokenizer, Message
from engine.config import EngineConfig
from engine.decode_graph import make_runner
from engine.demo_marker import is_demo_model
from engine.errors import EngineError
from engine.events import ContextOverflow, Event, LoadProgress
from engine.graph_homes import homes_for
from engine.loading import build_model, load_tokenizer, open_model_files, plan_memory
from engine.memory_plan import MemoryPlan
from engine.model import Transformer
from engine.runtime import Runtime
from engine.sampling import SamplingParams
from engine.session import Session, SessionError
from engine.stats import MemoryBudget, StepStats
from engine.step_meter import Gauges, StepMeter
from engine.turn import Turns
from engine.warmup import WARMING, engine_manifest, plan_warmup, run_warmup, warm_sampling, warm_up_kernels

ProgressFn = Callable[[LoadProgress], None]


class Engine:
    """One loaded model, its tokenizer and expert provider; runs turns of `Session`s."""

    def __init__(self, files, model: Transformer, tokenizer: ChatTokenizer, config: EngineConfig,
                 plan: MemoryPlan | None = None, progress: ProgressFn | None = None) -> None:
        self.files, self.model, self.tokenizer, self.config = files, model, tokenizer, config
        self.plan = plan or plan_memory(files.path, config)
        self.args = files.args
        self.device = torch.device(config.device)
        self.demo = is_demo_model(files.path)  # the directory says so (engine/demo_marker.py)
        self._lock = threading.RLock()
        self.experts = files.experts  # engine.experts.provider.ExpertProvider: the model gets it as it is
        self._trace = None
        if config.trace_path:  # record every routing decision as JSONL (engine/experts/trace.py)
            from engine.experts.trace import RoutingTrace, TraceWriter

            self._trace = TraceWriter(config.trace_path)
        log = RoutingTrace(self._trace) if self._trace is not None else None
        loaded = None if progress is None else (
            lambda done, total: progress(LoadProgress("loading experts", done, total, "layers", "into the GPU arena")))
        routes = self._graph_routes if log is not None else None  # graphed steps' routes: for the trace only
        runner = make_runner(model, self.experts, self.device, config.cuda_graphs, routes, loaded,
                             homes_for(files.args, config.max_seq_len), config.guess_whole_steps)
        self.runtime = Runtime(model, self.experts, self.device, self._lock, log, runner)
        self._sessions: WeakSet[Session] = WeakSet()
        self._closed = False
        self._gauges = Gauges(self.experts, self.args, self.device, self.plan, model.weight_bytes,
                              self._sessions)
        self._meter = StepMeter(self._gauges.cache, self.memory)
        self._turns = Turns(files, model, tokenizer, config, self.runtime, self._meter, self._gauges.cache)

    # ---------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path, config: EngineConfig | None = None, progress: ProgressFn | None = None,
             warmup: bool = True) -> "Engine":
        """Open `path` (converted or official layout), build the model, warm it up."""
        config = config or EngineConfig()
        report = progress or (lambda p: None)
        path = Path(path)
        if not path.is_dir():
            what = "is a file, not a model directory" if path.exists() else "does not exist"
            raise EngineError(f"model directory {path} {what}; give the directory of a converted model "
                              "(convert a checkpoint with dsv4-convert) or use --demo")
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"device {config.device!r}: this machine has no usable CUDA GPU "
                              "(torch.cuda.is_available() is false); use --device cpu")
        plan = plan_memory(path, config)
        report(LoadProgress("memory plan", 1, 1, "plan", "; ".join(line.strip() for line in plan.lines()[1:])))
        files = open_model_files(path, config, plan)
        if files.host_cache < plan.host_cache:  # the system would not pin that much host RAM
            plan = replace(plan, host_cache=files.host_cache, notes=plan.notes + (
                f"the host RAM tier was planned at {plan.host_cache / 2**30:.2f} GiB but only "
                f"{files.host_cache / 2**30:.2f} GiB could be pinned (a locked-memory or container limit); "
                "the tier uses that",))
            report(LoadProgress("memory plan", 1, 1, "plan", plan.notes[-1]))
        try:
            model = build_model(path, files, config, report)
            engine = cls(files, model, load_tokenizer(path, files.args.vocab_size), config, plan, progress)
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
        nothing compiles during a chat (a later load replays the kernel manifest the first one
        wrote instead, loading the kernels in parallel, then runs the steps, which find them
        built); with the torch reference, one short prefill and decode.
        The expert statistics and the step-guess policy are reset afterwards: they count the
        user's lookups and steps only."""
        self._open()
        full = self.config.backend == "tilelang"
        report = progress or (lambda p: None)
        steps = plan_warmup(self.args, self.config, full, graphed_short=self.runtime.runner is not None)

        def run(step: Callable[[int, int, str], None]) -> None:
            run_warmup(steps, self.runtime, self.model, self.tokenizer.bos_id, self.config.max_seq_len, step)

        if full:  # replays the kernel manifest when there is one (engine/warmup.py)
            manifest = engine_manifest(self.args, self.config, self.files.converted, self.device,
                                       self.experts.all_resident(), steps)
            if warm_up_kernels(steps, run, manifest, report):
                # the kernels are built; the steps' other first-use costs (decode graphs, cuBLAS's
                # per-shape setup) belong to this process: paid now, not by the first turns
                run(lambda done, total, what: report(LoadProgress(WARMING, done, total, "shapes", what)))
        else:
            run(lambda done, total, what: report(LoadProgress("warm-up", done, total, "shapes", what)))
        warm_sampling(self.runtime, self.args.vocab_size, self.device)
        self.experts.reset_stats()  # the statistics start with the user's first prompt
        self.runtime.reset_guesses()  # and the step-guess policy, which the warm-up forced

    @property
    def info(self) -> dict:
        self._open()
        a, runner = self.args, self.runtime.runner
        decode = "eager" if runner is None or not runner.graphs else "CUDA graphs"
        return {"model": self.files.path.name, "path": str(self.files.path), "n_layers": a.n_layers,
                "n_experts": a.n_routed_experts, "demo": self.demo,
                "device": str(self.device), "numerics": self.config.numerics, "vocab_size": a.vocab_size,
                "max_seq_len": self.config.max_seq_len,
                "experts": "streaming" if self.experts.cache is not None else "resident",
                "backend": self.config.backend, "decode": decode,
                "reference_ops": list(self.model.numerics.reference_ops),
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
            self._turns.close()
            self.runtime = self.model = self.experts = self._meter = self._gauges = None
            self.files.experts = None
        gc.collect()  # the model's modules hold reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch._C._cuda_clearCublasWorkspaces()  # one per stream cuBLAS ran on (no public API for it)
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------- sessions
    def new_session(self, system: str | None = None, history: list[Message] | tuple = ()) -> Session:
        """A fresh session; `history` (user/assistant messages) is prefilled with the first turn."""
        self._open()
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
                 cancel: threading.Event | None = None) -> Generator[Event, None, None]:
        """Answer `user_text` in `session`; yields events, the last one TurnFinished or EngineFailure.
        The session is busy with the turn from its first event until its last one is yielded: a
        caller that stops iterating before that must close() the generator (it rolls the session
        back to before the turn), else the session's next turn fails until the generator is
        garbage collected (engine.turn.Turns.run)."""
        self._check(session)
        return self._turns.run(session, lambda: (list(session.messages), user_text), params,
                               cancel or threading.Event())

    def context_overflow(self, conversation: list[Message], thinking: bool = False) -> ContextOverflow | None:
        """Whether a turn on `conversation` (system message first, the new user message last)
        would be refused for the context limit: the ContextOverflow it would end with (its
        numbers, for a front end's own words), or None. Checks what the turn checks, without a
        session: a front end's answer before it queues the turn."""
        self._open()
        return self._turns.prompt_overflow(conversation, thinking)

    def regenerate(self, session: Session, params: SamplingParams,
                   cancel: threading.Event | None = None) -> Generator[Event, None, None]:
        """Drop the last answer and answer the last user message again (same events and contract
        as `generate`)."""
        self._check(session)
        _last_question(session)  # refused now if there is nothing to answer again
        return self._turns.run(session, lambda: _last_question(session), params, cancel or threading.Event())

    def undo(self, session: Session) -> None:
        """Drop the last user message and its answer; the state rewinds to a snapshot."""
        self._check(session)
        users = [i for i, m in enumerate(session.messages) if m.role == "user"]
        if not users:
            raise SessionError("nothing to undo")
        with self._lock:
            session.rewind(session.messages[:users[-1]])

    # ---------------------------------------------------------------------------- cache control
    def flush_cache(self) -> int:
        """Evict every unpinned expert; returns how many (0 for an official checkpoint, whose experts
        stay in its mmapped shards: no cache). A cache that holds every expert is emptied too."""
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
            self.runtime.settle()  # a pin may evict: the routes still to be counted name resident experts
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

    def memory(self) -> MemoryBudget:
        """The MemoryBudget now (engine.memory)."""
        self._open()
        return self._gauges.memory()


def _last_question(session: Session) -> tuple[list[Message], str]:
    """(the messages before the last user message, its text) of a conversation that ends with an
    answer; SessionError otherwise (`Engine.regenerate`)."""
    msgs = session.messages
    if len(msgs) < 2 or msgs[-1].role != "assistant" or msgs[-2].role != "user":
        raise SessionError("nothing to regenerate: the conversation does not end with an answer")
    return list(msgs[:-2]), msgs[-2].content
