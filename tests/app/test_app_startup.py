"""Start-up: the first-run wizard (convert / demo), the demo model, resuming after a kill."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from fake_engine import ANSWER, ConvertProgress, FakeBackend, FakeEngine
from app_helpers import click, type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.autosave import Autosaver, find_unfinished, read_transcript
from app.conversation import ChatMessage
from app.demo import DEMO_NOTICE, _synth_progress, ensure_demo_model
from app.screens.progress import ProgressScreen, describe, fmt_eta
from app.screens.resume import ResumeScreen
from app.screens.wizard import SourceScreen, WizardScreen
from app.widgets.message import AssistantMessage, NoteMessage, UserMessage
from app.wizard import WizardError, check_source, find_model, free_space_problem
from engine import pack as layout
from engine.events import LoadProgress

SIZE = (120, 45)


def no_model(config):
    return replace(config, model=None)


def test_wizard_demo_path(config):
    backend = FakeBackend()

    async def go():
        app = ChatApp(no_model(config), backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
            await pilot.press("d")
            await wait_idle(pilot, app)
            assert backend.loaded == [config.data_dir / "models" / "demo"]
            assert app.screen is app.chat
            notes = [n.text for n in app.chat.transcript.query(NoteMessage)]
            assert DEMO_NOTICE in notes and "RANDOM weights" in DEMO_NOTICE

    asyncio.run(go())


def test_wizard_convert_path_with_live_validation(config, tmp_path):
    backend = FakeBackend(convert_delay=0.01)
    src = tmp_path / "DeepSeek-V4-Flash"

    async def go():
        app = ChatApp(no_model(config), backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
            await pilot.press("c")
            await wait_for(pilot, lambda: isinstance(app.screen, SourceScreen))
            screen = app.screen
            problems = screen.query_one("#source-problems")
            start = screen.query_one("#start")
            await pilot.press(*str(src))
            await wait_for(pilot, lambda: "✗" in str(problems.content))
            assert "no config.json" in str(problems.content) and start.disabled
            src.mkdir()
            (src / "config.json").write_text("{}")
            await pilot.press("/")
            await pilot.press("backspace")
            await wait_for(pilot, lambda: "✓" in str(problems.content), what="validation")
            assert not start.disabled
            dst = config.models_dir / "DeepSeek-V4-Flash"
            assert str(dst) in str(screen.query_one("#source-destination").content)
            await pilot.press("enter")
            await wait_idle(pilot, app)
            assert backend.loaded == [dst] and (dst / "manifest.json").is_file()
            assert app.screen is app.chat

    asyncio.run(go())


def test_conversion_can_be_cancelled(config, tmp_path):
    backend = FakeBackend(convert_delay=0.2)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")

    async def go():
        app = ChatApp(no_model(config), backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
            await pilot.press("c")
            await wait_for(pilot, lambda: isinstance(app.screen, SourceScreen))
            app.screen.query_one("#source-path").value = str(tmp_path / "src")
            await wait_for(pilot, lambda: not app.screen.query_one("#start").disabled)
            await click(pilot, app, "#start")
            await wait_for(pilot, lambda: isinstance(app.screen, ProgressScreen))
            await pilot.press("escape")
            line = app.screen.query_one("#job-line")
            await wait_for(pilot, lambda: "cancelled" in str(line.content))
            assert "✗ cancelled — run it again to resume" == str(line.content)
            await pilot.press("escape")  # Back
            await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
            assert backend.loaded == []

    asyncio.run(go())


def test_progress_lines():
    done, total, line = describe(ConvertProgress(2 * 2**30, 8 * 2**30, 300 * 2**20, 3725.0,
                                                 "layer_07.safetensors"))
    assert (done, total) == (2 * 2**30, 8 * 2**30)
    assert line == "2 GiB / 8 GiB · 300 MiB/s · ETA 1:02:05 · layer_07.safetensors"
    assert describe(LoadProgress("warm-up", 3, 43, "layers"))[2] == "warm-up: 3/43 layers"
    assert fmt_eta(75) == "1:15" and fmt_eta(None) == "—"
    events = []
    log = _synth_progress(events.append)  # synth's log lines become progress events
    log("[2/7] model-00002-of-00007.safetensors: 125 tensors, 0.005 GB (layers.0), 0.5 s")
    log("something else")
    assert [describe(e)[2] for e in events] == [
        "writing the demo checkpoint: 2/7 shards · model-00002-of-00007.safetensors",
        "writing the demo checkpoint · something else"]


def test_find_model_and_check_source(config, tmp_path):
    cfg = no_model(config)
    assert find_model(cfg) is None
    (cfg.models_dir / "demo").mkdir(parents=True)
    (cfg.models_dir / "demo" / "manifest.json").write_text("{}")
    half = cfg.models_dir / "half-converted"
    half.mkdir()
    assert find_model(cfg) is None  # neither the demo nor an incomplete directory counts
    (half / "manifest.json").write_text("{}")
    assert find_model(cfg) == half
    assert find_model(config) == config.model
    assert check_source(tmp_path / "absent") == [f"{tmp_path / 'absent'} is not a directory"]
    empty = tmp_path / "empty"
    empty.mkdir()
    problems = check_source(empty)
    assert problems and all(isinstance(p, str) and p for p in problems)


def test_free_space_problem(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model-00001.safetensors").write_bytes(b"x" * 1000)
    assert free_space_problem(src, tmp_path / "out" / "model") is None
    with (src / "model-00002.safetensors").open("wb") as fh:  # sparse, larger than the disk
        fh.truncate(shutil.disk_usage(tmp_path).free + 2**30)
    problem = free_space_problem(src, tmp_path / "out" / "model")
    assert problem is not None and problem.startswith(f"not enough space on {tmp_path}")


def test_ensure_demo_model_is_atomic_and_built_once(tmp_path):
    calls = []

    def failing(work, out, progress):
        out.mkdir()
        (out / "layer_00.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ensure_demo_model(tmp_path, print, build=failing)
    assert os.listdir(tmp_path / "models") == []  # nothing half-built is left

    def no_manifest(work, out, progress):
        out.mkdir()

    with pytest.raises(WizardError, match="no manifest.json"):
        ensure_demo_model(tmp_path, print, build=no_manifest)

    def good(work, out, progress):
        calls.append(work)
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"version": layout.VERSION}))

    path = ensure_demo_model(tmp_path, print, build=good)
    assert path == tmp_path / "models" / "demo" and (path / "manifest.json").is_file()
    assert ensure_demo_model(tmp_path, print, build=good) == path
    assert len(calls) == 1 and os.listdir(tmp_path / "models") == ["demo"]

    (path / "manifest.json").write_text(json.dumps({"version": layout.VERSION - 1}))  # an older build's
    assert ensure_demo_model(tmp_path, print, build=good) == path
    assert len(calls) == 2 and json.loads((path / "manifest.json").read_text())["version"] == layout.VERSION
    assert os.listdir(tmp_path / "models") == ["demo"]


def test_a_demo_another_instance_built_meanwhile_is_kept(tmp_path):
    """Two first runs at once: the one that finishes second keeps the first one's demo (which that
    instance may be loading) instead of replacing it."""
    def good(work, out, progress):
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"version": layout.VERSION}))
        (out / "built_by").write_text(str(work))

    outer = []

    def racing(work, out, progress):
        outer.append(str(work))
        good(work, out, progress)
        ensure_demo_model(tmp_path, print, build=good)  # the other instance, done first

    path = ensure_demo_model(tmp_path, print, build=racing)
    theirs = (path / "built_by").read_text()
    assert theirs != outer[0] and os.listdir(tmp_path / "models") == ["demo"]  # no build dir left either


def _killed_transcript(config, pending: str = "") -> Path:
    """What a killed run leaves: a transcript without the close record."""
    saver = Autosaver(config.transcripts_dir, "be kind")
    saver.user("earlier question")
    saver.assistant(ChatMessage("assistant", "earlier answer", "", "eos"))
    if pending:
        saver.user(pending)
    return saver.path


def test_resume_after_a_kill(config):
    path = _killed_transcript(config, pending="unanswered question")
    engine = FakeEngine()

    async def go():
        app = ChatApp(config, FakeBackend(engine))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, ResumeScreen))
            await pilot.press("y")
            await wait_idle(pilot, app)
            assert [u.text for u in app.chat.transcript.query(UserMessage)] == ["earlier question"]
            assert app.chat.transcript.query(AssistantMessage).last().answer_text == "earlier answer"
            assert app.service.session.system == "be kind"
            assert [m.content for m in app.service.session.messages] == ["earlier question",
                                                                         "earlier answer"]
            assert app.chat.prompt.text == "unanswered question"
            await type_and_send(pilot, app, "next question")
        conv, closed = read_transcript(path)  # the same file continues, then closes cleanly
        assert closed and [m.content for m in conv.messages] == [
            "earlier question", "earlier answer", "next question", ANSWER]

    asyncio.run(go())
    assert find_unfinished(config.transcripts_dir) is None


def test_decline_resume_and_clean_exit_offers_nothing(config):
    path = _killed_transcript(config)

    async def go(expect_offer: bool):
        app = ChatApp(config, FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            if expect_offer:
                await wait_for(pilot, lambda: isinstance(app.screen, ResumeScreen))
                await pilot.press("n")
            await wait_idle(pilot, app)
            assert not isinstance(app.screen, ResumeScreen)
            assert app.conversation.messages == []
            await type_and_send(pilot, app, "fresh start")

    asyncio.run(go(expect_offer=True))
    assert read_transcript(path)[1]  # declined: marked closed, content kept
    asyncio.run(go(expect_offer=False))  # the previous run exited cleanly: no offer


def test_heap_is_frozen_while_ready_and_released_on_exit(config):
    import gc

    async def go():
        app = ChatApp(config, FakeBackend())
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            assert app.heap.frozen and gc.get_freeze_count() > 1000  # engine + UI objects
        assert not app.heap.frozen and gc.get_freeze_count() == 0  # unmount handed them back

    asyncio.run(go())
