"""Fixed state buffers that captured decode graphs address, so graphs outlive a conversation.

A CUDA graph records tensor addresses. The decode step reads and writes a sequence state's
buffers (`engine.state.LayerState.tensors()`), so a graph captured on one conversation's state
cannot run another's: without homes, every new conversation, regenerated answer or restored
snapshot captured the step again (at 43 layers an eager step and a capture for each of the
step's control flows, a few hundred milliseconds at the start of each answer).

A *home* is one set of state buffers per shape signature (the shape and dtype of every state
tensor: the compressed caches' capacities). `GraphHomes.enter(state)` makes `state` the home's
occupant before a step: a state whose buffers are already the home's (the usual case: the same
conversation decoding on) costs an identity check; another state of the same signature is copied
into the home's buffers, which it then uses as its own (`LayerState.use`), and the previous
occupant, if it still uses them, first gets copies of its own (its values are unchanged). The
first state of a new signature lends its own buffers: it becomes the home. The graph sets
captured on a home's buffers live in `Home.sets` (the runner's) and go with the home.

Memory: a home's buffers are some state's own while it is the occupant; a vacant home (its last
occupant grew, or ended) keeps one state's buffers of its signature. Each captured graph set
also holds device memory outside the caching allocator (engine/memory_plan.py counts it), so at
most `limit` homes are kept (`homes_for`: one per decode capacity of the context), the least
recently entered dropped first with its graph sets.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.buckets import decode_capacities
from engine.config import ModelArgs
from engine.state import SequenceState, copies


def _buffers(state: SequenceState) -> list[torch.Tensor]:
    return [t for layer in state.layers for t in layer.tensors()]


def signature(state: SequenceState) -> tuple:
    """The shapes and dtypes of every tensor a decode step of `state` addresses."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in _buffers(state))


@dataclass
class Home:
    """The buffers of one signature, their current occupant and the graph sets captured on them."""

    buffers: list[torch.Tensor]  # in `_buffers` order
    occupant: weakref.ref  # the state using `buffers` (dead, or moved on, when vacant)
    sets: dict = field(default_factory=dict)  # the runner's graph sets, by control flow

    def held_by(self, state: SequenceState) -> bool:
        """True when `state` uses exactly these buffers."""
        current = _buffers(state)
        return len(current) == len(self.buffers) and all(a is b for a, b in zip(current, self.buffers))


def _use(state: SequenceState, buffers: list[torch.Tensor]) -> None:
    """Make `state` use `buffers` (`_buffers` order), layer by layer."""
    at = 0
    for layer in state.layers:
        n = len(layer.tensors())
        layer.use(buffers[at:at + n])
        at += n


# Homes kept at least: every capacity bucket of the default context (16..2048 entries at
# max_seq_len 4096). A capacity whose home was dropped captures its graphs again on first use:
# its first steps of each control flow run eagerly and are captured, ~0.3 s with every expert
# resident and ~0.8 s with streamed experts (one graph per layer) at 43 layers on the H200.
HOMES = 8


def homes_for(args: ModelArgs, max_seq_len: int) -> int:
    """Homes an engine keeps: one per decode capacity up to `max_seq_len` (the warm-up captures
    each), at least HOMES."""
    return max(HOMES, len(decode_capacities(args, max_seq_len)))


class GraphHomes:
    """The homes of one decode runner (module docstring)."""

    def __init__(self, limit: int = HOMES):
        if limit < 1:
            raise ValueError("GraphHomes needs room for at least one home")
        self.limit = limit
        self._homes: OrderedDict[tuple, Home] = OrderedDict()
        self._last: Home | None = None  # the home entered last
        self.moves = 0  # states copied into a home (for tests and statistics)

    def __len__(self) -> int:
        return len(self._homes)

    def enter(self, state: SequenceState) -> Home:
        """The home of `state`'s signature, with `state` using its buffers (module docstring)."""
        last = self._last
        if last is not None and last.occupant() is state and last.held_by(state):
            return last
        key = signature(state)
        home = self._homes.get(key)
        if home is None:
            home = Home(_buffers(state), weakref.ref(state))
            self._homes[key] = home
            while len(self._homes) > self.limit:
                self._homes.popitem(last=False)
        else:
            self._homes.move_to_end(key)
            if not home.held_by(state):
                self._move_in(home, state)
        home.occupant = weakref.ref(state)
        self._last = home
        return home

    def _move_in(self, home: Home, state: SequenceState) -> None:
        previous = home.occupant()
        if previous is not None and home.held_by(previous):  # it keeps its values in buffers of its own
            _use(previous, copies(home.buffers))
        torch._foreach_copy_(home.buffers, _buffers(state))  # one batched copy, as engine/state.py `copies`
        _use(state, home.buffers)
        self.moves += 1

    def clear(self) -> None:
        """Drop every home and the graph sets captured on it (the states keep their buffers)."""
        self._homes.clear()
        self._last = None
