"""The one-token decode step replayed from CUDA graphs (issue 6: the eager step is host-bound).

`DecodeRunner.step(state, token)` runs the model's static one-token step (`decode_begin`, each
block's `decode_attention` and `decode_ffn`, `logits`) — static shapes, the position in device
tensors, routed experts read from the expert arena through its slot table — so on CUDA the
step can be captured once and replayed. Three modes:

- **whole** (every expert the model routes, not the MTP block's, resident in the arena, e.g. after
  `StreamingExperts.load_all`): one graph per step, no host round trip inside it; the routes of
  all layers are copied to the host once (asynchronously, into pinned memory) and counted by the
  provider (statistics, every layer in one `record_routes` call) and `on_routes` only after the
  *next* step has been launched, so that this host work overlaps that step on the GPU instead of
  idling it. A chunk step's routes (every layer's distinct experts) wait one step more: the
  decode step launched right after a prefill is the one whose token the host reads first, and
  counting them then delayed the first token by milliseconds. `settle()` counts every step's
  routes not counted yet: call it before anything evicts experts, and when a turn ends.
  Checked every step: after a flush the runner goes layered until the pool is resident again
  (the main layers' experts, which its own misses bring back: `provider.all_resident`).
- **layered** (a bounded expert cache): one graph per segment between routing decisions —
  [embed, block 0 attention half], [block i FFN half, block i+1 attention half], ..., [last FFN
  half, head]. Between segments the host reads the layer's routed experts (one small copy) and
  `provider.acquire` makes them resident in the arena before their segment runs; when they are
  all resident already with no read pending (`provider.resident`: a warm cache's common case),
  the segment is launched first (the slot table sent if a hint wrote it) and `acquire` does its
  bookkeeping (lookups, holds, hints' accounting; the same calls in the same order) while the
  device runs it, so that host work is not an idle gap of the device per layer. Each layer's
  picks are copied to the host right behind the segment that makes them (not when the host asks
  for them, after the layer before's bookkeeping), so the device's idle time at a boundary is the
  host's wake-up and launch. Hash layers' experts follow from the token id: they are hinted
  (`provider.prefetch`) once segment 0, which reads no routed expert, is launched, with a fence
  taken before that launch, so their reads overlap it; a sampled token still on the device is
  copied to the host before that launch and waited for only after it, so segment 0 is queued
  behind the sampler while the host waits for the sampler alone.
  With router lookahead (`Transformer.lookahead`), segment i also computes layer i+1's predicted
  experts (`Transformer.predict_next`, in the graph, beside layer i's route: one host read for
  both). Once layer i's experts are held and segment i+1 is launched, they go to
  `provider.prefetch_predicted` with a fence taken before that launch: the hint's bookkeeping
  runs on the host while segment i+1 runs on the device, and its reads wait only for the work
  before the fence (segment i+1 reads only layer i's experts, which are held until the hint
  is issued), so they overlap segment i+1 (layer i's FFN and layer i+1's attention).
- **guessed whole** (a bounded cache, with `guesses`: engine/step_guess.py decides when): the
  layered step's host round trips only confirm what the cache holds when it holds every expert
  the step routes to, so the step replays the whole graph instead, its kernels reading every
  routed expert through the slot table (an expert not resident reads slot 0: a wrong value, no
  fault). Its routes come back to the host between the blocks and the head, and
  `provider.first_missing` checks them. All resident: the step stands, its routes pending as a
  whole step's (counted while the next step's blocks run, or by `settle()`, which anything that
  evicts calls first: here the cache can evict). Else the tensors the step rewrote in place are
  restored (`SequenceState.rewritten`, saved before an emitting step) and the step runs again
  layered at the same position, which rewrites everything else the guess wrote. A guess waits for no
  pending read: it is not made while one is pending (`provider.reading()`), since that slot may
  not hold its bytes yet. Checked at once, the host waits for the blocks, and the host work
  between this step and the next (a turn's sampler, detokenising, the next launch) is then an
  idle gap of the device: `step(..., defer=True)` (a chat turn's decode steps) returns the
  logits unchecked instead, and `confirm()`, which the caller must call before the next step and
  before it trusts a token drawn from them, checks the routes, waiting only for what the blocks
  have not finished; a wrong guess is redone there, and `confirm()` returns the redone logits,
  from which the caller draws again. `settle()` (anything that evicts) checks it too, its redo's
  logits kept for `confirm()`.

A step's control flow depends on one host-known fact: which compression ratios complete a
window at this token (`Transformer.emitting`: none, 4, or 4 and 128). Only those steps pool
compressed entries, so the runner keeps one graph set per pattern (at most three) and mode. Graphs
capture tensor addresses: the sets are captured on a *home*'s state buffers
(engine/graph_homes.py: one per shape signature, i.e. per compressed-cache capacity), and a state
is moved into its home before it steps, so another conversation or snapshot of the same capacity
replays the same graphs; the warm-up's decode steps leave a home and its sets for every capacity
bucket. The step that needs a missing set runs eagerly (it also compiles any kernel it needs)
and the set is captured right after it for the following steps. All sets share one memory pool:
they never run concurrently, and each set's outputs are read before another set replays.
On the CPU the same step runs eagerly (no graphs): the tests check it against
`Transformer.forward`.

The **chunk step** (`DecodeRunner.chunk`) prefills 1..CHUNK_SLOTS tokens in one static step of
CHUNK_SLOTS token slots: every position-dependent index is computed on the host
(engine/chunk_position.py), so its graph set ("chunk" in `Home.sets`: the blocks, then the
head) is captured once per home and replays at any position and length. It runs whole: with
every expert resident, or through a bounded cache guessed whole like a decode step (a wrong
guess restores what the chunk wrote that its tokens would read again, and runs them as decode
steps): a follow-up turn's few new tokens then cost a step or two, not an eager chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine.chunk_position import CHUNK_SLOTS
from engine.experts.provider import ExpertProvider
from engine.graph_homes import HOMES, GraphHomes
from engine.lanes import Lanes
from engine.model import DecodeCarry, Transformer
from engine.moe import Cells
from engine.state import SequenceState, copies
from engine.step_guess import StepGuess


@dataclass
class _Outputs:
    """A step's static intermediates: the carries between segments and the logits."""

    carry: list[DecodeCarry | None]
    final: torch.Tensor | None = None  # [1, n_hc, D] the streams after the last block
    logits: torch.Tensor | None = None
    # layer -> [1, 2k] its routed ids, then layer + 1's predicted ids (router lookahead)
    picks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Unchecked:
    """A guessed decode step whose routes are not checked yet (by `DecodeRunner.step` itself, or
    with `defer=True` by `confirm`): what the check needs, and the redo when its guess was wrong."""

    state: SequenceState
    pos: int  # its position (state.pos has moved past it)
    token: torch.Tensor | int  # its input (a device token stays referenced: the redo reads it)
    logits: bool
    host: torch.Tensor  # its routes [n_layers, k], on their way to the host (`event`)
    event: object
    rewritten: list[torch.Tensor]  # what an emitting step rewrote in place, and the copies saved before it
    saved: list[torch.Tensor]


@dataclass
class _GraphSet:
    """The captured graphs of one emission pattern, and the output tensors they write."""

    graphs: list
    out: _Outputs


class DecodeRunner:
    """One-token decode steps of `model` with experts from `provider.arena` (module docstring)."""

    def __init__(self, model: Transformer, provider: ExpertProvider, whole: bool, graphs: bool | None = None,
                 on_routes: Callable[[int, int, list[int]], None] | None = None, homes: int = HOMES,
                 lanes: Lanes | None = None, guesses: StepGuess | None = None):
        """`whole`: use one graph per step while every expert is resident (else one per layer);
        `on_routes(layer, position, expert ids)` observes every routing decision of a step (the
        provider counts the uses itself, in `acquire` and `record_routes`); `homes`: graph homes kept
        (engine/graph_homes.py `homes_for`); `lanes`: where a step's work off its chain of kernels
        runs (engine/lanes.py), None: side streams on the model's device; `guesses`: when a step
        through a bounded cache runs whole on the guess that its experts are resident
        (engine/step_guess.py), None: never."""
        self.model, self.provider, self.prefer_whole, self.on_routes = model, provider, whole, on_routes
        self.guesses = guesses
        self.whole = whole  # the mode of the current step
        self.device = model.embed.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; run the decode step eagerly on the CPU")
        # One side stream for every eager first step and capture: cuBLAS keeps a workspace per
        # stream it has run on (32 MiB on the H200), so a fresh stream per capture held up to 33 of
        # them (1.03 GiB) until the process ended.
        self._side = torch.cuda.Stream(self.device) if self.graphs else None
        # the step's side lanes (engine/lanes.py): work off its chain of kernels, on CUDA
        self.lanes = Lanes(self.device) if lanes is None else lanes
        self.ids = torch.zeros(1, dtype=torch.long, device=self.device)  # static inputs
        self.at = model.decode_position(self.device)  # static position inputs, set per step
        # Per home (state buffers of one capacity), one graph set per mode and emission pattern
        # (which compression ratios complete a window at this token: none, 4, or 4 and 128): the
        # step's control flow differs only in that. Home.sets: (whole, emitting) -> _GraphSet.
        self.homes = GraphHomes(homes)
        self._pool = None  # the graph memory pool every set shares (module docstring)
        self.captures = 0  # graph sets captured so far
        self.capture_error: str | None = None  # why graphs were given up, if they were
        # whole-mode steps' routes not counted yet, oldest first (at most a chunk step's and the
        # decode step's after it): (positions, host [n_layers, k] or a chunk step's
        # [n_layers, CHUNK_SLOTS, k], CUDA event or None)
        self._pending: deque[tuple[list[int], torch.Tensor, object]] = deque()
        # a guessed step returned unchecked (`step(..., defer=True)`), until `confirm` or `settle`
        # checks it; the logits of its redo when its guess was wrong, until `confirm` hands them over
        self._unchecked: _Unchecked | None = None
        self._redone: torch.Tensor | None = None
        # the pinned buffers and events of `_to_host`, one per key (by default the shape): a chunk
        # step's routes and the next decode step's are pending together, never two of one shape
        self._routes_host: dict[tuple, tuple[torch.Tensor, torch.cuda.Event]] = {}
        # hash layers know their experts from the token id: layered mode reads them ahead
        # (layers 0..n_hash_layers-1: ModelArgs.is_hash_layer)
        self._hashed = [(b.layer, b.ffn.gate.tid2eid_host) for b in model.blocks if b.ffn.gate.hash]
        self._lookahead = model.lookahead and provider.cache is not None  # router lookahead in layered steps
        self.chunk_at = model.chunk_position(CHUNK_SLOTS, self.device)  # a chunk step's static inputs
        # layered steps: each layer's picks on their way to the host (`_send_routes`: `_to_host`
        # with a buffer per layer and width)
        self._sent: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    # ------------------------------------------------------------------ segments
    def _segment(self, i: int, state: SequenceState, emitting: frozenset[int], out: _Outputs) -> None:
        """Segment i of the step: FFN half of block i-1 (if any), then the attention half of
        block i; after the last block, its streams go to `out.final` (the head is `_head`).
        Reads/writes `out`."""
        blocks = self.model.blocks
        following = blocks[i].hc_attn if i < len(blocks) else None  # its mHC pre fused into the post before
        if i == 0:
            streams, pre = self.model.decode_begin(self.ids), None
        else:
            streams, pre = blocks[i - 1].decode_ffn(out.carry[i - 1], self.provider.arena, self.lanes, following)
        if i < len(blocks):
            out.carry[i] = blocks[i].decode_attention(streams, self.ids, self.at, state.layers[i], emitting,
                                                      self.lanes, pre)
            if self._lookahead and not self.whole:
                predicted = self.model.predict_next(i, out.carry[i].hidden, self.ids)
                if predicted is not None:
                    out.picks[i] = torch.cat((out.carry[i].routed[0], predicted), dim=1)
        else:
            out.final = streams

    def _head(self, out: _Outputs) -> None:
        out.logits = self.model.logits(out.final)

    def _send_routes(self, out: _Outputs, layer: int) -> None:
        """Start copying `layer`'s picks (routed ids, then the predicted ones with lookahead) to
        the host, queued right behind the segment that makes them: the copy runs as soon as that
        segment ends, while the host does the layer before's bookkeeping (`_routes` waits for it)."""
        picks = out.picks.get(layer)
        src = out.carry[layer].routed[0] if picks is None else picks  # [1, k] or [1, 2k]
        self._sent[layer] = self._to_host(src, ("picks", layer, src.shape[1]))

    def _routes(self, out: _Outputs, layer: int) -> tuple[list[int], list[int] | None]:
        """(layer's routed ids, layer + 1's predicted ids or None): the segment boundary's one
        host wait, for the copy `_send_routes` started."""
        host, event = self._sent.pop(layer)
        if event is not None:
            event.synchronize()
        row = host[0].tolist()
        if layer in out.picks:
            ids, predicted = row[:len(row) // 2], row[len(row) // 2:]
        else:
            ids, predicted = row, None
        if self.on_routes is not None:
            self.on_routes(layer, self.at.host, ids)
        return ids, predicted

    def _run(self, out: _Outputs, segment, n_segments: int, token: torch.Tensor | int | None = None) -> bool:
        """Run segments 0..n-1 via `segment(i)`; layered mode makes each layer's routed experts
        resident (and holds them) around the segment that uses them, hands the next layer's
        predicted experts to the provider once that segment is launched, and the hash layers'
        experts of `token` to `provider.prefetch` once segment 0 (which reads no routed expert) is
        launched: a sampled token's wait (`int(token)`) overlaps that segment (module docstring).
        -> whether every layer's experts were `resident` at its turn (always in whole mode)."""
        n_blocks = len(self.model.blocks)
        every = True
        for i in range(n_segments):
            predicted = fence = None
            hash_now = i == 0 and token is not None and not self.whole and self._hashed
            if hash_now:
                fence = self.provider.fence()  # their reads need not wait for segment 0
                read_token = self._token_to_host(token)  # queued before segment 0: waits for the sampler only
            later = False  # layer i-1's experts all resident: segment i goes first, acquire's bookkeeping after
            if i and not self.whole:
                ids, predicted = self._routes(out, i - 1)
                later = self.provider.resident(i - 1, ids)
                every = every and later
                if later:  # a hint's table writes since the last acquire (engine/experts/streaming.py)
                    self.provider.arena.sync_table()
                else:
                    self.provider.acquire(i - 1, ids)
                if predicted is not None:
                    fence = self.provider.fence()  # before segment i: its reads need not wait for it
            try:
                segment(i)
                if not self.whole and i < n_blocks:
                    self._send_routes(out, i)
                if hash_now:
                    tok = read_token()  # a device token: the host waits here, segment 0 queued
                    for layer, table in self._hashed:
                        self.provider.prefetch(layer, table[tok].tolist(), fence=fence)
                if later:  # while the device runs segment i: the same lookups and holds, in the same order
                    self.provider.acquire(i - 1, ids)
                if predicted is not None:  # layer i-1's experts are held: guess layer i's
                    self.provider.prefetch_predicted(i, predicted, fence=fence)
            finally:
                if i and not self.whole:
                    self.provider.release(i - 1)
        return every

    def _token_to_host(self, token: torch.Tensor | int) -> Callable[[], int]:
        """Start copying a device token to the host (pinned buffer, event) -> a call that waits
        for that copy alone and returns the id. `int()` of a CUDA tensor would wait for the whole
        stream, segment 0 included."""
        if not isinstance(token, torch.Tensor) or token.device.type != "cuda":
            return lambda: int(token)
        host, event = self._to_host(token.reshape(1), ("token",))

        def read() -> int:
            event.synchronize()
            return int(host[0])
        return read

    def _run_eager(self, state: SequenceState, emitting: frozenset[int], logits: bool,
                   token: torch.Tensor | int, after_blocks: Callable[[_Outputs], None]) -> tuple[_Outputs, bool]:
        out = _Outputs([None] * len(self.model.blocks))
        every = self._run(out, lambda i: self._segment(i, state, emitting, out), len(self.model.blocks) + 1, token)
        after_blocks(out)
        if logits:
            self._head(out)
        return out, every

    def _capture(self, state: SequenceState, emitting: frozenset[int]) -> _GraphSet:
        """Record the graphs of one emission pattern on the current state buffers (nothing runs
        during capture). Whole mode: one graph for the blocks; layered: one per segment; then
        one for the head (a prefill token's step skips it). They share a pool."""
        n = len(self.model.blocks)
        out = _Outputs([None] * n)
        parts = [list(range(n + 1))] if self.whole else [[i] for i in range(n + 1)]

        def segments(seg: list[int]) -> Callable[[], None]:
            return lambda: [self._segment(i, state, emitting, out) for i in seg]
        return _GraphSet(self._record([segments(seg) for seg in parts] + [lambda: self._head(out)]), out)

    def _record(self, parts: list[Callable[[], None]]) -> list:
        """One CUDA graph of each of `parts` (callables queueing device work), in the shared pool."""
        self.provider.arena.sync_table()  # no table write may fall inside the capture
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graphs = []
        for part in parts:
            g = torch.cuda.CUDAGraph()
            # thread_local: the app's other threads may touch CUDA (e.g. an I/O thread's copy)
            with torch.cuda.graph(g, pool=self._pool, stream=self._side, capture_error_mode="thread_local"):
                part()
            graphs.append(g)
        self.captures += 1
        return graphs

    def _replay(self, gs: _GraphSet, logits: bool, token: torch.Tensor | int,
                after_blocks: Callable[[_Outputs], None]) -> tuple[_Outputs, bool]:
        *body, head = gs.graphs
        every = self._run(gs.out, lambda i: body[i].replay(), len(body), token)
        after_blocks(gs.out)
        if logits:
            head.replay()
        return gs.out, every

    # ------------------------------------------------------------------ routes of whole steps
    def _to_host(self, src: torch.Tensor, key: tuple = ()) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying `src` to the host, on the current stream -> (host tensor, event or None
        off CUDA): into the buffer of `key` (default: the shape; a step's routes [n_layers, k];
        pinned on CUDA), which must not still be waited on or read for an earlier copy. Off
        CUDA the copy is done when this returns, into the same buffer per key, so that the CPU
        tests see the buffers' reuse as the GPU has it."""
        key = key or tuple(src.shape)
        cuda = src.device.type == "cuda"
        if key not in self._routes_host:
            self._routes_host[key] = (torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda),
                                      torch.cuda.Event() if cuda else None)
        host, event = self._routes_host[key]
        host.copy_(src, non_blocking=cuda)
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))
        return host, event

    def settle(self) -> None:
        """Check a step returned unchecked (`confirm`; a wrong guess is redone now, its logits kept
        for `confirm`), then count the routes of every whole-mode step not counted yet
        (provider.record_routes, on_routes), oldest first, waiting for those steps if they still
        run; nothing when none is pending."""
        self._check_unchecked()
        while self._pending:
            self._count(*self._pending.popleft())

    def _settle_before_token(self) -> None:
        """`settle`, except that a chunk step's routes, pending last, stay pending: called by the
        decode step launched after that chunk, the one whose token the host reads first (the
        next step counts them, while this one runs)."""
        while self._pending and not (len(self._pending) == 1 and self._pending[0][1].dim() == 3):
            self._count(*self._pending.popleft())

    def _count(self, positions: list[int], host: torch.Tensor, event) -> None:
        """Count one step's routes `host`, once its copy (`event`) is done."""
        if event is not None:
            event.synchronize()
        layers = [rows[:len(positions)]  # a chunk step's real tokens only
                  for rows in host.view(host.shape[0], -1, host.shape[-1]).tolist()]
        # every layer in one call; a chunk's distinct experts once, as an eager chunk counts them
        self.provider.record_routes([rows[0] if len(rows) == 1 else sorted({e for ids in rows for e in ids})
                                     for rows in layers])
        if self.on_routes is not None:
            for t, position in enumerate(positions):
                for layer, rows in enumerate(layers):
                    self.on_routes(layer, position, rows[t])

    def close(self) -> None:
        """Drop every home and captured graph set (their memory pool goes with them) and the
        pinned route buffers; the runner captures anew if it steps again."""
        self.settle()
        self._redone = None  # nobody draws from a closed runner's logits
        self.homes.clear()
        self._pool = None
        self._routes_host = {}
        self._sent = {}

    # ------------------------------------------------------------------ the step
    def step(self, state: SequenceState, token: torch.Tensor | int, logits: bool = True,
             guess: bool | None = None, defer: bool = False) -> torch.Tensor | None:
        """Decode one token at state.pos -> logits [1, V] fp32 (a fresh tensor), or None without
        `logits` (a prefill token's step: the head is skipped); state.pos += 1. A whole-mode
        step's routes are counted by the next step (after its launch) or `settle()`. A step
        through a bounded cache may be guessed whole (`_guessed`, engine/step_guess.py): when
        the policy says so (`guess` None), whenever it can (True: not with every expert resident,
        without a policy or with a read pending) or never (False) — the warm-up's choice, so that
        both graph sets of each emission pattern are captured before a chat. With `defer` a
        guessed step is returned unchecked: `confirm()` must come before the next step (module
        docstring)."""
        self._refuse_unconfirmed("step")
        self.model.reserve(state, state.pos)
        complete = self._complete()
        if guess is None:  # a host token's hash-layer experts are checked too
            guess = self._guessing(None if isinstance(token, torch.Tensor) else [int(token)])
        else:
            guess = guess and self._may_guess()
        guess = guess and not complete
        self.whole = complete or guess
        if self.whole:  # no acquire sends the slot table: a hint's writes may not be on the device yet
            self.provider.arena.sync_table()
        else:
            self.settle()  # this step's provider calls come after the last one's statistics
        emitting, home = self._enter(state, token)
        if not guess:
            return self._unguessed(state, emitting, home, logits, token, observed=True)
        result = self._guessed(state, emitting, home, logits, token)
        if defer:
            return result
        redone = self.confirm()  # checked now: the host waits for the blocks
        return result if redone is None else redone

    def _enter(self, state: SequenceState, token: torch.Tensor | int) -> tuple[frozenset[int], object]:
        """A step's inputs at state.pos: the token and the position in the static buffers, a
        forced routing's position; the state moved into its graph home -> (emission pattern,
        home or None without graphs)."""
        if isinstance(token, torch.Tensor):
            self.ids.copy_(token.reshape(1))
        else:
            self.ids.fill_(int(token))
        self.at.set(state.pos)
        if self.model.routing is not None:  # forced routing (timing only): this position's ids, before the step
            self.model.routing.set_position(state.pos)
        home = self.homes.enter(state) if self.graphs else None  # state now uses the home's buffers
        return self.model.emitting(state.pos), home

    def _unguessed(self, state: SequenceState, emitting: frozenset[int], home, logits: bool,
                   token: torch.Tensor | int, observed: bool) -> torch.Tensor | None:
        """The step in the current mode, not guessed (`self.whole`: every expert resident), its
        inputs entered -> its logits or None; state.pos += 1. `observed`: the policy counts
        whether its experts were resident (not for a wrong guess's redo: `missed` counted it)."""
        out, every, _ = self._execute(state, emitting, home, logits, token)
        result = out.logits.clone() if logits else None
        routes = torch.stack([c.routed[0][0] for c in out.carry]) if self.whole else None  # [n_layers, k]
        self._capture_missing(state, home, emitting)  # after this step's results are taken
        self._settle_before_token()  # the previous step's routes, while this one runs (queued after it)
        if routes is not None:  # into the buffer the previous step's, counted now, came through
            self._pending.append(([state.pos], *self._to_host(routes)))
        if self.guesses is not None and observed:
            self.guesses.observed(every)
        state.pos += 1
        return result

    def confirm(self) -> torch.Tensor | None:
        """The verdict on a step returned unchecked (`step(..., defer=True)`), waiting for its
        routes -> None when it stands (or none is waiting), else its logits [1, V] redone layer
        by layer: whatever was drawn from the logits it returned must be drawn again from these
        (None also when the redone step had no logits: nothing was drawn from it). Call it before
        the next step."""
        self._check_unchecked()
        redone, self._redone = self._redone, None
        return redone

    def _refuse_unconfirmed(self, caller: str) -> None:
        if self._unchecked is not None or self._redone is not None:
            raise RuntimeError(f"DecodeRunner.{caller}: the last step was returned unchecked (defer=True); "
                               "call confirm() first, and draw again from the logits it returns")

    def _check_unchecked(self) -> None:
        """Check the guessed step not checked yet, if any (`_checked`); a wrong guess is redone
        layer by layer at its position, on its token, its logits kept in `_redone`."""
        u, self._unchecked = self._unchecked, None
        if u is None:
            return
        with torch.inference_mode():  # the restore and the redo write the state as its step did (Runtime.launch)
            if self._checked(u.host, u.event, [u.pos], u.rewritten, u.saved):
                return
            u.state.pos = u.pos
            self.whole = False
            self.settle()  # the steps before it, counted first
            emitting, home = self._enter(u.state, u.token)
            self._redone = self._unguessed(u.state, emitting, home, u.logits, u.token, observed=False)

    def _execute(self, state: SequenceState, emitting: frozenset[int], home, logits: bool,
                 token: torch.Tensor | int, key: tuple | None = None) -> tuple[_Outputs, bool, tuple | None]:
        """Run the step once in the current mode (`self.whole`): replayed from the home's graph
        set of this mode and emission pattern, or eagerly (with graphs on the side stream, as
        capture wants: it also compiles the kernels it needs; `_capture_missing` then captures
        the set) -> (its outputs, whether every layer's experts were resident at its turn, with
        `key` a whole step's routes [n_layers, k] on their way to the host (`_to_host` into the
        buffer of `key`), queued between the blocks and the head; else None)."""
        sent = None

        def after_blocks(out: _Outputs) -> None:
            nonlocal sent
            if key is not None:
                sent = self._to_host(torch.stack([c.routed[0][0] for c in out.carry]), key)
        gs = home.sets.get((self.whole, emitting)) if home is not None else None
        if not self.graphs:
            out, every = self._run_eager(state, emitting, logits, token, after_blocks)
        elif gs is None:
            side = self._side
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                out, every = self._run_eager(state, emitting, logits, token, after_blocks)
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            out, every = self._replay(gs, logits, token, after_blocks)
        return out, every, sent

    def _capture_missing(self, state: SequenceState, home, emitting: frozenset[int]) -> None:
        """Capture the current mode's graph set for this emission pattern if the home lacks it
        (a step just ran it eagerly)."""
        if not self.graphs or (self.whole, emitting) in home.sets:
            return
        try:
            home.sets[self.whole, emitting] = self._capture(state, emitting)
        except RuntimeError as err:  # graphs are an optimisation: decode eagerly, keep the step
            self.graphs, self.capture_error = False, f"CUDA graph capture failed, decoding eagerly: {err}"

    def _guessed(self, state: SequenceState, emitting: frozenset[int], home, logits: bool,
                 token: torch.Tensor | int) -> torch.Tensor | None:
        """The step run whole through a bounded cache, on the guess that every expert it routes
        to is resident (no read pending: the kernels read every routed expert through the slot
        table, a missing one a resident one's slot) -> its logits or None, unchecked; state.pos
        += 1. Its routes come back to the host between the blocks and the head; `_unchecked`
        holds them, with the tensors the step rewrites (`SequenceState.rewritten`, saved before
        an emitting step), for `_check_unchecked`: all resident, the routes are pending as a whole
        step's; else those tensors are restored and the step redone layer by layer, which
        rewrites every other write at the same position."""
        rewritten = state.rewritten() if emitting else []
        saved = copies(rewritten) if rewritten else []
        out, _, (host, event) = self._execute(state, emitting, home, logits, token, ("guess",))
        result = out.logits.clone() if logits else None
        self._capture_missing(state, home, emitting)
        self._settle_before_token()  # the previous step's routes, while this one's blocks run
        self._unchecked = _Unchecked(state, state.pos, token, logits, host, event, rewritten, saved)
        state.pos += 1
        return result

    def _checked(self, host: torch.Tensor, event, positions: list[int], rewritten: list[torch.Tensor],
                 saved: list[torch.Tensor], chunk: bool = False) -> bool:
        """A guessed step's verdict, once its routes `host` (a decode step's [n_layers, k], a chunk
        step's [n_layers, CHUNK_SLOTS, k]) are on the host (`event`): whether every expert the
        real tokens (`positions`) routed to was resident (`provider.first_missing`). Right: the
        routes are pending as a whole step's. Wrong: `rewritten` is restored from `saved`. The
        policy counts either (`chunk`: a chunk step's)."""
        if event is not None:
            event.synchronize()
        real = host.view(host.shape[0], -1, host.shape[-1])[:, :len(positions)]
        if self.provider.first_missing(real.reshape(host.shape[0], -1).numpy()) is None:
            self.guesses.right(chunk)
            self._pending.append((positions, host.clone(), None))  # counted as a whole step's
            return True
        self.guesses.missed(chunk)
        if rewritten:
            torch._foreach_copy_(rewritten, saved)
        return False

    # ------------------------------------------------------------------ the chunk step
    def runs_chunks(self) -> bool:
        """Whether chunk steps run on this runner at all: native numerics (the routed experts
        batched), a chunk's routed cells scheduled without a host sync (`Cells.static`), and
        every expert resident in whole mode or steps guessed whole (`guesses`)."""
        return (self.model.numerics.batched_experts
                and Cells.static(CHUNK_SLOTS * self.model.args.n_activated_experts, self.provider.arena.table.shape[1])
                and (self._complete() or self.guesses is not None))

    def can_chunk(self, ids: Sequence[int] | None = None) -> bool:
        """Whether `chunk` runs now (on tokens `ids`, when given): `runs_chunks`, and every expert
        resident in whole mode, or through a bounded cache a step guess ready (`_guessing`: the
        chunk is then guessed whole)."""
        return self.runs_chunks() and (self._complete() or self._guessing(ids))

    def can_force_chunk(self) -> bool:
        """Whether `chunk(..., force=True)` runs now: `runs_chunks`, and a guess, whatever the
        policy says, reads no slot whose read is pending (`_may_guess`)."""
        return self.runs_chunks() and (self._complete() or self._may_guess())

    def _complete(self) -> bool:
        """Every expert resident, and the runner prefers one graph a step then."""
        return self.prefer_whole and self.provider.all_resident()

    def _guessing(self, ids: Sequence[int] | None = None) -> bool:
        """A step through a bounded cache runs whole on the guess that its experts are resident:
        the policy says so, no read is pending (that slot may not hold its bytes yet), and with
        the step's token `ids` known on the host, the hash layers' experts of those tokens are
        resident (without them the guess is wrong for certain: no step is wasted on it, and the
        policy does not back off; the layered step then taken breaks its streak, as any step
        that misses does)."""
        return self._may_guess() and self.guesses.ready() and (ids is None or self._hash_resident(ids))

    def _may_guess(self) -> bool:
        """Whether a step could be guessed whole now, whatever the policy says: there is a policy
        (a bounded cache with EngineConfig.guess_whole_steps), and no read is in flight
        (`provider.reading`: that slot may not hold its bytes yet)."""
        return self.guesses is not None and not self.provider.reading()

    def _hash_resident(self, ids: Sequence[int]) -> bool:
        """Whether the hash layers' experts of tokens `ids` (layers 0.., from the token ids:
        `Gate.tid2eid_host`) are all resident, their reads landed (`provider.first_missing`)."""
        if not self._hashed:
            return True
        tokens = torch.as_tensor(ids, dtype=torch.long)
        rows = torch.stack([table[tokens].reshape(-1) for _, table in self._hashed])  # [hash layers 0.., n·k]
        return self.provider.first_missing(rows.numpy()) is None

    def _chunk_body(self, state: SequenceState, out: _Outputs) -> None:
        """Every block on the chunk's token slots (`Block.chunk_attention`, `chunk_ffn`), the
        routed experts read through a copy of the slot table in which a missing expert has slot
        0 (made in the step, so a replay reads the table of its time): a guessed chunk reads a
        wrong record for it, never memory outside the arena."""
        at, streams, pre = self.chunk_at, self.model.decode_begin(self.chunk_at.ids), None
        arena = self.provider.arena
        table = arena.table.clamp_min(0)
        blocks = self.model.blocks
        for i, block in enumerate(blocks):
            out.carry[i] = block.chunk_attention(streams, at, state.layers[i], self.lanes, pre)
            following = blocks[i + 1].hc_attn if i + 1 < len(blocks) else None
            streams, pre = block.chunk_ffn(out.carry[i], arena, table, self.lanes, following)
        out.final = streams

    def _chunk_head(self, out: _Outputs) -> None:
        out.logits = self.model.logits(out.final.index_select(0, self.chunk_at.last))

    def chunk(self, state: SequenceState, ids: list[int], logits: bool = True,
              force: bool = False) -> torch.Tensor | None:
        """Prefill `ids` (1..CHUNK_SLOTS tokens) at state.pos in one static step of CHUNK_SLOTS
        token slots (engine/chunk_position.py), replayed from one graph per home whatever the
        position -> logits [1, V] fp32 of the last token (a fresh tensor), or None without
        `logits`; state.pos += len(ids). Needs `can_chunk()`, or with `force` (the warm-up: its
        kernels and graphs made before the first turn) `can_force_chunk()`. Its routes are
        counted as a whole step's are (`settle`): each layer's distinct experts once, as an eager
        chunk's; each token's route to `on_routes`.

        Through a bounded cache the chunk is guessed whole, as a decode step is (`_guessed`):
        its real tokens' routes come back between the blocks and the head; all resident, the
        chunk stands; else what it wrote that its tokens, run again one by one, would read
        before rewriting is restored (`SequenceState.chunk_rewritten`: the window rings, the
        compressors' buffers and previous halves, the entries left open) and its tokens run again
        as decode steps (`step`: layer by layer unless the policy, having counted the miss, is
        ready to guess again)."""
        self._refuse_unconfirmed("chunk")
        if not (self.can_force_chunk() if force else self.can_chunk(ids)):
            raise RuntimeError("DecodeRunner.chunk needs native numerics and every expert resident, or a "
                               "step guess ready through a bounded cache")
        p0, n = state.pos, len(ids)
        self.model.reserve(state, p0 + n)  # the entry the chunk leaves open takes its unused windows
        guess = not self._complete()
        self.whole = True
        self.provider.arena.sync_table()
        self.chunk_at.set(p0, ids)
        if self.model.routing is not None:  # forced routing (timing only): the slots' ids, before the step
            self.model.routing.set_chunk(p0)
        home = self.homes.enter(state) if self.graphs else None  # state now uses the home's buffers
        if guess:
            rewritten = state.chunk_rewritten(p0 + n)
            saved = copies(rewritten)
        gs = home.sets.get("chunk") if home is not None else None
        out = gs.out if gs is not None else _Outputs([None] * len(self.model.blocks))
        sent = None

        def body() -> None:
            nonlocal sent
            if gs is None:
                self._chunk_body(state, out)
            else:
                gs.graphs[0].replay()
            if guess:  # the real tokens' routes to the host, queued before the head
                sent = self._to_host(torch.stack([c.routed[0] for c in out.carry]), ("guess", "chunk"))
            if logits:
                if gs is None:
                    self._chunk_head(out)
                else:
                    gs.graphs[1].replay()
        if self.graphs and gs is None:
            side = self._side
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # eagerly, off the default stream; compiles its kernels
                body()
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            body()
        result = out.logits.clone() if logits else None
        routes = None if guess else torch.stack([c.routed[0] for c in out.carry])  # [n_layers, CHUNK_SLOTS, k]
        if self.graphs and gs is None:
            try:
                cap = _Outputs([None] * len(self.model.blocks))
                home.sets["chunk"] = _GraphSet(self._record([lambda: self._chunk_body(state, cap),
                                                             lambda: self._chunk_head(cap)]), cap)
            except RuntimeError as err:
                self.graphs, self.capture_error = False, f"CUDA graph capture failed, decoding eagerly: {err}"
        self.settle()  # the previous steps' routes, while this one runs
        positions = list(range(p0, p0 + n))
        if not guess:
            self._pending.append((positions, *self._to_host(routes)))
            state.pos = p0 + n
            return result
        if self._checked(*sent, positions, rewritten, saved, chunk=True):
            state.pos = p0 + n
            return result
        for i, token in enumerate(ids):  # redone token by token
            result = self.step(state, token, logits=logits and i == n - 1)
        return result


def make_runner(model: Transformer, provider: ExpertProvider, device: torch.device, enabled: bool,
                on_routes: Callable[[int, int, list[int]], None] | None = None,
                on_loaded: Callable[[int, int], None] | None = None, homes: int = HOMES,
                guess: bool = True) -> DecodeRunner | None:
    """The graph runner for an engine, or None when decode stays eager: not CUDA, numerics that
    decode eagerly (exact: `Numerics.decode_graphs`), graphs disabled, or a provider without a
    device slot table. Reads every expert into the arena first when the cache budget holds the
    whole pool (then one graph per step), reporting `on_loaded(units done, units)`. `guess`:
    steps through a bounded cache may run whole on the guess that their experts are resident
    (engine/step_guess.py)."""
    if not enabled or device.type != "cuda" or not model.numerics.decode_graphs:
        return None
    if provider.arena is None:
        return None
    guesses = StepGuess() if guess and provider.cache is not None else None
    return DecodeRunner(model, provider, whole=provider.load_all(on_loaded), on_routes=on_routes, homes=homes,
                        guesses=guesses)
