"""What each slash command does in the app (one handler per `commands.REGISTRY` entry).

`run(app, command)` executes a parsed command; commands that need the engine start a job via
`app.service.call(label, fn)` and finish in `done(app, label, result)` when the worker posts
its CallDone. Every user-facing problem is a one-line note, never a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from app import conversation as conv_io
from app.autosave import Autosaver
from app.commands import Command, PinArgs, SetArgs, help_lines
from app.conversation import Conversation, ConversationError
from app.screens.stats import StatsScreen
from app.settings import SettingsError, with_gen

if TYPE_CHECKING:
    from app.app import ChatApp

Handler = Callable[["ChatApp", Any], Awaitable[None]]


def _keys(keys: Any) -> str:
    shown = ", ".join(f"{layer}:{expert}" for layer, expert in list(keys)[:8])
    return shown + (" …" if len(keys) > 8 else "")


async def cmd_help(app: ChatApp, args: None) -> None:
    await app.note("commands:\n" + "\n".join(help_lines()))


async def _restart(app: ChatApp, conv: Conversation, note: str) -> None:
    """Close the current transcript and continue with `conv` in a fresh session."""
    app.autosave.close()
    app.autosave = Autosaver(app.config.transcripts_dir, conv.system, on_error=app.autosave_failed)
    app.autosave.seed(conv)
    await app.show_conversation(conv, note)


async def cmd_new(app: ChatApp, args: None) -> None:
    if await app.require_idle():
        await _restart(app, Conversation(system=app.conversation.system), "new conversation")


async def cmd_system(app: ChatApp, text: str) -> None:
    if not text:
        current = app.conversation.system or "(none)"
        await app.note(f"system prompt: {current}")
        return
    if await app.require_idle():
        await _restart(app, Conversation(system=text), "system prompt set — new conversation")


async def cmd_set(app: ChatApp, args: SetArgs) -> None:
    if args.key is None:
        g = app.gen
        await app.note(f"temperature {g.temperature} · top_p {g.top_p} · top_k {g.top_k} · "
                       f"max_tokens {g.max_tokens} · think {'on' if g.think else 'off'}")
        return
    try:
        app.config = with_gen(app.config, **{args.key: args.value})
    except SettingsError as err:
        await app.note(str(err), error=True)
        return
    app.gen = app.config.gen
    shown = ("on" if args.value else "off") if args.key == "think" else args.value
    await app.note(f"{args.key} = {shown} (from the next answer)")


async def cmd_flush(app: ChatApp, args: None) -> None:
    if await app.require_idle():
        app.service.call("flush", lambda engine: engine.flush_cache())


async def cmd_pin(app: ChatApp, args: PinArgs) -> None:
    if not await app.require_idle():
        return
    if args.hot is not None:
        app.service.call("pin", lambda engine: engine.pin_hot(args.hot))
    else:
        app.service.call("pin", lambda engine: (engine.pin(list(args.keys)), list(args.keys))[1])


async def cmd_unpin(app: ChatApp, args: PinArgs) -> None:
    if await app.require_idle():
        keys = list(args.keys) or None
        app.service.call("unpin", lambda engine: (engine.unpin(keys), keys)[1])


async def cmd_stats(app: ChatApp, args: None) -> None:
    if app.service.engine is None:
        await app.note("no statistics yet: the model is not loaded", error=True)
    elif app.service.busy is None and app.service.ready:
        app.service.call("stats", lambda e: (e.stats(), e.cache_contents()), refresh_stats=False)
    else:  # mid-turn: live numbers now, the contents table once idle
        await app.push_screen(StatsScreen(app.service.latest_stats, None, app.service.info))


async def cmd_save(app: ChatApp, name: str) -> None:
    try:
        path = conv_io.save(app.conversation, app.config.saved_dir, name)
    except ConversationError as err:
        await app.note(str(err), error=True)
        return
    await app.note(f"saved {app.conversation.turns} turn(s) to {path}")


async def cmd_load(app: ChatApp, name: str) -> None:
    try:
        loaded = conv_io.load(app.config.saved_dir, name)
    except ConversationError as err:
        await app.note(str(err), error=True)
        return
    if await app.require_idle():
        await _restart(app, loaded.settled(), f"loaded {name!r} ({loaded.turns} turn(s))")


async def cmd_export(app: ChatApp, file: str) -> None:
    path = Path(file).expanduser()
    try:
        conv_io.write_atomic(path, app.conversation.to_markdown())
    except OSError as err:
        await app.note(f"cannot write {path}: {err.strerror or err}", error=True)
        return
    await app.note(f"exported {app.conversation.turns} turn(s) to {path}")


async def cmd_regen(app: ChatApp, args: None) -> None:
    if not await app.require_idle():
        return
    if not app.conversation.messages or app.conversation.messages[-1].role != "assistant":
        await app.note("nothing to regenerate yet", error=True)
        return
    await app.regenerate_view()
    app.service.regenerate(app.gen)


async def cmd_undo(app: ChatApp, args: None) -> None:
    if not await app.require_idle():
        return
    if not app.conversation.turns:
        await app.note("nothing to undo", error=True)
        return
    session = app.service.session
    app.service.call("undo", lambda engine: engine.undo(session), refresh_stats=False)


async def cmd_quit(app: ChatApp, args: None) -> None:
    app.exit()


HANDLERS: dict[str, Handler] = {
    "help": cmd_help, "new": cmd_new, "system": cmd_system, "set": cmd_set,
    "flush": cmd_flush, "pin": cmd_pin, "unpin": cmd_unpin, "stats": cmd_stats,
    "save": cmd_save, "load": cmd_load, "export": cmd_export, "regen": cmd_regen,
    "undo": cmd_undo, "quit": cmd_quit,
}


async def run(app: ChatApp, command: Command) -> None:
    await HANDLERS[command.name](app, command.args)


async def done(app: ChatApp, label: str, result: Any) -> None:
    """The engine finished the job `label` started by a command; show its effect."""
    if label == "flush":
        await app.note(f"flushed: evicted {result} expert(s); pinned experts stay")
    elif label == "pin":
        await app.note(f"pinned {len(result)} expert(s): {_keys(result)}")
    elif label == "unpin":
        await app.note("unpinned all experts" if result is None else f"unpinned {_keys(result)}")
    elif label == "undo":  # the app already dropped it from the conversation and transcript
        await app.chat.transcript.remove_last_turn()
        await app.note("removed the last question and answer")
    elif label == "stats":
        stats, contents = result
        await app.push_screen(StatsScreen(stats, contents, app.service.info))
