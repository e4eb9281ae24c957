"""Text in square brackets is the user's text, not Textual markup: questions, titles, paths and
error messages are shown as typed in every screen ("[/INST]" neither crashes the app nor
"[INST]" / "list[int]" vanishes)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from fake_engine import FakeBackend, FakeEngine
from app_helpers import screen_text, type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.screens.load_failed import LoadFailedScreen
from app.screens.progress import ProgressScreen
from app.screens.resume import ResumeScreen
from app.screens.wizard import SourceScreen, WizardScreen
from app.widgets.message import AssistantMessage
from engine.events import LoadProgress

SIZE = (120, 45)


def on_screen(app, screen_type, selector: str):
    """A condition: `screen_type` is on top and its widget `selector` is mounted."""
    return lambda: isinstance(app.screen, screen_type) and bool(app.screen.query(selector))
QUESTION = "Why [/INST]? and [INST] with list[int]"  # fits the resume dialog's 60-char preview


def _transcript(config, closed: bool) -> None:
    """A transcript whose first question is QUESTION (closed: a past one; else a killed run's)."""
    config.transcripts_dir.mkdir(parents=True, exist_ok=True)
    records = [{"type": "start", "version": 1, "time": "x", "system": ""},
               {"type": "message", "role": "user", "content": QUESTION},
               {"type": "message", "role": "assistant", "content": "a", "reasoning": "",
                "finish": "eos", "replace": False}]
    if closed:
        records.append({"type": "close"})
    (config.transcripts_dir / "20240101-000000-1.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))


def test_the_resume_dialog_shows_a_question_with_brackets_as_typed(config):
    _transcript(config, closed=False)

    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, on_screen(app, ResumeScreen, "#resume-what"))
            assert f"starting “{QUESTION}”" in str(app.screen.query_one("#resume-what").content)
            await pilot.press("y")
            await wait_idle(pilot, app)

    asyncio.run(go())


def test_the_palette_lists_and_finds_a_title_with_brackets(config):
    _transcript(config, closed=True)

    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await pilot.press("ctrl+p")
            await wait_for(pilot, lambda: f"Open: {QUESTION}" in screen_text(app),
                           what="the discovered title")
            await pilot.press(*"why")
            await wait_for(pilot, lambda: f"Open: {QUESTION}" in screen_text(app)
                           and "Model:" not in screen_text(app), what="the searched title")
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert [m.content for m in app.conversation.messages] == [QUESTION, "a"]

    asyncio.run(go())


def test_the_load_failed_dialog_shows_brackets_in_the_error_and_model_names(config):
    message = "cannot read /models/v4[/old]/manifest.json"
    other = config.models_dir / "v4[INST]"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text("{}")

    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine(), fail_load={str(config.model): message}))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, on_screen(app, LoadFailedScreen, "#model-0"))
            assert str(app.screen.query_one("#load-failed-why").content) == f"✗ {message}"
            assert str(app.screen.query_one("#model-0").label) == "v4[INST]"

    asyncio.run(go())


def test_the_wizard_shows_a_checkpoint_path_with_brackets_as_typed(config):
    async def go():
        app = ChatApp(replace(config, model=None), FakeBackend(FakeEngine()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
            await pilot.press("c")
            await wait_for(pilot, on_screen(app, SourceScreen, "#source-problems"))
            problems = app.screen.query_one("#source-problems")
            for path in ("/tmp/x[/]", "/tmp/[INST]/list[int]"):
                app.screen.query_one("#source-path").value = path
                await wait_for(pilot, lambda: str(problems.content) == f"✗ {path}: no config.json",
                               what=f"the problem with {path}")

    asyncio.run(go())


def test_the_progress_screen_shows_brackets_in_its_title_progress_and_error(config):
    def job(progress, cancel):
        progress(LoadProgress("converting", 1, 2, "files", "reading [/INST].bin"))
        raise RuntimeError("cannot write /models/v4[/old]")

    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            app.push_screen(ProgressScreen("Converting /ckpt/[INST]", job))
            await wait_for(pilot, on_screen(app, ProgressScreen, "#job-line"))
            line = app.screen.query_one("#job-line")
            await wait_for(pilot, lambda: str(line.content).startswith("✗"), what="the failure")
            assert str(line.content) == "✗ cannot write /models/v4[/old]"
            assert str(app.screen.query_one(".dialog-title").content) == "Converting /ckpt/[INST]"

    asyncio.run(go())


def test_a_failed_turn_shows_an_error_with_brackets_in_its_footer(config):
    engine = FakeEngine()

    async def go():
        app = ChatApp(config, FakeBackend(engine))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            engine.fail_next = "token [/INST] is not allowed here"
            await type_and_send(pilot, app, "hello")
            footer = app.chat.transcript.query(AssistantMessage).last().query_one(".turn-footer")
            assert str(footer.content) == "failed: token [/INST] is not allowed here"

    asyncio.run(go())
