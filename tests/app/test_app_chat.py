"""The main screen with the fake engine: streaming, panes, cancel, history, the service."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from fake_engine import ANSWER, THINKING, FakeBackend, FakeEngine
from app_helpers import start_turn, type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.autosave import read_transcript
from app.messages import StatsChanged
from app.service import EngineService
from app.widgets.bars import fmt_bytes, fmt_pct
from app.widgets.message import AssistantMessage, NoteMessage, UserMessage
from app.widgets.panes import CachePane, HitRatePane, MemoryPane, ThroughputPane
from engine.events import EngineFailure, TextDelta, TurnFinished
from engine.stats import CacheSnapshot, MemoryBudget, StepStats, StepTiming, TierSnapshot, TurnStats

SIZE = (120, 45)


def run(coro) -> None:
    asyncio.run(coro)


def test_message_streams_into_the_transcript(config):
    backend = FakeBackend(FakeEngine(step_delay=0.004))

    async def go():
        app = ChatApp(config, backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await start_turn(pilot, app, "What are experts?")
            partial = app._answer.answer_text
            assert ANSWER.startswith(partial) and len(partial) < len(ANSWER)  # mid-stream
            assert "answer" in app._answer._streams  # appended through a MarkdownStream
            await wait_idle(pilot, app)
            user = app.chat.transcript.query(UserMessage).last()
            answer = app.chat.transcript.query(AssistantMessage).last()
            assert user.text == "What are experts?"
            assert answer.answer_text == ANSWER
            assert answer.query_one(".answer").source == ANSWER
            assert "eos" in str(answer.query_one(".turn-footer").content)
            assert [m.role for m in app.conversation.messages] == ["user", "assistant"]
            assert app.conversation.messages[1].content == ANSWER
            assert app.chat.prompt.text == ""
            assert backend.engine.calls[0][0] == "What are experts?"

    run(go())


def test_thinking_goes_into_a_collapsible(config):
    async def go():
        app = ChatApp(config, FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "/set think on")
            await type_and_send(pilot, app, "why?")
            answer = app.chat.transcript.query(AssistantMessage).last()
            assert answer.reasoning_text == THINKING
            assert answer.query_one(".thinking").source == THINKING
            assert answer.answer_text == ANSWER
            assert app.conversation.messages[-1].reasoning == THINKING

    run(go())


def test_panes_show_the_step_stats(config):
    async def go():
        app = ChatApp(config, FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "hello")
            s = app.service.latest_stats
            c = s.cache
            cache = app.chat.query_one(CachePane).plain()
            assert f"{fmt_bytes(c.used_bytes)} / {fmt_bytes(c.capacity_bytes)}" in cache
            assert f"entries {c.entries} / {c.capacity_entries} · pinned {c.pinned}" in cache
            assert f"evicted {c.evictions}" in cache
            hits = app.chat.query_one(HitRatePane).plain()
            assert f"now {fmt_pct(c.hit_rate_window)} · total {fmt_pct(c.hit_rate)}" in hits
            assert f"hits {c.hits} · misses {c.misses}" in hits
            tp = app.chat.query_one(ThroughputPane).plain()
            assert f"{s.tok_per_s:.1f} tok/s · TTFT 0.25 s" in tp
            assert f"position {s.position}" not in tp and f"pos {s.position}" in str(
                app.chat.phase.content)

    run(go())


def _known_stats() -> StepStats:
    GiB = 2**30
    cache = CacheSnapshot(capacity_bytes=8 * GiB, used_bytes=6 * GiB, entries=480,
                          capacity_entries=640, pinned=12, hits=750, misses=250, evictions=9,
                          bytes_read=3 * GiB, hit_rate=0.75, hit_rate_window=0.9,
                          per_layer_hit_rate=(0.1, 0.5, 0.99))
    memory = MemoryBudget(True, 128 * GiB, (("resident weights", 8 * GiB),
                                            ("expert cache", 8 * GiB), ("free", 112 * GiB)),
                          page_cache=20 * GiB)
    return StepStats("graph replay", 1, 321, StepTiming(1.0, 2.0, 3.0, 4.0), 42.5, 1.5,
                     cache, memory, read_bytes_per_s=2 * GiB)


def test_panes_format_known_numbers(config):
    async def go():
        app = ChatApp(config, FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            stats = _known_stats()
            app.chat.show_stats(stats, [stats, stats])
            await pilot.pause()
            cache = app.chat.query_one(CachePane).plain()
            assert "75.0%" in cache and "6 GiB / 8 GiB" in cache
            assert "entries 480 / 640 · pinned 12" in cache
            assert "evicted 9 · read 3 GiB (2 GiB/s)" in cache
            assert "now 90.0% · total 75.0%" in app.chat.query_one(HitRatePane).plain()
            memory = app.chat.query_one(MemoryPane).plain()
            assert "unified pool 128 GiB" in memory
            assert "resident weights" in memory and "112 GiB" in memory
            assert "page cache" in memory and "20 GiB" in memory
            tp = app.chat.query_one(ThroughputPane).plain()
            assert "42.5 tok/s · TTFT 1.50 s" in tp
            assert "step 10.0 ms: attn 1.0 · moe 2.0" in tp and "expert wait 3.0 · other 4.0" in tp
            assert str(app.chat.phase.content) == "● graphs · pos 321"  # (issue 28: "graphs")
            replayed = StepStats("graph replay", 1, 322, StepTiming(expert_wait_ms=0.5, graph_ms=3.25), 42.5, 1.5,
                                 stats.cache, stats.memory)
            app.chat.show_stats(replayed, [replayed])
            await pilot.pause()
            tp = app.chat.query_one(ThroughputPane).plain()
            assert "step 3.8 ms: CUDA graph 3.2" in tp and "expert wait 0.5" in tp and "attn" not in tp
            assert "RAM tier" not in app.chat.query_one(CachePane).plain()  # no tier: no line
            tiered = replace(stats, cache=replace(stats.cache, tier=TierSnapshot(
                capacity_bytes=16 * 2**30, used_bytes=4 * 2**30, entries=320, capacity_entries=1280,
                ram_hits=240, disk_reads=10, hit_rate=0.96)))
            app.chat.show_stats(tiered, [tiered])
            await pilot.pause()
            cache = app.chat.query_one(CachePane).plain()
            assert "RAM tier 4 GiB / 16 GiB · misses served from RAM 96.0% · disk reads 10" in cache
            filling = replace(tiered, cache=replace(tiered.cache, tier=replace(tiered.cache.tier, filling=True)))
            app.chat.show_stats(filling, [filling])
            await pilot.pause()
            assert "RAM tier 4 GiB / 16 GiB (filling) · misses" in app.chat.query_one(CachePane).plain()
            stopped = replace(filling, cache=replace(filling.cache, tier=replace(
                filling.cache.tier, filling=False, fill_error="expert 3 of layer 7: Input/output error")))
            app.chat.show_stats(stopped, [stopped])
            await pilot.pause()
            assert "(fill stopped: expert 3 of layer 7: Input/output error)" in app.chat.query_one(CachePane).plain()

    run(go())


def test_escape_cancels_generation(config):
    backend = FakeBackend(FakeEngine(step_delay=0.02))

    async def go():
        app = ChatApp(config, backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await start_turn(pilot, app, "long answer please")
            await pilot.press("escape")
            await wait_idle(pilot, app)
            last = app.conversation.messages[-1]
            assert last.finish == "cancelled"
            assert 0 < len(last.content) < len(ANSWER) and ANSWER.startswith(last.content)
            footer = app.chat.transcript.query(AssistantMessage).last().query_one(".turn-footer")
            assert "cancelled" in str(footer.content)
            assert app.service.cancel() is False  # nothing left to cancel

    run(go())


def test_busy_prompt_and_engine_failure_are_one_line_notes(config):
    engine = FakeEngine(step_delay=0.02)
    backend = FakeBackend(engine)

    async def go():
        app = ChatApp(config, backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await start_turn(pilot, app, "first")
            app.chat.prompt.load_text("second")
            app.chat.prompt.submit()
            busy = "still answering — wait, or press Esc to stop"
            await wait_for(pilot, lambda: app.chat.transcript.query(NoteMessage).last().text == busy)
            await pilot.press("escape")
            await wait_idle(pilot, app)
            assert len(engine.calls) == 1
            engine.fail_next = "out of memory: lower cache_gb"
            await type_and_send(pilot, app, "third")
            note = app.chat.transcript.query(NoteMessage).last()
            assert note.text == "turn failed: out of memory: lower cache_gb" and "error" in note.classes
            assert [m.content for m in app.conversation.messages if m.role == "user"] == ["first"]

    run(go())


def test_input_history_and_newline_keys(config):
    async def go():
        app = ChatApp(config, FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "one")
            await type_and_send(pilot, app, "two")
            prompt = app.chat.prompt
            await pilot.press("u", "p")
            await pilot.press("up")
            assert prompt.text == "two"
            await pilot.press("up")
            assert prompt.text == "one"
            await pilot.press("down", "down")
            assert prompt.text == "up"  # the draft comes back
            await pilot.press("ctrl+j", "x")
            assert prompt.text == "up\nx"
            await pilot.press("up")
            assert prompt.text == "up\nx" and prompt.cursor_location[0] == 0  # moved, no recall
            prompt.load_text("/fl")
            prompt.move_cursor(prompt.document.end)
            await pilot.press("tab")
            assert prompt.text == "/flush "

    run(go())


def test_exit_cancels_and_closes_the_engine(config):
    engine = FakeEngine(step_delay=0.02)

    async def go():
        app = ChatApp(config, FakeBackend(engine))
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            await start_turn(pilot, app, "talk")
        assert engine.closed
        assert app.service.engine is None
        conv, closed = read_transcript(app.autosave.path)  # the cut-off answer was recorded
        assert closed and conv.messages[-1].finish == "cancelled"
        assert conv.messages[-1].content and ANSWER.startswith(conv.messages[-1].content)

    run(go())


class _Recorder:
    """Stands in for the App: records posted messages, runs workers inline."""

    def __init__(self) -> None:
        self.posted = []

    def post_message(self, message) -> bool:
        self.posted.append(message)
        return True

    def run_worker(self, fn, **kwargs) -> None:
        thread = threading.Thread(target=fn, name=kwargs["name"])
        thread.start()
        thread.join()


def test_stats_are_coalesced(config):
    service = EngineService(_Recorder(), FakeBackend(), config, history=50)
    snaps = [_known_stats() for _ in range(200)]
    for s in snaps:
        service._publish(s, step=True)
    assert sum(isinstance(m, StatsChanged) for m in service._app.posted) == 1
    latest, recent = service.take_stats()
    assert latest is snaps[-1] and len(recent) == 50 and recent[-1] is snaps[-1]
    service._publish(snaps[0])
    assert sum(isinstance(m, StatsChanged) for m in service._app.posted) == 2


def test_the_service_gives_heap_pages_back_after_every_turn(config):
    """bench/soak.py --trim: RSS growth over 1,000 demo turns was glibc keeping freed pages
    (+3.54 -> +0.20 MiB per 100 turns with malloc_trim); the service trims after each turn, done
    or failed."""
    calls = []
    service = EngineService(_Recorder(), FakeBackend(), config, trim=lambda: calls.append("trim"))
    stats = TurnStats(prompt_tokens=3, completion_tokens=1, prefill_s=0.1, decode_s=0.1, ttft_s=0.1,
                      tok_per_s=10.0, finish_reason="eos")
    service._drain((ev for ev in [TextDelta("hi"), TurnFinished(stats, "", "hi")]), False)
    service._drain((ev for ev in [EngineFailure("boom")]), False)
    assert calls == ["trim", "trim"]


def test_the_service_closes_every_turn_it_stops_reading(config, monkeypatch):
    """A turn keeps its session busy until its events end or it is closed (engine.engine.Engine
    .generate): the service closes it whatever stops its loop — the last event (the turn's
    generator is not asked for more), or an error while handling an event."""
    stats = TurnStats(prompt_tokens=3, completion_tokens=1, prefill_s=0.1, decode_s=0.1, ttft_s=0.1,
                      tok_per_s=10.0, finish_reason="eos")
    closed = []

    def events(*evs):
        try:
            yield from evs
            yield TextDelta("never asked for")
        finally:
            closed.append(evs[-1])

    service = EngineService(_Recorder(), FakeBackend(), config)
    last = [TurnFinished(stats, "", "hi"), EngineFailure("boom")]
    turns = [events(TextDelta("hi"), last[0]), events(last[1])]  # the caller keeps them
    for t in turns:
        service._drain(t, False)
    assert closed == last

    def fail(channel, text):
        raise RuntimeError("the UI is gone")

    monkeypatch.setattr(service, "_push_text", fail)
    broken = events(TextDelta("hi"))
    with pytest.raises(RuntimeError):
        service._drain(broken, False)
    assert closed == last + [TextDelta("hi")]
