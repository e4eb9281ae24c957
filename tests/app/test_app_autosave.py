"""Transcripts (autosave), saved conversations, Markdown export — no app."""

from __future__ import annotations

import json

import pytest

from app import conversation as conv_io
from app.autosave import Autosaver, dismiss, find_unfinished, read_transcript
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
