"""The one-token decode step replayed from CUDA graphs (issue 6: the eager step is host-bound).

`DecodeRunner.step(state, token)` runs `Transformer.decode` — static shapes, the position in a
device tensor, routed experts read from the expert arena through its slot table — so on CUDA
the step can be captured once and replayed. Two modes:

- **whole** (every expert of every layer resident in the arena, e.g. after
  `StreamingExperts.load_all`): one graph per step, no host round trip inside it; afterwards the
  routes of all layers are copied to the host once and counted by the provider (statistics).
- **layered** (a bounded expert cache): one graph per segment between routing decisions —
  [embed, block 0 attention half], [block i FFN half, block i+1 attention half], ..., [last FFN
  half, head]. Between segments the host reads the layer's routed experts (one small copy) and
  `provider.acquire` makes them resident in the arena before their segment runs; hash layers'
  experts follow from the token id, so their reads start with the step (`provider.prefetch`).

Graphs capture tensor addresses, so the runner re-captures when the sequence state's buffers
change identity (another conversation or snapshot, or `LayerState.reserve` growing the
compressed caches — geometric, so rarely). The step that triggers a capture runs eagerly (it
also compiles any kernel it needs) and the captured graphs serve the following steps. On the
CPU the same step runs eagerly (no graphs): the tests check it against `Transformer.forward`.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine.model import DecodeCarry, Transformer
from engine.state import SequenceState


class ArenaProvider(Protocol):
    """The expert provider side the runner needs (engine.experts.provider.StreamingExperts)."""

    arena: object  # engine.experts.arena.ExpertArena

    def acquire(self, layer: int, ids: list[int]) -> None: ...

    def release(self, layer: int) -> None: ...

    def prefetch(self, layer: int, ids: list[int]) -> None: ...

    def record(self, layer: int, ids: list[int]) -> None: ...


class DecodeRunner:
    """One-token decode steps of `model` with experts from `provider.arena` (module docstring)."""

    def __init__(self, model: Transformer, provider: ArenaProvider, whole: bool, graphs: bool | None = None,
                 on_routes: Callable[[int, int, list[int]], None] | None = None):
        """`on_routes(layer, position, expert ids)` observes every routing decision of a step."""
        self.model, self.provider, self.whole, self.on_routes = model, provider, whole, on_routes
        self.device = model.embed.device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; run the decode step eagerly on the CPU")
        self.ids = torch.zeros(1, dtype=torch.long, device=self.device)  # static inputs
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        n = len(model.blocks)
        self._carry: list[DecodeCarry | None] = [None] * n  # static intermediates between segments
        self._logits: torch.Tensor | None = None
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._pool = None  # one memory pool shared by the segment graphs (replayed in order)
        self._key: tuple | None = None
        self.captures = 0  # how many times graphs were (re)captured
        # hash layers know their experts from the token id: layered mode reads them ahead
        self._hashed = [(b.layer, b.ffn.gate.tid2eid_host) for b in model.blocks if b.ffn.gate.hash]
        self._position = 0

    # ------------------------------------------------------------------ segments
    def _segment(self, i: int, state: SequenceState) -> None:
        """Segment i of the step: FFN half of block i-1 (if any), then the attention half of
        block i, or the head after the last block. Reads/writes the static carries."""
        blocks = self.model.blocks
        if i == 0:
            streams = self.model.decode_begin(self.ids)
        else:
            streams = blocks[i - 1].decode_ffn(self._carry[i - 1], self.provider.arena)
        if i < len(blocks):
            self._carry[i] = blocks[i].decode_attention(streams, self.ids, self.pos, state.layers[i])
        else:
            self._logits = self.model.logits(streams)

    def _routes(self, layer: int) -> list[int]:
        ids = self._carry[layer].routed[0][0].tolist()  # the segment boundary's one host sync
        if self.on_routes is not None:
            self.on_routes(layer, self._position, ids)
        return ids

    def _run_eager(self, state: SequenceState) -> None:
        n = len(self.model.blocks)
        for i in range(n + 1):
            if i and not self.whole:
                self.provider.acquire(i - 1, self._routes(i - 1))
            try:
                self._segment(i, state)
            finally:
                if i and not self.whole:
                    self.provider.release(i - 1)

    def _capture(self, state: SequenceState) -> None:
        """Record the graphs of the current state buffers (nothing runs during capture)."""
        self._graphs = []
        torch.cuda.synchronize(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        n = len(self.model.blocks)
        parts = [list(range(n + 1))] if self.whole else [[i] for i in range(n + 1)]
        for seg in parts:
            g = torch.cuda.CUDAGraph()
            # thread_local: the app's other threads may touch CUDA (e.g. an I/O thread's copy)
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                for i in seg:
                    self._segment(i, state)
            self._graphs.append(g)
        self.captures += 1

    def _replay(self) -> None:
        if self.whole:
            self._graphs[0].replay()
            return
        for i, g in enumerate(self._graphs):
            if i:
                self.provider.acquire(i - 1, self._routes(i - 1))
            try:
                g.replay()
            finally:
                if i:
                    self.provider.release(i - 1)

    @staticmethod
    def _buffers(state: SequenceState) -> tuple:
        """Addresses of every state tensor a captured step reads or writes."""
        out = []
        for st in state.layers:
            out.append(st.kv.data_ptr())
            for comp in (st.compressor, st.indexer):
                if comp is not None:
                    out += [t.data_ptr() for t in (comp.buf_kv, comp.buf_gate, comp.entries, comp.prev_kv,
                                                   comp.prev_gate) if t is not None]
        return tuple(out)

    # ------------------------------------------------------------------ the step
    def step(self, state: SequenceState, token: torch.Tensor | int) -> torch.Tensor:
        """Decode one token at state.pos -> logits [1, V] fp32 (a fresh tensor); state.pos += 1."""
        self.model.reserve(state, state.pos)
        if not self.whole and self._hashed:  # start their reads now, overlapping earlier layers
            tok = int(token)
            for layer, table in self._hashed:
                self.provider.prefetch(layer, table[tok].tolist())
        if isinstance(token, torch.Tensor):
            self.ids.copy_(token.reshape(1))
        else:
            self.ids.fill_(int(token))
        self.pos.fill_(state.pos)
        self._position = state.pos  # host copy for on_routes
        key = self._buffers(state)
        if not self.graphs:
            self._run_eager(state)
        elif key != self._key:
            self._graphs, self._key = [], None
            side = torch.cuda.Stream(self.device)  # warm-up off the default stream, as capture wants
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._run_eager(state)  # this step, eagerly; also compiles the kernels it needs
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            self._replay()
        logits = self._logits.clone()
        routes = torch.stack([c.routed[0][0] for c in self._carry]) if self.whole else None  # [n_layers, k]
        if self.graphs and key != self._key:
            # capture after taking this step's results: capturing re-binds the carries and the
            # logits to the graphs' (not yet computed) output tensors
            self._capture(state)
            self._key = key
        if routes is not None:
            for layer, ids in enumerate(routes.tolist()):
                self.provider.record(layer, ids)
                if self.on_routes is not None:
                    self.on_routes(layer, state.pos, ids)
        state.pos += 1
        return logits


def make_runner(model: Transformer, provider, device: torch.device, enabled: bool,
                on_routes: Callable[[int, int, list[int]], None] | None = None) -> DecodeRunner | None:
    """The graph runner for an engine, or None when decode stays eager: not CUDA, not native
    numerics, graphs disabled, or a provider without a device slot table. Reads every expert
    into the arena first when the cache budget holds the whole pool (then one graph per step)."""
    if not enabled or device.type != "cuda" or not model.numerics.native:
        return None
    if not all(hasattr(provider, a) for a in ("arena", "acquire", "release", "record", "prefetch", "load_all")):
        return None
    return DecodeRunner(model, provider, whole=provider.load_all(), on_routes=on_routes)
