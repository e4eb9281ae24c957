"""Issue 28's smaller items: an answer lost to thinking, the status label, the first-token
spinner, one tok/s figure, /unpin's report, error lines, the resume dialog's count."""

from __future__ import annotations

import asyncio
import functools
import re

from fake_engine import THINKING, FakeBackend, FakeEngine
from app_helpers import app_test, screen_text, shown, start_turn, type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.autosave import Autosaver
from app.conversation import ChatMessage
from app.screens.progress import ProgressScreen
from app.screens.resume import ResumeScreen
from app.screens.stats import StatsScreen
from app.service import user_message
from app.widgets.message import SPINNER, AssistantMessage, NoteMessage
from app.widgets.panes import ThroughputPane
from dataclasses import replace

SIZE = (100, 34)


def last_note(app) -> str:
    return app.chat.transcript.query(NoteMessage).last().text


with_app = functools.partial(app_test, size=SIZE)


async def _thinking_budget(pilot, app, engine):
    await type_and_send(pilot, app, "/set think on")
    await type_and_send(pilot, app, "/set max_tokens 5")
    await type_and_send(pilot, app, "why?")
    answer = app.chat.transcript.query(AssistantMessage).last()
    assert answer.answer_text == "" and answer.reasoning_text == " ".join(THINKING.split()[:5]) + " "
    notice = answer.query_one(".answer-notice")
    assert notice.display and str(notice.content) == (
        "no answer: all 5 tokens of max_tokens went to thinking (shown above) — /set max_tokens N "
        "to allow more, or /set think off")
    assert not answer.query_one("Collapsible").collapsed  # the thinking is shown, not hidden
    await type_and_send(pilot, app, "/set max_tokens 512")
    await type_and_send(pilot, app, "again")
    answer = app.chat.transcript.query(AssistantMessage).last()
    assert answer.answer_text and not answer.query_one(".answer-notice").display

test_an_answer_lost_to_thinking_says_so = with_app(_thinking_budget)


async def _status_label(pilot, app, engine):
    assert str(app.chat.phase.content) == "● ready · graphs · pos 0"
    await type_and_send(pilot, app, "hello there")
    position = app.service.session.position
    assert position > 0 and str(app.chat.phase.content) == f"● ready · graphs · pos {position}"
    engine.step_delay = 0.05
    await start_turn(pilot, app, "and again")
    await wait_for(pilot, lambda: str(app.chat.phase.content).startswith("● graphs · pos "),
                   what="the mid-turn label")
    await wait_idle(pilot, app)
    engine.step_delay = 0.0
    await type_and_send(pilot, app, "/new")
    assert str(app.chat.phase.content) == "● ready · graphs · pos 0"

test_the_status_label_shows_the_decode_mode_and_new_resets_the_position = with_app(_status_label)


async def _eager_label(pilot, app, engine):
    await type_and_send(pilot, app, "hello")
    assert re.fullmatch(r"● ready · eager · pos \d+", str(app.chat.phase.content))

test_the_status_label_says_eager_without_graphs = with_app(_eager_label, FakeEngine(graphs=False))


async def _spinner(pilot, app, engine):
    app.chat.prompt.load_text("slow start")
    app.chat.prompt.submit()
    await wait_for(pilot, lambda: app._answer is not None and app._answer.waiting, what="spinner")
    waiting = app._answer.query_one(".waiting")
    await pilot.pause(0.2)
    text = str(waiting.content)
    assert waiting.display and text[0] in SPINNER and "waiting for the first token…" in text
    assert re.search(r"\d+\.\d s$", text)
    answer = app._answer
    await wait_for(pilot, lambda: answer.answer_text, what="the first token")
    assert not answer.waiting and not waiting.display and answer._spinner is None  # timer stopped
    await wait_idle(pilot, app)

test_a_spinner_waits_for_the_first_token = with_app(_spinner, FakeEngine(first_token_delay=0.8))


async def _one_rate(pilot, app, engine):
    await type_and_send(pilot, app, "hello")
    answer = app.chat.transcript.query(AssistantMessage).last()
    footer = re.search(r"([\d.]+) tok/s", str(answer.query_one(".turn-footer").content)).group(1)
    pane = re.search(r"([\d.]+) tok/s", app.chat.query_one(ThroughputPane).plain()).group(1)
    await type_and_send(pilot, app, "/stats")
    await wait_for(pilot, lambda: isinstance(app.screen, StatsScreen))
    summary = str(app.screen.query_one("#stats-summary").content)
    stats = re.search(r"([\d.]+) tok/s", summary).group(1)
    n = len(app.conversation.messages[-1].content.split())
    assert footer == pane == stats == f"{10.0 + n / 10:.1f}"  # the turn's figure, everywhere

test_one_tok_per_s_figure = with_app(_one_rate)


async def _unpin(pilot, app, engine):
    await type_and_send(pilot, app, "/pin 0:1")
    await type_and_send(pilot, app, "/unpin 0:1,2:3")
    assert last_note(app) == "unpinned 0:1 · not pinned: 2:3"
    await type_and_send(pilot, app, "/unpin 2:3")
    assert last_note(app) == "none of 2:3 was pinned"
    await type_and_send(pilot, app, "/unpin")
    assert last_note(app) == "no experts were pinned"

test_unpin_reports_only_experts_that_were_pinned = with_app(_unpin)


def test_error_lines_have_no_exception_class_names(config):
    assert user_message(RuntimeError("Numpy is not available")) == "Numpy is not available"
    assert user_message(ValueError("first\n  second")) == "first second"
    assert user_message(KeyError()) == "KeyError"  # nothing else to say

    class Broken(FakeBackend):
        def ensure_demo(self, data_dir, progress):
            raise RuntimeError("Numpy is not available")

    async def go():
        app = ChatApp(replace(config, model=None, demo=True), Broken())
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, ProgressScreen)
                           and app.screen.query("#job-line"), what="the progress screen")
            line = app.screen.query_one("#job-line")
            await wait_for(pilot, lambda: "✗" in str(line.content))
            assert str(line.content) == "✗ Numpy is not available"
            await wait_for(pilot, lambda: shown(app, "#job-line"), what="the progress screen shown")
            text = screen_text(app)
            assert "✗ Numpy is not available" in text and "RuntimeError" not in text

    asyncio.run(go())


def test_the_resume_dialog_counts_what_it_restores(config):
    saver = Autosaver(config.transcripts_dir)
    saver.user("q1")
    saver.assistant(ChatMessage("assistant", "a1", "", "eos"))
    saver.user("unanswered")

    async def go():
        app = ChatApp(config, FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, ResumeScreen)
                           and app.screen.query("#resume-what"), what="the dialog's text")
            what = str(app.screen.query_one("#resume-what").content)
            assert what.startswith("1 turn(s) and an unanswered question (put back into the "
                                   "prompt), starting “q1”")
            await pilot.press("y")
            await wait_idle(pilot, app)
            assert app.conversation.turns == 1 and app.chat.prompt.text == "unanswered"

    asyncio.run(go())
