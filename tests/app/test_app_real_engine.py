"""The app on the real engine: the demo model (tiny synthetic checkpoint, real tokenizer,
built by the real synth + converter through app.demo) driven through the Pilot."""

from __future__ import annotations

import asyncio

import pytest
from app_helpers import type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.demo import ensure_demo_model
from app.settings import AppConfig
from engine.sampling import SamplingParams
from app.widgets.bars import fmt_bytes
from app.widgets.message import AssistantMessage, NoteMessage
from app.widgets.panes import CachePane, ThroughputPane

SIZE = (120, 45)


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    """A data dir holding the converted demo model (built once for this module)."""
    data = tmp_path_factory.mktemp("data")
    events = []
    path = ensure_demo_model(data, events.append)
    assert path == data / "models" / "demo" and (path / "manifest.json").is_file()
    assert events  # synth and converter progress reached the callback
    assert sorted(p.name for p in (data / "models").iterdir()) == ["demo"]  # no temp left
    return data


def test_chat_on_the_demo_model(demo_data):
    config = AppConfig(data_dir=demo_data, demo=True, gen=SamplingParams(max_tokens=6))

    async def go():
        app = ChatApp(config, offer_resume=False)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.service.ready and app.service.busy is None,
                           timeout=120, what="the demo engine")
            assert app.service.info["demo"] is True
            notes = [n.text for n in app.chat.transcript.query(NoteMessage)]
            assert any("RANDOM weights" in n for n in notes)
            await type_and_send(pilot, app, "Hello")
            answer = app.conversation.messages[-1]
            assert answer.role == "assistant" and answer.finish == "max_tokens"
            assert app.chat.transcript.query(AssistantMessage).last().answer_text == answer.content
            assert [m.content for m in app.service.session.messages] == ["Hello", answer.content]
            position = app.service.session.position  # the status label: decode mode, position
            assert position > 0 and str(app.chat.phase.content) == f"● ready · eager · pos {position}"
            footer = str(app.chat.transcript.query(AssistantMessage).last()
                         .query_one(".turn-footer").content)
            rate = f"{app.service.latest_stats.tok_per_s:.1f} tok/s"
            assert rate in footer and rate in app.chat.query_one(ThroughputPane).plain()
            c = app.service.latest_stats.cache
            pane = app.chat.query_one(CachePane)
            assert f"entries {c.entries} / {c.capacity_entries} · pinned 0" in pane.plain()
            assert f"{fmt_bytes(c.used_bytes)} / {fmt_bytes(c.capacity_bytes)}" in pane.plain()
            await type_and_send(pilot, app, "/pin hot 3")
            await type_and_send(pilot, app, "/flush")
            assert "entries 3 / " in pane.plain() and "pinned 3" in pane.plain()
            assert sum(1 for *_, pinned, _ in app.service.engine.cache_contents() if pinned) == 3
            await type_and_send(pilot, app, "/undo")
            assert app.conversation.messages == [] and app.service.session.messages == []
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "/new")
            assert str(app.chat.phase.content) == "● ready · eager · pos 0"
        assert app.service.engine is None  # closed on exit

    asyncio.run(go())
