"""Ctrl+P command palette entries: reopen a past conversation, switch the model.

Titles, paths and model names are the user's text: they reach the palette as literal `Content`,
never as Textual markup (a title like "Why does my prompt end with [/INST]?" is shown as typed).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

from textual.command import DiscoveryHit, Hit, Hits, Matcher, Provider
from textual.content import Content

from app.history import past_conversations
from app.wizard import DEMO_NAME, converted_models

if TYPE_CHECKING:
    from app.app import ChatApp


def highlight(matcher: Matcher, text: str) -> Content:
    """`text` as literal content with the letters `matcher` matched highlighted (Matcher.highlight
    would parse `text` as markup)."""
    content = Content(text)
    score, offsets = matcher.fuzzy_search.match(matcher.query, text)
    if score:
        for offset in offsets:
            if not text[offset].isspace():
                content = content.stylize(matcher.match_style, offset, offset + 1)
    return content


class ChatCommands(Provider):
    """"Open: <first question>" for each past conversation, "Model: <name>" for each model."""

    def _entries(self) -> list[tuple[str, Callable, str]]:
        app: ChatApp = self.app  # type: ignore[assignment]
        entries = []
        for past in past_conversations(app.config.transcripts_dir):
            entries.append((f"Open: {past.title()}", partial(app.reopen, past),
                            f"past conversation · {past.line()}"))
        for model in converted_models(app.config):
            name = DEMO_NAME if app.is_demo(model) else model.name
            entries.append((f"Model: {name}", partial(app.switch_model, name),
                            f"switch to {model}"))
        return entries

    # The help is passed as Content: Textual renders a str help as markup, and Content as is.
    async def discover(self) -> Hits:
        for text, callback, help_text in self._entries():
            yield DiscoveryHit(Content(text), callback, text=text, help=Content(help_text))

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, callback, help_text in self._entries():
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, highlight(matcher, text), callback, text=text,
                          help=Content(help_text))
