"""First-run screens: choose between converting a downloaded checkpoint and the demo model;
then pick the checkpoint directory with live validation and a free-space check."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, Footer, Input, Static

from app.demo import DEMO_NOTICE
from app.settings import AppConfig
from app.wizard import default_destination, free_space_problem, unreadable


class WizardScreen(Screen[str]):
    """Dismisses with "convert", "demo" or "quit"."""

    BINDINGS = [Binding("c", "choose('convert')", "Convert"), Binding("d", "choose('demo')", "Demo"),
                Binding("q,escape", "choose('quit')", "Quit")]

    def __init__(self, config: AppConfig) -> None:
        super().__init__()
        self._config = config

    def compose(self) -> ComposeResult:
        with Vertical(id="wizard-box", classes="dialog"):
            yield Static("Welcome to dsv4-chat", classes="dialog-title")
            yield Static(
                f"No converted model was found in {self._config.models_dir}.\n\n"
                "Convert a downloaded DeepSeek-V4-Flash checkpoint (the Hugging Face directory "
                "with config.json and *.safetensors) into the streaming layout — about the "
                "checkpoint's size on disk, resumable — or try the demo model.\n",
                markup=False,
            )
            yield Static(DEMO_NOTICE, classes="demo-notice", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Convert a checkpoint (c)", id="convert", variant="primary")
                yield Button("Demo model (d)", id="demo")
                yield Button("Quit (q)", id="quit")
        yield Footer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(str(event.button.id))

    def action_choose(self, choice: str) -> None:
        self.dismiss(choice)


@dataclass(frozen=True)
class ConvertRequest:
    src: Path
    dst: Path


class SourceScreen(Screen[ConvertRequest | None]):
    """The checkpoint path, validated while typing; dismisses with a ConvertRequest or None."""

    BINDINGS = [Binding("escape", "back", "Back")]

    class Checked(Message):
        def __init__(self, text: str, problems: list[str]) -> None:
            super().__init__()
            self.text = text
            self.problems = problems

    def __init__(self, config: AppConfig, check: Callable[[Path], list[str]]) -> None:
        super().__init__()
        self._config = config
        self._check = check
        self._ok: ConvertRequest | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="source-box", classes="dialog"):
            yield Static("Convert a checkpoint", classes="dialog-title")
            yield Static("Directory of the downloaded checkpoint:")
            yield Input(placeholder="/path/to/DeepSeek-V4-Flash", id="source-path")
            yield Static("", id="source-problems", markup=False)
            yield Static("", id="source-destination", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Convert", id="start", variant="primary", disabled=True)
                yield Button("Back", id="back")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(Input).focus()
        self._validate("")

    def on_input_changed(self, event: Input.Changed) -> None:
        self._ok = None
        self.query_one("#start", Button).disabled = True
        self.query_one("#source-problems", Static).update("checking…")
        self._validate(event.value)

    @work(thread=True, exclusive=True, group="validate", name="validate-source")
    def _validate(self, text: str) -> None:
        """Check `text` off the UI thread and post the problems ([] = ready); a path the system
        refuses is a problem line, never an exception (a worker's would end the app)."""
        src = Path(text.strip()).expanduser()
        try:
            problems = self._check(src) if text.strip() else ["enter a directory"]
            if not problems:
                space = free_space_problem(src, default_destination(self._config, src))
                if space:
                    problems = [space]
        except OSError as err:
            problems = [unreadable(src, err)]
        self.post_message(self.Checked(text, problems))

    def on_source_screen_checked(self, event: Checked) -> None:
        if event.text != self.query_one(Input).value:
            return  # stale result for text the user has since changed
        problems = self.query_one("#source-problems", Static)
        dest = self.query_one("#source-destination", Static)
        if event.problems:
            problems.update("\n".join(f"✗ {p}" for p in event.problems))
            dest.update("")
            return
        src = Path(event.text.strip()).expanduser()
        self._ok = ConvertRequest(src, default_destination(self._config, src))
        problems.update("✓ looks like a DeepSeek-V4 checkpoint")
        dest.update(f"will write: {self._ok.dst}")
        self.query_one("#start", Button).disabled = False

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "start" and self._ok is not None:
            self.dismiss(self._ok)
        elif event.button.id == "back":
            self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if self._ok is not None:
            self.dismiss(self._ok)

    def action_back(self) -> None:
        self.dismiss(None)
