"""/stats: per-layer hit rates, the cache's contents and the memory breakdown, in tables."""

from __future__ import annotations

from typing import Any, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from app.widgets.bars import bar, fmt_bytes, fmt_pct, tier_text
from engine.stats import StepStats

MAX_CONTENT_ROWS = 2000


class StatsScreen(Screen):
    """A detailed, live-updating view of the engine's statistics; Esc or q closes it."""

    BINDINGS = [Binding("escape,q", "app.pop_screen", "Close")]

    def __init__(self, stats: StepStats | None, contents: Sequence[tuple] | None,
                 info: dict[str, Any]) -> None:
        super().__init__()
        self._stats = stats
        self._contents = contents
        self._info = info

    @property
    def has_contents(self) -> bool:
        """False when opened mid-turn: the cache's contents wait for the engine to be idle."""
        return self._contents is not None

    def compose(self) -> ComposeResult:
        yield Static("", id="stats-summary")
        with Horizontal(id="stats-tables"):
            with Vertical():
                yield Static("Per-layer hit rate", classes="table-title")
                yield DataTable(id="layers-table", cursor_type="row")
                yield Static("Memory", classes="table-title")
                yield DataTable(id="memory-table", cursor_type="row")
            with Vertical():
                yield Static("", id="contents-title", classes="table-title")
                yield DataTable(id="contents-table", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#layers-table", DataTable).add_columns("layer", "hit rate", "")
        self.query_one("#memory-table", DataTable).add_columns("part", "size", "share")
        self.query_one("#contents-table", DataTable).add_columns("layer", "expert", "pinned", "uses")
        self._fill_contents()
        if self._stats is not None:
            self.update_stats(self._stats)

    def _fill_contents(self) -> None:
        table = self.query_one("#contents-table", DataTable)
        title = self.query_one("#contents-title", Static)
        if self._contents is None:
            title.update("Cache contents — available when the engine is idle")
            return
        rows = sorted(self._contents, key=lambda r: (-r[3], r[0], r[1]))
        title.update(f"Cache contents — {len(rows)} experts, "
                     f"{sum(1 for r in rows if r[2])} pinned (most used first)")
        for layer, expert, pinned, uses in rows[:MAX_CONTENT_ROWS]:
            table.add_row(layer, expert, "yes" if pinned else "", uses)

    def update_stats(self, stats: StepStats) -> None:
        """Refresh the live parts (summary, per-layer rates, memory) from a newer snapshot."""
        self._stats = stats
        c, m = stats.cache, stats.memory
        model = self._info.get("model", "model")
        self.query_one("#stats-summary", Static).update(Text(
            f"{model} · {stats.phase} · position {stats.position} · {stats.tok_per_s:.1f} tok/s\n"
            f"cache {fmt_bytes(c.used_bytes)} / {fmt_bytes(c.capacity_bytes)} · "
            f"{c.entries}/{c.capacity_entries} entries · {c.pinned} pinned · "
            f"hit {fmt_pct(c.hit_rate)} (recent {fmt_pct(c.hit_rate_window)}) · "
            f"{c.hits} hits · {c.misses} misses · {c.evictions} evictions · "
            f"read {fmt_bytes(c.bytes_read)}"
            + ("" if c.tier is None else "\n" + tier_text(c.tier))
        ))
        layers = self.query_one("#layers-table", DataTable)
        layers.clear()
        for i, rate in enumerate(c.per_layer_hit_rate):
            layers.add_row(i, fmt_pct(rate), bar(rate, 20, "green3"))
        mem = self.query_one("#memory-table", DataTable)
        mem.clear()
        for name, size in m.parts:
            share = size / m.total if m.total else 0.0
            mem.add_row(Text(name), fmt_bytes(size), fmt_pct(share))
        mem.add_row(Text("total", style="bold"), fmt_bytes(m.total), "")
        if m.unified:
            mem.add_row(Text("page cache", style="italic"), fmt_bytes(m.page_cache), "reclaimable")
