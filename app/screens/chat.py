"""The main screen: transcript and prompt on the left, live engine panes on the right.

Below PANES_MIN_WIDTH columns the panes start hidden (the chat keeps the width) and a one-line
status under the transcript carries the phase, position, tok/s and cache figures; F3 toggles
the panes at any width."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Header, Static

from app.widgets.bars import fmt_pct
from app.widgets.panes import STEP_PHASES, CachePane, HitRatePane, MemoryPane, Pane, PhaseLabel, ThroughputPane
from app.widgets.prompt import HINT, PromptInput
from app.widgets.transcript import Transcript
from engine.stats import StepStats


PANES_MIN_WIDTH = 110  # narrower terminals start with the panes hidden


class ChatScreen(Screen):
    """Layout only; the app drives it through `show_stats`, `transcript` and `prompt`."""

    def compose(self) -> ComposeResult:
        yield Header(icon="◆")
        with Horizontal(id="main"):
            with Vertical(id="chat-col"):
                yield Transcript(id="transcript")
                yield PhaseLabel("● starting", id="status-line")
                yield Static("", id="completions", markup=False)
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
        self._panes_chosen: bool | None = None  # F3's choice; None: by the terminal's width
        self._phase: tuple[str, str] = ("starting", "")
        self._summary = ""  # tok/s and cache figures for the one-line status

    def on_resize(self, event: events.Resize) -> None:
        if self._panes_chosen is None:
            self._show_panes(event.size.width >= PANES_MIN_WIDTH)

    def toggle_panes(self) -> None:
        """F3: show or hide the stats panes (the choice then holds at any width)."""
        self._panes_chosen = not self.panes_shown
        self._show_panes(self._panes_chosen)

    @property
    def panes_shown(self) -> bool:
        return bool(self.query_one("#side").display)

    def _show_panes(self, shown: bool) -> None:
        self.query_one("#side").display = shown
        self.query_one("#status-line").display = not shown

    def show_phase(self, phase: str, detail: str = "") -> None:
        """The status (phase · detail) in the panes' label and the narrow one-line status."""
        self._phase = (phase, detail)
        self.phase.show_phase(phase, detail)
        self._show_status_line()

    def _show_status_line(self) -> None:
        phase, detail = self._phase
        self.query_one("#status-line", PhaseLabel).show_phase(
            phase, " · ".join(x for x in (detail, self._summary) if x))

    def on_mount(self) -> None:
        self.prompt.focus()
        self._show_panes(self.app.size.width >= PANES_MIN_WIDTH)

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    @property
    def phase(self) -> PhaseLabel:
        return self.query_one("#phase", PhaseLabel)

    def show_stats(self, stats: StepStats, recent: list[StepStats],
                   idle: tuple[str, int] | None = None) -> None:
        """Fill the panes and the status label: the step's phase ("graph replay" reads
        "graphs") and position, or between turns `idle` = (decode mode, session position)."""
        c = stats.cache
        self._summary = (f"{stats.tok_per_s:.1f} tok/s · cache {c.entries}/{c.capacity_entries} · "
                         f"hit {fmt_pct(c.hit_rate_window)}")
        if idle is None:
            self.show_phase(STEP_PHASES.get(stats.phase, stats.phase), f"pos {stats.position}")
        else:
            self.show_phase(f"ready · {idle[0]}", f"pos {idle[1]}")
        for pane in self.query(Pane):
            pane.show(stats, recent)

    def on_prompt_input_completions(self, event: PromptInput.Completions) -> None:
        if event.matches == self._matches:
            return  # unchanged: no update (each one would re-lay out the screen)
        self._matches = event.matches
        line = self.query_one("#completions", Static)
        line.update("Tab ▸ " + "  ".join(event.matches), layout=False)
        line.display = bool(event.matches)
