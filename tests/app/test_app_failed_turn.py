"""A failed turn (e.g. over the context limit) stays shown with its error but is not a turn:
/undo and /regen act on the conversation's last real turn, on the screen as in the conversation."""

from __future__ import annotations

import functools

from fake_engine import ANSWER
from app_helpers import app_test, type_and_send

from app.widgets.message import AssistantMessage, NoteMessage, UserMessage

with_app = functools.partial(app_test, size=(120, 45))


def shown(app) -> list[str]:
    """The transcript's questions and answers, in order ("U:" / "A:")."""
    out = []
    for w in app.chat.transcript.children:
        if isinstance(w, UserMessage):
            out.append(f"U: {w.text}")
        elif isinstance(w, AssistantMessage):
            out.append(f"A: {w.answer_text[:13]}")
    return out


async def _fail(pilot, app, engine, text: str) -> None:
    engine.fail_next = "the prompt is over the context limit"
    await type_and_send(pilot, app, text)
    assert app.chat.transcript.query(NoteMessage).last().text == (
        "turn failed: the prompt is over the context limit")


async def _undo_after_a_failed_turn(pilot, app, engine):
    await type_and_send(pilot, app, "q1")
    await type_and_send(pilot, app, "q2")
    await _fail(pilot, app, engine, "too long")
    assert shown(app) == ["U: q1", "A: Mixture-of-ex", "U: q2", "A: Mixture-of-ex",
                          "U: too long", "A: "]
    await type_and_send(pilot, app, "/undo")
    assert [m.content for m in app.conversation.messages] == ["q1", ANSWER]
    assert [m.content for m in app.service.session.messages] == ["q1", ANSWER]
    assert shown(app) == ["U: q1", "A: Mixture-of-ex"]
    await type_and_send(pilot, app, "/undo")
    assert app.conversation.messages == [] and shown(app) == []

test_undo_after_a_failed_turn_removes_the_last_real_turn = with_app(_undo_after_a_failed_turn)


async def _regen_after_a_failed_turn(pilot, app, engine):
    await type_and_send(pilot, app, "q1")
    await _fail(pilot, app, engine, "too long")
    await type_and_send(pilot, app, "/regen")
    assert [m.content for m in app.conversation.messages] == ["q1", "Regenerated: " + ANSWER]
    assert shown(app) == ["U: q1", "A: Regenerated: ", "U: too long", "A: "]
    failed = [w for w in app.chat.transcript.children if w.has_class("failed-turn")]
    assert len(failed) == 2 and all(w.styles.text_opacity < 1 for w in failed)  # dimmed, in the error's colour
    assert failed[0].styles.border_top[1].hex.upper() == app.current_theme.to_color_system().generate()["error"].upper()
    assert app.chat.transcript.last_assistant().answer_text == "Regenerated: " + ANSWER

test_regen_after_a_failed_turn_replaces_the_last_real_answer = with_app(_regen_after_a_failed_turn)
