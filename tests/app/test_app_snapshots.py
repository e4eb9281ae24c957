"""Snapshot tests (pytest-textual-snapshot). Regenerate with `--snapshot-update` after an
intended UI change and review the SVGs under __snapshots__/ before committing them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fake_engine import FakeBackend, FakeEngine
from app_helpers import type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.screens.stats import StatsScreen
from app.screens.wizard import WizardScreen

SIZE = (120, 40)


def test_main_screen(config, snap_compare):
    """After one answered question with thinking on. A reviewer should see: the user message
    in a "you" box; the assistant box with a collapsed "▶ Thinking" row, the Markdown answer
    (bold "Streaming") and the footer "44 tokens · … tok/s · TTFT 0.25 s · eos"; the prompt
    and key hints at the bottom; on the right the phase "● graph replay · pos …", the expert
    cache bar at 100% with "entries 24 / 24 · pinned 0", hit rate now/total with a sparkline
    and a four-cell layer heat row, the memory budget's stacked bar with six parts, and
    throughput with a tok/s sparkline and the ms/step split."""
    app = ChatApp(config, FakeBackend(FakeEngine()))

    async def run_before(pilot) -> None:
        await wait_idle(pilot, app)
        app.chat.prompt.cursor_blink = False  # a blinking cursor makes the capture timing-dependent
        await type_and_send(pilot, app, "/set think on")
        await type_and_send(pilot, app, "How do experts stream?")

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_stats_screen(config, snap_compare):
    """The /stats screen after one answer and `/pin hot 4`. A reviewer should see: a summary
    line (model, phase, position, tok/s, cache fill, hit rates, counters); a per-layer table
    of four layers with hit-rate bars; the memory table (six parts, shares, total); and the
    cache-contents table, most used first, whose top four rows are marked pinned ("yes")."""
    app = ChatApp(config, FakeBackend(FakeEngine()))

    async def run_before(pilot) -> None:
        await wait_idle(pilot, app)
        app.chat.prompt.cursor_blink = False  # a blinking cursor makes the capture timing-dependent
        await type_and_send(pilot, app, "hello")
        await type_and_send(pilot, app, "/pin hot 4")
        await type_and_send(pilot, app, "/stats")
        await wait_for(pilot, lambda: isinstance(app.screen, StatsScreen))
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_wizard(snap_compare):
    """First run with no converted model. A reviewer should see a centred dialog "Welcome to
    dsv4-chat" naming the models directory (/nonexistent/dsv4-data/models), explaining the
    conversion, the warning that the demo model has RANDOM weights, three buttons (Convert a
    checkpoint (c), Demo model (d), Quit (q)), and a footer listing c / d / q."""
    config = replace_data(Path("/nonexistent/dsv4-data"))
    app = ChatApp(config, FakeBackend())

    async def run_before(pilot) -> None:
        await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def replace_data(data_dir: Path):
    from app.settings import AppConfig

    return replace(AppConfig(data_dir=data_dir), model=None)
