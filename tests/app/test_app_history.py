"""Past conversations (/history, the Ctrl+P palette), /new and /system keeping the old chat,
/set save, and /export asking before it overwrites or creates a directory."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fake_engine import ANSWER, FakeBackend, FakeEngine
from app_helpers import type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.autosave import read_transcript
from app.settings import build_config
from app.widgets.message import NoteMessage, UserMessage

SIZE = (100, 34)


def last_note(app) -> NoteMessage:
    return app.chat.transcript.query(NoteMessage).last()


def users(app) -> list[str]:
    return [u.text for u in app.chat.transcript.query(UserMessage)]


def test_new_keeps_the_old_conversation_and_history_reopens_it(config):
    engine = FakeEngine()
    paths = {}

    async def go():
        app = ChatApp(config, FakeBackend(engine))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "first question")
            paths["first"] = app.autosave.path
            await type_and_send(pilot, app, "/new")
            assert last_note(app).text == ("new conversation — the previous one (1 turn(s)) is "
                                           "kept: /history")
            await type_and_send(pilot, app, "second question")
            await type_and_send(pilot, app, "/system Be brief.")
            assert "the previous one (1 turn(s)) is kept: /history" in last_note(app).text
            await type_and_send(pilot, app, "/history")
            listing = last_note(app).text.splitlines()
            assert listing[0] == "past conversations (newest first):"
            assert listing[1].endswith("1 turn(s) · second question")
            assert listing[2].endswith("1 turn(s) · first question")
            assert listing[-1] == "/history N reopens one (also Ctrl+P)"
            await type_and_send(pilot, app, "/history 9")
            assert last_note(app).text == "no conversation 9: /history lists 1-2"
            await type_and_send(pilot, app, "/history 2")
            await wait_idle(pilot, app)
            assert users(app) == ["first question"]
            assert last_note(app).text == "reopened “first question” (1 turn(s))"
            assert [m.content for m in app.service.session.messages] == ["first question", ANSWER]
            assert app.autosave.path == paths["first"]
            await type_and_send(pilot, app, "third question")

    asyncio.run(go())
    conv, closed = read_transcript(paths["first"])  # the reopened file continued, then closed
    assert closed and [m.content for m in conv.messages] == [
        "first question", ANSWER, "third question", ANSWER]


def test_the_command_palette_reopens_a_past_conversation(config):
    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "about routing")
            await type_and_send(pilot, app, "/new")
            assert users(app) == []
            await pilot.press("ctrl+p")
            await pilot.pause()
            await pilot.press(*"Open: about")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await wait_for(pilot, lambda: users(app) == ["about routing"], what="reopened")
            await wait_idle(pilot, app)
            assert [m.content for m in app.service.session.messages] == ["about routing", ANSWER]

    asyncio.run(go())


def test_set_save_keeps_settings_for_the_next_start(config, tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('cache_gb = 20\n# my comment\n[generation]\ntemperature = 0.9\n'
                    'system = "be brief"\n')

    async def go(cfg):
        app = ChatApp(cfg, FakeBackend(FakeEngine()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "/set temperature 0.3")
            await type_and_send(pilot, app, "/set think on")
            await type_and_send(pilot, app, "/set save")
            return last_note(app)

    note = asyncio.run(go(replace(config, config_file=path)))
    assert note.text == f"saved temperature = 0.3, think = true to {path} (used from the next start)"
    again = build_config({}, {}, path)
    assert again.gen.temperature == 0.3 and again.gen.thinking and again.gen.max_tokens == 512
    assert again.engine.cache_bytes == 20 * 2**30 and again.system == "be brief"
    assert "# my comment" in path.read_text()
    note = asyncio.run(go(replace(config, config_file=None)))
    assert note.text == "no settings file to save to: start with --config FILE"
    assert "error" in note.classes


def test_export_asks_before_overwriting_or_creating_a_directory(config):
    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "hello")
            new_dir = config.data_dir / "out"
            out = new_dir / "sub" / "chat.md"
            await type_and_send(pilot, app, f"/export {out}")
            assert last_note(app).text == (f"the directory {new_dir} does not exist: "
                                           f"/export {out} --force creates it")
            assert "error" in last_note(app).classes and not new_dir.exists()
            await type_and_send(pilot, app, f"/export {out} --force")
            assert last_note(app).text == f"exported 1 turn(s) to {out} (created {new_dir})"
            out.write_text("mine")
            await type_and_send(pilot, app, f"/export {out}")
            assert last_note(app).text == f"{out} exists: /export {out} --force overwrites it"
            assert out.read_text() == "mine"
            await type_and_send(pilot, app, f"/export --force {out}")
            assert last_note(app).text == f"exported 1 turn(s) to {out}"
            assert "## User\n\nhello" in out.read_text()

    asyncio.run(go())
