"""The scrolling transcript: user messages, assistant answers and notes, newest at the bottom.

A turn that failed (the engine left the conversation as it was) stays on the screen with its
error, marked FAILED: it is not a turn of the conversation, so `last_assistant` and
`remove_last_turn` (for /regen and /undo) skip it."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widget import Widget

from app.conversation import Conversation
from app.widgets.message import AssistantMessage, NoteMessage, UserMessage

FAILED = "failed-turn"  # the CSS class of a failed turn's question and answer


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
                            footer: str = "", after: Widget | None = None) -> AssistantMessage:
        """A new answer at the bottom, or right `after` a widget (a /regen answer takes the old
        one's place)."""
        msg = AssistantMessage(content, reasoning, footer)
        await self.mount(msg, after=after)
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

    def mark_failed(self, answer: AssistantMessage) -> None:
        """`answer`'s turn failed: it and its question (the user message before it) stay shown
        but no longer count as a turn."""
        answer.add_class(FAILED)
        children = list(self.children)
        for child in reversed(children[:children.index(answer)]):
            if isinstance(child, UserMessage):
                child.add_class(FAILED)
                return

    def last_assistant(self) -> AssistantMessage | None:
        """The last answer of the conversation (failed turns skipped), or None."""
        found = self.query(AssistantMessage).exclude(f".{FAILED}")
        return found.last() if found else None

    async def remove_last_turn(self) -> None:
        """Remove the conversation's last user message and everything after it (for /undo;
        failed turns do not count, those after it go too)."""
        users = self.query(UserMessage).exclude(f".{FAILED}")
        if not users:
            return
        last = users.last()
        children = list(self.children)
        for child in children[children.index(last):]:
            await child.remove()
