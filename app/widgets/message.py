"""Transcript entries: the user's message, the assistant's (streamed) answer, one-line notes."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream


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

    def compose(self) -> ComposeResult:
        if self.reasoning_text:
            yield self._thinking_box(self.reasoning_text, "Thinking")
        yield Markdown(self.answer_text, classes="answer")
        yield Static(self._footer, classes="turn-footer")

    def on_mount(self) -> None:
        self.border_title = "assistant"

    @staticmethod
    def _thinking_box(text: str, title: str) -> Collapsible:
        return Collapsible(Markdown(text, classes="thinking"), title=title, collapsed=True)

    async def append(self, text: str, channel: str) -> None:
        """Append a decoded fragment to the thinking or answer part."""
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

    async def finish(self, footer: str, content: str | None = None) -> None:
        """Stop streaming and show the turn summary; `content` replaces the text if it differs."""
        for stream in self._streams.values():
            await stream.stop()
        self._streams.clear()
        if self.query(Collapsible):
            self.query_one(Collapsible).title = "Thinking"
        if content is not None and content != self.answer_text:
            self.answer_text = content
            await self.query_one(".answer", Markdown).update(content)
        self.query_one(".turn-footer", Static).update(footer)


def turn_footer(stats: Any) -> str:
    """'42 tokens · 12.3 tok/s · TTFT 0.41 s · eos' from a TurnStats."""
    return (
        f"{stats.completion_tokens} tokens · {stats.tok_per_s:.1f} tok/s · "
        f"TTFT {stats.ttft_s:.2f} s · {stats.finish_reason}"
    )
