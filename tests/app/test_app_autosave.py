"""Transcripts (autosave), saved conversations, Markdown export — no app."""

from __future__ import annotations

import errno
import json
import os

import pytest

from app import conversation as conv_io
from app.autosave import AutosaveError, Autosaver, dismiss, find_unfinished, read_transcript
from app.conversation import ChatMessage, Conversation, ConversationError


def _chat(saver: Autosaver) -> None:
    saver.user("q1")
    saver.assistant(ChatMessage("assistant", "a1", "r1", "eos"))
    saver.user("q2")
    saver.assistant(ChatMessage("assistant", "a2", "", "cancelled"))


def test_nothing_written_until_the_first_message(tmp_path):
    saver = Autosaver(tmp_path / "t", "sys")
    saver.undo()
    saver.close()
    assert saver.path is None and not (tmp_path / "t").exists()


def test_transcript_round_trip_with_regen_and_undo(tmp_path):
    saver = Autosaver(tmp_path / "t", "be terse")
    _chat(saver)
    saver.assistant(ChatMessage("assistant", "a2 again", "", "eos"), replace=True)
    conv, closed = read_transcript(saver.path)
    assert not closed and conv.system == "be terse"
    assert [(m.role, m.content, m.finish) for m in conv.messages] == [
        ("user", "q1", ""), ("assistant", "a1", "eos"), ("user", "q2", ""),
        ("assistant", "a2 again", "eos")]
    assert conv.messages[1].reasoning == "r1"
    saver.undo()
    saver.close()
    conv, closed = read_transcript(saver.path)
    assert closed and [m.content for m in conv.messages] == ["q1", "a1"]
    lines = saver.path.read_text().splitlines()
    assert json.loads(lines[0])["type"] == "start" and json.loads(lines[-1]) == {"type": "close"}


def test_messages_with_unicode_line_separators_survive_the_round_trip(tmp_path):
    texts = ["first", "line\u2028two", "second\x85x", "para\u2029graph", "ok\u000bvt\u000cff"]
    saver = Autosaver(tmp_path / "t", "sys\u2028tem")
    for i, text in enumerate(texts):
        if i % 2:
            saver.assistant(ChatMessage("assistant", text, "why\u2028so", "eos"))
        else:
            saver.user(text)
    saver.close()
    conv, closed = read_transcript(saver.path)  # /history reopens exactly this conversation
    assert closed and conv.system == "sys\u2028tem" and [m.content for m in conv.messages] == texts
    assert conv.messages[1].reasoning == "why\u2028so"


def test_torn_last_line_is_ignored(tmp_path):
    saver = Autosaver(tmp_path)
    _chat(saver)
    with saver.path.open("a") as fh:
        fh.write('{"type": "message", "role": "user", "cont')  # killed mid-write
    conv, closed = read_transcript(saver.path)
    assert not closed and len(conv.messages) == 4


def test_find_unfinished_offers_only_the_last_unclosed(tmp_path):
    old = Autosaver(tmp_path)
    old.user("killed while chatting")
    assert find_unfinished(tmp_path).path == old.path
    assert find_unfinished(tmp_path).conversation.pending_prompt() == "killed while chatting"
    dismiss(old.path)
    assert find_unfinished(tmp_path) is None
    assert read_transcript(old.path)[0].messages[0].content == "killed while chatting"  # kept
    assert find_unfinished(tmp_path / "absent") is None


def test_conversation_helpers():
    conv = Conversation("s", [ChatMessage("user", "q1"), ChatMessage("assistant", "a1"),
                              ChatMessage("user", "q2")])
    assert conv.turns == 2 and conv.pending_prompt() == "q2"
    assert [m.content for m in conv.settled().messages] == ["q1", "a1"]
    conv.drop_last_turn()
    assert [m.content for m in conv.messages] == ["q1", "a1"]
    conv.replace_last_answer(ChatMessage("assistant", "a1'"))
    assert [m.content for m in conv.messages] == ["q1", "a1'"]


def test_save_load_and_errors(tmp_path):
    conv = Conversation("sys", [ChatMessage("user", "hi"),
                                ChatMessage("assistant", "hello", "think", "eos")])
    path = conv_io.save(conv, tmp_path, "chat-1")
    assert path == tmp_path / "chat-1.json"
    assert conv_io.load(tmp_path, "chat-1") == conv
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind
    with pytest.raises(ConversationError, match="bad name '../x'"):
        conv_io.save(conv, tmp_path, "../x")
    with pytest.raises(ConversationError, match=r"no saved conversation 'nope' \(saved: chat-1\)"):
        conv_io.load(tmp_path, "nope")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConversationError, match="not a saved conversation"):
        conv_io.load(tmp_path, "broken")
    (tmp_path / "future.json").write_text('{"version": 9, "messages": []}')
    with pytest.raises(ConversationError, match="format version 9"):
        conv_io.load(tmp_path, "future")


def test_markdown_export():
    conv = Conversation("be brief", [
        ChatMessage("user", "What is MoE?"),
        ChatMessage("assistant", "Experts.", "line one\nline two", "eos"),
        ChatMessage("user", "More?"),
        ChatMessage("assistant", "Partial", "", "cancelled")])
    md = conv.to_markdown()
    assert md.startswith("# Conversation\n")
    assert "**System:** be brief" in md
    assert "## User\n\nWhat is MoE?" in md
    assert "> line one\n> line two" in md
    assert "Partial\n\n*(cancelled)*" in md
    assert md.index("What is MoE?") < md.index("Experts.") < md.index("More?")


# ---- faults: a full disk, a read-only data dir (issue 30) ---------------------------------------

class DiskFullAfter:
    """Stands in for os.write in app.autosave: lets `budget` bytes through in total, then writes
    what still fits of one call and raises ENOSPC, like a filesystem that fills up."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.real = os.write

    def __call__(self, fd: int, data) -> int:
        if self.budget <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.real(fd, bytes(data[: self.budget]))
        self.budget -= n
        return n


def _lines(path):
    return [json.loads(line) for line in path.read_bytes().decode().splitlines()]  # no torn line


def test_full_disk_mid_record_leaves_every_earlier_record_whole(tmp_path, monkeypatch):
    errors = []
    saver = Autosaver(tmp_path / "t", "sys", on_error=errors.append)
    saver.user("q1")
    saver.assistant(ChatMessage("assistant", "a1", "", "eos"))
    before = saver.path.read_bytes()
    # The next rewrite of the transcript gets only part of its bytes onto the disk.
    monkeypatch.setattr("app.autosave.os.write", DiskFullAfter(len(before) + 10))
    saver.user("q2 " * 50)
    assert errors == [f"autosave is off: cannot write the transcript {saver.path} (No space left on device); "
                      "the chat goes on, but what follows is not saved — free space or fix the data dir's "
                      "permissions"]
    assert saver.path.read_bytes() == before  # the failed record left no trace, nothing torn
    assert [p.name for p in saver.path.parent.iterdir()] == [saver.path.name]  # no temp file left
    saver.assistant(ChatMessage("assistant", "a2"))  # autosave is off: dropped, no second warning
    saver.undo()
    saver.close()
    assert len(errors) == 1 and saver.path.read_bytes() == before
    conv, closed = read_transcript(saver.path)
    assert [m.content for m in conv.messages] == ["q1", "a1"] and not closed
    assert [r["type"] for r in _lines(saver.path)] == ["start", "message", "message"]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_unwritable_data_dir_before_the_first_record(tmp_path, monkeypatch, code):
    def refuse(path, flags, mode=0o777):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr("app.autosave.os.open", refuse)
    saver = Autosaver(tmp_path / "t")
    with pytest.raises(AutosaveError) as info:  # no on_error: raised once ...
        saver.user("hello")
    assert str(info.value).startswith(f"autosave is off: cannot write the transcript {tmp_path / 't'} "
                                      f"({os.strerror(code)})")
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == code
    saver.assistant(ChatMessage("assistant", "a"))  # ... then off: no exception
    saver.close()
    assert saver.path is None and list((tmp_path / "t").iterdir()) == []


def test_fsync_failure_keeps_the_transcript_as_it_was(tmp_path, monkeypatch):
    saver = Autosaver(tmp_path, on_error=lambda message: None)
    saver.user("q1")
    before = saver.path.read_bytes()

    def eio(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr("app.autosave.os.fsync", eio)
    saver.assistant(ChatMessage("assistant", "a1"))
    assert saver.off is not None and "Input/output error" in saver.off
    assert saver.path.read_bytes() == before


def test_resuming_a_file_with_a_torn_line_from_an_older_build(tmp_path):
    saver = Autosaver(tmp_path)
    saver.user("q1")
    with saver.path.open("a") as fh:
        fh.write('{"type": "message", "role": "assistant", "cont')  # killed mid-append
    resumed = Autosaver(tmp_path, path=saver.path)
    resumed.assistant(ChatMessage("assistant", "a1"))
    resumed.close()
    conv, closed = read_transcript(saver.path)
    assert closed and [m.content for m in conv.messages] == ["q1", "a1"]


def test_dismiss_on_a_read_only_dir_says_why(tmp_path, monkeypatch):
    saver = Autosaver(tmp_path)
    saver.user("q1")
    monkeypatch.setattr("app.autosave.os.open", lambda *a: (_ for _ in ()).throw(
        OSError(errno.EROFS, os.strerror(errno.EROFS))))
    assert "Read-only file system" in dismiss(saver.path)
    assert find_unfinished(tmp_path).path == saver.path  # offered again next time


def test_tui_read_only_data_dir_notifies_and_the_chat_goes_on(config, monkeypatch):
    import asyncio

    from app_helpers import screen_text, type_and_send, wait_idle
    from fake_engine import ANSWER, FakeBackend

    from app.app import ChatApp
    from app.widgets.message import AssistantMessage

    def refuse(path, flags, mode=0o777):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr("app.autosave.os.open", refuse)

    async def go():
        app = ChatApp(config, FakeBackend())
        async with app.run_test(size=(120, 45), notifications=True) as pilot:
            await wait_idle(pilot, app)
            await type_and_send(pilot, app, "first")
            await type_and_send(pilot, app, "second")
            answers = [a.answer_text for a in app.chat.transcript.query(AssistantMessage)]
            assert answers[-2:] == [ANSWER, ANSWER] and app.is_running
            await pilot.pause(0.1)
            assert "autosave off" in screen_text(app)  # the toast's title
            shown = [n.message for n in app._notifications]
            assert len(shown) == 1 and shown[0].startswith(
                f"autosave is off: cannot write the transcript {config.transcripts_dir} (Read-only file system)")

    asyncio.run(go())
    assert not config.transcripts_dir.exists() or not list(config.transcripts_dir.iterdir())


def test_two_transcripts_in_the_same_second_stay_apart(tmp_path):
    first, second = Autosaver(tmp_path, "one"), Autosaver(tmp_path, "two")
    first.user("q1")
    second.user("q2")  # e.g. /new right after a message
    first.close()
    second.close()
    assert first.path != second.path
    assert read_transcript(first.path)[0].messages[0].content == "q1"
    assert read_transcript(second.path)[0].system == "two"
