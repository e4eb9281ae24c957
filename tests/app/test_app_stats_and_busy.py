"""While the engine works: F2's statistics screen is one at a time (F2 on it closes it, a second
F2 while its numbers are being fetched opens nothing more) and one opened mid-turn gets the
cache's contents once the engine is idle; a message refused as busy stays in the prompt."""

from __future__ import annotations

import functools
import threading

from fake_engine import FakeEngine
from app_helpers import app_test, wait_for, wait_idle

from app.screens.stats import StatsScreen
from app.widgets.message import NoteMessage

with_app = functools.partial(app_test, size=(120, 45))


def stats_screens(app) -> int:
    return sum(isinstance(s, StatsScreen) for s in app.screen_stack)


def contents_title(app) -> str:
    found = app.screen.query("#contents-title")
    return str(found.first().content) if found else ""


class HeldEngine(FakeEngine):
    """`hold_contents`: cache_contents (the /stats job) waits for `release`; `hold_turn`: a turn
    waits for it after its first event."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.hold_contents = self.hold_turn = False

    def cache_contents(self):
        if self.hold_contents:
            self.release.wait(timeout=30)
        return super().cache_contents()

    def generate(self, session, user_text, params, cancel):
        events = super().generate(session, user_text, params, cancel)

        def held():
            for i, event in enumerate(events):
                yield event
                if i == 0 and self.hold_turn:
                    self.release.wait(timeout=30)

        return held()


async def _f2_toggles(pilot, app, engine):
    for _ in range(2):
        await pilot.press("f2")
        await wait_for(pilot, lambda: "experts" in contents_title(app), what="the stats screen")
        assert stats_screens(app) == 1
        await pilot.press("f2")
        await wait_for(pilot, lambda: app.screen is app.chat, what="the chat")
        assert stats_screens(app) == 0

test_f2_opens_and_closes_one_statistics_screen = with_app(_f2_toggles)


async def _f2_twice_while_fetching(pilot, app, engine):
    engine.hold_contents = True
    await pilot.press("f2")
    await wait_for(pilot, lambda: app.service.busy == "stats", what="the stats job")
    await pilot.press("f2")
    await pilot.pause()
    engine.release.set()
    await wait_for(pilot, lambda: "experts" in contents_title(app), what="the stats screen")
    await wait_idle(pilot, app)
    assert stats_screens(app) == 1

test_f2_twice_while_the_numbers_come_opens_one_screen = with_app(_f2_twice_while_fetching,
                                                                 HeldEngine())


async def _hold_a_turn(pilot, app, engine) -> None:
    """Send "hello" and wait until the engine runs it (held until `engine.release` is set)."""
    engine.hold_turn = True
    app.chat.prompt.load_text("hello")
    app.chat.prompt.submit()
    await wait_for(pilot, lambda: app.service.busy == "turn", what="the turn")


async def _opened_mid_turn(pilot, app, engine):
    await _hold_a_turn(pilot, app, engine)
    await pilot.press("f2")
    await wait_for(pilot, lambda: contents_title(app)
                   == "Cache contents — available when the engine is idle", what="live stats")
    engine.release.set()
    await wait_for(pilot, lambda: "experts" in contents_title(app), what="the contents")
    await wait_idle(pilot, app)
    assert stats_screens(app) == 1 and app.conversation.messages[-1].role == "assistant"

test_a_stats_screen_opened_mid_turn_gets_the_contents_after_it = with_app(_opened_mid_turn,
                                                                          HeldEngine())


async def _refused_while_busy(pilot, app, engine):
    await _hold_a_turn(pilot, app, engine)
    app.chat.prompt.load_text("a second question")
    app.chat.prompt.submit()
    await wait_for(pilot, lambda: app.chat.prompt.text == "a second question",
                   what="the message back in the prompt")
    assert app.chat.transcript.query(NoteMessage).last().text == (
        "still answering — wait, or press Esc to stop")
    engine.release.set()
    await wait_idle(pilot, app)
    assert [m.content for m in app.conversation.messages if m.role == "user"] == ["hello"]

test_a_message_refused_while_busy_stays_in_the_prompt = with_app(_refused_while_busy, HeldEngine())


async def _command_refused_while_busy(pilot, app, engine):
    await _hold_a_turn(pilot, app, engine)
    app.chat.prompt.load_text("/flush")
    app.chat.prompt.submit()
    await wait_for(pilot, lambda: app.chat.prompt.text == "/flush", what="the command back in the prompt")
    assert "error" in app.chat.transcript.query(NoteMessage).last().classes
    engine.release.set()
    await wait_idle(pilot, app)
    app.chat.prompt.submit()  # sent again once idle: it runs, and the prompt empties
    await wait_for(pilot, lambda: app.chat.transcript.query(NoteMessage).last().text.startswith("flushed"),
                   what="the flush")
    assert app.chat.prompt.text == ""

test_a_command_refused_while_busy_stays_in_the_prompt = with_app(_command_refused_while_busy, HeldEngine())
