"""Slash commands whose paths the system refuses (a name too long) and a command that fails
unexpectedly: one error line each, and the app goes on."""

from __future__ import annotations

import functools
from pathlib import Path

from app_helpers import app_test, type_and_send
from fake_engine import ANSWER

from app import controller as controller_mod
from app.commands import parse
from app.controller import Controller, Reply
from app.settings import AppConfig
from app.widgets.message import AssistantMessage, NoteMessage
from app.wizard import is_converted, resolve_model

LONG = "x" * 300  # longer than NAME_MAX (255): os.stat raises ENAMETOOLONG
with_app = functools.partial(app_test, size=(120, 45))


def last_note(app) -> NoteMessage:
    return app.chat.transcript.query(NoteMessage).last()


async def _export_name_too_long(pilot, app, engine):
    await type_and_send(pilot, app, "hello")
    out = app.config.data_dir / f"{LONG}.md"
    await type_and_send(pilot, app, f"/export {out}")
    assert last_note(app).text == f"cannot write {out}: File name too long"
    assert "error" in last_note(app).classes and app.is_running
    await type_and_send(pilot, app, "still here?")  # the app goes on
    assert app.chat.transcript.query(AssistantMessage).last().answer_text == ANSWER

test_export_of_a_name_too_long_is_one_line_not_a_crash = with_app(_export_name_too_long)


async def _command_failing_unexpectedly(pilot, app, engine):
    def broken(controller, args, state):
        raise RuntimeError("something no check foresaw\nsecond line")

    controller_mod.HANDLERS["flush"], saved = broken, controller_mod.HANDLERS["flush"]
    try:
        await type_and_send(pilot, app, "/flush")
    finally:
        controller_mod.HANDLERS["flush"] = saved
    assert last_note(app).text == ("/flush failed (RuntimeError: something no check foresaw) — the chat "
                                   "goes on; please report this as a bug")
    assert "error" in last_note(app).classes and app.is_running
    await type_and_send(pilot, app, "/flush")
    assert last_note(app).text.startswith("flushed: ")

test_a_slash_command_failing_unexpectedly_is_one_note_and_the_app_goes_on = with_app(
    _command_failing_unexpectedly)


def test_model_of_a_name_too_long_is_one_line(tmp_path):
    config = AppConfig(data_dir=tmp_path / "data")
    for name in (LONG, str(tmp_path / LONG)):
        assert resolve_model(config, name) == Path(name) and not is_converted(Path(name))
        result = Controller(config, autosave=False).apply(parse(f"/model {name}"))
        assert result == Reply(f"no converted model {name!r} (in {config.models_dir}: none)", error=True)


def test_export_to_a_name_ending_in_a_slash_is_refused(tmp_path):
    controller = Controller(AppConfig(data_dir=tmp_path / "data"), autosave=False)
    for force in ("", " --force"):
        result = controller.apply(parse(f"/export {tmp_path}/nodir/{force}"))
        assert result == Reply(f"{tmp_path}/nodir/ names a directory: name a file, e.g. /export "
                               f"{tmp_path}/nodir/chat.md", error=True)
    assert list(tmp_path.iterdir()) == []
