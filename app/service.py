"""EngineService: the one bridge between the Textual app and the engine.

Every engine call runs in a named Textual thread worker, one job at a time; results reach the
UI only as posted messages (app.messages). Widgets are never touched from a worker. Statistics
are coalesced: the newest StepStats is kept here and at most one `StatsChanged` is pending, so
a slow terminal renders the latest snapshot instead of working through a backlog. Decoded
text is coalesced the same way: deltas accumulate here (consecutive ones of one channel
merged) and at most one `TokensReady` is pending.

Threading: `busy` and the methods that start jobs (`load`, `start_session`, `send`,
`regenerate`, `call`) and `finished` belong to the UI thread; workers only post messages and
fill the text/stats slots (under `_lock`). `cancel()`, `stop()` and `close()` are the only ways
to stop a running job (a threading.Event the engine checks between steps).
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Sequence

from textual.app import App
from textual.message import Message

from app.backend import Backend, EngineLike, SessionLike, history_messages
from app.conversation import ChatMessage
from app.messages import (
    CallDone,
    EngineError,
    EngineReady,
    LoadProgressed,
    StatsChanged,
    TokensReady,
    TurnDone,
)
from app.settings import AppConfig
from engine.events import EngineFailure, Event, StepUpdate, TextDelta, TurnFinished
from engine.sampling import SamplingParams
from engine.stats import StepStats


def user_message(err: BaseException) -> str:
    """An exception as one line for the user: its message, without the class name (the class
    only when the message is empty); the lines of a multi-line message are joined."""
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text or type(err).__name__


@dataclass(frozen=True)
class SessionStarted:
    """The result of `start_session`'s job: the new session is `EngineService.session`."""


class ServiceBusy(RuntimeError):
    """An engine job is running; the message says which."""


class EngineService:
    """Owns the engine and its current session; runs every engine call in a worker."""

    def __init__(self, app: App, backend: Backend, config: AppConfig, history: int = 120,
                 trim: Callable[[], None] | None = None) -> None:
        """`trim` runs on the worker after every turn (app.heap_trim: freed heap pages back to the
        OS, or None)."""
        self._app = app
        self._trim = trim
        self._backend = backend
        self._config = config
        self.engine: EngineLike | None = None
        self.session: SessionLike | None = None
        self.info: dict = {}
        self.busy: str | None = None  # label of the running job (UI thread)
        self.unhandled_turn: TurnDone | None = None  # posted, not yet handled by the app
        self._cancel = threading.Event()
        self._job_done = threading.Event()
        self._job_done.set()
        self._lock = threading.Lock()  # guards the text and stats slots below
        self._latest: StepStats | None = None
        self._recent: deque[StepStats] = deque(maxlen=history)
        self._stats_pending = False
        self._turn_rate: float | None = None  # the last turn's tok/s (TurnStats), see with_turn_rate
        self._text: list[tuple[str, str]] = []  # (channel, text), consecutive channels merged
        self._text_pending = False
        self._closing = False
        self._handoff = threading.Lock()  # engine handed over vs. close()

    # ---- jobs -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.session is not None

    def _post(self, message: Message) -> None:
        self._app.post_message(message)

    def _start(self, label: str, work: Callable[[], None]) -> None:
        if self._closing:
            raise ServiceBusy("the app is closing")
        if self.busy is not None:
            raise ServiceBusy(f"busy ({self.busy}) — wait, or press Esc to stop it")
        self.busy = label
        self._cancel.clear()
        done = threading.Event()
        self._job_done = done

        def run() -> None:
            try:
                work()
            except Exception as err:  # shown to the user as one line, never a traceback
                self._post(EngineError(label, user_message(err)))
            finally:
                done.set()

        self._app.run_worker(run, thread=True, name=f"engine-{label}", group="engine",
                             exit_on_error=False)

    def finished(self) -> None:
        """Called by the app when it handled a job's final message."""
        self.busy = None
        self.unhandled_turn = None

    def cancel(self) -> bool:
        """Ask the running turn to stop (Esc); True if there was one."""
        if self.busy in ("turn", "regen"):
            self._cancel.set()
            return True
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel a running turn and wait for its worker (its last messages are then queued)."""
        if self.cancel():
            self._job_done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel any job, wait for its worker, then close the engine (joins its threads)."""
        with self._handoff:
            self._closing = True
        self._cancel.set()
        self._job_done.wait(timeout_s)
        with self._handoff:
            engine, self.engine, self.session = self.engine, None, None
        if engine is not None:
            engine.close()

    # ---- loading and sessions -------------------------------------------------------------

    def load(self, model_dir: Path) -> None:
        """Load `model_dir`; a loaded engine is closed first (a model switch)."""

        def work() -> None:
            with self._handoff:
                old, self.engine, self.session = self.engine, None, None
            if old is not None:
                old.close()
            engine = self._backend.load_engine(
                model_dir, self._config, lambda p: self._post(LoadProgressed(p))
            )
            with self._handoff:
                if not self._closing:
                    self.engine, engine = engine, None
            if engine is not None:  # closed while loading
                engine.close()
                return
            self.info = dict(self.engine.info)
            self._publish(self.engine.stats())
            self._post(EngineReady(self.info))

        self._start("load", work)

    def start_session(self, system: str, history: Sequence[ChatMessage] = ()) -> None:
        """A fresh engine session; `history` (ChatMessages) is re-fed to it (resume, /load)."""
        msgs = history_messages(self._backend, history)

        def work() -> None:
            kwargs: dict[str, Any] = {"system": system or None}
            if msgs:
                kwargs["history"] = msgs
            self.session = self.engine.new_session(**kwargs)
            self._post(CallDone("session", SessionStarted()))

        self._start("session", work)

    # ---- turns ----------------------------------------------------------------------------

    def send(self, text: str, params: SamplingParams) -> None:
        self._start("turn", lambda: self._drain(
            self.engine.generate(self.session, text, params, cancel=self._cancel), False))

    def regenerate(self, params: SamplingParams) -> None:
        self._start("regen", lambda: self._drain(
            self.engine.regenerate(self.session, params, cancel=self._cancel), True))

    def _drain(self, events: Generator[Event, None, None], regenerated: bool) -> None:
        """Run one turn's events to their end; the turn is closed on the way out, whatever stops
        the loop (its last event, an error here), so it never keeps the session busy
        (engine.engine.Engine.generate)."""
        try:
            with closing(events):
                self._drain_events(events, regenerated)
        finally:
            if self._trim is not None:
                self._trim()

    def _drain_events(self, events: Iterable[Event], regenerated: bool) -> None:
        job = "regen" if regenerated else "turn"
        for ev in events:
            if isinstance(ev, TextDelta):
                if ev.text:
                    self._push_text(ev.channel, ev.text)
            elif isinstance(ev, StepUpdate):
                self._publish(ev.stats, step=True)
            elif isinstance(ev, TurnFinished):
                self._turn_rate = ev.stats.tok_per_s
                if self.latest_stats is not None:
                    self._publish(self.latest_stats)  # (now with the turn's rate)
                self.unhandled_turn = TurnDone(ev.stats, ev.reasoning, ev.content, regenerated)
                self._post(self.unhandled_turn)
                return
            elif isinstance(ev, EngineFailure):
                self._post(EngineError(job, ev.message))
                return
        self._post(EngineError(job, "the engine ended the turn without a result"))

    # ---- other engine calls ---------------------------------------------------------------

    def call(self, label: str, fn: Callable[[EngineLike, SessionLike], Any],
             refresh_stats: bool = True) -> None:
        """Run `fn(engine, session)` in a worker (app.controller's EngineJob.run); posts
        CallDone(label, result) (and fresh stats)."""

        def work() -> None:
            result = fn(self.engine, self.session)
            if refresh_stats:
                self._publish(self.engine.stats())
            self._post(CallDone(label, result))

        self._start(label, work)

    # ---- streamed text and statistics ----------------------------------------------------

    def _push_text(self, channel: str, text: str) -> None:
        with self._lock:
            if self._text and self._text[-1][0] == channel:
                self._text[-1] = (channel, self._text[-1][1] + text)
            else:
                self._text.append((channel, text))
            if self._text_pending:
                return
            self._text_pending = True
        self._post(TokensReady())

    def take_text(self) -> list[tuple[str, str]]:
        """Text decoded since the last call, as (channel, text) runs; re-arms TokensReady."""
        with self._lock:
            out, self._text = self._text, []
            self._text_pending = False
            return out

    def with_turn_rate(self, stats: StepStats) -> StepStats:
        """`stats` with the last turn's tok/s in place of the engine's recent-window rate, so that
        between turns every readout (the turn footer, the Throughput pane, /stats) shows one
        figure: decode steps / decode time of the last turn. Unchanged before the first turn."""
        rate = self._turn_rate
        return stats if rate is None else replace(stats, tok_per_s=rate)

    def _publish(self, stats: StepStats, step: bool = False) -> None:
        """Make `stats` the newest snapshot; `step` snapshots (live, mid-turn) also join the
        recent history; the others carry the last turn's rate (`with_turn_rate`)."""
        if not step:
            stats = self.with_turn_rate(stats)
        with self._lock:
            self._latest = stats
            if step:
                self._recent.append(stats)
            if self._stats_pending:
                return
            self._stats_pending = True
        self._post(StatsChanged())

    def take_stats(self) -> tuple[StepStats | None, list[StepStats]]:
        """The newest snapshot and the recent ones (oldest first); re-arms StatsChanged."""
        with self._lock:
            self._stats_pending = False
            return self._latest, list(self._recent)

    @property
    def latest_stats(self) -> StepStats | None:
        with self._lock:
            return self._latest
