"""Per-sequence inference state (spec §D), passed into the model's forward — never module buffers.

One `SequenceState` per conversation: the number of tokens processed, and for every layer the
sliding-window ring of KV, plus for compressed layers the compressor state and the compressed
caches. `clone()` gives an independent snapshot (used at turn boundaries for regenerate/undo).

Layout contract (the one-token decode step and its CUDA graphs rely on it): a layer's attention
keys live in ONE buffer `LayerState.kv` [W + capacity, head_dim]; rows 0..W-1 are the window
ring (`window`, slot p mod W holds position p) and rows W.. the attention compressor's entries
(`compressor.entries`, entry w covers tokens [w·r, (w+1)·r)). Both are views of `kv`, so a
sparse-attention call indexes window and compressed keys in one tensor. Tensors change identity
only when `reserve` grows the capacity; everything else is written in place.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

MIN_ENTRIES = 16  # initial compressed-entry capacity of a layer


def copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Independent copies of `tensors`, made by one batched copy (`torch._foreach_copy_`): a
    state's ~270 buffers at 43 layers are copied on the path of a turn's first token, where a
    clone per buffer cost a launch and its host time each."""
    out = [torch.empty_like(t) for t in tensors]
    torch._foreach_copy_(out, list(tensors))
    return out


@dataclass
class CompressorState:
    """State of one compressor (attention or indexer) of a layer with ratio r.

    `buf_kv`/`buf_gate` [r, c·d] fp32 hold the projected values and gate logits (ape included)
    of the current incomplete window; row t mod r. For overlap compressors (r = 4, c = 2)
    `prev_kv`/`prev_gate` [r, d] hold the first half of the previous complete window (zeros
    with -inf logits before the first window completes, i.e. weight 0). `entries`
    [capacity, d] hold emitted compressed entries. The number of entries is derived from the
    sequence position, so it is not stored twice.
    """

    ratio: int
    buf_kv: torch.Tensor
    buf_gate: torch.Tensor
    entries: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None

    @classmethod
    def empty(cls, ratio: int, width: int, dim: int, entries: torch.Tensor) -> "CompressorState":
        dev = entries.device
        overlap = width == 2 * dim
        return cls(ratio=ratio,
                   buf_kv=torch.zeros(ratio, width, device=dev),
                   buf_gate=torch.full((ratio, width), float("-inf"), device=dev),
                   entries=entries,
                   prev_kv=torch.zeros(ratio, dim, device=dev) if overlap else None,
                   prev_gate=torch.full((ratio, dim), float("-inf"), device=dev) if overlap else None)

    def store_entries(self, first: int, new: torch.Tensor) -> None:
        """Write entries first..first+len(new)-1 (capacity reserved by `LayerState.reserve`)."""
        end = first + new.shape[0]
        if end > self.entries.shape[0]:
            raise IndexError(f"compressed entries {first}..{end - 1} exceed the reserved capacity "
                             f"{self.entries.shape[0]}; call LayerState.reserve first")
        self.entries[first:end] = new


@dataclass
class LayerState:
    """The key buffer `kv` [W + capacity, D] (window ring, then compressed entries) and compressors."""

    kv: torch.Tensor
    window_size: int
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    @property
    def window(self) -> torch.Tensor:
        """The window ring [W, D] (a view of `kv`)."""
        return self.kv[:self.window_size]

    @property
    def capacity(self) -> int:
        """Compressed entries the buffers hold without growing (0 for window-only layers)."""
        return self.kv.shape[0] - self.window_size

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer owns (views such as `window` and the attention entries excluded)."""
        out = [self.kv]
        for comp in (self.compressor, self.indexer):
            if comp is not None:
                out += [t for t in (comp.buf_kv, comp.buf_gate, comp.prev_kv, comp.prev_gate) if t is not None]
        if self.indexer is not None:
            out.append(self.indexer.entries)
        return out

    def rewritten(self) -> list[torch.Tensor]:
        """The tensors a step reads and then overwrites in place: the overlap compressors'
        previous first halves (`prev_kv`, `prev_gate`), pooled into an entry and replaced when
        a window completes. Every other write of a step stores values at its position (a ring row, a
        buffer row, an entry), so a step run again at the same position, these restored first,
        leaves the same state."""
        return [t for comp in (self.compressor, self.indexer) if comp is not None
                for t in (comp.prev_kv, comp.prev_gate) if t is not None]

    def chunk_rewritten(self, end: int) -> list[torch.Tensor]:
        """What a chunk step ending at position `end` (engine/chunk_position.py) writes that its
        tokens, run again one by one as decode steps from its first position, would read before
        rewriting: the window ring (the chunk's later tokens' rows held keys its earlier tokens
        attend to), the compressors' open-window buffers (rows of windows the earlier tokens
        complete) and previous halves, and the entry each compressor has open at `end` (a [1, d]
        view, when reserved: the chunk's unused window slots write it, a decode step only once
        its window completes). The chunk's other writes are complete entries, which the decode
        steps write again."""
        out = [self.window]
        for comp in (self.compressor, self.indexer):
            if comp is not None:
                out += [t for t in (comp.buf_kv, comp.buf_gate, comp.prev_kv, comp.prev_gate) if t is not None]
                e = end // comp.ratio
                if e < comp.entries.shape[0]:
                    out.append(comp.entries[e:e + 1])
        return out

    def use(self, tensors: Sequence[torch.Tensor]) -> None:
        """Take `tensors` (ordered and shaped as `tensors()` returns them) as this layer's buffers,
        without copying; the views (`window`, the attention entries) follow `kv`."""
        it = iter(tensors)
        self.kv = next(it)
        for comp in (self.compressor, self.indexer):
            if comp is not None:
                comp.buf_kv, comp.buf_gate = next(it), next(it)
                if comp.prev_kv is not None:
                    comp.prev_kv, comp.prev_gate = next(it), next(it)
        if self.compressor is not None:
            self.compressor.entries = self.kv[self.window_size:]
        if self.indexer is not None:
            self.indexer.entries = next(it)
        if next(it, None) is not None:
            raise ValueError("LayerState.use: more tensors than the layer holds")

    def clone(self) -> "LayerState":
        """An independent copy: every tensor of `tensors()` copied once, the views re-made on the
        copies."""
        return self.on(copies(self.tensors()))

    def on(self, tensors: Sequence[torch.Tensor]) -> "LayerState":
        """A layer like this one whose buffers are `tensors` (ordered and shaped as `tensors()`
        returns them; taken without copying), the views re-made on them."""
        other = LayerState(kv=self.kv, window_size=self.window_size,
                           compressor=None if self.compressor is None else replace(self.compressor),
                           indexer=None if self.indexer is None else replace(self.indexer))
        other.use(tensors)
        return other

    def reserve(self, n_entries: int) -> bool:
        """Make room for `n_entries` compressed entries (attention and indexer), growing to the
        power of two that holds them, at least doubling; True when the buffers were reallocated
        (their identity changed). Powers of two: a decode step's kernels take the capacity as a
        static shape, so each capacity is compiled once (a first step at a new one waited ~1 s
        on the H200)."""
        if self.compressor is None or n_entries <= self.capacity:
            return False
        cap = 1 << (max(n_entries, 2 * self.capacity) - 1).bit_length()
        kv = self.kv.new_zeros(self.window_size + cap, self.kv.shape[1])
        kv[:self.kv.shape[0]] = self.kv
        self.kv = kv
        self.compressor.entries = kv[self.window_size:]
        if self.indexer is not None:
            old = self.indexer.entries
            self.indexer.entries = old.new_zeros(cap, old.shape[1])
            self.indexer.entries[:old.shape[0]] = old
        return True


@dataclass
class SequenceState:
    """Everything one sequence needs between forward calls; `pos` = tokens processed so far."""

    layers: list[LayerState]
    mtp: LayerState | None = None
    pos: int = 0
    extra: dict = field(default_factory=dict)

    def clone(self) -> "SequenceState":
        """An independent deep copy (tensors copied; views stay views of their copied buffer):
        every layer's buffers in one batched copy (`copies`)."""
        layers = self.layers + ([] if self.mtp is None else [self.mtp])
        owned = [layer.tensors() for layer in layers]
        flat = iter(copies([t for tensors in owned for t in tensors]))
        cloned = [layer.on([next(flat) for _ in tensors]) for layer, tensors in zip(layers, owned)]
        return SequenceState(layers=cloned[:len(self.layers)], mtp=None if self.mtp is None else cloned[-1],
                             pos=self.pos, extra=copy.deepcopy(self.extra))

    def rewritten(self) -> list[torch.Tensor]:
        """Every main layer's `LayerState.rewritten` tensors (a decode step does not run the MTP block)."""
        return [t for layer in self.layers for t in layer.rewritten()]

    def chunk_rewritten(self, end: int) -> list[torch.Tensor]:
        """Every main layer's `LayerState.chunk_rewritten(end)`."""
        return [t for layer in self.layers for t in layer.chunk_rewritten(end)]

    def nbytes(self) -> int:
        """Bytes held by the state's tensors (for the memory budget); views are not counted twice."""
        return sum(t.numel() * t.element_size()
                   for layer in self.layers + ([self.mtp] if self.mtp else []) for t in layer.tensors())


def new_layer_state(window: int, head_dim: int, ratio: int, index_head_dim: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu", capacity: int = MIN_ENTRIES) -> LayerState:
    """Fresh state for one layer with compression ratio `ratio` (0, 4 or 128)."""
    cap = capacity if ratio else 0
    kv = torch.zeros(window + cap, head_dim, dtype=dtype, device=device)
    state = LayerState(kv=kv, window_size=window)
    if ratio:
        c = 2 if ratio == 4 else 1
        state.compressor = CompressorState.empty(ratio, c * head_dim, head_dim, kv[window:])
        if ratio == 4:
            idx_entries = torch.zeros(cap, index_head_dim, dtype=dtype, device=device)
            state.indexer = CompressorState.empty(ratio, 2 * index_head_dim, index_head_dim, idx_entries)
    return state
