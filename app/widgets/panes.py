"""Live stats panes fed from StepStats: expert cache, hit rate, memory budget, throughput, phase.

Every pane has `show(stats, recent)`: the newest snapshot and the recent step snapshots
(oldest first, for sparklines). Panes render text only; they never ask the engine anything.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from app.widgets.bars import bar, fmt_bytes, fmt_pct, heat_row, part_colour, stacked_bar, tier_text
from engine.stats import StepStats

STEP_PHASES = {"graph replay": "graphs"}  # the status label's words for engine step phases
BAR_WIDTH = 34
HEAT_WIDTH = 44  # one cell per layer up to 44 layers (the real model has 43)


class Pane(Vertical):
    """A bordered pane; subclasses fill their Static parts in `show`."""

    TITLE = ""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._line_counts: dict[str, int] = {}

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    def show(self, stats: StepStats, recent: list[StepStats]) -> None:
        raise NotImplementedError

    def put(self, selector: str, text: Text) -> None:
        """Set a part's text; re-layout only when its line count changed (layout is costly)."""
        lines = text.plain.count("\n")
        layout = self._line_counts.get(selector) != lines
        self._line_counts[selector] = lines
        self.query_one(selector, Static).update(text, layout=layout)

    def plain(self) -> str:
        """The pane's text (for tests and the plain-text dump)."""
        return "\n".join(str(s.content) for s in self.query(Static))


class CachePane(Pane):
    TITLE = "Expert cache"

    def compose(self) -> ComposeResult:
        yield Static("waiting for the engine…", id="cache-bar")
        yield Static("", id="cache-text")

    def show(self, stats: StepStats, recent: list[StepStats]) -> None:
        c = stats.cache
        frac = c.used_bytes / c.capacity_bytes if c.capacity_bytes else 0.0
        line = bar(frac, BAR_WIDTH)
        line.append(f" {fmt_pct(frac)}")
        self.put("#cache-bar", line)
        self.put("#cache-text", Text(
            f"{fmt_bytes(c.used_bytes)} / {fmt_bytes(c.capacity_bytes)}\n"
            f"entries {c.entries} / {c.capacity_entries} · pinned {c.pinned}\n"
            f"evicted {c.evictions} · read {fmt_bytes(c.bytes_read)}"
            f" ({fmt_bytes(stats.read_bytes_per_s)}/s)"
            + ("" if c.tier is None else "\n" + tier_text(c.tier))
        ))


class HitRatePane(Pane):
    TITLE = "Hit rate"

    def compose(self) -> ComposeResult:
        yield Static("", id="hit-text")
        yield Sparkline([], id="hit-spark")
        yield Static("", id="hit-heat")

    def show(self, stats: StepStats, recent: list[StepStats]) -> None:
        c = stats.cache
        self.put("#hit-text", Text(
            f"now {fmt_pct(c.hit_rate_window)} · total {fmt_pct(c.hit_rate)}\n"
            f"hits {c.hits} · misses {c.misses}"
        ))
        self.query_one("#hit-spark", Sparkline).data = [s.cache.hit_rate_window for s in recent]
        n = len(c.per_layer_hit_rate)
        heat = Text(f"per layer (0 → {n - 1}):\n" if n else "per layer: —", style="dim")
        heat.append_text(heat_row(c.per_layer_hit_rate, HEAT_WIDTH))
        self.put("#hit-heat", heat)


class MemoryPane(Pane):
    TITLE = "Memory budget"

    def compose(self) -> ComposeResult:
        yield Static("", id="mem-bar")
        yield Static("", id="mem-legend")

    def show(self, stats: StepStats, recent: list[StepStats]) -> None:
        m = stats.memory
        self.put("#mem-bar", stacked_bar(m.parts, BAR_WIDTH + 7))
        legend = Text()
        kind = "unified" if m.unified else "device"
        legend.append(f"{kind} pool {fmt_bytes(m.total)}\n", style="bold")
        for i, (name, size) in enumerate(m.parts):
            legend.append("■ ", style=part_colour(name, i))
            legend.append(f"{name:<17}{fmt_bytes(size):>9}\n")
        if m.unified:
            legend.append(f"  page cache       {fmt_bytes(m.page_cache):>9}\n", style="italic")
        if m.plan:
            legend.append(m.plan, style="dim")
        legend.rstrip()
        self.put("#mem-legend", legend)


class ThroughputPane(Pane):
    TITLE = "Throughput"

    def compose(self) -> ComposeResult:
        yield Static("", id="tp-text")
        yield Sparkline([], id="tp-spark")
        yield Static("", id="tp-split")

    def show(self, stats: StepStats, recent: list[StepStats]) -> None:
        ttft = "—" if stats.ttft_s is None else f"{stats.ttft_s:.2f} s"
        self.put("#tp-text", Text(f"{stats.tok_per_s:.1f} tok/s · TTFT {ttft}"))
        self.query_one("#tp-spark", Sparkline).data = [s.tok_per_s for s in recent]
        self.put("#tp-split", Text("\n  ".join(stats.timing.lines())))


class PhaseLabel(Static):
    """The status: the engine phase (loading · warm-up · graph capture · graphs · eager, or
    "ready · graphs|eager" when idle) and the position."""

    def show_phase(self, phase: str, detail: str = "") -> None:
        good = phase in ("graphs", "graph replay", "eager") or phase.startswith("ready")
        text = Text("● ", style="green" if good else "yellow")
        text.append(phase, style="bold")
        if detail:
            text.append(f" · {detail}")
        self.update(text, layout=False)  # always one line
