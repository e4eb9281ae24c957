"""The main screen: transcript and prompt on the left, live engine panes on the right."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Header, Static

from app.widgets.panes import STEP_PHASES, CachePane, HitRatePane, MemoryPane, Pane, PhaseLabel, ThroughputPane
from app.widgets.prompt import HINT, PromptInput
from app.widgets.transcript import Transcript
from engine.stats import StepStats


class ChatScreen(Screen):
    """Layout only; the app drives it through `show_stats`, `transcript` and `prompt`."""

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="main"):
            with Vertical(id="chat-col"):
                yield Transcript(id="transcript")
                yield Static("", id="completions")
                yield PromptInput(id="prompt")
                yield Static(HINT, id="hint")
            with Vertical(id="side"):
                yield PhaseLabel("● starting", id="phase")
                yield CachePane(id="cache-pane")
                yield HitRatePane(id="hit-pane")
                yield MemoryPane(id="memory-pane")
                yield ThroughputPane(id="throughput-pane")

    def __init__(self) -> None:
        super().__init__()
        self._matches: list[str] = []

    def on_mount(self) -> None:
        self.prompt.focus()

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def phase(self) -> PhaseLabel:
        return self.query_one(PhaseLabel)

    def show_stats(self, stats: StepStats, recent: list[StepStats],
                   idle: tuple[str, int] | None = None) -> None:
        """Fill the panes and the status label: the step's phase ("graph replay" reads
        "graphs") and position, or between turns `idle` = (decode mode, session position)."""
        if idle is None:
            self.phase.show_phase(STEP_PHASES.get(stats.phase, stats.phase), f"pos {stats.position}")
        else:
            self.phase.show_phase(f"ready · {idle[0]}", f"pos {idle[1]}")
        for pane in self.query(Pane):
            pane.show(stats, recent)

    def on_prompt_input_completions(self, event: PromptInput.Completions) -> None:
        if event.matches == self._matches:
            return  # unchanged: no update (each one would re-lay out the screen)
        self._matches = event.matches
        line = self.query_one("#completions", Static)
        line.update("Tab ▸ " + "  ".join(event.matches), layout=False)
        line.display = bool(event.matches)
