"""The wizard's checkpoint path: a path the system refuses (a name too long) is one problem line
under the field, never an OSError ending the app."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from fake_engine import FakeBackend
from app_helpers import wait_for

from app.app import ChatApp
from app.screens.wizard import SourceScreen, WizardScreen
from app.wizard import check_source, free_space_problem

TOO_LONG = "/tmp/" + "x" * 300  # one name over NAME_MAX (255): ENAMETOOLONG


class RealCheckBackend(FakeBackend):
    """The fake engine, with the real checkpoint check."""

    def check_source(self, path: Path) -> list[str]:
        return check_source(path)


def test_check_source_and_free_space_name_a_path_too_long(tmp_path):
    assert check_source(Path(TOO_LONG)) == [
        f"cannot read {TOO_LONG}: File name too long — check the directory's path"]
    assert free_space_problem(Path(TOO_LONG), tmp_path / "out") == (
        f"cannot read {TOO_LONG}: File name too long — check the directory's path")
    problem = free_space_problem(tmp_path, tmp_path / ("y" * 300) / "out")
    assert problem is not None and problem.startswith("cannot measure the free space for ")


def test_the_wizard_says_a_path_is_too_long_and_goes_on(config):
    async def go():
        app = ChatApp(replace(config, model=None), RealCheckBackend())
        async with app.run_test(size=(120, 45)) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
            await pilot.press("c")
            await wait_for(pilot, lambda: isinstance(app.screen, SourceScreen)
                           and bool(app.screen.query("#source-problems")))
            problems = app.screen.query_one("#source-problems")
            app.screen.query_one("#source-path").value = TOO_LONG
            await wait_for(pilot, lambda: "File name too long" in str(problems.content))
            assert str(problems.content) == (
                f"✗ cannot read {TOO_LONG}: File name too long — check the directory's path")
            app.screen.query_one("#source-path").value = "/nonexistent"
            await wait_for(pilot, lambda: str(problems.content) == "✗ /nonexistent is not a directory")

    asyncio.run(go())
