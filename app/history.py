"""Past conversations: the autosaved transcripts (app/autosave.py), newest first, for `/history`
and the command palette. Reopening one continues the same transcript file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from app.autosave import read_transcript
from app.conversation import Conversation


@dataclass(frozen=True)
class Past:
    """One autosaved conversation."""

    path: Path
    conversation: Conversation
    modified: float  # st_mtime of the transcript

    def title(self, width: int = 50) -> str:
        """The first question, shortened to `width` characters ("(no question)" if none)."""
        first = next((m.content for m in self.conversation.messages if m.role == "user"), "")
        first = " ".join(first.split()) or "(no question)"
        return first if len(first) <= width else first[: width - 1] + "…"

    def line(self) -> str:
        """'2026-12-01 22:10 · 3 turn(s) · first question…'."""
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.modified))
        return f"{when} · {self.conversation.turns} turn(s) · {self.title()}"


def past_conversations(directory: Path, limit: int = 50) -> list[Past]:
    """The newest `limit` transcripts in `directory` that hold a message, newest first."""
    if not directory.is_dir():
        return []
    paths = sorted(directory.glob("*.jsonl"), key=lambda p: p.stat().st_mtime, reverse=True)
    out = []
    for path in paths:
        conv, _closed = read_transcript(path)
        if conv.messages:
            out.append(Past(path, conv, path.stat().st_mtime))
        if len(out) == limit:
            break
    return out
