"""app.controller: every slash command's typed result and its effect on the conversation, the
transcript, the settings and the engine — and the TUI and `--plain` driving that one controller
to the same state."""

from __future__ import annotations

import asyncio
import errno
import io
import os
import threading
from dataclasses import replace

import pytest
from fake_engine import ANSWER, FakeBackend, FakeEngine
from app_helpers import type_and_send, wait_idle

from app.app import ChatApp
from app.autosave import read_transcript
from app.commands import REGISTRY, parse
from app.controller import (
    HANDLERS,
    IDLE,
    BuildDemo,
    CacheFlushed,
    Controller,
    EngineJob,
    EngineState,
    ExpertsPinned,
    ExpertsUnpinned,
    Help,
    LiveStats,
    Quit,
    Regenerate,
    Reply,
    SessionReset,
    SettingChanged,
    StatsReady,
    SwitchModel,
    TurnUndone,
)
from app.conversation import ChatMessage
from app.plain import PlainChat
from app.widgets.message import NoteMessage, UserMessage

BUSY = EngineState(busy="turn")


class Rig:
    """A controller and a fake engine with one session, running engine jobs inline."""

    def __init__(self, config) -> None:
        self.engine = FakeEngine()
        self.ctl = Controller(config)
        self.session = self.engine.new_session(system=config.system or None)

    def apply(self, line: str, state: EngineState = IDLE):
        return self.ctl.apply(parse(line), state)

    def job(self, line: str):
        """Apply `line`, which must yield an EngineJob, run it and finish it."""
        job = self.apply(line)
        assert isinstance(job, EngineJob), job
        return self.ctl.finish(job.run(self.engine, self.session))

    def turn(self, text: str) -> None:
        """One answered question, as a front-end records it."""
        events = list(self.engine.generate(self.session, text, self.ctl.gen,
                                           threading.Event()))
        self.ctl.sent(text)
        done = events[-1]
        self.ctl.answered(ChatMessage("assistant", done.content, done.reasoning, done.stats.finish_reason),
                          regenerated=False)


@pytest.fixture
def rig(config) -> Rig:
    return Rig(config)


def test_every_command_has_one_handler():
    assert HANDLERS.keys() == REGISTRY.keys()


def test_help_and_quit(rig):
    result = rig.apply("/help")
    assert isinstance(result, Help) and len(result.lines) == len(REGISTRY)
    assert [line.split()[0] for line in result.lines] == [s.usage.split()[0] for s in REGISTRY.values()]
    assert rig.apply("/quit") == Quit()
    assert rig.apply("/quit", BUSY) == Quit()  # leaving needs no idle engine


def test_new_and_system_reset_the_session_and_keep_the_transcript(rig):
    rig.turn("q1")
    first = rig.ctl.autosave.path
    result = rig.apply("/new")
    assert isinstance(result, SessionReset) and result.note == "new conversation" and result.kept_turns == 1
    assert result.conversation is rig.ctl.conversation and rig.ctl.conversation.messages == []
    conv, closed = read_transcript(first)
    assert closed and [m.content for m in conv.messages] == ["q1", ANSWER]
    assert rig.ctl.autosave.path is None  # a new transcript, created with its first record
    assert rig.apply("/system") == Reply("system prompt: (none)")
    result = rig.apply("/system Be terse.")
    assert result == SessionReset(rig.ctl.conversation, "system prompt set — new conversation", 0)
    assert rig.ctl.conversation.system == "Be terse."
    assert rig.apply("/system") == Reply("system prompt: Be terse.")


def test_set_changes_the_settings_or_says_why_not(rig, tmp_path):
    assert rig.apply("/set temperature 0.2") == SettingChanged("temperature", 0.2)
    assert rig.ctl.gen.temperature == 0.2 and rig.ctl.config.gen.temperature == 0.2
    assert rig.apply("/set top_p 5") == Reply("top_p must be in (0, 1], got 5.0", error=True)
    assert rig.ctl.gen.top_p == 1.0
    assert rig.apply("/set") == Reply("temperature 0.2 · top_p 1.0 · top_k 0 · max_tokens "
                                      f"{rig.ctl.gen.max_tokens} · think off")
    assert rig.apply("/set save") == Reply("no settings file to save to: start with --config FILE", error=True)
    rig.ctl.config = replace(rig.ctl.config, config_file=tmp_path / "dsv4.toml")
    assert rig.apply("/set save") == Reply(f"saved temperature = 0.2 to {tmp_path / 'dsv4.toml'} "
                                           "(used from the next start)")
    assert "temperature = 0.2" in (tmp_path / "dsv4.toml").read_text()


def test_cache_commands_are_engine_jobs_with_typed_results(rig):
    rig.turn("fill the cache")
    resident = len(rig.engine.cache_contents())
    assert resident > 0
    assert rig.job("/flush") == CacheFlushed(resident)
    pinned = rig.job("/pin hot 2")
    assert isinstance(pinned, ExpertsPinned) and len(pinned.keys) == 2
    assert rig.job("/pin 0:9,1:10") == ExpertsPinned(((0, 9), (1, 10)))
    assert rig.job("/unpin 0:9,3:3") == ExpertsUnpinned(((0, 9), (3, 3)), ((0, 9),), ((3, 3),))
    everything = rig.job("/unpin")
    assert everything.everything and set(everything.was) == set(pinned.keys) | {(1, 10)}
    assert not [c for c in rig.engine.cache_contents() if c[2]]
    stats = rig.job("/stats")
    assert isinstance(stats, StatsReady) and stats.contents == rig.engine.cache_contents()
    assert stats.stats.cache.capacity_entries == 24
    assert rig.apply("/stats").refresh_stats is False


def test_an_engine_refusal_is_the_jobs_exception(rig):
    job = rig.apply("/pin 9:99")
    with pytest.raises(ValueError, match="no expert 9:99"):
        job.run(rig.engine, rig.session)


def test_regen_and_undo(rig):
    assert rig.apply("/regen") == Reply("nothing to regenerate yet", error=True)
    assert rig.apply("/undo") == Reply("nothing to undo", error=True)
    rig.turn("q1")
    rig.turn("q2")
    assert rig.apply("/regen") == Regenerate()
    assert rig.job("/undo") == TurnUndone(rig.session.position)
    assert [m.content for m in rig.ctl.conversation.messages] == ["q1", ANSWER]
    assert [m.content for m in rig.session.messages] == ["q1", ANSWER]
    rig.ctl.close()
    conv, _ = read_transcript(rig.ctl.autosave.path)
    assert [m.content for m in conv.messages] == ["q1", ANSWER]


@pytest.mark.parametrize("line", ["/new", "/system x", "/flush", "/pin hot 1", "/unpin", "/regen", "/undo"])
def test_engine_commands_wait_for_an_idle_engine(rig, line):
    rig.turn("q1")
    assert rig.apply(line, BUSY) == Reply("still answering — wait, or press Esc to stop", error=True)
    assert rig.apply(line, EngineState(busy="pin")) == Reply(
        "the engine is busy (pin) — try again in a moment", error=True)
    assert rig.apply(line, EngineState(ready=False)) == Reply("the model is not loaded yet", error=True)
    assert [m.content for m in rig.ctl.conversation.messages] == ["q1", ANSWER]  # nothing changed


def test_stats_by_engine_state(rig):
    assert isinstance(rig.apply("/stats"), EngineJob)
    assert rig.apply("/stats", BUSY) == LiveStats()
    assert rig.apply("/stats", EngineState(loaded=False, ready=False)) == Reply(
        "no statistics yet: the model is not loaded", error=True)


def test_save_load_export(rig, tmp_path):
    rig.turn("q1")
    saved = rig.apply("/save keep")
    assert saved == Reply(f"saved 1 turn(s) to {rig.ctl.config.saved_dir / 'keep.json'}")
    rig.apply("/new")
    result = rig.apply("/load keep")
    assert isinstance(result, SessionReset) and result.note == "loaded 'keep' (1 turn(s))"
    assert [m.content for m in rig.ctl.conversation.messages] == ["q1", ANSWER]
    assert rig.apply("/load gone").error
    out = tmp_path / "new-dir" / "chat.md"
    assert rig.apply(f"/export {out}").error and not out.exists()
    assert rig.apply(f"/export {out} --force") == Reply(
        f"exported 1 turn(s) to {out} (created {out.parent})")
    assert "## User\n\nq1" in out.read_text()


def test_history_lists_and_reopens(rig):
    assert rig.apply("/history") == Reply("no past conversations yet")
    rig.turn("the first question")
    first = rig.ctl.autosave.path
    listing = rig.apply("/history")
    assert listing.text.startswith("past conversations (newest first):\n 1. ") and "(open)" in listing.text
    assert rig.apply("/history 1") == Reply("that conversation is the one open now")
    rig.apply("/new")
    assert rig.apply("/history 2") == Reply("no conversation 2: /history lists 1-1", error=True)
    result = rig.apply("/history 1")
    assert result == SessionReset(rig.ctl.conversation, "reopened “the first question” (1 turn(s))")
    assert rig.ctl.autosave.path == first


def test_model_without_models(rig):
    assert rig.apply("/model").error
    assert rig.apply("/model demo") == BuildDemo()
    assert rig.apply("/model nope") == Reply(
        f"no converted model 'nope' (in {rig.ctl.config.models_dir}: none)", error=True)
    assert rig.apply("/model nope", BUSY).error
    assert rig.apply("/model demo", EngineState(ready=False)) == BuildDemo()  # a failed load is replaceable


def test_model_lists_and_switches(rig):
    models = rig.ctl.config.models_dir
    for name in ("alpha", "beta"):
        (models / name).mkdir(parents=True)
        (models / name / "manifest.json").write_text("{}")
    rig.ctl.model_dir = models / "alpha"
    listing = rig.apply("/model")
    assert listing.text.startswith("models (● in use):\n") and "● alpha" in listing.text
    assert "  beta" in listing.text and not listing.error
    assert rig.apply("/model alpha") == Reply("alpha is the model in use")
    assert rig.apply("/model beta") == SwitchModel(models / "beta")
    assert rig.ctl.model_dir == models / "alpha"  # the front-end loads it (and records it then)


# ---- both front-ends, one controller ------------------------------------------------------------

SCRIPT = ["q1", "q2", "/regen", "/undo", "/set max_tokens 3", "q3", "/system be brief", "q4", "/pin 0:1",
          "/flush", "/undo", "/undo"]


def reader(lines: list[str]):
    """A PlainChat line reader: `lines`, then end of input."""
    it = iter(lines)

    def read() -> str:
        line = next(it, None)
        if line is None:
            raise EOFError
        return line

    return read


def _records(config) -> list[list[tuple[str, str]]]:
    """Each transcript's (role, content) messages, by system prompt."""
    out = {}
    for path in config.transcripts_dir.glob("*.jsonl"):
        conv, closed = read_transcript(path)
        assert closed
        out[conv.system] = [(m.role, m.content) for m in conv.messages]
    return [out[k] for k in sorted(out)]


def test_plain_and_tui_reach_the_same_state(config):
    plain_config = replace(config, data_dir=config.data_dir / "plain")
    tui_config = replace(config, data_dir=config.data_dir / "tui")
    plain_engine = FakeEngine()
    chat = PlainChat(plain_engine, plain_config, reader(SCRIPT), io.StringIO(), io.StringIO())
    assert chat.run() == 0
    tui_engine = FakeEngine()
    state = {}

    async def go():
        app = ChatApp(tui_config, FakeBackend(tui_engine))
        async with app.run_test(size=(120, 45)) as pilot:
            await wait_idle(pilot, app)
            for line in SCRIPT:
                await type_and_send(pilot, app, line)
            state["conv"] = app.controller.conversation
            state["pinned"] = [c[:2] for c in tui_engine.cache_contents() if c[2]]
            state["gen"] = app.gen

    asyncio.run(go())
    assert [(m.role, m.content) for m in chat.controller.conversation.messages] == \
        [(m.role, m.content) for m in state["conv"].messages] == []
    assert chat.controller.conversation.system == state["conv"].system == "be brief"
    assert chat.controller.gen == state["gen"] and state["gen"].max_tokens == 3
    assert [c[:2] for c in plain_engine.cache_contents() if c[2]] == state["pinned"] == [(0, 1)]
    plain_records = _records(plain_config)
    assert plain_records == _records(tui_config)
    first, brief = plain_records
    assert first[:3] == [("user", "q1"), ("assistant", ANSWER), ("user", "q3")]
    assert len(first) == 4 and ANSWER.startswith(first[3][1].strip()) and first[3][1].strip() != ANSWER
    assert brief == []  # "be brief": q4 asked, then undone


def test_plain_gets_history_from_the_controller_and_refuses_model(config):
    """--plain used to ignore /history and /model silently: /history now works as in the TUI,
    /model (a model switch) is refused like the other TUI-only commands."""
    engine = FakeEngine()
    err = io.StringIO()
    chat = PlainChat(engine, config, reader(["first question", "/new", "/history", "/history 1", "second",
                                             "/model", "/help"]), io.StringIO(), err, strict=True)
    assert chat.run() == 1  # the refused /model
    text = err.getvalue()
    assert "past conversations (newest first):\n 1. " in text
    assert "reopened “first question” (1 turn(s))" in text
    assert "! /model is not available in --plain mode; use the TUI (dsv4-chat)" in text
    assert "list the converted models; NAME: switch to it  (TUI only)" in text
    assert [m.content for m in chat.session.messages] == ["first question", ANSWER, "second", ANSWER]
    path, = config.transcripts_dir.glob("*.jsonl")  # the reopened transcript goes on
    assert [m.content for m in read_transcript(path)[0].messages] == ["first question", ANSWER, "second", ANSWER]


# ---- a conversation that cannot be continued is refused, nothing switched -----------------------

def _plant_bad_transcript(config):
    """A transcript (newer than any other) whose second message has the role 'bot'."""
    import os
    import time

    path = config.transcripts_dir / "29990101-000000-1.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"type": "start", "version": 1, "system": ""}\n'
                    '{"type": "message", "role": "user", "content": "hi"}\n'
                    '{"type": "message", "role": "bot", "content": "beep"}\n')
    future = time.time() + 3600
    os.utime(path, (future, future))
    return path, path.read_bytes()


BAD_ROLE = "message 2 has role 'bot' (expected 'user' or 'assistant') — fix or remove it in that file"


def test_load_of_a_bad_role_is_refused_and_keeps_the_conversation(rig):
    rig.turn("q1")
    before, transcript = list(rig.ctl.conversation.messages), rig.ctl.autosave.path
    bad = rig.ctl.config.saved_dir / "bad.json"
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text('{"version": 1, "system": "", "messages": [{"role": "bot", "content": "x"}]}')
    assert rig.apply("/load bad") == Reply(
        f"{bad}: message 1 has role 'bot' (expected 'user' or 'assistant') — fix or remove it in "
        "that file", error=True)
    assert rig.ctl.conversation.messages == before and rig.ctl.autosave.path == transcript


def test_history_of_a_bad_transcript_is_refused_and_keeps_the_conversation(rig):
    rig.turn("q1")
    before, transcript = list(rig.ctl.conversation.messages), rig.ctl.autosave.path
    bad, data = _plant_bad_transcript(rig.ctl.config)
    listing = rig.apply("/history").text.splitlines()
    assert listing[1].endswith(f"cannot be reopened: {bad}: {BAD_ROLE}")
    assert rig.apply("/history 1") == Reply(f"{bad}: {BAD_ROLE}", error=True)
    assert rig.ctl.conversation.messages == before and rig.ctl.autosave.path == transcript
    rig.turn("q2")
    assert bad.read_bytes() == data
    assert [m.content for m in read_transcript(transcript)[0].messages] == ["q1", ANSWER, "q2", ANSWER]


def test_plain_history_of_a_bad_transcript_keeps_the_session(config):
    bad, data = _plant_bad_transcript(config)
    err = io.StringIO()
    chat = PlainChat(FakeEngine(), config, reader(["first", "/history 1", "second"]), io.StringIO(),
                     err, strict=True)
    assert chat.run() == 1
    assert f"! {bad}: {BAD_ROLE}\n" in err.getvalue()
    assert [m.content for m in chat.session.messages] == ["first", ANSWER, "second", ANSWER]
    assert bad.read_bytes() == data
    good, = [p for p in config.transcripts_dir.glob("*.jsonl") if p != bad]
    assert [m.content for m in read_transcript(good)[0].messages] == ["first", ANSWER, "second", ANSWER]


def test_tui_history_of_a_bad_transcript_keeps_the_session(config):
    bad, data = _plant_bad_transcript(config)

    async def go():
        app = ChatApp(config, FakeBackend(FakeEngine()))
        async with app.run_test(size=(120, 45)) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "first")
            transcript = app.autosave.path
            await type_and_send(pilot, app, "/history 1")
            note = app.chat.transcript.query(NoteMessage).last()
            assert note.text == f"{bad}: {BAD_ROLE}" and "error" in note.classes
            assert [u.text for u in app.chat.transcript.query(UserMessage)] == ["first"]
            assert app.autosave.path == transcript
            await type_and_send(pilot, app, "second")
            assert [m.content for m in app.service.session.messages] == ["first", ANSWER, "second", ANSWER]
            return transcript

    transcript = asyncio.run(go())
    assert bad.read_bytes() == data
    assert [m.content for m in read_transcript(transcript)[0].messages] == ["first", ANSWER, "second", ANSWER]


def test_save_and_load_file_errors_are_one_line_naming_the_file(rig, monkeypatch):
    from app import conversation as conv_io

    rig.turn("q1")
    path = rig.ctl.config.saved_dir / "keep.json"

    def disk_full(target, text):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(conv_io, "write_atomic", disk_full)
        assert rig.apply("/save keep") == Reply(f"cannot write {path}: No space left on device", error=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'{"version": 1, "messages": [{"role": "user", "content": "\xff"}]}')
    before = list(rig.ctl.conversation.messages)
    assert rig.apply("/load keep") == Reply(f"{path}: not a saved conversation (not UTF-8 text)", error=True)
    assert rig.ctl.conversation.messages == before


def test_save_over_an_existing_save_asks_for_force(rig):
    rig.turn("q1")
    path = rig.ctl.config.saved_dir / "keep.json"
    assert not rig.apply("/save keep").error
    kept = path.read_text()
    rig.turn("q2")
    assert rig.apply("/save keep") == Reply(f"{path} exists: /save keep --force overwrites it", error=True)
    assert path.read_text() == kept
    assert rig.apply("/save keep --force") == Reply(f"saved 2 turn(s) to {path}")
    assert [m.content for m in conv_io_load(rig, "keep").messages] == ["q1", ANSWER, "q2", ANSWER]


def conv_io_load(rig, name):
    from app import conversation as conv_io

    return conv_io.load(rig.ctl.config.saved_dir, name)


def test_history_shows_the_open_transcript_as_autosave_off_once_autosave_stopped(config, monkeypatch):
    """A transcript whose autosave turned itself off (a full or read-only data dir) holds only the
    turns before: /history marks it so, not as a live "(open)" one."""
    warnings: list[str] = []
    rig = Rig(config)
    rig.ctl = Controller(config, on_autosave_error=warnings.append)
    rig.turn("the first question")
    path = rig.ctl.autosave.path
    assert rig.apply("/history").text.splitlines()[1].endswith("the first question (open)")

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("app.autosave.os.write", refuse)
    rig.turn("the second question")
    assert len(warnings) == 1 and rig.ctl.autosave.path == path
    line = rig.apply("/history").text.splitlines()[1]
    assert line.endswith("the first question (open, autosave off)") and "(open)" not in line
    assert rig.apply("/history 1") == Reply("that conversation is the one open now")
