"""Snapshot tests (pytest-textual-snapshot). Regenerate with `--snapshot-update` after an
intended UI change and review the SVGs under __snapshots__/ before committing them."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from fake_engine import FakeBackend, FakeEngine
from app_helpers import type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.screens.load_failed import LoadFailedScreen
from app.screens.stats import StatsScreen
from app.screens.wizard import WizardScreen

SIZE = (120, 40)
SMALL = (80, 24)


def test_main_screen(config, snap_compare):
    """After one answered question with thinking on. A reviewer should see: the user message
    in a "you" box; the assistant box with a collapsed "▶ Thinking" row, the Markdown answer
    (bold "Streaming") and the footer "44 tokens · 14.4 tok/s · TTFT 0.25 s · eos"; the prompt
    and key hints at the bottom; on the right the status "● ready · graphs · pos 52", the expert
    cache bar at 100% with "entries 24 / 24 · pinned 0", hit rate now/total with a sparkline
    and a four-cell layer heat row, the memory budget's stacked bar with six parts, and
    throughput with "14.4 tok/s" (the footer's figure), a sparkline and the ms/step split."""
    app = ChatApp(config, FakeBackend(FakeEngine()))
    assert snap_compare(app, terminal_size=SIZE, run_before=_one_answer(app))


def _one_answer(app, *keys: str):
    async def run_before(pilot) -> None:
        await wait_idle(pilot, app)
        app.chat.prompt.cursor_blink = False  # a blinking cursor makes the capture timing-dependent
        await type_and_send(pilot, app, "/set think on")
        await type_and_send(pilot, app, "How do experts stream?")
        for key in keys:
            await pilot.press(key)
        await pilot.pause()

    return run_before


def test_main_screen_80x24(config, snap_compare):
    """The same answer in an 80×24 terminal. A reviewer should see: no stats panes — the
    transcript, prompt and hints take the whole width (boxes of 78 columns, the answer wrapped,
    its footer "44 tokens · 14.4 tok/s · …"); one status line above the prompt, "● ready ·
    graphs · pos 52 · 14.4 tok/s · cache 24/24 · hit …"; the hints end with "F3 panes · /help"."""
    app = ChatApp(config, FakeBackend(FakeEngine()))
    assert snap_compare(app, terminal_size=SMALL, run_before=_one_answer(app))


def test_main_screen_80x24_with_panes(config, snap_compare):
    """80×24 after F3: the stats panes are back on the right (the status line is gone, the
    panes' own "● ready · graphs · pos 52" label is at their top) and the chat is narrower."""
    app = ChatApp(config, FakeBackend(FakeEngine()))
    assert snap_compare(app, terminal_size=SMALL, run_before=_one_answer(app, "f3"))


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


def test_wizard_80x24(snap_compare):
    """The first-run wizard in 80×24: the whole dialog fits — the text wraps inside the border,
    the RANDOM-weights warning, and all three buttons on one row, nothing cut off."""
    config = replace_data(Path("/nonexistent/dsv4-data"))
    app = ChatApp(config, FakeBackend())

    async def run_before(pilot) -> None:
        await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
        await pilot.pause()

    assert snap_compare(app, terminal_size=SMALL, run_before=run_before)


def test_load_failed_80x24(snap_compare):
    """A model that fails to load, in 80×24. A reviewer should see a dialog "Could not load
    …/models/broken", the reason without an exception class name ("✗ the tokenizer has 129280
    tokens but the model's vocab_size is 512"), a button for the other converted model
    ("other"), then "Wizard (w)", "Demo model (d)" and "Quit (q)"."""
    data = Path(tempfile.gettempdir()) / "dsv4-chat-snapshot-data"  # a path the capture shows
    shutil.rmtree(data, ignore_errors=True)
    config = replace_data(data)
    for name in ("broken", "other"):
        (config.models_dir / name).mkdir(parents=True)
        (config.models_dir / name / "manifest.json").write_text("{}")
    broken = config.models_dir / "broken"
    why = "the tokenizer has 129280 tokens but the model's vocab_size is 512"
    app = ChatApp(replace(config, model=broken), FakeBackend(fail_load={str(broken): why}))

    async def run_before(pilot) -> None:
        await wait_for(pilot, lambda: isinstance(app.screen, LoadFailedScreen)
                       and app.screen.query("#load-failed-why"), what="the dialog")
        await pilot.pause()

    try:
        assert snap_compare(app, terminal_size=SMALL, run_before=run_before)
    finally:
        shutil.rmtree(data, ignore_errors=True)


def replace_data(data_dir: Path):
    from app.settings import AppConfig

    return replace(AppConfig(data_dir=data_dir), model=None)
