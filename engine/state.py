"""Per-sequence inference state (spec §D), passed into the model's forward — never module buffers.

One `SequenceState` per conversation: the number of tokens processed, and for every layer the
sliding-window ring of KV, plus for compressed layers the compressor state and the compressed
caches. `clone()` gives an independent snapshot (used at turn boundaries for regenerate/undo).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """State of one compressor (attention or indexer) of a layer with ratio r.

    `buf_kv`/`buf_gate` [r, c·d] fp32 hold the projected values and gate logits (ape included)
    of the current incomplete window; row t mod r. For overlap compressors (r = 4, c = 2)
    `prev_kv`/`prev_gate` [r, d] hold the first half of the previous complete window (None
    before the first window completes). `entries` [capacity, d] hold emitted compressed
    entries; entry w covers tokens [w·r, (w+1)·r). The number of entries is derived from the
    sequence position, so it is not stored twice.
    """

    ratio: int
    buf_kv: torch.Tensor
    buf_gate: torch.Tensor
    entries: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_gate: torch.Tensor | None = None

    @classmethod
    def empty(cls, ratio: int, width: int, dim: int, dtype: torch.dtype, device: torch.device,
              capacity: int = 16) -> "CompressorState":
        return cls(ratio=ratio,
                   buf_kv=torch.zeros(ratio, width, device=device),
                   buf_gate=torch.full((ratio, width), float("-inf"), device=device),
                   entries=torch.zeros(capacity, dim, dtype=dtype, device=device))

    def store_entries(self, first: int, new: torch.Tensor) -> None:
        """Write entries first..first+len(new)-1, growing the buffer geometrically."""
        end = first + new.shape[0]
        if end > self.entries.shape[0]:
            grown = self.entries.new_zeros(max(end, 2 * self.entries.shape[0]), self.entries.shape[1])
            grown[:first] = self.entries[:first]
            self.entries = grown
        self.entries[first:end] = new


@dataclass
class LayerState:
    """The window ring [W, head_dim] (slot p mod W holds position p) and compressors."""

    window: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass
class SequenceState:
    """Everything one sequence needs between forward calls; `pos` = tokens processed so far."""

    layers: list[LayerState]
    mtp: LayerState | None = None
    pos: int = 0
    extra: dict = field(default_factory=dict)

    def clone(self) -> "SequenceState":
        """An independent deep copy (tensors copied)."""
        return copy.deepcopy(self)

    def nbytes(self) -> int:
        """Bytes held by the state's tensors (for the memory budget)."""
        total = 0
        for layer in self.layers + ([self.mtp] if self.mtp else []):
            total += layer.window.numel() * layer.window.element_size()
            for comp in (layer.compressor, layer.indexer):
                if comp is None:
                    continue
                for t in (comp.buf_kv, comp.buf_gate, comp.entries, comp.prev_kv, comp.prev_gate):
                    if t is not None:
                        total += t.numel() * t.element_size()
        return total


def new_layer_state(window: int, head_dim: int, ratio: int, index_head_dim: int, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> LayerState:
    """Fresh state for one layer with compression ratio `ratio` (0, 4 or 128)."""
    state = LayerState(window=torch.zeros(window, head_dim, dtype=dtype, device=device))
    if ratio:
        c = 2 if ratio == 4 else 1
        state.compressor = CompressorState.empty(ratio, c * head_dim, head_dim, dtype, device)
        if ratio == 4:
            state.indexer = CompressorState.empty(ratio, 2 * index_head_dim, index_head_dim, dtype, device)
    return state
