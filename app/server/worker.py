"""One generation at a time: a bounded queue of jobs drained by one named, owned, stoppable thread.

The HTTP side submits a `Job` (a validated request, a cancel event and an `emit` callback that is
safe to call from another thread) and reads what the worker emits: `Started` when the job leaves
the queue, `Delta`s of reasoning/content text, then `Finished` or `Failed`; every submitted job
gets exactly one `Finished` or `Failed`. A full queue makes `submit` return False (the API
answers 429). Setting the job's cancel event (the client went away) stops its generation after
the current step, or skips it while it still waits (with a `Failed`, which nobody may read).
`begin_shutdown` (the server is stopping) cancels the running job and fails the waiting ones at
once, so that their clients get an ending before the connections close.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable

from app.server.pool import SessionPool
from app.server.request import ChatRequest
from app.server.stops import StopScanner
from engine.events import EngineFailure, StepUpdate, TextDelta, TurnFinished
from engine.stats import StepStats, TurnStats

SHUTTING_DOWN = "the server is shutting down; send the request again once it is back"
FINISH = {"eos": "stop", "max_tokens": "length", "context": "length", "cancelled": "cancelled"}


@dataclass(frozen=True)
class Started:
    waited_s: float  # time spent in the queue


@dataclass(frozen=True)
class Delta:
    content: str = ""
    reasoning: str = ""


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # OpenAI's: "stop" | "length" (or "cancelled" when the client left)
    content: str
    reasoning: str
    stats: TurnStats


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500  # the HTTP status a non-streamed request answers with


@dataclass
class Job:
    request: ChatRequest
    emit: Callable[[object], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)


class Worker:
    """Runs the queued jobs of one engine, one after another, on the thread "dsv4-serve-worker"."""

    def __init__(self, engine, pool: SessionPool, max_queue: int = 8, recent: int = 32,
                 on_idle: Callable[[], None] | None = None) -> None:
        """`on_idle` runs on the worker thread after a job when no other job waits (app.heap_trim)."""
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine, self.pool, self.max_queue, self.on_idle = engine, pool, max_queue, on_idle
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._waiting = 0  # jobs submitted and not yet taken
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsv4-serve-worker", daemon=True)
        self._current: Job | None = None
        self._counts = {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "rejected": 0,
                        "prompt_tokens": 0, "reused_tokens": 0, "prefill_tokens": 0, "completion_tokens": 0}
        self._turns: deque[dict] = deque(maxlen=recent)
        self._step: StepStats | None = None
        self._epoch = time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuse new jobs, cancel the running one (it ends after its current step) and fail every
        waiting one; returns at once (call it on the event loop, not in a signal handler)."""
        self._stop.set()
        with self._lock:
            if self._current is not None:
                self._current.cancel.set()
        self._fail_waiting()

    def stop(self, timeout: float = 30.0) -> None:
        """`begin_shutdown`, then join the thread."""
        self.begin_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _fail_waiting(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._waiting -= 1
            job.emit(Failed(SHUTTING_DOWN, 503))

    @property
    def stopping(self) -> bool:
        """True once shutdown began: no new job is taken."""
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ submitting
    def submit(self, job: Job) -> bool:
        """Queue `job`; False when `max_queue` jobs are already waiting (or the worker stopped)."""
        with self._lock:
            if self._stop.is_set() or self._waiting >= self.max_queue + (self._current is None):
                self._counts["rejected"] += 1
                return False
            self._waiting += 1
            self._counts["requests"] += 1
            self._jobs.put(job)  # under the lock: begin_shutdown either sees it queued or submit sees the stop
        return True

    def retry_after(self) -> int:
        """Seconds a rejected client should wait: the recent mean time of a finished (not
        cancelled) turn times the jobs ahead."""
        with self._lock:
            times = [t["total_s"] for t in self._turns if t["finish_reason"] != "cancelled"]
            ahead = self._waiting + (self._current is not None)
        mean = sum(times) / len(times) if times else 1.0
        return max(1, round(mean * ahead + 0.5))

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                self._waiting -= 1
                self._current = job
                if self._stop.is_set():  # taken as shutdown began
                    job.cancel.set()
            try:
                if job.cancel.is_set():  # the client left while waiting, or the server is stopping
                    self._count("cancelled")
                    job.emit(Failed(SHUTTING_DOWN if self._stop.is_set() else
                                    "the request was cancelled before it started", 503))
                else:
                    self._serve(job)
            except Exception as exc:  # never let one request take the worker down
                self._count("failed")
                job.emit(Failed(f"internal error: {type(exc).__name__}: {exc}"))
            finally:
                with self._lock:
                    self._current = None
                    idle = self._waiting == 0
            if idle and self.on_idle is not None:
                self.on_idle()

    def _serve(self, job: Job) -> None:
        req, t0 = job.request, time.monotonic()
        job.emit(Started(t0 - job.submitted))
        key, session = self.pool.checkout(req.system, req.history)
        scanner = StopScanner(req.stops)
        content: list[str] = []
        try:
            # closed before the session goes back to the pool, whatever ends the loop (a failed
            # emit): an unfinished turn keeps its session busy (engine.engine.Engine.generate)
            with closing(self.engine.generate(session, req.user, req.params, job.cancel)) as events:
                for ev in events:
                    if isinstance(ev, StepUpdate):
                        with self._lock:
                            self._step = ev.stats
                    elif isinstance(ev, TextDelta):
                        if ev.channel == "thinking":
                            job.emit(Delta(reasoning=ev.text))
                            continue
                        text, hit = scanner.push(ev.text)
                        if text:
                            content.append(text)
                            job.emit(Delta(content=text))
                        if hit:
                            job.cancel.set()  # the engine stops after this step; the answer is cut here
                    elif isinstance(ev, TurnFinished):
                        tail = scanner.flush()
                        if tail:
                            content.append(tail)
                            job.emit(Delta(content=tail))
                        finish = "stop" if scanner.hit else FINISH.get(ev.stats.finish_reason, "stop")
                        text = "".join(content) if scanner.hit else ev.content
                        self._record(ev.stats, finish, t0)
                        job.emit(Finished(finish, text, ev.reasoning, ev.stats))
                    elif isinstance(ev, EngineFailure):
                        self._count("failed")
                        job.emit(Failed(ev.message))
        finally:
            self.pool.checkin(key, session)

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _record(self, st: TurnStats, finish: str, t0: float) -> None:
        now = time.monotonic()
        with self._lock:
            c = self._counts
            c["cancelled" if finish == "cancelled" else "completed"] += 1
            c["prompt_tokens"] += st.prompt_tokens
            c["reused_tokens"] += st.reused_tokens
            c["prefill_tokens"] += st.prefill_tokens
            c["completion_tokens"] += st.completion_tokens
            self._turns.append({"prompt_tokens": st.prompt_tokens, "reused_tokens": st.reused_tokens,
                                "prefill_tokens": st.prefill_tokens, "completion_tokens": st.completion_tokens,
                                "prefill_s": round(st.prefill_s, 4), "ttft_s": round(st.ttft_s, 4),
                                "tok_per_s": round(st.tok_per_s, 2), "total_s": round(now - t0, 4),
                                "started_s": round(t0 - self._epoch, 4), "ended_s": round(now - self._epoch, 4),
                                "finish_reason": finish})

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict:
        """Counters, queue, recent turns and the last step's snapshot (any thread). A recent turn's
        started_s/ended_s are seconds since the worker was built."""
        with self._lock:
            c = dict(self._counts)
            out = {"busy": self._current is not None, "queued": self._waiting, "max_queue": self.max_queue,
                   **c, "reuse_rate": round(c["reused_tokens"] / c["prompt_tokens"], 4) if c["prompt_tokens"] else 0.0,
                   "recent_turns": list(self._turns)}
            step = self._step
        out["last_step"] = step
        return out
