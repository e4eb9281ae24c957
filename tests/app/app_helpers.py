"""Helpers for driving ChatApp under Textual's Pilot."""

from __future__ import annotations

import io
import time

from rich.console import Console
from textual.app import App
from textual.errors import NoWidget
from textual.pilot import Pilot


def screen_text(app: App) -> str:
    """The current screen as plain text (what a user would read)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True,
                      color_system=None, record=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens, simplify=True))
    return console.export_text()


async def wait_for(pilot: Pilot, condition, timeout: float = 15.0, what: str = "condition") -> None:
    """Let the app run until `condition()` holds (fails the test after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def shown(app: App, selector: str) -> bool:
    """Whether the widget `selector` is on the current screen, laid out, and the one a user would
    see (and click) at its centre. A widget just mounted has an empty region until the next
    layout: reading the screen or clicking before then sees nothing (a race only load shows)."""
    found = app.screen.query(selector)
    if not found:
        return False
    widget = found.first()
    if not widget.region.area:
        return False
    try:
        return app.get_widget_at(*widget.region.center)[0] is widget
    except NoWidget:  # the compositor has not placed anything there yet
        return False


async def click(pilot: Pilot, app: App, selector: str) -> None:
    """Click the widget `selector` once it is `shown`; fails if the click lands elsewhere."""
    await wait_for(pilot, lambda: shown(app, selector), what=f"{selector} to be shown")
    assert await pilot.click(selector), f"the click on {selector} landed on another widget"


async def wait_idle(pilot: Pilot, app) -> None:
    """Wait until the engine service has no job and the UI processed the results."""
    await wait_for(pilot, lambda: app.service.busy is None and app.service.ready,
                   what="the engine to be idle")
    await pilot.pause()


async def type_and_send(pilot: Pilot, app, text: str) -> None:
    """Type `text` into the prompt, press Enter and wait for the resulting job to finish."""
    app.chat.prompt.load_text(text)
    await pilot.press("enter")
    await pilot.pause()
    await wait_idle(pilot, app)


async def start_turn(pilot: Pilot, app, text: str) -> None:
    """Submit `text` and return as soon as the first answer text has arrived (mid-stream)."""
    app.chat.prompt.load_text(text)
    app.chat.prompt.submit()
    await wait_for(pilot, lambda: app._answer is not None and app._answer.answer_text,
                   what="the first token")


def app_test(body, engine=None, size: tuple[int, int] = (120, 45)):
    """A test function (taking the `config` fixture) that runs `body(pilot, app, engine)` in a
    started ChatApp of `size` whose engine (a FakeEngine unless given) is ready."""
    import asyncio

    from fake_engine import FakeBackend, FakeEngine

    from app.app import ChatApp

    def test(config):
        fake = engine or FakeEngine()

        async def go():
            app = ChatApp(config, FakeBackend(fake))
            async with app.run_test(size=size) as pilot:
                await wait_idle(pilot, app)
                await body(pilot, app, fake)

        asyncio.run(go())

    return test
