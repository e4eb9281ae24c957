"""The TUI's rendering of slash commands: what each of the controller's results looks like.

`run(app, command)` hands a parsed command to the app's `Controller` (app.controller, where every
command's effect lives) and renders the typed result: a note in the transcript, a screen, or an
engine job started via `app.service.call`, whose result comes back in a CallDone and is rendered
by `render` in turn. Every user-facing problem is a one-line note, never a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.commands import Command
from app.controller import (
    BuildDemo,
    CacheFlushed,
    EngineJob,
    ExpertsPinned,
    ExpertsUnpinned,
    Help,
    LiveStats,
    Quit,
    Regenerate,
    Reply,
    Result,
    SessionReset,
    SettingChanged,
    StatsReady,
    SwitchModel,
    TurnUndone,
    pinned_text,
    setting_text,
    unpinned_text,
)
from app.screens.stats import StatsScreen

if TYPE_CHECKING:
    from app.app import ChatApp

KEYS_HELP = ("keys: Esc or Ctrl+C stop the answer · Ctrl+C twice or Ctrl+Q quit · F2 statistics · "
             "F3 show/hide the panes · Ctrl+P past conversations and models")


async def run(app: ChatApp, command: Command) -> bool:
    """Apply `command` and render its result -> False where it was refused (an error reply, e.g.
    the engine is busy or an argument is wrong) or failed. A last resort: an exception escaping
    the controller or the rendering (a bug, or an OS error no check foresaw) becomes one error
    note naming the command and the exception, and the app goes on; it is never raised into
    Textual, which would end the app (and lose what is on the screen)."""
    try:
        result = app.controller.apply(command, app.engine_state())
        await render(app, result)
    except Exception as err:  # noqa: BLE001 — the last resort described above
        await app.note(failure_line(command, err), error=True)
        return False
    return not (isinstance(result, Reply) and result.error)


def failure_line(command: Command, err: BaseException) -> str:
    """The one line shown when a slash command fails unexpectedly."""
    detail = (err.strerror if isinstance(err, OSError) and err.strerror else str(err)).splitlines()
    reason = f"{type(err).__name__}: {detail[0]}" if detail and detail[0] else type(err).__name__
    return f"/{command.name} failed ({reason}) — the chat goes on; please report this as a bug"


async def render(app: ChatApp, result: Result) -> None:
    """Show `result` (a command's, or an engine job's after `Controller.finish`)."""
    match result:
        case Reply(text, error):
            await app.note(text, error=error)
        case Help(lines):
            await app.note("commands:\n" + "\n".join(lines) + "\n" + KEYS_HELP)
        case SettingChanged():
            await app.note(f"{setting_text(result)} (from the next answer)")
        case SessionReset(conv, note, kept):
            if kept:
                note += f" — the previous one ({kept} turn(s)) is kept: /history"
            await app.show_conversation(conv, note)
        case EngineJob(label, job, refresh_stats):
            app.service.call(label, job, refresh_stats=refresh_stats)
        case CacheFlushed(evicted):
            await app.note(f"flushed: evicted {evicted} expert(s); pinned experts stay")
        case ExpertsPinned():
            await app.note(pinned_text(result))
        case ExpertsUnpinned():
            await app.note(unpinned_text(result))
        case StatsReady(stats, contents):
            await app.show_stats_screen(StatsScreen(app.service.with_turn_rate(stats), contents,
                                                    app.service.info))
        case LiveStats():
            await app.show_stats_screen(StatsScreen(app.service.latest_stats, None,
                                                    app.service.info))
        case TurnUndone():  # the controller already dropped it from the conversation and transcript
            await app.chat.transcript.remove_last_turn()
            await app.note("removed the last question and answer")
        case Regenerate():
            await app.regenerate_view()
            app.service.regenerate(app.gen)
        case SwitchModel(path):
            app.load_model(path)
        case BuildDemo():
            app.build_demo()
        case Quit():
            app.exit()
