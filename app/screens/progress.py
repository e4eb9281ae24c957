"""Progress of a long model job (conversion, building the demo) with bytes/s, ETA and cancel."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Button, Footer, ProgressBar, Static

from app.messages import ConvertProgressed, ModelFailed, ModelReady
from converter.convert import ConvertProgress
from engine.events import LoadProgress
from app.service import user_message
from app.widgets.bars import fmt_bytes

JobFn = Callable[[Callable[[ConvertProgress | LoadProgress], None], threading.Event], Path]


def fmt_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "—"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def describe(progress: ConvertProgress | LoadProgress) -> tuple[float, float, str]:
    """(done, total, one line) of a conversion's or a load's progress."""
    if isinstance(progress, ConvertProgress):
        line = (f"{fmt_bytes(progress.bytes_done)} / {fmt_bytes(progress.bytes_total)} · "
                f"{fmt_bytes(progress.bytes_per_s)}/s · ETA {fmt_eta(progress.eta_s)}")
        if progress.current:
            line += f" · {progress.current}"
        return progress.bytes_done, progress.bytes_total, line
    unit = f" {progress.unit}" if progress.unit else ""
    line = progress.phase
    if progress.total:
        line += f": {progress.done}/{progress.total}{unit}"
    if progress.message:
        line += f" · {progress.message}"
    return progress.done, progress.total, line


class ProgressScreen(Screen[Path | None]):
    """Runs `job(progress, cancel)` in a thread worker; dismisses with its Path, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, job: JobFn, note: str = "") -> None:
        super().__init__()
        self._title = title
        self._job = job
        self._note = note
        self._cancel = threading.Event()
        self._failed = False

    def compose(self) -> ComposeResult:
        with Vertical(id="progress-box", classes="dialog"):
            yield Static(self._title, classes="dialog-title", markup=False)
            if self._note:
                yield Static(self._note, classes="demo-notice", markup=False)
            yield ProgressBar(total=None, show_eta=False, id="job-bar")
            yield Static("starting…", id="job-line", markup=False)
            yield Button("Cancel (Esc)", id="cancel", variant="error")
        yield Footer()

    def on_mount(self) -> None:
        self.run_worker(self._run, thread=True, name="model-job", group="model-job",
                        exit_on_error=False)

    def on_unmount(self) -> None:
        self._cancel.set()  # leaving (e.g. the app exits) stops the job; it resumes next time

    def _run(self) -> None:
        try:
            path = self._job(lambda p: self.post_message(ConvertProgressed(p)), self._cancel)
        except Exception as err:  # the converter raises ConvertCancelled when cancelled
            if not self._cancel.is_set():
                self.post_message(ModelFailed(user_message(err)))
                return
        if self._cancel.is_set():
            self.post_message(ModelFailed("cancelled — run it again to resume", True))
        else:
            self.post_message(ModelReady(path))

    def on_convert_progressed(self, event: ConvertProgressed) -> None:
        done, total, line = describe(event.progress)
        self.query_one("#job-bar", ProgressBar).update(total=total or None, progress=done)
        self.query_one("#job-line", Static).update(line)

    def on_model_ready(self, event: ModelReady) -> None:
        self.dismiss(event.model_dir)

    def on_model_failed(self, event: ModelFailed) -> None:
        self.query_one("#job-line", Static).update(f"✗ {event.message}")
        button = self.query_one("#cancel", Button)
        button.label = "Back"
        button.variant = "default"
        self._failed = True

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_cancel()

    def action_cancel(self) -> None:
        if self._failed:
            self.dismiss(None)
        elif not self._cancel.is_set():
            self._cancel.set()
            self.query_one("#job-line", Static).update("cancelling…")
