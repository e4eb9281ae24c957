"""Pure text renderers for the stats panes: sizes, fill bars, stacked bars, heat rows."""

from __future__ import annotations

from typing import Sequence

from rich.text import Text

# Memory-budget part name -> colour; unknown names cycle through the spare colours.
PART_COLOURS = {
    "resident weights": "dodger_blue1",
    "expert cache": "dark_orange",
    "kv/state": "medium_purple1",
    "workspace": "gold1",
    "framework": "grey62",
    "free": "grey23",
}
_SPARE = ("cyan", "magenta", "green", "red", "yellow")
_HEAT = ("red3", "dark_orange3", "orange1", "gold1", "yellow3", "chartreuse3", "green3")


def fmt_bytes(n: float) -> str:
    """1536 → '1.5 KiB'; binary units, three significant digits."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def tier_text(tier) -> str:
    """The host-RAM tier (engine.stats.TierSnapshot) in one line: its fill (and whether its
    background fill still reads, or why it stopped), and where the GPU cache's misses were served
    from."""
    state = (f" (fill stopped: {tier.fill_error})" if tier.fill_error else " (filling)" if tier.filling else "")
    return (f"RAM tier {fmt_bytes(tier.used_bytes)} / {fmt_bytes(tier.capacity_bytes)}{state} · "
            f"misses served from RAM {fmt_pct(tier.hit_rate)} · disk reads {tier.disk_reads}")


def part_colour(name: str, index: int) -> str:
    return PART_COLOURS.get(name.lower(), _SPARE[index % len(_SPARE)])


def bar(fraction: float, width: int, colour: str = "dark_orange") -> Text:
    """A fill bar of `width` cells, `fraction` (clamped to 0..1) of it filled."""
    width = max(1, width)
    frac = min(1.0, max(0.0, fraction))
    filled = round(frac * width)
    text = Text("█" * filled, style=colour)
    text.append("░" * (width - filled), style="grey30")
    return text


def segment_widths(sizes: Sequence[int], width: int) -> list[int]:
    """Split `width` cells proportionally to `sizes` (largest remainder; sums to `width`)."""
    total = sum(max(0, s) for s in sizes)
    if total <= 0 or width <= 0:
        return [0 for _ in sizes]
    exact = [max(0, s) * width / total for s in sizes]
    cells = [int(e) for e in exact]
    order = sorted(range(len(sizes)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in order[: width - sum(cells)]:
        cells[i] += 1
    return cells


def stacked_bar(parts: Sequence[tuple[str, int]], width: int) -> Text:
    """One bar whose coloured segments are proportional to the parts' sizes."""
    text = Text()
    cells = segment_widths([size for _, size in parts], width)
    for i, ((name, _), n) in enumerate(zip(parts, cells)):
        glyph = "░" if name.lower() == "free" else "█"
        text.append(glyph * n, style=part_colour(name, i))
    return text


def heat_row(values: Sequence[float], width: int) -> Text:
    """One cell per value in 0..1, coloured red (0) → green (1); with more values than
    `width`, neighbouring values share a cell (their mean)."""
    if len(values) > width > 0:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
    text = Text()
    for v in values:
        idx = min(len(_HEAT) - 1, max(0, int(v * len(_HEAT))))
        text.append("▇", style=_HEAT[idx])
    return text
