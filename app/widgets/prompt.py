"""The multi-line prompt: Enter sends, Ctrl+J (or Shift+Enter) adds a line, ↑/↓ walk the
history (from the first / last line), Tab completes slash commands."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

from app.commands import complete

HINT = "Enter send · Ctrl+J newline · ↑↓ history · Esc stop · F3 panes · /help"  # fits 80 columns


class PromptInput(TextArea):
    """A TextArea that posts `Submitted(text)` on Enter and keeps an input history."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class Completions(Message):
        """Matching commands while a '/command' is being typed (empty: none / not a command)."""

        def __init__(self, matches: list[str]) -> None:
            super().__init__()
            self.matches = matches

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, **kwargs)
        self.sent: list[str] = []
        self._index = 0  # == len(history) when editing a new entry
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.submit()
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "tab" and self.text.startswith("/") and " " not in self.text:
            event.stop()
            event.prevent_default()
            self._complete()
            return
        await super()._on_key(event)

    def submit(self) -> None:
        """Send the text (Enter): post Submitted, remember it in the history, clear."""
        text = self.text.strip()
        if not text:
            return
        if not self.sent or self.sent[-1] != text:
            self.sent.append(text)
        self._index = len(self.sent)
        self._draft = ""
        self.clear()
        self.post_message(self.Submitted(text))

    def _complete(self) -> None:
        matches = complete(self.text)
        if len(matches) == 1:
            self.load_text(matches[0] + " ")
            self.move_cursor(self.document.end)
        elif matches:
            common = _common_prefix(matches)
            if len(common) > len(self.text):
                self.load_text(common)
                self.move_cursor(self.document.end)
        self.post_message(self.Completions(matches))

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        text = self.text
        is_cmd = text.startswith("/") and " " not in text and "\n" not in text
        self.post_message(self.Completions(complete(text) if is_cmd else []))

    def _recall(self, index: int) -> None:
        if self._index == len(self.sent):
            self._draft = self.text
        self._index = index
        self.load_text(self._draft if index == len(self.sent) else self.sent[index])
        self.move_cursor(self.document.end)

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.cursor_location[0] == 0 and self._index > 0:
            self._recall(self._index - 1)
        else:
            super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if not select and self.cursor_location[0] == last_row and self._index < len(self.sent):
            self._recall(self._index + 1)
        else:
            super().action_cursor_down(select)


def _common_prefix(words: list[str]) -> str:
    first, last = min(words), max(words)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    return first[:n]
