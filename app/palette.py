"""Ctrl+P command palette entries: reopen a past conversation, switch the model."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

from textual.command import DiscoveryHit, Hit, Hits, Provider

from app.history import past_conversations
from app.wizard import DEMO_NAME, converted_models

if TYPE_CHECKING:
    from app.app import ChatApp


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

    async def discover(self) -> Hits:
        for text, callback, help_text in self._entries():
            yield DiscoveryHit(text, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for text, callback, help_text in self._entries():
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), callback, help=help_text)
