"""The app's controller: what each slash command does, written once for both front-ends.

`Controller.apply(command, state)` applies a parsed command (app.commands) to the conversation,
its autosaved transcript and the settings, and returns a typed result that the front-end renders:
the Textual TUI (app.command_handlers) and the `--plain` line mode (app.plain). Work on the
engine is returned as an `EngineJob`; the front-end runs `job.run(engine, session)` (the TUI in a
worker thread, the line mode inline), hands its result to `Controller.finish` (which applies the
result's effect on the conversation, e.g. /undo's) and renders it. Results that ask the front-end
to act (`SessionReset`, `Regenerate`, `SwitchModel`, `BuildDemo`, `Quit`) carry what it needs.

The turns themselves also pass through here (`sent`, `answered`, `turn_failed`), so the
conversation and its transcript change in one place whichever front-end streams the answer.
Every problem the user caused is a `Reply(text, error=True)`: one line, never a traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from app import conversation as conv_io
from app.autosave import Autosaver
from app.backend import EngineLike, SessionLike
from app.commands import Command, ExportArgs, PinArgs, SaveArgs, SetArgs, help_lines
from app.conversation import ChatMessage, Conversation, ConversationError
from app.history import Past, past_conversations
from app.settings import AppConfig, SettingsError, generation_settings, with_gen
from app.settings_writer import save_generation
from app.wizard import DEMO_NAME, converted_models, demo_dir, is_converted, resolve_model

if TYPE_CHECKING:
    from engine.sampling import SamplingParams
    from engine.stats import StepStats

Key = tuple[int, int]  # (layer, expert)


# ---- what the front-ends tell the controller ----------------------------------------------------

@dataclass(frozen=True)
class EngineState:
    """The engine as the front-end sees it when a command arrives."""

    loaded: bool = True  # an engine exists (it may still lack a session)
    busy: str | None = None  # the label of the job running now
    ready: bool = True  # an engine and a session: a job can start


IDLE = EngineState()  # the line mode: commands arrive only between turns


def idle_problem(state: EngineState) -> str | None:
    """Why the engine cannot take a job now (one line), or None."""
    if state.busy in ("turn", "regen"):
        return "still answering — wait, or press Esc to stop"
    if state.busy is not None:
        return f"the engine is busy ({state.busy}) — try again in a moment"
    if not state.ready:
        return "the model is not loaded yet"
    return None


# ---- results ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    """A line (or lines) for the user; `error` marks a refused command."""

    text: str
    error: bool = False


@dataclass(frozen=True)
class Help:
    """/help: one line per command (usage and what it does)."""

    lines: tuple[str, ...]


@dataclass(frozen=True)
class SettingChanged:
    """/set KEY VALUE took effect (from the next answer)."""

    key: str
    value: float | int | bool


@dataclass(frozen=True)
class SessionReset:
    """The conversation is now `conversation` (the controller already switched to it and to its
    transcript): the front-end shows it, starts a fresh engine session that continues it, then
    says `note`. `kept_turns`: turns of the previous conversation, which stays in /history."""

    conversation: Conversation
    note: str
    kept_turns: int = 0


@dataclass(frozen=True)
class CacheFlushed:
    evicted: int  # experts evicted (pinned ones stay)


@dataclass(frozen=True)
class ExpertsPinned:
    keys: tuple[Key, ...]


@dataclass(frozen=True)
class ExpertsUnpinned:
    """`requested`: the keys asked for (None: all); `was`/`was_not`: which of them were pinned."""

    requested: tuple[Key, ...] | None
    was: tuple[Key, ...]
    was_not: tuple[Key, ...]

    @property
    def everything(self) -> bool:
        return self.requested is None


@dataclass(frozen=True)
class StatsReady:
    """/stats between turns: the engine's StepStats and its cache contents."""

    stats: StepStats
    contents: list[tuple[int, int, bool, int]]


@dataclass(frozen=True)
class LiveStats:
    """/stats while a job runs: show the latest published statistics (no contents table)."""


@dataclass(frozen=True)
class TurnUndone:
    """/undo: the engine dropped the last question and answer; the session is at `position`."""

    position: int


@dataclass(frozen=True)
class Regenerate:
    """/regen: stream a new answer to the last question (the front-end starts the turn)."""


@dataclass(frozen=True)
class SwitchModel:
    """/model NAME: load the converted model in `path` (the conversation continues on it)."""

    path: Path


@dataclass(frozen=True)
class BuildDemo:
    """/model demo: build the demo model if needed, then load it."""


@dataclass(frozen=True)
class Quit:
    """/quit: leave (the conversation stays in /history)."""


JobResult = Union[CacheFlushed, ExpertsPinned, ExpertsUnpinned, StatsReady, TurnUndone]


@dataclass(frozen=True)
class EngineJob:
    """Engine work of a command: the front-end runs `run(engine, session)` when the engine is
    free, passes the result to `Controller.finish` and renders it. `label` names the job (the
    TUI's busy state, its failure line "LABEL failed: …"); `refresh_stats`: publish fresh
    statistics after it."""

    label: str
    run: Callable[[EngineLike, SessionLike], JobResult]
    refresh_stats: bool = True


Result = Union[Reply, Help, SettingChanged, SessionReset, EngineJob, CacheFlushed, ExpertsPinned,
               ExpertsUnpinned, StatsReady, LiveStats, TurnUndone, Regenerate, SwitchModel, BuildDemo,
               Quit]


def keys_text(keys: Sequence[Key], limit: int = 8) -> str:
    """'3:17, 4:2 …' — at most `limit` experts."""
    shown = ", ".join(f"{layer}:{expert}" for layer, expert in list(keys)[:limit])
    return shown + (" …" if len(keys) > limit else "")


# The lines that report a command's typed result, the same in the TUI (app.command_handlers) and
# in --plain (app.plain).
def pinned_text(result: ExpertsPinned) -> str:
    if not result.keys:  # /pin hot N before any expert was used
        return "nothing to pin yet: no expert has been used (ask something first)"
    return f"pinned {len(result.keys)} expert(s): {keys_text(result.keys)}"


def unpinned_text(result: ExpertsUnpinned) -> str:
    if not result.was:
        return ("no experts were pinned" if result.everything
                else f"none of {keys_text(result.was_not)} was pinned")
    if result.everything:
        return "unpinned all experts"
    return f"unpinned {keys_text(result.was)}" + (f" · not pinned: {keys_text(result.was_not)}"
                                                  if result.was_not else "")


def setting_text(result: SettingChanged) -> str:
    return f"{result.key} = " + (("on" if result.value else "off") if result.key == "think" else str(result.value))


def _shown(value: object) -> str:
    """A setting's value as the settings file spells it (true/false for a switch)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


# ---- engine jobs (run by the front-end, in a worker or inline) ----------------------------------

def _pin_keys_job(keys: tuple[Key, ...]) -> Callable[[EngineLike, SessionLike], ExpertsPinned]:
    def run(engine: EngineLike, session: SessionLike) -> ExpertsPinned:
        engine.pin(list(keys))
        return ExpertsPinned(keys)

    return run


def _pin_hot_job(n: int) -> Callable[[EngineLike, SessionLike], ExpertsPinned]:
    return lambda engine, session: ExpertsPinned(tuple(engine.pin_hot(n)))


def _unpin_job(keys: tuple[Key, ...] | None) -> Callable[[EngineLike, SessionLike], ExpertsUnpinned]:
    def run(engine: EngineLike, session: SessionLike) -> ExpertsUnpinned:
        pinned = {(layer, expert) for layer, expert, is_pinned, _ in engine.cache_contents() if is_pinned}
        engine.unpin(None if keys is None else list(keys))
        if keys is None:
            return ExpertsUnpinned(None, tuple(sorted(pinned)), ())
        return ExpertsUnpinned(keys, tuple(k for k in keys if k in pinned),
                               tuple(k for k in keys if k not in pinned))

    return run


def _flush_job(engine: EngineLike, session: SessionLike) -> CacheFlushed:
    return CacheFlushed(engine.flush_cache())


def _stats_job(engine: EngineLike, session: SessionLike) -> StatsReady:
    return StatsReady(engine.stats(), engine.cache_contents())


def _undo_job(engine: EngineLike, session: SessionLike) -> TurnUndone:
    engine.undo(session)
    return TurnUndone(session.position)


# ---- the controller -----------------------------------------------------------------------------

class Controller:
    """The conversation, its transcript and the settings of one front-end, and every command's
    effect on them. `on_autosave_error` gets one line when a transcript cannot be written;
    `autosave=False` records nothing (`dsv4-chat run`); a front-end may set `autosave_enabled`
    to False to stop opening new transcripts (the line mode does after a failure)."""

    def __init__(self, config: AppConfig, on_autosave_error: Callable[[str], None] | None = None,
                 autosave: bool = True) -> None:
        self.config = config
        self.conversation = Conversation(system=config.system)
        self.model_dir: Path | None = None  # the model loaded, or being loaded (TUI)
        self.autosave_enabled = autosave
        self._set_keys: dict[str, None] = {}  # the settings changed with /set (what /set save writes)
        self._on_autosave_error = on_autosave_error
        self.autosave: Autosaver | None = self._open_saver(config.system)

    @property
    def gen(self) -> SamplingParams:
        return self.config.gen

    # ---- the transcript ---------------------------------------------------------------------

    def _open_saver(self, system: str, path: Path | None = None) -> Autosaver | None:
        if not self.autosave_enabled:
            return None
        directory = path.parent if path is not None else self.config.transcripts_dir
        return Autosaver(directory, system, path=path, on_error=self._on_autosave_error)

    def close(self) -> None:
        """Mark the transcript closed cleanly (the app is leaving)."""
        if self.autosave is not None:
            self.autosave.close()

    def _restart(self, conv: Conversation, note: str) -> SessionReset:
        """Close the current transcript (it stays in /history) and continue with `conv`."""
        kept = self.conversation.turns
        self.close()
        self.autosave = self._open_saver(conv.system)
        if self.autosave is not None:
            self.autosave.seed(conv)
        self.conversation = conv
        return SessionReset(conv, note, kept)

    def continue_transcript(self, path: Path, conv: Conversation) -> Conversation:
        """Continue the transcript file `path` holding `conv` (resume, reopen); a trailing
        unanswered question is dropped from the file and the result. Returns the conversation
        now current. Raises ConversationError if `conv` cannot be continued (`Conversation.check`);
        nothing is switched then."""
        conv.check(str(path))
        self.close()
        self.autosave = self._open_saver(conv.system, path)
        if conv.pending_prompt() and self.autosave is not None:
            self.autosave.undo()  # the file then holds what is shown
        self.conversation = conv.settled()
        return self.conversation

    def reopen(self, past: Past, state: EngineState = IDLE) -> Reply | SessionReset:
        """Continue a past (autosaved) conversation in its own transcript file. One that cannot
        be reopened (`past.problem`) is refused, and the current conversation, its transcript and
        the engine session stay as they are."""
        current = self.autosave.path if self.autosave is not None else None
        if current is not None and past.path.resolve() == current.resolve():
            return Reply("that conversation is the one open now")
        problem = idle_problem(state)
        if problem:
            return Reply(problem, error=True)
        if past.problem is not None:
            return Reply(past.problem, error=True)
        try:
            conv = self.continue_transcript(past.path, past.conversation)
        except ConversationError as err:
            return Reply(str(err), error=True)
        return SessionReset(conv, f"reopened “{past.title()}” ({conv.turns} turn(s))")

    # ---- turns ------------------------------------------------------------------------------

    def sent(self, text: str) -> None:
        """A question went to the engine."""
        self.conversation.messages.append(ChatMessage("user", text))
        if self.autosave is not None:
            self.autosave.user(text)

    def answered(self, msg: ChatMessage, regenerated: bool) -> None:
        """A turn ended with `msg` (a /regen answer replaces the last one)."""
        if regenerated:
            self.conversation.replace_last_answer(msg)
        else:
            self.conversation.messages.append(msg)
        if self.autosave is not None:
            self.autosave.assistant(msg, replace=regenerated)

    def turn_failed(self) -> None:
        """A turn for a new question failed: the engine left the session as it was before it."""
        self.conversation.drop_last_turn()
        if self.autosave is not None:
            self.autosave.undo()

    # ---- commands ---------------------------------------------------------------------------

    def apply(self, command: Command, state: EngineState = IDLE) -> Result:
        """What `command` does now, given the engine's `state`."""
        return HANDLERS[command.name](self, command.args, state)

    def finish(self, result: JobResult) -> JobResult:
        """Apply the effect of an `EngineJob`'s result on the conversation; returns it."""
        if isinstance(result, TurnUndone):
            self.conversation.drop_last_turn()
            if self.autosave is not None:
                self.autosave.undo()
        return result

    def _help(self, args: None, state: EngineState) -> Help:
        return Help(tuple(help_lines()))

    def _new(self, args: None, state: EngineState) -> Reply | SessionReset:
        problem = idle_problem(state)
        if problem:
            return Reply(problem, error=True)
        return self._restart(Conversation(system=self.conversation.system), "new conversation")

    def _system(self, text: str, state: EngineState) -> Reply | SessionReset:
        if not text:
            return Reply(f"system prompt: {self.conversation.system or '(none)'}")
        problem = idle_problem(state)
        if problem:
            return Reply(problem, error=True)
        return self._restart(Conversation(system=text), "system prompt set — new conversation")

    def _set(self, args: SetArgs, state: EngineState) -> Reply | SettingChanged:
        if args.key == "save":
            return self._save_settings()
        if args.key is None:
            g = self.gen
            return Reply(f"temperature {g.temperature} · top_p {g.top_p} · top_k {g.top_k} · "
                         f"max_tokens {g.max_tokens} · think {'on' if g.thinking else 'off'}")
        try:
            self.config = with_gen(self.config, **{args.key: args.value})
        except SettingsError as err:
            return Reply(str(err), error=True)
        self._set_keys.pop(args.key, None)
        self._set_keys[args.key] = None  # in the order last set
        return SettingChanged(args.key, args.value)

    def _save_settings(self) -> Reply:
        """/set save: write the settings changed with /set in this session (their current values)
        into the settings file, which keeps everything else it had. Values that came from flags
        or the environment are one-offs and are not written.

        A saved setting that a DSV4_<KEY> variable also set is still written, but the environment
        outranks the file at every start: the reply says so in the same line, naming each such
        variable and the fix (unset it), rather than letting the next start quietly ignore the
        saved value. Flags are not named: they last one command line, not a shell session."""
        path = self.config.config_file
        if path is None:
            return Reply("no settings file to save to: start with --config FILE", error=True)
        if not self._set_keys:
            return Reply("nothing to save: no setting was changed with /set KEY VALUE in this session")
        current = generation_settings(self.gen)
        values = {key: current[key] for key in self._set_keys}
        try:
            save_generation(path, values)
        except SettingsError as err:
            return Reply(str(err), error=True)
        except OSError as err:
            return Reply(f"cannot write {path}: {err.strerror or err}", error=True)
        saved = ", ".join(f"{key} = {_shown(value)}" for key, value in values.items())
        overridden = [key for key in values if key in self.config.from_env]
        note = ""
        if overridden:
            names = " and ".join(f"DSV4_{key.upper()}" for key in overridden)
            one = len(overridden) == 1
            note = (f"; but {names} {'is' if one else 'are'} set in the environment and "
                    f"override{'s' if one else ''} the saved {', '.join(overridden)} at every start: "
                    f"unset {'it' if one else 'them'} to use the saved value{'' if one else 's'}")
        return Reply(f"saved {saved} to {path} (used from the next start){note}")

    def is_demo(self, model_dir: Path) -> bool:
        return model_dir.resolve() == demo_dir(self.config).resolve()

    def _model_name(self, path: Path) -> str:
        return DEMO_NAME if self.is_demo(path) else path.name

    def _model(self, name: str, state: EngineState) -> Reply | SwitchModel | BuildDemo:
        models = converted_models(self.config)
        current = self.model_dir
        if not name:
            listed = [("● " if current is not None and p.resolve() == current.resolve() else "  ")
                      + self._model_name(p) for p in models]
            if current is not None and not any(p.resolve() == current.resolve() for p in models):
                listed.insert(0, f"● {current}")
            if not listed:
                return Reply(f"no converted models in {self.config.models_dir} — restart with --demo "
                             "or convert a checkpoint", error=True)
            return Reply("models (● in use):\n" + "\n".join(listed)
                         + "\n/model NAME switches (the conversation continues)")
        problem = idle_problem(replace(state, ready=True))  # a model that failed to load can be replaced
        if problem:
            return Reply(problem, error=True)
        path = resolve_model(self.config, name)
        in_use = state.loaded and current is not None and path.resolve() == current.resolve()
        if self.is_demo(path):  # (re)built if missing, unless it is the model loaded now
            return Reply(f"{name} is the model in use") if in_use else BuildDemo()
        if not is_converted(path):
            have = ", ".join(self._model_name(p) for p in models) or "none"
            return Reply(f"no converted model {name!r} (in {self.config.models_dir}: {have})", error=True)
        if in_use:
            return Reply(f"{name} is the model in use")
        return SwitchModel(path)

    def _history(self, number: int | None, state: EngineState) -> Reply | SessionReset:
        """/history lists the past conversations, the current one's transcript marked "(open)",
        or "(open, autosave off)" once its autosave stopped (the file lacks the later turns);
        /history N reopens one."""
        past = past_conversations(self.config.transcripts_dir)
        if not past:
            return Reply("no past conversations yet", error=number is not None)
        if number is None:
            current = self.autosave.path if self.autosave is not None else None
            mark = " (open)" if self.autosave is None or self.autosave.off is None else " (open, autosave off)"
            lines = [f"{i:>2}. {p.line()}" + (mark if current == p.path else "")
                     for i, p in enumerate(past, 1)]
            return Reply("past conversations (newest first):\n" + "\n".join(lines)
                         + "\n/history N reopens one (also Ctrl+P)")
        if number > len(past):
            return Reply(f"no conversation {number}: /history lists 1-{len(past)}", error=True)
        return self.reopen(past[number - 1], state)

    def _flush(self, args: None, state: EngineState) -> Reply | EngineJob:
        problem = idle_problem(state)
        return Reply(problem, error=True) if problem else EngineJob("flush", _flush_job)

    def _pin(self, args: PinArgs, state: EngineState) -> Reply | EngineJob:
        problem = idle_problem(state)
        if problem:
            return Reply(problem, error=True)
        return EngineJob("pin", _pin_hot_job(args.hot) if args.hot is not None
                         else _pin_keys_job(args.keys))

    def _unpin(self, args: PinArgs, state: EngineState) -> Reply | EngineJob:
        problem = idle_problem(state)
        return Reply(problem, error=True) if problem else EngineJob("unpin", _unpin_job(args.keys or None))

    def _stats(self, args: None, state: EngineState) -> Reply | EngineJob | LiveStats:
        if not state.loaded:
            return Reply("no statistics yet: the model is not loaded", error=True)
        if state.busy is None and state.ready:
            return EngineJob("stats", _stats_job, refresh_stats=False)
        return LiveStats()  # mid-turn: live numbers now, the contents table once idle

    def _save(self, args: SaveArgs, state: EngineState) -> Reply:
        """Save the conversation as `args.name`: an existing save of that name only with --force.
        Every problem (a bad name, the file exists, it cannot be written) is one error Reply."""
        try:
            path = conv_io.save(self.conversation, self.config.saved_dir, args.name, args.force)
        except ConversationError as err:
            return Reply(str(err), error=True)
        return Reply(f"saved {self.conversation.turns} turn(s) to {path}")

    def _load(self, name: str, state: EngineState) -> Reply | SessionReset:
        try:
            loaded = conv_io.load(self.config.saved_dir, name)
        except ConversationError as err:
            return Reply(str(err), error=True)
        problem = idle_problem(state)
        if problem:
            return Reply(problem, error=True)
        return self._restart(loaded.settled(), f"loaded {name!r} ({loaded.turns} turn(s))")

    def _export(self, args: ExportArgs, state: EngineState) -> Reply:
        """Write the conversation as Markdown to `args.file`: an existing file only with --force,
        missing directories created only with --force; a name ending in "/" (a directory) is
        refused. Every problem, an OS error on checking the path included (e.g. a name too long),
        is one error Reply."""
        path = Path(args.file).expanduser()
        if args.file.endswith(("/", os.sep)):
            return Reply(f"{args.file} names a directory: name a file, e.g. /export "
                         f"{path / 'chat.md'}", error=True)
        try:
            missing = next((p for p in reversed(path.parents) if not p.exists()), None)
            if path.is_dir():
                return Reply(f"{path} is a directory: name a file, e.g. {path / 'chat.md'}", error=True)
            if not args.force and path.exists():
                return Reply(f"{path} exists: /export {args.file} --force overwrites it", error=True)
            if not args.force and missing is not None:
                return Reply(f"the directory {missing} does not exist: /export {args.file} --force "
                             "creates it", error=True)
            conv_io.write_atomic(path, self.conversation.to_markdown())
        except OSError as err:
            return Reply(f"cannot write {path}: {err.strerror or err}", error=True)
        created = f" (created {missing})" if missing is not None else ""
        return Reply(f"exported {self.conversation.turns} turn(s) to {path}{created}")

    def _regen(self, args: None, state: EngineState) -> Reply | Regenerate:
        problem = idle_problem(state)
        if problem:
            return Reply(problem, error=True)
        if not self.conversation.messages or self.conversation.messages[-1].role != "assistant":
            return Reply("nothing to regenerate yet", error=True)
        return Regenerate()

    def _undo(self, args: None, state: EngineState) -> Reply | EngineJob:
        problem = idle_problem(state)
        if problem:
            return Reply(problem, error=True)
        if not self.conversation.turns:
            return Reply("nothing to undo", error=True)
        return EngineJob("undo", _undo_job, refresh_stats=False)

    def _quit(self, args: None, state: EngineState) -> Quit:
        return Quit()


HANDLERS: dict[str, Callable[[Controller, Any, EngineState], Result]] = {
    "help": Controller._help, "new": Controller._new, "system": Controller._system,
    "set": Controller._set, "model": Controller._model, "history": Controller._history,
    "flush": Controller._flush, "pin": Controller._pin, "unpin": Controller._unpin,
    "stats": Controller._stats, "save": Controller._save, "load": Controller._load,
    "export": Controller._export, "regen": Controller._regen, "undo": Controller._undo,
    "quit": Controller._quit,
}
