"""Keys: Ctrl+C stops the answer, a second Ctrl+C quits (as llama-cli and ollama)."""

from __future__ import annotations

import asyncio

from fake_engine import FakeBackend, FakeEngine
from app_helpers import start_turn, wait_for, wait_idle

from app.app import ChatApp

SIZE = (100, 34)


def test_ctrl_c_stops_the_answer_then_quits(config):
    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine(step_delay=0.05)))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await start_turn(pilot, app, "a long answer please")
            await pilot.press("ctrl+c")
            await wait_idle(pilot, app)
            assert app.conversation.messages[-1].finish == "cancelled"
            assert app.is_running
            await pilot.press("ctrl+c")  # the second one quits
            await wait_for(pilot, lambda: not app.is_running, what="the app to exit")

    asyncio.run(go())


def test_ctrl_c_when_idle_warns_once_then_quits(config):
    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine()))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await pilot.press("ctrl+c")
            await pilot.pause()
            assert app.is_running
            assert [n.message for n in app._notifications] == [
                "press Ctrl+C again (or Ctrl+Q) to quit"]
            app.chat.prompt.load_text("keep this")
            app.chat.prompt.select_all()
            app._interrupted_at -= 10  # long after: a selection is copied, not a quit
            await pilot.press("ctrl+c")
            await pilot.pause()
            assert app.is_running and app.clipboard == "keep this"
            app.chat.prompt.move_cursor((0, 0))  # no selection any more
            await pilot.press("ctrl+c")
            await pilot.pause()
            assert app.is_running  # the copy was not a first press
            await pilot.press("ctrl+c")
            await wait_for(pilot, lambda: not app.is_running, what="the app to exit")

    asyncio.run(go())


def test_panes_start_hidden_below_110_columns_and_f3_toggles_them(config):
    async def go(size, shown_first: bool):
        app = ChatApp(config, FakeBackend(FakeEngine()))
        async with app.run_test(size=size) as pilot:
            await wait_idle(pilot, app)
            side, status = app.chat.query_one("#side"), app.chat.query_one("#status-line")
            assert app.chat.panes_shown is shown_first and status.display is not shown_first
            if not shown_first:  # the chat keeps the width; the one-line status has the figures
                assert app.chat.query_one("#chat-col").size.width == size[0]
                assert str(status.content).startswith("● ready · graphs · pos 0 · 0.0 tok/s · cache")
            await pilot.press("f3")
            await pilot.pause()
            assert app.chat.panes_shown is not shown_first and side.display is not shown_first
            assert status.display is shown_first
            await pilot.resize_terminal(200, 50)  # F3's choice holds at any width
            await pilot.pause()
            assert app.chat.panes_shown is not shown_first

    asyncio.run(go((80, 24), shown_first=False))
    asyncio.run(go((120, 40), shown_first=True))
