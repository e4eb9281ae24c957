"""Offer to resume a conversation the previous run did not close cleanly."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from app.autosave import Unfinished
from app.conversation import Conversation


def describe(conv: Conversation) -> str:
    """What resuming restores: the answered turns, and a question put back into the prompt."""
    text = f"{conv.settled().turns} turn(s)"
    if conv.pending_prompt():
        text += " and an unanswered question (put back into the prompt)"
    return text


class ResumeScreen(ModalScreen[bool]):
    """Dismisses with True (resume) or False (start a new conversation)."""

    BINDINGS = [Binding("y", "choose(True)", "Resume"), Binding("n,escape", "choose(False)", "New")]

    def __init__(self, unfinished: Unfinished) -> None:
        super().__init__()
        self._unfinished = unfinished

    def compose(self) -> ComposeResult:
        conv = self._unfinished.conversation
        first = next((m.content for m in conv.messages if m.role == "user"), "")
        preview = first if len(first) <= 60 else first[:57] + "…"
        with Vertical(id="resume-box", classes="dialog"):
            yield Static("The last conversation was not closed cleanly.", classes="dialog-title")
            yield Static(describe(conv) + f", starting “{preview}”\n"
                         f"saved in {self._unfinished.path}", id="resume-what", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Resume it (y)", id="resume", variant="primary")
                yield Button("Start new (n)", id="new")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "resume")

    def action_choose(self, resume: bool) -> None:
        self.dismiss(resume)
