"""The pure renderers behind the stats panes."""

from __future__ import annotations

from app.widgets.bars import bar, fmt_bytes, heat_row, segment_widths, stacked_bar


def test_fmt_bytes():
    assert fmt_bytes(0) == "0 B"
    assert fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(1536) == "1.5 KiB"
    assert fmt_bytes(192 * 2**20) == "192 MiB"
    assert fmt_bytes(53.25 * 2**30) == "53.2 GiB"
    assert fmt_bytes(3 * 2**40) == "3 TiB"


def test_bar_fills_proportionally_and_clamps():
    assert str(bar(0.5, 10)) == "█████░░░░░"
    assert str(bar(1.7, 4)) == "████" and str(bar(-1, 4)) == "░░░░"


def test_segment_widths_sum_to_width():
    assert segment_widths([8, 8, 112], 32) == [2, 2, 28]
    assert sum(segment_widths([1, 1, 1], 10)) == 10
    assert segment_widths([0, 0], 5) == [0, 0]


def test_stacked_bar_marks_free_space():
    text = stacked_bar((("resident weights", 1), ("free", 3)), 8)
    assert str(text) == "██░░░░░░"


def test_heat_row_one_cell_per_layer_or_buckets():
    assert len(heat_row([0.1, 0.5, 0.9], 44)) == 3
    assert len(heat_row([0.5] * 43, 44)) == 43
    assert len(heat_row([0.5] * 100, 44)) == 44
    row = heat_row([0.0, 1.0], 10)
    assert row.spans[0].style != row.spans[1].style  # red vs green
