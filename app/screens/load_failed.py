"""A model failed to load: say why and offer a way on (the wizard, the demo, another model)."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Static

MAX_OTHERS = 4  # other converted models offered as buttons


class LoadFailedScreen(ModalScreen[str]):
    """Dismisses with "wizard", "demo", "quit", "back" (only when `back`), or the path (str) of
    another model to load. `back`: the failed load was a model switch, so there is a chat to go
    back to (Esc and a "Back" button do; at start-up Esc quits, as there is none)."""

    BINDINGS = [Binding("w", "choose('wizard')", "Wizard"), Binding("d", "choose('demo')", "Demo"),
                Binding("q", "choose('quit')", "Quit"), Binding("escape", "escape", "Back")]

    def __init__(self, model_dir: Path | None, message: str, others: list[Path],
                 back: bool = False) -> None:
        super().__init__()
        self._model_dir = model_dir
        self._message = message
        self._others = others[:MAX_OTHERS]
        self._back = back

    def compose(self) -> ComposeResult:
        with Vertical(id="load-failed-box", classes="dialog"):
            yield Static(f"Could not load {self._model_dir}", classes="dialog-title", markup=False)
            yield Static(f"✗ {self._message}", id="load-failed-why", markup=False)
            yield Static(("Open another converted model, c" if self._others else "C")
                         + "onvert a checkpoint with the wizard, or try the demo model.")
            if self._others:
                with Horizontal(classes="buttons"):
                    for i, path in enumerate(self._others):
                        yield Button(Content(path.name), id=f"model-{i}", variant="primary")
            with Horizontal(classes="buttons"):
                yield Button("Wizard (w)", id="wizard")
                yield Button("Demo model (d)", id="demo")
                yield Button("Quit (q)", id="quit")
                if self._back:
                    yield Button("Back to the chat (Esc)", id="back")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        bid = str(event.button.id)
        if bid.startswith("model-"):
            self.dismiss(str(self._others[int(bid.removeprefix("model-"))]))
        else:
            self.dismiss(bid)

    def action_choose(self, choice: str) -> None:
        self.dismiss(choice)

    def action_escape(self) -> None:
        self.dismiss("back" if self._back else "quit")
