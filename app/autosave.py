"""Crash-proof transcripts: every message is appended (and fsynced) as it completes.

A transcript is `<data_dir>/transcripts/<YYYYmmdd-HHMMSS>-<pid>.jsonl`, one JSON object a line:

    {"type": "start", "version": 1, "time": "...", "system": "..."}
    {"type": "message", "role": "user", "content": "..."}      # when sent
    {"type": "message", "role": "assistant", "content": "...", "reasoning": "...",
     "finish": "eos", "replace": false}                         # when the turn completes;
                                                               # replace=true after /regen
    {"type": "undo"}                                           # /undo dropped the last turn
    {"type": "close"}                                          # the app ended cleanly

A file whose last record is not `close` was not closed cleanly (the app was killed): on the next
start the app offers to resume it. A torn last line (killed mid-write) is ignored on reading.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.conversation import ChatMessage, Conversation

TRANSCRIPT_VERSION = 1


class Autosaver:
    """Appends records to one transcript file; the file is created on the first record."""

    def __init__(self, directory: Path, system: str = "", path: Path | None = None) -> None:
        self.directory = directory
        self.system = system
        self.path = path  # an existing file when resuming
        self._closed = False

    def _append(self, record: dict[str, Any]) -> None:
        if self._closed:
            raise RuntimeError("transcript already closed")
        if self.path is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.path = self.directory / f"{stamp}-{os.getpid()}.jsonl"
            n = 1
            while self.path.exists():  # a second conversation begun within the same second
                self.path = self.directory / f"{stamp}-{os.getpid()}-{n}.jsonl"
                n += 1
            self._write({"type": "start", "version": TRANSCRIPT_VERSION,
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "system": self.system})
        self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        assert self.path is not None
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def user(self, content: str) -> None:
        self._append({"type": "message", "role": "user", "content": content})

    def assistant(self, msg: ChatMessage, replace: bool = False) -> None:
        self._append({"type": "message", "role": "assistant", "content": msg.content,
                      "reasoning": msg.reasoning, "finish": msg.finish, "replace": replace})

    def seed(self, conv: Conversation) -> None:
        """Record the messages a conversation starts with (a loaded or restarted one)."""
        self.system = conv.system
        for msg in conv.messages:
            if msg.role == "user":
                self.user(msg.content)
            else:
                self.assistant(msg)

    def undo(self) -> None:
        if self.path is not None:
            self._append({"type": "undo"})

    def close(self) -> None:
        """Mark the transcript closed cleanly (no-op if nothing was ever written)."""
        if self.path is not None and not self._closed:
            self._write({"type": "close"})
        self._closed = True


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # torn line from a kill mid-write
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_transcript(path: Path) -> tuple[Conversation, bool]:
    """The conversation a transcript describes, and whether it was closed cleanly."""
    conv = Conversation()
    closed = False
    for rec in _records(path):
        kind = rec.get("type")
        closed = kind == "close"
        if kind == "start":
            conv.system = str(rec.get("system", ""))
        elif kind == "undo":
            conv.drop_last_turn()
        elif kind == "message":
            msg = ChatMessage(str(rec.get("role")), str(rec.get("content", "")),
                              str(rec.get("reasoning", "")), str(rec.get("finish", "")))
            if msg.role == "assistant" and rec.get("replace"):
                conv.replace_last_answer(msg)
            else:
                conv.messages.append(msg)
    return conv, closed


@dataclass(frozen=True)
class Unfinished:
    """A transcript left open by a previous run."""

    path: Path
    conversation: Conversation


def find_unfinished(directory: Path) -> Unfinished | None:
    """The newest transcript that was not closed cleanly and holds a message, if any."""
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True):
        conv, closed = read_transcript(path)
        if closed:
            return None  # only the last conversation is offered
        if conv.messages:
            return Unfinished(path, conv)
    return None


def dismiss(path: Path) -> None:
    """Mark an unfinished transcript closed (the user declined to resume it)."""
    saver = Autosaver(path.parent, path=path)
    saver.close()
