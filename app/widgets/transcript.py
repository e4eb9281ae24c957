"""The scrolling transcript: user messages, assistant answers and notes, newest at the bottom."""

from __future__ import annotations

from textual.containers import VerticalScroll

from app.conversation import Conversation
from app.widgets.message import AssistantMessage, NoteMessage, UserMessage


class Transcript(VerticalScroll):
    """Anchored to the bottom while answers stream, until the user scrolls up."""

    can_focus = False

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str) -> UserMessage:
        msg = UserMessage(text)
        await self.mount(msg)
        return msg

    async def add_assistant(self, content: str = "", reasoning: str = "",
                            footer: str = "") -> AssistantMessage:
        msg = AssistantMessage(content, reasoning, footer)
        await self.mount(msg)
        self.anchor()
        return msg

    async def add_note(self, text: str, error: bool = False) -> NoteMessage:
        note = NoteMessage(text, error)
        await self.mount(note)
        return note

    async def clear(self) -> None:
        await self.remove_children()

    async def show_conversation(self, conv: Conversation) -> None:
        """Replace the transcript with a whole (saved or resumed) conversation."""
        await self.clear()
        if conv.system:
            await self.add_note(f"system prompt: {conv.system}")
        for m in conv.messages:
            if m.role == "user":
                await self.add_user(m.content)
            else:
                footer = "" if m.finish in ("", "eos") else m.finish
                await self.add_assistant(m.content, m.reasoning, footer)

    def last_assistant(self) -> AssistantMessage | None:
        found = self.query(AssistantMessage)
        return found.last() if found else None

    async def remove_last_turn(self) -> None:
        """Remove the last user message and everything after it (for /undo)."""
        users = self.query(UserMessage)
        if not users:
            return
        last = users.last()
        children = list(self.children)
        for child in children[children.index(last):]:
            await child.remove()
