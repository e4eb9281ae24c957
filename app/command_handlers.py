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
from app.commands import Command, ExportArgs, PinArgs, SetArgs, help_lines
from app.conversation import Conversation, ConversationError
from app.history import past_conversations
from app.screens.stats import StatsScreen
from app.settings import SettingsError, with_gen
from app.settings_writer import save_generation
from app.wizard import DEMO_NAME, converted_models, is_converted, resolve_model

if TYPE_CHECKING:
    from app.app import ChatApp

KEYS_HELP = ("keys: Esc or Ctrl+C stop the answer · Ctrl+C twice or Ctrl+Q quit · F2 statistics · "
             "F3 show/hide the panes · Ctrl+P past conversations and models")

Handler = Callable[["ChatApp", Any], Awaitable[None]]


def _keys(keys: Any) -> str:
    shown = ", ".join(f"{layer}:{expert}" for layer, expert in list(keys)[:8])
    return shown + (" …" if len(keys) > 8 else "")


async def cmd_help(app: ChatApp, args: None) -> None:
    await app.note("commands:\n" + "\n".join(help_lines()) + "\n" + KEYS_HELP)


async def _restart(app: ChatApp, conv: Conversation, note: str) -> None:
    """Close the current transcript (it stays in /history) and continue with `conv` in a fresh
    session."""
    if app.conversation.turns:
        note += f" — the previous one ({app.conversation.turns} turn(s)) is kept: /history"
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
    if args.key == "save":
        await _save_settings(app)
        return
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


async def _save_settings(app: ChatApp) -> None:
    path = app.config.config_file
    if path is None:
        await app.note("no settings file to save to: start with --config FILE", error=True)
        return
    try:
        save_generation(path, app.gen)
    except SettingsError as err:
        await app.note(str(err), error=True)
        return
    except OSError as err:
        await app.note(f"cannot write {path}: {err.strerror or err}", error=True)
        return
    await app.note(f"saved the settings to {path} (used from the next start)")


def _model_name(app: ChatApp, path: Path) -> str:
    return DEMO_NAME if app.is_demo(path) else path.name


async def cmd_model(app: ChatApp, name: str) -> None:
    models = converted_models(app.config)
    if not name:
        current = app.model_dir
        listed = [("● " if current is not None and p.resolve() == current.resolve() else "  ")
                  + _model_name(app, p) for p in models]
        if current is not None and not any(p.resolve() == current.resolve() for p in models):
            listed.insert(0, f"● {current}")
        if not listed:
            await app.note(f"no converted models in {app.config.models_dir} — restart with --demo "
                           "or convert a checkpoint", error=True)
            return
        await app.note("models (● in use):\n" + "\n".join(listed)
                       + "\n/model NAME switches (the conversation continues)")
        return
    if app.service.busy is not None:  # (a model that failed to load can still be replaced)
        await app.require_idle()
        return
    path = resolve_model(app.config, name)
    if app.is_demo(path):
        app.build_demo()
        return
    if not is_converted(path):
        have = ", ".join(_model_name(app, p) for p in models) or "none"
        await app.note(f"no converted model {name!r} (in {app.config.models_dir}: {have})",
                       error=True)
        return
    if app.model_dir is not None and path.resolve() == app.model_dir.resolve():
        await app.note(f"{name} is the model in use")
        return
    app.load_model(path)


async def cmd_history(app: ChatApp, number: int | None) -> None:
    past = past_conversations(app.config.transcripts_dir)
    if not past:
        await app.note("no past conversations yet", error=number is not None)
        return
    if number is None:
        current = app.autosave.path
        lines = [f"{i:>2}. {p.line()}" + (" (open)" if current == p.path else "")
                 for i, p in enumerate(past, 1)]
        await app.note("past conversations (newest first):\n" + "\n".join(lines)
                       + "\n/history N reopens one (also Ctrl+P)")
        return
    if number > len(past):
        await app.note(f"no conversation {number}: /history lists 1-{len(past)}", error=True)
        return
    await app.reopen(past[number - 1])


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


def _unpin(engine: Any, keys: list[tuple[int, int]] | None) -> tuple[list, list, bool]:
    """Unpin `keys` (None: all); returns (the keys that were pinned, those that were not, all)."""
    pinned = {(layer, expert) for layer, expert, is_pinned, _ in engine.cache_contents() if is_pinned}
    engine.unpin(keys)
    if keys is None:
        return sorted(pinned), [], True
    return [k for k in keys if k in pinned], [k for k in keys if k not in pinned], False


async def cmd_unpin(app: ChatApp, args: PinArgs) -> None:
    if await app.require_idle():
        keys = list(args.keys) or None
        app.service.call("unpin", lambda engine: _unpin(engine, keys))


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


async def cmd_export(app: ChatApp, args: ExportArgs) -> None:
    path = Path(args.file).expanduser()
    missing = next((p for p in reversed(path.parents) if not p.exists()), None)
    if path.is_dir():
        await app.note(f"{path} is a directory: name a file, e.g. {path / 'chat.md'}", error=True)
        return
    if not args.force and path.exists():
        await app.note(f"{path} exists: /export {args.file} --force overwrites it", error=True)
        return
    if not args.force and missing is not None:
        await app.note(f"the directory {missing} does not exist: /export {args.file} --force "
                       "creates it", error=True)
        return
    try:
        conv_io.write_atomic(path, app.conversation.to_markdown())
    except OSError as err:
        await app.note(f"cannot write {path}: {err.strerror or err}", error=True)
        return
    created = f" (created {missing})" if missing is not None else ""
    await app.note(f"exported {app.conversation.turns} turn(s) to {path}{created}")


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
    "undo": cmd_undo, "quit": cmd_quit, "model": cmd_model, "history": cmd_history,
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
        was, was_not, everything = result
        if not was:
            text = "no experts were pinned" if everything else f"none of {_keys(was_not)} was pinned"
        elif everything:
            text = "unpinned all experts"
        else:
            text = f"unpinned {_keys(was)}" + (f" · not pinned: {_keys(was_not)}" if was_not else "")
        await app.note(text)
    elif label == "undo":  # the app already dropped it from the conversation and transcript
        await app.chat.transcript.remove_last_turn()
        await app.note("removed the last question and answer")
    elif label == "stats":
        stats, contents = result
        await app.push_screen(StatsScreen(app.service.with_turn_rate(stats), contents,
                                          app.service.info))
