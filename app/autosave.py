"""Crash-proof transcripts: every message is recorded (durably) as it completes.

A transcript is `<data_dir>/transcripts/<YYYYmmdd-HHMMSS>-<pid>[-<n>].jsonl`, one JSON object a line:

    {"type": "start", "version": 1, "time": "...", "system": "..."}
    {"type": "message", "role": "user", "content": "..."}      # when sent
    {"type": "message", "role": "assistant", "content": "...", "reasoning": "...",
     "finish": "eos", "replace": false}                         # when the turn completes;
                                                               # replace=true after /regen
    {"type": "undo"}                                           # /undo dropped the last turn
    {"type": "close"}                                          # the app ended cleanly

A file whose last record is not `close` was not closed cleanly (the app was killed): on the next
start the app offers to resume it. Records are written by atomic replacement (see `Autosaver`), so
no line is ever torn; a torn last line in a file from an older build is ignored on reading.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from app.conversation import ChatMessage, Conversation, ConversationError, create_temp

TRANSCRIPT_VERSION = 1


class AutosaveError(OSError):
    """A transcript record could not be written; the message names the file and the cause."""


class Autosaver:
    """Appends records to one transcript file; the file is created on the first record.

    Each record is made durable whole: the transcript's bytes plus the new line are written to a
    temporary file next to it, fsynced, renamed over the transcript (atomic) and the directory
    fsynced, so a full disk, a read-only directory or a kill at any point leaves the transcript
    as it was before the record or with it, never with a torn line. Several savers (in several
    processes) may append to one transcript: each write re-reads the file under a lock on its
    directory, so none clobbers another's records (see `_write`).

    When a write fails, the saver turns itself off (later records are dropped, the file keeps
    every record written before) and calls `on_error` once with one line for the user; without
    `on_error` it raises `AutosaveError` once instead.
    """

    def __init__(self, directory: Path, system: str = "", path: Path | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.directory = directory
        self.system = system
        self.path = path  # an existing file when resuming
        self.on_error = on_error
        self.off: str | None = None  # why autosave stopped, once it has
        self._closed = False
        self._data: bytes | None = None  # the transcript's bytes as last written (if it vanishes)

    def _append(self, record: dict[str, Any]) -> None:
        if self._closed:
            raise RuntimeError("transcript already closed")
        if self.off is not None:
            return
        try:
            if self.path is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                path = _new_name(self.directory)
                self._data = b""
                self._write(path, [{"type": "start", "version": TRANSCRIPT_VERSION,
                                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "system": self.system},
                                   record])
                self.path = path
            else:
                self._write(self.path, [record])
        except OSError as err:
            self._fail(err)

    def _fail(self, err: OSError) -> None:
        where = self.path or self.directory
        reason = err.strerror or str(err)
        self.off = (f"autosave is off: cannot write the transcript {where} ({reason}); the chat goes "
                    "on, but what follows is not saved — free space or fix the data dir's permissions")
        if self.on_error is None:
            raise AutosaveError(self.off) from err
        self.on_error(self.off)

    def _write(self, path: Path, records: list[dict[str, Any]]) -> None:
        """Durably replace `path` with its bytes plus `records` (temp file, fsync, rename).

        Another instance may be continuing the same transcript (both reopened it from /history):
        so the file is re-read under an exclusive lock on its directory (fcntl.flock, held for this
        write only) and rewritten with its current bytes, never from a copy taken earlier, and the
        temp file has a unique name. Neither writer's records are lost (they interleave in the
        order written). A filesystem without flock is written unlocked."""
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX)
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            self._replace(path, records)
        finally:
            os.close(dir_fd)  # releases the lock

    def _replace(self, path: Path, records: list[dict[str, Any]]) -> None:
        try:
            current = path.read_bytes()
        except FileNotFoundError:  # removed behind our back: keep what it held
            current = self._data or b""
        if current and not current.endswith(b"\n"):  # a torn line from an older build
            current += b"\n"
        data = current + b"".join(
            (json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in records)
        fd, tmp = create_temp(path.parent, f".{path.name}.", 0o644)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._data = data
        _fsync_dir(path.parent)

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
        if self.path is not None and not self._closed and self.off is None:
            try:
                self._write(self.path, [{"type": "close"}])
            except OSError as err:
                self._closed = True
                self._fail(err)
        self._closed = True


def _new_name(directory: Path) -> Path:
    """`<stamp>-<pid>.jsonl`, or `<stamp>-<pid>-<n>.jsonl` when this process already started a
    transcript this second (a /new right after the first message): never an existing file."""
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path, n = directory / f"{base}.jsonl", 1
    while path.exists():
        n += 1
        path = directory / f"{base}-{n}.jsonl"
    return path


def _fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (best effort: some filesystems refuse a directory fd)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    # records end at "\n" only: str.splitlines() would also split a record at a U+2028, U+2029 or
    # U+0085 inside a message (json.dumps with ensure_ascii=False writes them raw) and lose it
    for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # torn line from a kill mid-write
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_transcript(path: Path) -> tuple[Conversation, bool]:
    """The conversation a transcript describes, and whether it was closed cleanly. Raises
    ConversationError (naming the file, the message and the fix) if a message is not one a chat
    can hold (`Conversation.check`: e.g. a role other than user or assistant)."""
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
    return conv.check(str(path)), closed


@dataclass(frozen=True)
class Unfinished:
    """A transcript left open by a previous run."""

    path: Path
    conversation: Conversation


def find_unfinished(directory: Path) -> Unfinished | None:
    """The newest transcript that was not closed cleanly and holds a message, if any. One that
    cannot be read as a conversation is passed over (/history lists it with its problem)."""
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            conv, closed = read_transcript(path)
        except ConversationError:
            continue
        if closed:
            return None  # only the last conversation is offered
        if conv.messages:
            return Unfinished(path, conv)
    return None


def dismiss(path: Path) -> str | None:
    """Mark an unfinished transcript closed (the user declined to resume it). Returns None, or
    the reason it could not be marked (it is then offered again on the next start)."""
    saver = Autosaver(path.parent, path=path)
    try:
        saver.close()
    except AutosaveError as err:
        return str(err)
    return None
