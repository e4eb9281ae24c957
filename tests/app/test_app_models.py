"""Models: the wizard's tokenizer check, a model that fails to load, the last-used model,
`--model NAME` and `/model`."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from fake_engine import FakeBackend, FakeEngine
from app_helpers import click, screen_text, shown, type_and_send, wait_for, wait_idle

from app.app import ChatApp
from app.screens.load_failed import LoadFailedScreen
from app.screens.wizard import WizardScreen
from app.widgets.message import NoteMessage, UserMessage
from app.wizard import LAST_MODEL, check_source, find_model, last_model
from converter.synth import SynthOptions, chat_tiny_config, tiny_config, write_checkpoint

SIZE = (100, 34)
TOKENIZER_LINE = "the tokenizer has 129280 tokens but config.json's vocab_size is 512"


def converted(config, name: str) -> Path:
    path = config.models_dir / name
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    return path


def test_wizard_check_refuses_a_tokenizer_larger_than_the_vocab(tmp_path):
    small = write_checkpoint(tmp_path / "small", tiny_config(1), SynthOptions(n_shards=2))
    problems = check_source(small)  # preflight's check (converter/preflight.py) reports it first
    assert [p for p in problems if "tokenizer" in p] == [p for p in problems if "129,280 tokens but the model" in p
                                                         and "vocab_size" in p and "--logits-only" in p], problems
    assert len(problems) == 1 and not any(p.startswith(TOKENIZER_LINE) for p in problems)  # said once
    chat = write_checkpoint(tmp_path / "chat", chat_tiny_config(1), SynthOptions(n_shards=2))
    assert not any("tokenizer" in p for p in check_source(chat))


def test_a_failed_load_offers_the_demo_then_the_demo_is_remembered(config):
    cfg = replace(config, model=None)
    broken = converted(cfg, "tiny-logits")
    (cfg.data_dir / LAST_MODEL).write_text(f"{broken.resolve()}\n")
    why = "the tokenizer has 129280 tokens but the model's vocab_size is 512"
    backend = FakeBackend(fail_load={str(broken.resolve()): why})

    async def go(expect_failure: bool):
        app = ChatApp(cfg, backend)
        async with app.run_test(size=SIZE) as pilot:
            if expect_failure:
                await wait_for(pilot, lambda: isinstance(app.screen, LoadFailedScreen)
                               and shown(app, "#load-failed-why"), what="the dialog")
                text = screen_text(app)
                assert why in text and "RuntimeError" not in text
                assert "Wizard (w)" in text and "Demo model (d)" in text
                assert last_model(cfg) is None  # the next start will not pick it again
                await pilot.press("d")
            await wait_idle(pilot, app)
            assert app.screen is app.chat and not isinstance(app.screen, WizardScreen)

    asyncio.run(go(expect_failure=True))
    demo = cfg.models_dir / "demo"
    assert backend.loaded == [demo] and last_model(cfg) == demo.resolve()
    asyncio.run(go(expect_failure=False))  # the demo opens again: no wizard, no failure
    assert backend.loaded == [demo, demo]


def test_a_failed_load_offers_another_model_and_the_wizard(config):
    cfg = replace(config, model=None)
    broken, other = converted(cfg, "broken"), converted(cfg, "other")
    backend = FakeBackend(fail_load={str(broken): "bad shard"})

    async def go(press: str):
        app = ChatApp(replace(cfg, model=broken), backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, LoadFailedScreen)
                           and shown(app, "#load-failed-why"), what="the dialog")
            if press == "other":
                await click(pilot, app, "#model-0")
                await wait_idle(pilot, app)
                assert backend.loaded[-1] == other and app.model_dir == other
                assert app.chat.phase.content.plain.startswith("● ")
            else:
                await pilot.press("w")
                await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))

    asyncio.run(go("other"))
    assert last_model(cfg) == other.resolve()
    asyncio.run(go("wizard"))


def test_model_name_resolves_under_the_data_dir(config):
    cfg = replace(config, model=None)
    assert find_model(cfg) is None
    alpha = converted(cfg, "alpha")
    assert find_model(replace(cfg, model=Path("alpha"))) == alpha
    assert find_model(replace(cfg, model=Path("demo"))) == cfg.models_dir / "demo"
    assert find_model(replace(cfg, model=Path("nowhere"))) == Path("nowhere")  # load says why


def test_model_command_lists_and_switches(config):
    alpha, beta = converted(config, "alpha"), converted(config, "beta")
    backend = FakeBackend(FakeEngine())

    async def go():
        app = ChatApp(replace(config, model=Path("alpha")), backend)
        async with app.run_test(size=SIZE) as pilot:
            await wait_idle(pilot, app)
            assert backend.loaded == [alpha]
            await type_and_send(pilot, app, "first question")
            await type_and_send(pilot, app, "/model")
            listing = app.chat.transcript.query(NoteMessage).last().text
            assert "● alpha" in listing and "  beta" in listing
            await type_and_send(pilot, app, "/model nope")
            note = app.chat.transcript.query(NoteMessage).last()
            assert note.text.startswith(f"no converted model 'nope' (in {config.models_dir}: ")
            assert "alpha" in note.text and "beta" in note.text
            assert "error" in note.classes
            await type_and_send(pilot, app, "/model beta")
            await wait_idle(pilot, app)
            assert backend.loaded == [alpha, beta] and app.model_dir == beta
            # the conversation continues on the new model
            assert [u.text for u in app.chat.transcript.query(UserMessage)] == ["first question"]
            assert [m.content for m in app.service.session.messages][0] == "first question"
            assert last_model(config) == beta.resolve()

    asyncio.run(go())


def test_the_wizard_refuses_a_logits_only_checkpoint(config, tmp_path):
    """The wizard's live validation (the real check, not the fake's) names the tokenizer
    problem and keeps Convert disabled."""
    from app.screens.wizard import SourceScreen

    small = write_checkpoint(tmp_path / "small", tiny_config(1), SynthOptions(n_shards=2))

    class RealCheck(FakeBackend):
        def check_source(self, path):
            return check_source(path)

    async def go():
        app = ChatApp(replace(config, model=None), RealCheck())
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, WizardScreen))
            await pilot.press("c")
            await wait_for(pilot, lambda: isinstance(app.screen, SourceScreen)
                           and app.screen.query("#source-problems"), what="the source screen")
            app.screen.query_one("#source-path").value = str(small)
            problems = app.screen.query_one("#source-problems")
            await wait_for(pilot, lambda: "✗" in str(problems.content)
                           and "enter a directory" not in str(problems.content), timeout=20)
            assert "tokenizer.json has 129,280 tokens but the model" in str(problems.content)
            assert app.screen.query_one("#start").disabled

    asyncio.run(go())
