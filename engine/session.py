"""A chat session: its messages, its per-sequence state, and snapshots for rewinding (spec §D.3).

KV reuse works on the rendered prompt text. Every `Snapshot` pairs a `SequenceState` with the
token ids it has processed and the exact text those ids stand for (prompt text as rendered +
generated text as decoded). A new turn renders the whole conversation (engine.chat) and looks
for the snapshot with the longest text that is a prefix of the new prompt: only the rest is
tokenised and prefilled, and the kept ids — including a completion's generated ids, never
re-tokenised — stay in front. The cut between kept text and new text always sits next to a
special token (BOS, EOS, `<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`), where the tokenizer
splits anyway, so kept ids + encode(rest) is exactly the from-scratch tokenisation of the rest.

A snapshot may also hold `pending` ids (covered by its text but not yet run through the model:
the last sampled token of a turn, typically EOS) and the logits of its last processed position
(so a prompt already fully processed, as in regenerate, needs no prefill at all).

Snapshots kept: the live state; per turn a copy at the turn's start (undo), one after the
prompt (regenerate) and, in thinking mode, one just before the final `<think>` (the next turn
drops the reasoning and continues from there, §F.2). Only snapshots whose text is a prefix of
the live text are kept, at most `max_snapshots`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.chat import (ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, THINK_END, THINK_START, USER_TOKEN, Message,
                         render_messages)
from engine.state import SequenceState

MARKERS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, THINK_START, THINK_END)


class SessionError(ValueError):
    """A session operation that cannot be done now (nothing to undo, foreign session, …)."""


@dataclass
class Snapshot:
    """A state together with the ids it processed and the text those ids (+ pending) encode."""

    text: str
    ids: list[int]
    state: SequenceState
    pending: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [V] fp32 of the last processed position, if kept

    def copy(self) -> "Snapshot":
        """An independent copy (the state is cloned; logits are immutable and shared)."""
        return Snapshot(self.text, list(self.ids), self.state.clone(), list(self.pending), self.logits)

    @property
    def length(self) -> int:
        """Tokens the text stands for: processed + pending."""
        return len(self.ids) + len(self.pending)

    def nbytes(self) -> int:
        n = self.state.nbytes()
        if self.logits is not None:
            n += self.logits.numel() * self.logits.element_size()
        return n


@dataclass(frozen=True)
class Plan:
    """How to reach a prompt: start from `base` (live if `from_live`) and process `suffix`."""

    base: Snapshot
    from_live: bool
    suffix: list[int]
    reused: int  # len(base.ids) when planned (the live base is then extended in place)

    @property
    def prompt_tokens(self) -> int:
        return self.reused + len(self.suffix)


def _closed_engine() -> SequenceState:
    raise SessionError("the engine that owned this session is closed")


def _clean_cut(kept: str, rest: str) -> bool:
    """True if tokenising `rest` on its own matches tokenising it after `kept`."""
    return not kept or not rest or kept.endswith(MARKERS) or rest.startswith(MARKERS)


class Session:
    """One conversation. Create with `Engine.new_session`; the engine drives the turns."""

    def __init__(self, new_state: Callable[[], SequenceState], system: str | None = None,
                 history: Sequence[Message] = (), owner: object = None, max_snapshots: int = 8) -> None:
        for m in history:
            if not isinstance(m, Message) or m.role == "system":
                raise SessionError("history must be engine.chat.Message objects with role user or assistant; "
                                   "pass the system prompt as system=")
        self._new_state = new_state
        self.owner = owner
        self.max_snapshots = max_snapshots
        self.system: str | None = system or None
        self.messages: list[Message] = list(history)
        self.live = self._empty()
        self.answering = False  # one of its turns has started and not ended (engine.turn.Turns.run: one at a time)
        self.snapshots: list[Snapshot] = []
        # (the live snapshot, its copy made between turns by `spare_live`), for `live_copy`
        self._spare: tuple[Snapshot, Snapshot] | None = None

    # ------------------------------------------------------------------------ properties
    @property
    def position(self) -> int:
        """Tokens processed into the live state."""
        return len(self.live.ids)

    @property
    def ids(self) -> list[int]:
        """Token ids of the conversation so far: processed + pending (a copy)."""
        return self.live.ids + self.live.pending

    @property
    def state(self) -> SequenceState:
        return self.live.state

    def nbytes(self) -> int:
        """Bytes of the live state, its spare copy and every snapshot (for the memory budget)."""
        spare = self._spare[1].nbytes() if self._spare is not None else 0
        return self.live.nbytes() + spare + sum(s.nbytes() for s in self.snapshots)

    # ------------------------------------------------------------------------ the live state's copy
    def spare_live(self) -> None:
        """Copy the live snapshot now, between turns (a turn has just ended): the next turn that
        continues it takes the copy as its undo point (`live_copy`), so that the copy's host work
        (a state's ~270 buffers at 43 layers) is not on the path of that turn's first token. The
        copy is as large as the live state; it is counted by `nbytes`."""
        self._spare = (self.live, self.live.copy()) if self.live.length else None

    def live_copy(self) -> Snapshot:
        """An independent copy of the live snapshot: the one `spare_live` made, if the live
        snapshot is still the one it copied (it is handed out once; a turn that changes the live
        state drops it in `start`), else a new one."""
        spare, self._spare = self._spare, None
        return spare[1] if spare is not None and spare[0] is self.live else self.live.copy()

    # ------------------------------------------------------------------------ conversation
    def conversation(self, messages: Sequence[Message] | None = None) -> list[Message]:
        """The system message (if any) followed by `messages` (default: the session's)."""
        msgs = list(self.messages if messages is None else messages)
        return ([Message("system", self.system)] if self.system else []) + msgs

    def stable_text(self, messages: Sequence[Message] | None = None) -> str:
        """The text every future prompt of this conversation starts with (earlier assistant
        turns render without reasoning in both chat and thinking mode with drop_thinking)."""
        convo = self.conversation(messages)
        return render_messages(convo, thinking=False) if convo else BOS_TOKEN

    def set_system(self, text: str | None) -> None:
        """Set the system prompt. With turns already taken this resets the session."""
        if self.messages or self.live.length:
            self.reset()
        self.system = text or None

    def reset(self) -> None:
        """Forget every message and all state (the system prompt stays)."""
        self.messages = []
        self.live = self._empty()
        self.snapshots = []
        self._spare = None

    def release(self) -> None:
        """Give back the device memory of the live state and every snapshot (the engine that
        owns the session is closing); the messages and token ids stay readable, the session cannot run
        again."""
        live = self.live
        self.snapshots, self._spare = [], None
        self.live = Snapshot(live.text, live.ids, SequenceState(layers=[]), live.pending)
        self._new_state = _closed_engine

    def _empty(self) -> Snapshot:
        return Snapshot("", [], self._new_state())

    # ------------------------------------------------------------------------ planning
    def candidates(self) -> list[tuple[Snapshot, bool]]:
        """(snapshot, is_live) for the live state and every snapshot."""
        return [(self.live, True)] + [(s, False) for s in self.snapshots]

    def plan(self, text: str, encode: Callable[[str], list[int]]) -> Plan:
        """The cheapest way to have processed the prompt `text` (mutates nothing)."""
        best: Plan | None = None
        for snap, live in self.candidates():
            if not text.startswith(snap.text) or not _clean_cut(snap.text, text[len(snap.text):]):
                continue
            rest = text[len(snap.text):]
            suffix = snap.pending + (encode(rest) if rest else [])
            if not suffix and snap.logits is None:
                continue  # nothing to run, and no logits to sample the first token from
            if best is None or len(snap.ids) > len(best.base.ids):
                best = Plan(snap, live, suffix, len(snap.ids))
        if best is None:
            best = Plan(Snapshot("", [], self._new_state()), False, encode(text), 0)
        return best

    def start(self, plan: Plan) -> Snapshot:
        """The working snapshot for a turn following `plan` (a copy unless it is the live one)."""
        if plan.from_live:
            self._spare = None  # the turn changes the live state: a copy made before is stale
            return self.live
        if not plan.base.ids and not plan.base.pending:
            return plan.base  # a fresh state made by `plan`
        return plan.base.copy()

    def keep(self, snap: Snapshot) -> None:
        """Remember `snap` for later rewinds (the caller hands over a copy)."""
        self.snapshots.append(snap)
        self._trim()

    def commit(self, live: Snapshot, messages: list[Message]) -> None:
        """Make `live` the session's state and `messages` its conversation; prune snapshots."""
        self.live = live
        self.messages = messages
        self._spare = None
        self.snapshots = [s for s in self.snapshots if live.text.startswith(s.text) and s is not live]
        self._trim()

    def rewind(self, messages: list[Message]) -> None:
        """Set the conversation to `messages` (a prefix of the current one) and the live state to
        the best snapshot for it (or empty). Snapshots beyond it are dropped."""
        target = self.stable_text(messages)
        best: Snapshot | None = None
        for snap, _ in self.candidates():
            if target.startswith(snap.text) and _clean_cut(snap.text, target[len(snap.text):]):
                if best is None or len(snap.ids) > len(best.ids):
                    best = snap
        self.messages = messages
        if best is None:
            self.live, self._spare = self._empty(), None
        elif best is not self.live:
            self.live, self._spare = best.copy(), None
        self.snapshots = [s for s in self.snapshots if target.startswith(s.text)]

    def _trim(self) -> None:
        if len(self.snapshots) > self.max_snapshots:
            self.snapshots.sort(key=lambda s: len(s.ids))
            del self.snapshots[: len(self.snapshots) - self.max_snapshots]
