"""ChatApp: wires the chat screen, the engine service, the controller (commands, conversation,
autosave; app/controller.py) and the wizard.

Start-up: --demo → build/load the demo; a model (flag or data dir) → load it; neither → the
first-run wizard. Once the engine is ready, an unfinished transcript is offered for resuming,
then a session starts. All engine work goes through `EngineService` (thread workers).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.timer import Timer
from textual.widgets import TextArea

from app import autosave, command_handlers
from app.autosave import Autosaver
from app.backend import Backend, RealBackend
from app.commands import Command, CommandError, is_command, message_text, parse
from app.controller import Controller, EngineState, idle_problem
from app.conversation import ChatMessage, Conversation
from app.demo import DEMO_NOTICE
from app.heap import HeapFreeze
from app.heap_trim import heap_trimmer
from app.messages import (
    CallDone,
    EngineError,
    EngineReady,
    LoadProgressed,
    StatsChanged,
    TokensReady,
    TurnDone,
)
from app.history import Past
from app.palette import ChatCommands
from app.screens.chat import ChatScreen
from app.screens.load_failed import LoadFailedScreen
from app.screens.progress import ProgressScreen
from app.screens.resume import ResumeScreen
from app.screens.stats import StatsScreen
from app.screens.wizard import ConvertRequest, SourceScreen, WizardScreen
from app.service import EngineService, SessionStarted
from app.settings import AppConfig
from app.widgets.message import AssistantMessage, empty_answer_notice, turn_footer
from app.widgets.prompt import PromptInput
from app.wizard import converted_models, find_model, forget_model, remember_model
from engine.sampling import SamplingParams


QUIT_WINDOW_S = 3.0  # a second Ctrl+C within this many seconds quits
STATS_HZ = 5  # the panes redraw at most this often however fast steps come
TEXT_HZ = 10  # streamed text is appended to the transcript at most this often


class ChatApp(App):
    """The dsv4-chat terminal app. `backend` is the engine/converter seam (tests pass a fake)."""

    CSS_PATH = "chat.tcss"
    TITLE = "dsv4-chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        Binding("escape", "cancel", "Stop", show=False),
        Binding("f2", "stats", "Stats", show=False),
        Binding("f3", "toggle_panes", "Panes", show=False),
        Binding("ctrl+c", "interrupt", "Stop/Quit", show=False, priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, config: AppConfig, backend: Backend | None = None,
                 *, offer_resume: bool = True, driver_class: type | None = None) -> None:
        super().__init__(driver_class=driver_class)
        self.controller = Controller(config, on_autosave_error=self.autosave_failed)
        self.backend = backend if backend is not None else RealBackend()
        self.service = EngineService(self, self.backend, config, trim=heap_trimmer())
        self.chat = ChatScreen()
        self._offer_resume = offer_resume
        self._answer: AssistantMessage | None = None
        self._after_session: list[str] = []  # notes to show once the session exists
        self._stats_timer: Timer | None = None
        self._text_timer: Timer | None = None
        self._text_shown = 0.0
        self._stats_shown = 0.0  # time.monotonic() of the last stats render
        self.heap = HeapFreeze()
        self._interrupted_at = -QUIT_WINDOW_S  # time.monotonic() of the last Ctrl+C
        self.decode_mode = "eager"  # "graphs" when the engine replays CUDA graphs (Engine.info)
        self._chatted = False  # a model was ready once: a later failed load was a model switch

    @property
    def config(self) -> AppConfig:
        return self.controller.config

    @property
    def gen(self) -> SamplingParams:
        return self.controller.gen

    @property
    def conversation(self) -> Conversation:
        return self.controller.conversation

    @property
    def autosave(self) -> Autosaver | None:
        return self.controller.autosave

    @property
    def model_dir(self) -> Path | None:
        return self.controller.model_dir

    def engine_state(self) -> EngineState:
        return EngineState(loaded=self.service.engine is not None, busy=self.service.busy,
                           ready=self.service.ready)

    # ---- start-up -------------------------------------------------------------------------

    async def on_mount(self) -> None:
        await self.push_screen(self.chat)
        model = None if self.config.demo else find_model(self.config)
        if self.config.demo or (model is not None and self.is_demo(model)):
            self.build_demo()  # (re)built if missing or from an older build; else returned at once
        elif model is not None:
            self.load_model(model)
        else:
            self.push_screen(WizardScreen(self.config), self._wizard_choice)

    def is_demo(self, model_dir: Path) -> bool:
        return self.controller.is_demo(model_dir)

    def _wizard_choice(self, choice: str | None) -> None:
        if choice == "convert":
            self.push_screen(SourceScreen(self.config, self.backend.check_source), self._convert)
        elif choice == "demo":
            self.build_demo()
        else:
            self.exit()

    def _convert(self, request: ConvertRequest | None) -> None:
        if request is None:
            self.push_screen(WizardScreen(self.config), self._wizard_choice)
            return
        job = partial(self.backend.convert, request.src, request.dst)
        self.push_screen(ProgressScreen(f"Converting {request.src}", job), self._model_built)

    def build_demo(self) -> None:
        def job(progress, cancel) -> Path:
            return self.backend.ensure_demo(self.config.data_dir, progress)

        self.push_screen(ProgressScreen("Preparing the demo model", job, DEMO_NOTICE),
                         self._model_built)

    def _model_built(self, path: Path | None) -> None:
        """A conversion or the demo build ended (None: cancelled or failed). Without a model the
        wizard comes back; with one still loaded (`/model demo` cancelled) the chat goes on."""
        if path is not None:
            self.load_model(path)
        elif self.service.engine is None:
            self.push_screen(WizardScreen(self.config), self._wizard_choice)
        else:
            name = "?" if self.model_dir is None else self.model_dir.name
            self.run_worker(self.note(f"no model switch: still chatting with {name}"),
                            name="switch-kept")

    def load_model(self, model_dir: Path) -> None:
        """Load `model_dir` (closing the current engine first, for a switch); once ready, the
        current conversation continues on it."""
        self.controller.model_dir = model_dir
        self.chat.show_phase("loading", str(model_dir))
        self.service.load(model_dir)

    def _load_failed_choice(self, choice: str | None) -> None:
        if choice == "back":  # a failed switch: the chat, where /model NAME picks another
            return
        if choice == "wizard":
            self.push_screen(WizardScreen(self.config), self._wizard_choice)
        elif choice == "demo":
            self.build_demo()
        elif choice and choice != "quit":
            self.load_model(Path(choice))
        else:
            self.exit()

    @property
    def ui_alive(self) -> bool:
        """False once the app is exiting: late engine messages then skip the widgets."""
        return self.chat.is_attached

    def on_load_progressed(self, event: LoadProgressed) -> None:
        if not self.ui_alive:
            return
        p = event.progress
        self.chat.show_phase(p.phase, f"{p.done}/{p.total} {p.unit}".strip())

    async def on_engine_ready(self, event: EngineReady) -> None:
        self.service.finished()
        if not self.ui_alive:
            return
        self._chatted = True
        info = event.info
        problem = None if self.model_dir is None else remember_model(self.config, self.model_dir)
        if problem:  # (the next start opens it again, else)
            await self.note(problem, error=True)
        demo = bool(info.get("demo")) or (self.model_dir is not None and self.is_demo(self.model_dir))
        graphs = "CUDA graphs" if info.get("decode") == "CUDA graphs" else None
        self.sub_title = " · ".join(
            str(x) for x in (info.get("model", self.model_dir), info.get("device"),
                             info.get("numerics"), graphs) if x)
        self.decode_mode = "graphs" if info.get("decode") == "CUDA graphs" else "eager"
        self.chat.show_phase("ready", self.decode_mode)
        self.heap.freeze()  # the engine and UI are built: keep full GC passes short (app/heap.py)
        self._show_latest_stats()
        if info.get("decode_note"):
            await self.note(info["decode_note"])
        if demo:
            await self.note(DEMO_NOTICE)
        self._after_session.append("ready — type a message; /help lists the commands")
        found = autosave.find_unfinished(self.config.transcripts_dir) if self._offer_resume else None
        self._offer_resume = False  # only at start-up, not after a model switch
        if found is None:  # a switched model continues the conversation shown
            self.service.start_session(self.conversation.system, self.conversation.messages)
        else:
            self.push_screen(ResumeScreen(found), lambda yes: self._resume(found, bool(yes)))

    def _resume(self, found: autosave.Unfinished, yes: bool) -> None:
        if not yes:
            autosave.dismiss(found.path)
            self.service.start_session(self.conversation.system)
            return
        pending = found.conversation.pending_prompt()
        if pending:  # the unanswered question goes back into the prompt
            self.chat.prompt.load_text(pending)
        conv = self.controller.continue_transcript(found.path, found.conversation)
        self.run_worker(self.show_conversation(conv, f"resumed ({conv.turns} turn(s))"),
                        name="show-resumed")

    async def switch_model(self, name: str) -> None:
        """`/model NAME` (also from the command palette)."""
        await command_handlers.run(self, Command("model", name))

    async def reopen(self, past: Past) -> None:
        """Continue a past (autosaved) conversation in its own transcript file (the palette)."""
        await command_handlers.render(self, self.controller.reopen(past, self.engine_state()))

    async def show_conversation(self, conv: Conversation, note: str) -> None:
        """Display `conv` (the controller's conversation now) and start an engine session that
        continues it; `note` once ready."""
        await self.chat.transcript.show_conversation(conv)
        self._after_session.append(note)
        self.service.start_session(conv.system, conv.messages)

    # ---- chatting -------------------------------------------------------------------------

    def autosave_failed(self, message: str) -> None:
        """The data dir is read-only or full: autosave turned itself off; the chat goes on."""
        self.notify(message, title="autosave off", severity="warning", timeout=20, markup=False)

    async def note(self, text: str, error: bool = False) -> None:
        await self.chat.transcript.add_note(text, error)

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if is_command(text):
            try:
                command = parse(text)
            except CommandError as err:
                await self.note(str(err), error=True)
                self._give_back(text)
                return
            if not await command_handlers.run(self, command):
                self._give_back(text)
            return
        if not await self.require_idle():
            self._give_back(text)
            return
        text = message_text(text)
        await self.chat.transcript.add_user(text)
        self._answer = await self.chat.transcript.add_assistant()
        self._answer.start_waiting()
        self.controller.sent(text)
        self.service.send(text, self.gen)

    def _give_back(self, text: str) -> None:
        """A refused message or command goes back into the prompt to be fixed or sent again
        (unless something was typed meanwhile: that is kept; the text is in ↑'s history too)."""
        if not self.chat.prompt.text:
            self.chat.prompt.load_text(text)
            self.chat.prompt.move_cursor(self.chat.prompt.document.end)

    async def require_idle(self) -> bool:
        """True if the engine can take a job now; otherwise says why (one line) and False."""
        problem = idle_problem(self.engine_state())
        if problem:
            await self.note(problem, error=True)
            return False
        return True

    async def on_tokens_ready(self, event: TokensReady) -> None:
        """Append the waiting text, at most TEXT_HZ times a second (each append re-lays out
        the transcript; batching keeps keypresses responsive while tokens pour in)."""
        if self._text_timer is not None:
            return
        wait = self._text_shown + 1.0 / TEXT_HZ - time.monotonic()
        if wait > 0:
            self._text_timer = self.set_timer(wait, self._flush_text)
        else:
            await self._flush_text()

    async def _flush_text(self) -> None:
        if self._text_timer is not None:
            self._text_timer.stop()
            self._text_timer = None
        self._text_shown = time.monotonic()
        for channel, text in self.service.take_text():
            if self._answer is not None and self.ui_alive:
                await self._answer.append(text, channel)

    def on_stats_changed(self, event: StatsChanged) -> None:
        """Render the newest stats, at most STATS_HZ times a second (later ones wait)."""
        if self._stats_timer is not None:
            return  # a render is already scheduled; it will take the newest snapshot
        wait = self._stats_shown + 1.0 / STATS_HZ - time.monotonic()
        if wait > 0:
            self._stats_timer = self.set_timer(wait, self._show_latest_stats)
        else:
            self._show_latest_stats()

    def _show_latest_stats(self) -> None:
        """Render the newest snapshot now (also called at the end of every job)."""
        if self._stats_timer is not None:
            self._stats_timer.stop()
            self._stats_timer = None
        self._stats_shown = time.monotonic()
        stats, recent = self.service.take_stats()
        if stats is None or not self.ui_alive:
            return
        idle = None  # mid-turn (or loading): the steps' own phase and position
        if self.service.busy not in ("turn", "regen") and self.service.ready:
            idle = (self.decode_mode, self.service.session.position)
        self.chat.show_stats(stats, recent, idle)
        if isinstance(self.screen, StatsScreen):
            self.screen.update_stats(stats)

    def _record_turn(self, event: TurnDone) -> None:
        msg = ChatMessage("assistant", event.content, event.reasoning, event.stats.finish_reason)
        self.controller.answered(msg, event.regenerated)

    async def on_turn_done(self, event: TurnDone) -> None:
        self.service.finished()
        self._record_turn(event)
        await self._flush_text()
        self._show_latest_stats()
        if self._answer is not None and self.ui_alive:
            notice = empty_answer_notice(event.content, event.reasoning, event.stats.finish_reason,
                                         self.gen.max_tokens)
            await self._answer.finish(turn_footer(event.stats), event.content, notice)
            self._answer = None
        if self.ui_alive:
            await self.complete_stats_screen()

    async def on_engine_error(self, event: EngineError) -> None:
        self.service.finished()
        if event.job == "turn":  # the engine left the session as it was before the turn
            self.controller.turn_failed()
        if not self.ui_alive:
            return
        if event.job == "load":
            self.chat.show_phase("failed", "/model NAME, or restart with --demo")
            await self.note(f"could not load the model from {self.model_dir}: {event.message}", True)
            if self.model_dir is not None:
                forget_model(self.config, self.model_dir)  # the next start does not pick it again
            others = [p for p in converted_models(self.config)
                      if p != self.model_dir and not self.is_demo(p)]
            self.push_screen(LoadFailedScreen(self.model_dir, event.message, others,
                                              back=self._chatted), self._load_failed_choice)
            return
        await self._flush_text()
        self._show_latest_stats()
        if self._answer is not None and event.job == "turn":  # shown, but not a turn
            await self._answer.finish(f"failed: {event.message}")
            self.chat.transcript.mark_failed(self._answer)
        elif self._answer is not None and event.job == "regen":  # the old answer stands
            old = self.conversation.messages[-1]
            await self._answer.finish("regeneration failed; previous answer kept", old.content)
        self._answer = None
        await self.note(f"{event.job} failed: {event.message}", error=True)
        await self.complete_stats_screen()

    async def on_call_done(self, event: CallDone) -> None:
        self.service.finished()
        started = isinstance(event.result, SessionStarted)
        result = event.result if started else self.controller.finish(event.result)
        if not self.ui_alive:
            return
        self._show_latest_stats()
        if started:
            for text in self._after_session:
                await self.note(text)
            self._after_session.clear()
        else:
            await command_handlers.render(self, result)
        await self.complete_stats_screen()

    # ---- actions --------------------------------------------------------------------------

    def action_cancel(self) -> None:
        if self.service.cancel():
            self.notify("stopping…", timeout=2)

    def action_interrupt(self) -> None:
        """Ctrl+C: copy a selection in the prompt; else stop the answer being written; else
        (or pressed again within QUIT_WINDOW_S) quit — as in llama-cli and ollama."""
        focused = self.focused
        if isinstance(focused, TextArea) and focused.selected_text:
            focused.action_copy()
            return
        now = time.monotonic()
        again = now - self._interrupted_at < QUIT_WINDOW_S
        self._interrupted_at = now
        if self.service.cancel():
            self.notify("stopping the answer — Ctrl+C again quits", timeout=QUIT_WINDOW_S)
        elif again:
            self.exit()
        else:
            self.notify("press Ctrl+C again (or Ctrl+Q) to quit", timeout=QUIT_WINDOW_S)

    def action_toggle_panes(self) -> None:
        if self.screen is self.chat:
            self.chat.toggle_panes()

    async def action_stats(self) -> None:
        """F2: open the statistics screen; on it, close it (one at a time, never stacked)."""
        if isinstance(self.screen, StatsScreen):
            self.pop_screen()
        elif self.service.busy != "stats":  # else the screen of the job running is coming
            await command_handlers.run(self, parse("/stats"))

    async def complete_stats_screen(self) -> None:
        """A statistics screen opened mid-job (without the cache's contents) on top and the
        engine idle now: fetch the full statistics; they replace it."""
        if (isinstance(self.screen, StatsScreen) and not self.screen.has_contents
                and self.service.busy is None and self.service.ready):
            await command_handlers.run(self, parse("/stats"))

    async def show_stats_screen(self, screen: StatsScreen) -> None:
        """Show `screen` in place of a statistics screen on top, else over the current one."""
        if isinstance(self.screen, StatsScreen):
            await self.switch_screen(screen)
        else:
            await self.push_screen(screen)

    async def action_quit(self) -> None:
        self.exit()

    async def regenerate_view(self) -> None:
        """Replace the last answer's widget (failed turns skipped) with a fresh, streaming one
        in its place (for /regen)."""
        last = self.chat.transcript.last_assistant()
        self._answer = await self.chat.transcript.add_assistant(after=last)
        if last is not None:
            await last.remove()
        self._answer.start_waiting()

    def exit(self, *args, **kwargs) -> None:
        """Stop a running answer first, so its end is recorded before the app closes."""
        self.service.stop()
        super().exit(*args, **kwargs)

    def on_unmount(self) -> None:
        self.heap.release()
        self.service.close()
        if self.service.unhandled_turn is not None:  # the turn ended as the app closed
            self._record_turn(self.service.unhandled_turn)
        self.controller.close()
