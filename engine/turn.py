"""One turn of a chat session: the turn state machine and the pipelined decode loop.

A turn renders the whole conversation, reuses the longest kept prefix of processed tokens
(engine.session) and prefills only the rest, in chunks of `EngineConfig.prefill_chunk`; then it
decodes one token per step until EOS, `max_tokens` or the context limit. Outcomes:

* success: the session gains the user message and the assistant message; the completion's ids
  are kept (the final sampled token, usually EOS, is processed at the start of the next turn);
* cancelled while decoding: the partial answer is kept as the assistant message with its ids
  (finish_reason "cancelled"); cancelled during prefill: the assistant message is empty and the
  state is rolled back to the turn's start (the next turn prefills the missing prompt);
* failure (context limit: ContextOverflow, refused before any step; an exception in the model):
  EngineFailure, session exactly as before.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Generator, Iterator

import torch

from engine.chat import ChatTokenizer, Message, ThinkingSplitter, parse_completion
from engine.chat import THINK_START, not_unicode, render_messages
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.events import ContextOverflow, EngineFailure, Event, StepUpdate, TurnFinished
from engine.model import Transformer
from engine.runtime import Runtime
from engine.sampling import Sampler, SamplingParams, checked
from engine.session import Session, SessionError, Snapshot
from engine.stats import CacheSnapshot, TurnStats
from engine.step_meter import StepMeter


ANSWERING = ("this session is already answering: a turn of it has started and not ended. Iterate that turn's "
             "events to its last one (TurnFinished or EngineFailure; set its cancel event to stop it sooner), or "
             "close() it to drop it unfinished (the session is then as before that turn)")


class CorruptModelError(EngineError):
    """The model computed non-finite logits: its weights are most likely corrupt."""


def _non_finite(path: Path, converted: bool, generated: int) -> str:
    check = (f"check it with `dsv4-convert --verify {path}`; if that finds nothing, the checkpoint it was "
             "converted from is damaged: download it again and run dsv4-convert again (it converts "
             "what changed)") if converted else (
             f"the checkpoint at {path} is damaged: download it again")
    return (f"the logits after {generated} generated tokens are not finite (NaN or inf): the model's "
            f"weights are most likely corrupt; {check}")


class Turns:
    """Runs the turns of one engine's sessions on its model, runtime and tokenizer (owned by
    `engine.engine.Engine`, which checks the session and the engine before each turn)."""

    def __init__(self, files, model: Transformer, tokenizer: ChatTokenizer, config: EngineConfig,
                 runtime: Runtime, meter: StepMeter, cache_snapshot: Callable[[], CacheSnapshot]) -> None:
        self.files, self.model, self.tokenizer, self.config = files, model, tokenizer, config
        self.runtime, self._meter, self._cache_snapshot = runtime, meter, cache_snapshot

    def close(self) -> None:
        """Drop the model, runtime and meters (the engine is closed): a turn still running fails."""
        self.runtime = self.model = self._meter = self._cache_snapshot = None

    def overflow(self, prompt_tokens: int) -> ContextOverflow | None:
        """The context rule, here only: a prompt of `prompt_tokens` tokens (the conversation with
        the new message, rendered and tokenised) is refused, before any step, when it is not
        below max_seq_len (the turn needs a position for its first generated token)."""
        limit = self.config.max_seq_len
        if prompt_tokens < limit:
            return None
        return ContextOverflow(f"the conversation would be {prompt_tokens} tokens, over the context limit of "
                               f"{limit} tokens (max_seq_len): start a new conversation or raise max_seq_len",
                               prompt_tokens, limit)

    def prompt_overflow(self, conversation: list[Message], thinking: bool) -> ContextOverflow | None:
        """`overflow` of a whole conversation (system message first, the new user message
        last), rendered as a turn renders it: a front end's check before it queues a turn."""
        return self.overflow(len(self.tokenizer.encode(render_messages(conversation, thinking))))

    def run(self, session: Session, question: Callable[[], tuple[list[Message], str]], params: SamplingParams,
            cancel: threading.Event) -> Generator[Event, None, None]:
        """One turn answering `question()` = (the messages before it, the user's text), asked when
        the turn starts (its first event), not when it is made (the module docstring's outcomes);
        yields events, the last one TurnFinished or EngineFailure.

        One turn of a session at a time: the session is answering from the turn's first event
        until its last one is yielded (by then the turn has ended: its state is committed or
        rolled back), or until the generator is closed mid-way (then the session is as before the
        turn: the module docstring's failure). A turn started while another of the session has
        not ended fails at once, leaving that one untouched (it may be running in another thread:
        only its consumer can end it, by iterating to its last event or closing it); so does a
        turn of a closed engine, and one whose question raises SessionError (e.g. nothing left to
        regenerate)."""
        if self.runtime is None:
            yield EngineFailure("the engine is closed: load the model again to chat")
            return
        if session.answering:
            yield EngineFailure(ANSWERING)
            return
        try:
            base, user_text = question()
        except SessionError as err:
            yield EngineFailure(str(err))
            return
        session.answering = True
        events, last = self._run(session, base, user_text, params, cancel), None
        try:
            for event in events:
                if isinstance(event, (TurnFinished, EngineFailure)):
                    last = event  # the turn's last event: yielded once the turn has ended
                else:
                    yield event
        finally:
            events.close()  # closed mid-way (GeneratorExit at a yield above): the turn rolls back now
            session.answering = False
        if last is not None:
            yield last

    def _run(self, session: Session, base: list[Message], user_text: str, params: SamplingParams,
             cancel: threading.Event) -> Iterator[Event]:
        """`run`'s turn, answering `user_text` after the messages `base`."""
        t_start = time.perf_counter()
        tok, limit = self.tokenizer, self.config.max_seq_len
        user = Message("user", user_text)
        prompt_text = render_messages(session.conversation(base + [user]), params.thinking)
        bad = not_unicode(prompt_text)
        if bad is not None:  # a lone surrogate: e.g. input that was not UTF-8
            yield EngineFailure(f"the conversation holds text that is not valid Unicode ({prompt_text[bad]!r}, "
                                "e.g. input that was not UTF-8): send UTF-8 text")
            return
        plan = session.plan(prompt_text, tok.encode)
        refused = self.overflow(plan.prompt_tokens)
        if refused is not None:
            yield refused
            return
        turn_start = session.live_copy() if plan.from_live and session.live.length else None
        work = session.start(plan)
        max_new = min(params.max_tokens, limit - plan.prompt_tokens)
        # the caches grow for the whole turn now: no step of it, prefill included, changes the
        # state's buffers (which would capture the decode graphs again)
        self.runtime.reserve(work.state, plan.prompt_tokens + max_new)
        self._meter.start_turn(work.state.pos)
        committed = False
        try:
            prefill_s, logits, after_prompt = yield from self._prefill(session, work, plan, prompt_text, params,
                                                                       cancel)
            if logits is None:  # cancelled during prefill: state as before the turn, messages kept
                back = turn_start if plan.from_live else plan.base
                session.commit(back.copy() if back is not None and back.length else self._empty(),
                               base + [user, Message("assistant", "")])
                committed = True
                yield TurnFinished(self._turn_stats(plan, [], prefill_s, [], 0.0, "cancelled"), "", "")
                return
            if turn_start is not None:
                session.keep(turn_start)  # the end of the previous turn: undo comes back here
            if plan.suffix:  # after the prompt: regenerate starts here (state copied by _prefill)
                work.text = prompt_text
                session.keep(Snapshot(prompt_text, list(work.ids), after_prompt, [], logits))
            completion, step_ms, ttft, finish = yield from self._decode(work, max_new, params, cancel, logits,
                                                                        t_start)
            completion_text = tok.decode(completion)
            reasoning, content = parse_completion(completion_text, params.thinking)
            work.text = prompt_text + completion_text
            session.commit(work, base + [user, Message("assistant", content, reasoning)])
            committed = True
            session.spare_live()  # the next turn's undo point, copied now rather than before its first token
            yield TurnFinished(self._turn_stats(plan, completion, prefill_s, step_ms, ttft, finish), reasoning, content)
        except Exception as exc:  # the model failed: the session is left as it was (finally)
            if not committed:
                yield EngineFailure("the engine was closed during the turn" if self.model is None else
                                    f"the turn failed: {type(exc).__name__}: {exc}")
        finally:
            # failed or abandoned: roll the live state back (unless the engine was closed under the turn)
            if not committed and plan.from_live and self.model is not None:
                session.live = turn_start.copy() if turn_start is not None else self._empty()

    def _empty(self) -> Snapshot:
        return Snapshot("", [], self.model.new_state())

    def _prefill(self, session: Session, work: Snapshot, plan, prompt_text: str, params: SamplingParams,
                 cancel: threading.Event):
        """Run plan.suffix into work (chunked); returns (seconds, last logits or None if cancelled,
        a copy of the state after the suffix or None if none ran).

        The copy is queued once the suffix's last chunk is, while the device runs it
        (`Runtime.prefill`'s `on_queued`), and the memory budget is measured then: their host time
        (the state's ~270 buffers at 43 layers, engine/state.py `copies`; every session's state)
        no longer follows the prompt's steps before the first token. In thinking mode
        the final `<think>` runs as its own step after a snapshot, so that the next turn (which
        drops this turn's reasoning) can resume right before it."""
        suffix, think = plan.suffix, self.tokenizer.think_start_id
        parts = [suffix]
        if params.thinking and len(suffix) > 1 and suffix[-1] == think and prompt_text.endswith(THINK_START):
            parts = [suffix[:-1], suffix[-1:]]
        seconds, logits, copy = 0.0, plan.base.logits, None
        for i, part in enumerate(parts):
            done, copies = 0, []

            def queued() -> None:  # the last chunk is queued: host work while the device runs it
                copies.append(work.state.clone())
                self._meter.refresh()
            for res in self.runtime.prefill(work.state, part, self.config.prefill_chunk, cancel, on_queued=queued):
                work.ids += part[done:done + res.tokens]
                done += res.tokens
                seconds += res.seconds
                logits = res.logits
                yield StepUpdate(self._meter.step(res, work.state.pos, None))
            if done < len(part):
                return seconds, None, None
            copy = copies[-1] if copies else None
            if i == 0 and len(parts) == 2:
                work.text = prompt_text[: -len(THINK_START)]
                session.keep(Snapshot(work.text, list(work.ids), copy, [], logits))
        work.pending, work.logits = [], None
        return seconds, logits, copy

    def _decode(self, work: Snapshot, max_new: int, params: SamplingParams, cancel: threading.Event,
                logits: torch.Tensor, t_start: float):
        """Sample and run one token per step; yields text deltas and step stats.

        Each sampled token is launched as the next step before the host reads it (one transfer
        per token, waiting for the sampler only), and the sampler is queued on a step's logits
        before that step has run, so the device always holds the next step while the host
        detokenises, reports and queues the one after. A step guessed whole through a bounded
        cache is launched unchecked (`defer_check`) and checked (`Runtime.confirm`) before the
        next launch, once its blocks have run, so the host's work between tokens overlaps them; a
        wrong guess is redone there and its token drawn again (`Sampler.undo`: the same draw as
        if the step had never been guessed). The token that reaches the length limit
        is not run: it is left in work.pending. An EOS has been run by then (its logits are
        dropped; the next turn would run it first anyway). At most `max_new` tokens (`run` has
        grown the state's caches for them). Returns (completion ids, step times in ms, ttft s,
        finish reason)."""
        tok = self.tokenizer
        sampler = Sampler(params, logits.device)
        splitter = ThinkingSplitter(tok, params.thinking)
        completion: list[int] = []
        step_ms: list[float] = []
        ttft, finish = 0.0, "cancelled"
        ahead = None  # the step launched on the last sampled token; `logits` are its output
        t0 = time.perf_counter()
        try:
            while not cancel.is_set():
                chosen = sampler(logits)  # queued after the step that writes `logits`
                last = len(completion) + 1 >= max_new  # this token ends the turn, whatever it is
                # its copy to the host starts first; -1 if the logits row is not finite (same copy)
                value = self.runtime.read(checked(chosen, logits))
                redone = self.runtime.confirm()  # the step that made `logits`, if it was returned unchecked
                if redone is not None:  # its guess was wrong: redone layer by layer, drawn again from its logits
                    sampler.undo()
                    logits = redone
                    continue
                ran, ahead = ahead, (None if last else self.runtime.launch(work.state, chosen.reshape(1),
                                                                           defer_check=True))
                token = value()  # the one host transfer per token: `ran` has run by now
                if token < 0:
                    raise CorruptModelError(_non_finite(self.files.path, self.files.converted, len(completion)))
                completion.append(token)
                if ahead is not None:
                    work.ids.append(token)
                if ran is not None:
                    res = self.runtime.finish(ran)
                    now = time.perf_counter()
                    step_ms.append(1e3 * (now - t0))
                    self._meter.decode_step(now - t0)
                    t0 = now
                    yield StepUpdate(self._meter.step(res, work.state.pos - (ahead is not None), ttft))
                if len(completion) == 1:
                    ttft = time.perf_counter() - t_start
                yield from splitter.push(token)
                if token == tok.eos_id or last:
                    finish = "eos" if token == tok.eos_id else (
                        "max_tokens" if len(completion) >= params.max_tokens else "context")
                    if ahead is None:
                        work.pending = [token]
                    break
                logits = ahead.logits
        finally:
            if self.runtime is not None:  # else the engine was closed before this turn's generator
                if ahead is not None:  # the EOS's step, or a step left running when the turn was closed
                    self.runtime.finish(ahead)
                self.runtime.confirm()  # that step checked (redone if need be: the state stays exact), its logits dropped
                self.runtime.settle()  # the last replayed step's routes (usage counts, trace)
        yield from splitter.flush()
        return completion, step_ms, ttft, finish

    def _turn_stats(self, plan, completion: list[int], prefill_s: float, step_ms: list[float], ttft: float,
                    finish: str) -> TurnStats:
        decode_s = sum(step_ms) / 1e3
        return TurnStats(prompt_tokens=plan.prompt_tokens, completion_tokens=len(completion), prefill_s=prefill_s,
                         decode_s=decode_s, ttft_s=ttft, tok_per_s=len(step_ms) / decode_s if decode_s else 0.0,
                         finish_reason=finish, cache=self._cache_snapshot(), step_ms=tuple(step_ms),
                         prefill_tokens=len(plan.suffix), reused_tokens=plan.reused)
