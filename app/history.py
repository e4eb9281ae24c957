"""Past conversations: the autosaved transcripts (app/autosave.py), newest first, for `/history`
and the command palette. Reopening one continues the same transcript file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from app.autosave import read_transcript
from app.conversation import Conversation, ConversationError


@dataclass(frozen=True)
class Past:
    """One autosaved conversation. `problem`: why the transcript cannot be reopened (one line
    naming the file and the fix; `conversation` is then empty), or None."""

    path: Path
    conversation: Conversation
    modified: float  # st_mtime of the transcript
    problem: str | None = None

    def title(self, width: int = 50) -> str:
        """The first question, shortened to `width` characters ("(no question)" if none;
        "(unreadable)" for a transcript with a problem)."""
        if self.problem is not None:
            return "(unreadable)"
        first = next((m.content for m in self.conversation.messages if m.role == "user"), "")
        first = " ".join(first.split()) or "(no question)"
        return first if len(first) <= width else first[: width - 1] + "…"

    def line(self) -> str:
        """'2026-12-01 22:10 · 3 turn(s) · first question…' ('… · cannot be reopened: PROBLEM')."""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.modified))
        if self.problem is not None:
            return f"{when} · cannot be reopened: {self.problem}"
        return f"{when} · {self.conversation.turns} turn(s) · {self.title()}"


def past_conversations(directory: Path, limit: int = 50) -> list[Past]:
    """The newest `limit` transcripts in `directory` that hold a message, newest first; one that
    cannot be read as a conversation is listed with its `problem`."""
    if not directory.is_dir():
        return []
    paths = sorted(directory.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True)
    out = []
    for path in paths:
        try:
            conv, _closed = read_transcript(path)
        except ConversationError as err:
            out.append(Past(path, Conversation(), path.stat().st_mtime, str(err)))
        else:
            if conv.messages:
                out.append(Past(path, conv, path.stat().st_mtime))
        if len(out) == limit:
            break
    return out
