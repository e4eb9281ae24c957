"""Transcript entries: the user's message, the assistant's (streamed) answer, one-line notes."""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.timer import Timer
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream


SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
SPINNER_HZ = 10


class UserMessage(Static):
    """What the user sent, verbatim."""

    def __init__(self, content: str) -> None:
        super().__init__(Text(content), classes="user-message")
        self.text = content

    def on_mount(self) -> None:
        self.border_title = "you"


class NoteMessage(Static):
    """A one-line notice from the app (command results, errors); never a traceback."""

    def __init__(self, text: str, error: bool = False) -> None:
        super().__init__(Text(text), classes="note error" if error else "note")
        self.text = text


class AssistantMessage(Vertical):
    """An answer: thinking in a collapsible, the answer as Markdown grown by appending deltas.

    Streaming goes through Textual's MarkdownStream (Markdown.append under the hood), which
    parses only the tail of the document and batches fragments that arrive faster than the
    terminal can draw them; the message is never re-rendered as a whole per token.
    """

    def __init__(self, content: str = "", reasoning: str = "", footer: str = "") -> None:
        super().__init__(classes="assistant-message")
        self.answer_text = content
        self.reasoning_text = reasoning
        self._footer = footer
        self._streams: dict[str, MarkdownStream] = {}
        self._waiting_since: float | None = None
        self._spinner: Timer | None = None

    def compose(self) -> ComposeResult:
        if self.reasoning_text:
            yield self._thinking_box(self.reasoning_text, "Thinking")
        yield Static("", classes="waiting", markup=False)
        yield Markdown(self.answer_text, classes="answer")
        yield Static("", classes="answer-notice", markup=False)
        yield Static(self._footer, classes="turn-footer", markup=False)

    def start_waiting(self) -> None:
        """Show a spinner and the seconds waited until the first token (or the end) arrives."""
        self._waiting_since = time.monotonic()
        self._tick()
        self._spinner = self.set_interval(1 / SPINNER_HZ, self._tick, name="first-token-spinner")

    @property
    def waiting(self) -> bool:
        return self._waiting_since is not None

    def _tick(self) -> None:
        waiting = self.query_one(".waiting", Static)
        if self._waiting_since is None:
            waiting.display = False
            return
        waited = time.monotonic() - self._waiting_since
        frame = SPINNER[int(waited * SPINNER_HZ) % len(SPINNER)]
        waiting.update(f"{frame} waiting for the first token… {waited:.1f} s")
        waiting.display = True

    def _stop_waiting(self) -> None:
        if self._spinner is not None:
            self._spinner.stop()
            self._spinner = None
        if self._waiting_since is not None:
            self._waiting_since = None
            self._tick()

    def on_mount(self) -> None:
        self.border_title = "assistant"

    @staticmethod
    def _thinking_box(text: str, title: str) -> Collapsible:
        return Collapsible(Markdown(text, classes="thinking"), title=title, collapsed=True)

    async def append(self, text: str, channel: str) -> None:
        """Append a decoded fragment to the thinking or answer part."""
        self._stop_waiting()
        if channel == "thinking":
            self.reasoning_text += text
            if not self.query(Collapsible):
                box = self._thinking_box("", "Thinking…")
                await self.mount(box, before=self.query_one(".answer", Markdown))
            target = self.query_one(".thinking", Markdown)
        else:
            self.answer_text += text
            target = self.query_one(".answer", Markdown)
        stream = self._streams.get(channel)
        if stream is None:
            if channel == "answer" and "thinking" in self._streams:
                self.query_one(Collapsible).title = "Thinking"  # thinking is over
            stream = self._streams[channel] = Markdown.get_stream(target)
        await stream.write(text)

    async def finish(self, footer: str, content: str | None = None, notice: str = "") -> None:
        """Stop streaming and show the turn summary; `content` replaces the text if it differs;
        `notice` says why the answer is empty (the thinking box is then opened)."""
        self._stop_waiting()
        for stream in self._streams.values():
            await stream.stop()
        self._streams.clear()
        if self.query(Collapsible):
            self.query_one(Collapsible).title = "Thinking"
        if content is not None and content != self.answer_text:
            self.answer_text = content
            await self.query_one(".answer", Markdown).update(content)
        if notice:
            shown = self.query_one(".answer-notice", Static)
            shown.update(notice)
            shown.display = True
            if self.query(Collapsible):
                self.query_one(Collapsible).collapsed = False
        self.query_one(".turn-footer", Static).update(footer)


def empty_answer_notice(content: str, reasoning: str, finish: str, max_tokens: int) -> str:
    """Why an answer is empty ("" when it is not, or no reason applies)."""
    if content.strip():
        return ""
    if finish == "max_tokens" and reasoning:
        return (f"no answer: all {max_tokens} tokens of max_tokens went to thinking (shown "
                "above) — /set max_tokens N to allow more, or /set think off")
    if finish == "max_tokens":
        return f"no answer: max_tokens ({max_tokens}) was reached before any text"
    if finish == "cancelled":
        return "stopped before the answer began"
    return ""


def turn_footer(stats: Any) -> str:
    """'42 tokens · 12.3 tok/s · TTFT 0.41 s · eos' from a TurnStats."""
    return (
        f"{stats.completion_tokens} tokens · {stats.tok_per_s:.1f} tok/s · "
        f"TTFT {stats.ttft_s:.2f} s · {stats.finish_reason}"
    )
