"""`dsv4-chat --plain`: line-mode chat for ssh, tmux and scripts (prompt-toolkit).

On a terminal: Enter sends; Esc then Enter, or a line ending in a backslash, continues on a new
line. Up/Down walk the input history (kept in `<data_dir>/plain_history`; an unwritable history
file falls back to an in-memory one, with one warning). Ctrl-C while an answer streams stops that
answer (the partial answer stays in the conversation); Ctrl-C at the prompt clears the line;
Ctrl-D or /quit leaves. Slash commands are parsed by app.commands and applied by app.controller
(same as the TUI); /model (switching models) belongs to the TUI.

Without a terminal on stdin (scripts), lines are read plainly (one message per line), answers go
to stdout and everything else (banner, prompts, statistics, thinking, errors) to stderr, and the
exit status is 1 if any turn or command failed (the remaining lines are still handled), so
`printf 'hi\\n' | dsv4-chat --plain > answer.txt` works. A line that is not UTF-8 is refused with
one error and the next line is read. Output that goes away (`| head`, a closed or full stdout)
stops the chat quietly with status 1 (one line on stderr for a failing write), the conversation
autosaved up to it. `run_once` is `dsv4-chat run PROMPT`.

Every conversation is autosaved as a transcript (app.autosave), like the TUI's; a data dir that
is read-only or full turns autosave off with one warning and the chat goes on.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import closing, contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, TextIO

from app.backend import EngineLike, RealBackend, history_messages
from app.commands import is_command, message_text, parse
from app.controller import (
    CacheFlushed,
    Controller,
    EngineJob,
    ExpertsPinned,
    ExpertsUnpinned,
    Help,
    Quit,
    Regenerate,
    Reply,
    Result,
    SessionReset,
    SettingChanged,
    StatsReady,
    TurnUndone,
    pinned_text,
    setting_text,
    unpinned_text,
)
from app.conversation import ChatMessage
from app.heap import HeapFreeze
from app.heap_trim import heap_trimmer
from app.settings import AppConfig

if TYPE_CHECKING:
    from converter.convert import ConvertProgress
    from engine.events import Event, LoadProgress
    from engine.sampling import SamplingParams
    from engine.stats import StepStats, TurnStats

TUI_ONLY = ("model",)
PROMPT, CONTINUATION = ">>> ", "... "


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def turn_line(stats: TurnStats) -> str:
    """The one-line summary printed after every answer (engine.stats.TurnStats)."""
    cache = stats.cache
    parts = [f"{stats.completion_tokens} tokens ({stats.finish_reason})",
             f"prefill {stats.prefill_tokens} tok, {stats.reused_tokens} reused, {stats.prefill_s:.2f} s",
             f"TTFT {stats.ttft_s:.2f} s", f"{stats.tok_per_s:.1f} tok/s"]
    if cache is not None:
        parts.append(f"hit rate {cache.hit_rate:.1%}")
        parts.append(f"cache {_gib(cache.used_bytes)}/{_gib(cache.capacity_bytes)}")
    return "[" + " · ".join(parts) + "]"


def stats_lines(stats: StepStats) -> list[str]:
    """Detailed statistics for /stats (engine.stats.StepStats)."""
    c, m, t = stats.cache, stats.memory, stats.timing
    lines = [f"expert cache: {c.entries}/{c.capacity_entries} entries, {_gib(c.used_bytes)} of "
             f"{_gib(c.capacity_bytes)}, {c.pinned} pinned",
             f"hit rate: {c.hit_rate:.1%} cumulative, {c.hit_rate_window:.1%} recent; {c.hits} hits, "
             f"{c.misses} misses, {c.evictions} evictions, {_gib(c.bytes_read)} read "
             f"({_gib(stats.read_bytes_per_s)}/s)",
             *([] if c.tier is None else [
                 f"host RAM tier: {c.tier.entries}/{c.tier.capacity_entries} entries, {_gib(c.tier.used_bytes)} of "
                 f"{_gib(c.tier.capacity_bytes)}; the cache's misses: {c.tier.ram_hits} from RAM "
                 f"({c.tier.hit_rate:.1%}), {c.tier.disk_reads} read from disk"
                 + (f"; its background fill stopped: {c.tier.fill_error}" if c.tier.fill_error else
                    "; filling in the background" if c.tier.filling else "")]),
             "per layer: " + " ".join(f"{i}:{r:.0%}" for i, r in enumerate(c.per_layer_hit_rate)),
             f"last {' · '.join(t.lines())}; {stats.tok_per_s:.1f} tok/s; position {stats.position}",
             f"memory ({'unified' if m.unified else 'discrete GPU'}, {_gib(m.total)}): "
             + ", ".join(f"{name} {_gib(size)}" for name, size in m.parts)
             + (f"; page cache {_gib(m.page_cache)}" if m.unified else "")]
    return lines


@contextmanager
def sigint_sets(event: threading.Event):
    """While inside, Ctrl-C (SIGINT) sets `event` instead of raising KeyboardInterrupt."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def history_for(path, warn: Callable[[str], None]):
    """A prompt-toolkit history kept in `path`; when the file cannot be read or written (now or
    later: read-only, full disk) it goes on in memory, with one `warn` line."""
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    class FallbackFileHistory(FileHistory):
        def __init__(self) -> None:
            super().__init__(str(path))
            self.broken = False

        def _off(self, err: OSError) -> None:
            if not self.broken:
                self.broken = True
                warn(f"input history is kept in memory only: cannot use {path} ({err.strerror or err})")

        def load_history_strings(self):
            if self.broken:
                return []
            try:
                return list(super().load_history_strings())
            except OSError as err:
                self._off(err)
                return []

        def store_string(self, string: str) -> None:
            if not self.broken:
                try:
                    super().store_string(string)
                except OSError as err:
                    self._off(err)

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as err:
        warn(f"input history is kept in memory only: cannot use {path} ({err.strerror or err})")
        return InMemoryHistory()
    return FallbackFileHistory()


def terminal_reader(history_path, warn: Callable[[str], None]) -> Callable[[], str]:
    """A prompt-toolkit line reader: history, Esc+Enter / trailing backslash for new lines."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("enter")
    def _enter(event) -> None:
        buf = event.current_buffer
        if buf.text.endswith("\\") and buf.cursor_position == len(buf.text):
            buf.delete_before_cursor(1)
            buf.insert_text("\n")
        else:
            buf.validate_and_handle()

    @keys.add("escape", "enter")
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    session = PromptSession(history=history_for(history_path, warn), key_bindings=keys, multiline=True,
                            prompt_continuation=lambda width, line, wrap: CONTINUATION)
    return lambda: session.prompt(PROMPT)


def not_text(line: str) -> str | None:
    """Why `line` cannot be sent (one line), or None: input that is not UTF-8 reaches Python's
    standard streams as lone surrogates (errors="surrogateescape"), which no tokenizer takes."""
    from engine.chat import not_unicode

    bad = not_unicode(line)
    if bad is None:
        return None
    code = ord(line[bad])
    byte = f" (byte 0x{code - 0xDC00:02X})" if 0xDC80 <= code <= 0xDCFF else ""
    return f"this text is not UTF-8{byte} at character {bad + 1}; it was not sent: send UTF-8 text"


def stream_reader(stream: TextIO, prompts: TextIO) -> Callable[[], str]:
    """Reads one message per line from a non-terminal stream, writing `>>> ` to `prompts` (stderr
    in scripts); EOF raises EOFError."""

    def read() -> str:
        prompts.write(PROMPT)
        prompts.flush()
        line = stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n").removesuffix("\r")  # a file with Windows line ends

    return read


class PlainChat:
    """The line-mode loop around one engine and its current session; the commands' effects are
    the shared `Controller`'s (app.controller), rendered here as lines.

    Answers go to `out`; everything else (statistics, notes, errors) to `err` (default: `out`,
    as on a terminal). With `strict` (scripts), `run` returns 1 if any turn or command failed.
    With `autosave`, the conversation is recorded under `config.transcripts_dir`."""

    def __init__(self, engine: EngineLike, config: AppConfig, read: Callable[[], str], out: TextIO,
                 err: TextIO | None = None, strict: bool = False, autosave: bool = True,
                 trim: Callable[[], None] | None = None):
        self.engine, self.read, self.out = engine, read, out
        self.trim = trim
        self.err = err if err is not None else out
        self.strict = strict
        self.failed = False
        self.controller = Controller(config, on_autosave_error=self._autosave_failed, autosave=autosave)
        self.session = engine.new_session(system=config.system or None)

    @property
    def config(self) -> AppConfig:
        return self.controller.config

    def _autosave_failed(self, message: str) -> None:
        self.controller.autosave_enabled = False  # not again after /new: the data dir is still unwritable
        self.say(f"! warning: {message}")

    def say(self, text: str = "") -> None:
        """A line for the user that is not an answer (stderr in scripts)."""
        self.err.write(text + "\n")
        self.err.flush()

    def error(self, text: str) -> None:
        """One error line; in scripts the exit status becomes 1."""
        self.failed = True
        self.say(f"! {text}")

    def params(self) -> SamplingParams:
        return self.config.gen

    def run(self) -> int:
        """Read and handle lines until /quit or end of input; returns the exit status."""
        try:
            while True:
                try:
                    if not self.handle(self.read()):
                        break
                except KeyboardInterrupt:  # at the prompt, or between prompts
                    self.say("^C (Ctrl-D or /quit to leave)")
                except EOFError:
                    self.say()
                    break
        finally:
            self.controller.close()
        return 1 if self.strict and self.failed else 0

    def handle(self, line: str) -> bool:
        """One input line: a message or a slash command. False means leave."""
        if not line.strip():
            return True
        problem = not_text(line)
        if problem:
            self.error(problem)
            return True
        if not is_command(line):
            text = message_text(line)
            self.answer(lambda cancel: self.engine.generate(self.session, text, self.params(), cancel),
                        user=text)
            return True
        try:
            command = parse(line)
            if command.name in TUI_ONLY:
                self.error(f"/{command.name} is not available in --plain mode; use the TUI (dsv4-chat)")
                return True
            return self.show(self.controller.apply(command))
        except Exception as err:  # a refused command is one line, never a traceback
            self.error(str(err))
            return True

    def answer(self, start: Callable[[threading.Event], Iterator[Event]], user: str | None = None) -> bool:
        """Run one turn, streaming its text (answer to `out`, thinking to `err`); Ctrl-C stops it.
        `user` is the new message (None: /regen). Returns whether the turn finished. Afterwards
        `trim` (app.heap_trim) gives the turn's freed heap pages back."""
        try:
            return self._answer(start, user)
        finally:
            if self.trim is not None:
                self.trim()

    def _answer(self, start: Callable[[threading.Event], Iterator[Event]], user: str | None) -> bool:
        cancel = threading.Event()
        with sigint_sets(cancel):
            try:
                events = start(cancel)
            except ValueError as err:
                self.error(str(err))
                return False
            if user is not None:
                self.controller.sent(user)
            with closing(events):  # ended here if the output fails (| head): the turn is abandoned
                return self._show_events(events, user)

    def _show_events(self, events: Iterator[Event], user: str | None) -> bool:
        """Stream one turn's events (answer to `out`, thinking to `err`); whether it finished."""
        from engine.events import EngineFailure, TextDelta, TurnFinished

        channel = None
        for ev in events:
            if isinstance(ev, TextDelta):
                stream = self.err if ev.channel == "thinking" else self.out
                if ev.channel != channel:
                    if channel is not None:
                        (self.err if channel == "thinking" else self.out).write("\n")
                    stream.write("(thinking) " if ev.channel == "thinking" else "")
                    channel = ev.channel
                stream.write(ev.text)
                stream.flush()
            elif isinstance(ev, TurnFinished):
                (self.err if channel == "thinking" else self.out).write("\n")
                self.out.flush()
                if ev.stats.finish_reason == "cancelled":
                    self.say("(answer stopped)")
                self.say(turn_line(ev.stats))
                self.controller.answered(ChatMessage("assistant", ev.content, ev.reasoning,
                                                     ev.stats.finish_reason), regenerated=user is None)
                return True
            elif isinstance(ev, EngineFailure):
                if channel == "answer":
                    self.out.write("\n")
                self.error(ev.message)
                if user is not None:
                    self.controller.turn_failed()
                return False
        return False

    def show(self, result: Result) -> bool:
        """Render a command's result as lines (running its engine job inline); False means leave."""
        match result:
            case Quit():
                return False
            case Reply(text, error):
                if error:
                    self.error(text)
                else:
                    self.say(text)
            case Help(lines):
                self.say("\n".join(line + ("  (TUI only)" if line.split()[0][1:] in TUI_ONLY else "")
                                   for line in lines))
            case SettingChanged():
                self.say(setting_text(result))
            case SessionReset(conv, note):
                history = history_messages(RealBackend(), conv.messages)
                self.session = self.engine.new_session(system=conv.system or None, history=history)
                self.say(note)
            case EngineJob(_, job):
                return self.show(self.controller.finish(job(self.engine, self.session)))
            case CacheFlushed(evicted):
                self.say(f"evicted {evicted} experts")
            case ExpertsPinned():
                self.say(pinned_text(result))
            case ExpertsUnpinned():
                self.say(unpinned_text(result))
            case StatsReady(stats):
                self.say("\n".join(stats_lines(stats)))
            case TurnUndone(position):
                self.say(f"dropped the last question and answer (position {position})")
            case Regenerate():
                self.answer(lambda cancel: self.engine.regenerate(self.session, self.params(), cancel))
        return True


def progress_line(p: LoadProgress | ConvertProgress) -> str:
    """One log line for a converter ConvertProgress (building the demo) or an engine LoadProgress."""
    from converter.convert import ConvertProgress

    if isinstance(p, ConvertProgress):
        share = p.bytes_done / p.bytes_total if p.bytes_total else 1.0
        return f"converting: {share:.0%} of {_gib(p.bytes_total)}" + (f" · {p.current}" if p.current else "")
    line = p.phase + (f": {p.done}/{p.total} {p.unit}".rstrip() if p.total else "")
    return line + (f" · {p.message}" if p.message else "")


def load_engine(config: AppConfig, log: TextIO) -> EngineLike:
    """The engine for `config`'s model (--model, the newest converted one, or --demo)."""
    from app.wizard import WizardError, find_model

    def progress(p) -> None:
        log.write(progress_line(p) + "\n")
        log.flush()

    if config.demo:
        from app.demo import DEMO_NOTICE, ensure_demo_model

        try:
            model_dir = ensure_demo_model(config.data_dir, progress)
        except WizardError as err:
            raise SystemExit(f"dsv4-chat: cannot prepare the demo model: {err}") from None
        log.write(DEMO_NOTICE + "\n")
    else:
        model_dir = find_model(config)
        if model_dir is None:
            raise SystemExit("dsv4-chat: no model: pass --model DIR (a converted model) or --demo")
    return RealBackend().load_engine(model_dir, config, progress)


def _open(config: AppConfig, log: TextIO) -> tuple[EngineLike | None, int]:
    """The loaded engine, or (None, status) after one line on `log`."""
    try:
        return load_engine(config, log), 0
    except SystemExit as exc:
        print(exc, file=log)
    except Exception as exc:  # a model that cannot be loaded: one line, no traceback
        print(f"dsv4-chat: cannot load the model: {exc}", file=log)
    return None, 2


def _closed(stdout: TextIO | None, stderr: TextIO) -> bool:
    """True (after one line on stderr) when there is no standard output to answer on (`>&-`)."""
    if stdout is None:
        print("dsv4-chat: the standard output is closed; give the answers somewhere to go (e.g. > answers.txt)",
              file=stderr)
    return stdout is None


def _until_output_fails(run: Callable[[], int], stdout: TextIO, stderr: TextIO) -> int:
    """`run()`, or 1 once an output stream fails: a reader that went away (`| head`) ends the chat
    quietly, another I/O error (a full disk) with one line on `stderr`. The standard output then
    goes to /dev/null, so that Python's flush at exit does not fail again."""
    try:
        return run()
    except BrokenPipeError:
        pass
    except OSError as err:
        try:
            print(f"dsv4-chat: stopped: {err.strerror or err} (writing the output)", file=stderr)
        except OSError:
            pass
    if stdout is sys.stdout:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
    return 1


def main(config: AppConfig, stdin: TextIO | None = None, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    """Entry point of `dsv4-chat --plain` (called by app.__main__); streams default to sys's."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if _closed(stdout, stderr):
        return 2
    engine, status = _open(config, stderr)
    if engine is None:
        return status
    heap = HeapFreeze()
    try:
        heap.freeze()  # the engine is built: keep full GC passes short, as the TUI does (app/heap.py)
        terminal = stdin.isatty() and stdout.isatty()
        info_out = stdout if terminal else stderr

        def warn(text: str) -> None:
            info_out.write(f"! warning: {text}\n")
            info_out.flush()

        read = (terminal_reader(config.data_dir / "plain_history", warn) if terminal
                else stream_reader(stdin, stderr))
        info = engine.info
        info_out.write(f"dsv4-chat --plain · {info.get('model')} · {info.get('device')} · "
                       f"{info.get('numerics')} · /help for commands, Ctrl-D to leave\n")
        chat = PlainChat(engine, config, read, stdout, info_out, strict=not terminal, trim=heap_trimmer())
        return _until_output_fails(chat.run, stdout, stderr)
    finally:
        heap.release()
        engine.close()


def warm_up(config: AppConfig, stderr: TextIO | None = None) -> int:
    """`dsv4-chat --warm-up`: load the model (its warm-up compiles every kernel a chat can need, or
    loads it from TileLang's on-disk cache) with progress on stderr, then exit; 0, or 2 when the
    model cannot be loaded."""
    stderr = stderr or sys.stderr
    t0 = time.perf_counter()
    engine, status = _open(config, stderr)
    if engine is None:
        return status
    try:
        info = engine.info
        print(f"ready in {time.perf_counter() - t0:.1f} s: {info.get('model')} on {info.get('device')} "
              f"({info.get('backend')} kernels); later starts load the compiled kernels from the cache",
              file=stderr)
        return 0
    finally:
        engine.close()


def run_once(config: AppConfig, prompt: str, stdin: TextIO | None = None, stdout: TextIO | None = None,
             stderr: TextIO | None = None) -> int:
    """`dsv4-chat run PROMPT`: the answer on stdout, statistics on stderr; 0, 1 if the turn
    failed, 2 if there is no prompt or no model. An empty PROMPT reads it from stdin (not a
    terminal). Nothing is autosaved: the answer is the output."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if _closed(stdout, stderr):
        return 2
    if not prompt.strip() and not stdin.isatty():
        prompt = stdin.read()
    if not prompt.strip():
        print("dsv4-chat run: no prompt: give it as an argument or on stdin", file=stderr)
        return 2
    problem = not_text(prompt)
    if problem:
        print(f"dsv4-chat run: {problem}", file=stderr)
        return 2
    engine, status = _open(config, stderr)
    if engine is None:
        return status
    try:
        chat = PlainChat(engine, config, lambda: "", stdout, stderr, strict=True, autosave=False)
        text = prompt.strip()

        def answer() -> int:
            done = chat.answer(lambda cancel: engine.generate(chat.session, text, chat.params(), cancel), user=text)
            return 0 if done and not chat.failed else 1

        return _until_output_fails(answer, stdout, stderr)
    finally:
        engine.close()
