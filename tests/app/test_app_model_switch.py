"""A model switch that does not happen leaves the user in the chat with the model still loaded:
a cancelled or failed `/model demo` build does not open the first-run wizard (whose Esc quits),
Esc on the load-failed dialog of a switch goes back to the chat (at start-up it still quits),
and `/model demo` while the demo is in use says so instead of loading it again."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

from fake_engine import FakeBackend, FakeEngine
from app_helpers import type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.commands import Command
from app.controller import BuildDemo, Controller, EngineState, Reply
from app.screens.load_failed import LoadFailedScreen
from app.screens.progress import ProgressScreen
from app.screens.wizard import WizardScreen
from app.widgets.message import NoteMessage, UserMessage
from app.wizard import demo_dir

SIZE = (120, 45)


class HeldDemo(FakeBackend):
    """Building the demo waits for `release` (so it can be cancelled meanwhile), or fails."""

    def __init__(self, fail: str = "") -> None:
        super().__init__(FakeEngine())
        self.release = threading.Event()
        self.fail = fail

    def ensure_demo(self, data_dir: Path, progress) -> Path:
        if self.fail:
            raise RuntimeError(self.fail)
        self.release.wait(timeout=30)
        return super().ensure_demo(data_dir, progress)


def converted(config, name: str) -> Path:
    path = config.models_dir / name
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    return path


def job_line(app) -> str:
    found = app.screen.query("#job-line")
    return str(found.first().content) if found else ""


def last_note(app) -> str:
    return app.chat.transcript.query(NoteMessage).last().text


async def _still_chatting(pilot, app, backend) -> None:
    """Back from the progress screen: the chat, on the model loaded before, which still answers."""
    await pilot.press("escape")  # "Back"
    await wait_for(pilot, lambda: app.screen is app.chat, what="the chat")
    await wait_for(pilot, lambda: last_note(app) == "no model switch: still chatting with model")
    assert not isinstance(app.screen, WizardScreen) and app.is_running
    assert backend.loaded == [app.config.model]
    await type_and_send(pilot, app, "still there?")
    assert [u.text for u in app.chat.transcript.query(UserMessage)] == ["hello", "still there?"]


async def _chat_then_switch_to_the_demo(pilot, app) -> None:
    """One turn on the configured model, then `/model demo` sent."""
    await wait_idle(pilot, app)
    await type_and_send(pilot, app, "hello")
    app.chat.prompt.load_text("/model demo")
    await pilot.press("enter")


def test_a_cancelled_demo_switch_goes_back_to_the_chat(config):
    backend = HeldDemo()

    async def go():
        app = ChatApp(config, backend)
        async with app.run_test(size=SIZE) as pilot:
            await _chat_then_switch_to_the_demo(pilot, app)
            await wait_for(pilot, lambda: isinstance(app.screen, ProgressScreen)
                           and bool(job_line(app)), what="the progress screen")
            await pilot.press("escape")  # cancel
            await wait_for(pilot, lambda: job_line(app) == "cancelling…")
            backend.release.set()
            await wait_for(pilot, lambda: job_line(app).startswith("✗ cancelled"))
            await _still_chatting(pilot, app, backend)

    asyncio.run(go())


def test_a_failed_demo_switch_goes_back_to_the_chat(config):
    backend = HeldDemo(fail="no space left on device")

    async def go():
        app = ChatApp(config, backend)
        async with app.run_test(size=SIZE) as pilot:
            await _chat_then_switch_to_the_demo(pilot, app)
            await wait_for(pilot, lambda: job_line(app) == "✗ no space left on device")
            await _still_chatting(pilot, app, backend)

    asyncio.run(go())


def test_esc_on_a_failed_switch_goes_back_to_the_chat_and_another_model_loads(config):
    alpha, beta = converted(config, "alpha"), converted(config, "beta")
    backend = FakeBackend(FakeEngine(), fail_load={str(beta): "bad shard"})

    async def go():
        app = ChatApp(replace(config, model=alpha), backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "hello")
            app.chat.prompt.load_text("/model beta")
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, LoadFailedScreen)
                           and bool(app.screen.query("#back")), what="the dialog")
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.screen is app.chat, what="the chat")
            assert app.is_running
            await type_and_send(pilot, app, "/model alpha")
            await wait_idle(pilot, app)
            assert backend.loaded == [alpha, alpha] and app.model_dir == alpha
            assert [m.content for m in app.service.session.messages][0] == "hello"

    asyncio.run(go())


def test_esc_on_a_failed_load_at_start_up_still_quits(config):
    async def go():
        app = ChatApp(config, FakeBackend(fail_load={str(config.model): "bad shard"}))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, LoadFailedScreen)
                           and bool(app.screen.query("#load-failed-why")), what="the dialog")
            assert not app.screen.query("#back")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.is_running, what="the app to quit")

    asyncio.run(go())


def test_model_demo_when_the_demo_is_in_use_says_so(config):
    ctl = Controller(config, autosave=False)
    ctl.model_dir = demo_dir(config)
    assert ctl.apply(Command("model", "demo")) == Reply("demo is the model in use")
    failed = EngineState(loaded=False, ready=False)  # the demo failed to load: build/load again
    assert ctl.apply(Command("model", "demo"), failed) == BuildDemo()


def test_model_demo_in_the_demo_does_not_reload_it(config):
    backend = FakeBackend(FakeEngine())

    async def go():
        app = ChatApp(replace(config, model=None, demo=True), backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "/model demo")
            assert last_note(app) == "demo is the model in use"
            assert app.screen is app.chat and len(backend.loaded) == 1

    asyncio.run(go())
