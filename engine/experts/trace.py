"""Routing traces: record which experts each MoE layer call used, to replay cache policies.

File format (contract), UTF-8 JSON Lines, one line per routed MoE layer call, in call order:

    {"step": 12, "layer": 3, "tokens": 2, "experts": [[5, 17, 200, 9, 41, 77], [5, 3, 8, 1, 0, 2]]}

- step: int >= 0, the forward call (prefill chunk or decode step) the layer call belongs to.
- layer: int >= 0, the decoder layer index.
- tokens: int >= 1, the number of tokens routed in that call; equals len(experts).
- experts: one list per token of the routed expert ids (ints >= 0), in router order.

The writer streams to "<path>.partial" and renames it to <path> on a clean close, so a file
at <path> is always complete; an interrupted recording is left as "<path>.partial" (still
readable line by line).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from engine.experts.cache import ExpertKey


class TraceFormatError(Exception):
    """A routing-trace file or record does not follow the format in this module's docstring."""


@dataclass(frozen=True)
class TraceRecord:
    """One MoE layer call: `experts[t]` are the experts routed for token t."""

    step: int
    layer: int
    experts: tuple[tuple[int, ...], ...]  # [tokens, top_k]

    @property
    def tokens(self) -> int:
        return len(self.experts)


def _as_int_rows(experts: Any) -> tuple[tuple[int, ...], ...]:
    rows = experts.tolist() if hasattr(experts, "tolist") else experts  # tensor/ndarray [T, k]
    try:
        out = tuple(tuple(int(e) for e in row) for row in rows)
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(
            f"experts must be a [tokens, top_k] sequence of ints, got {type(experts).__name__}: {exc}"
        ) from None
    if not out:
        raise TraceFormatError("experts must hold at least one token's routing, got none")
    if any(e < 0 for row in out for e in row):
        raise TraceFormatError("expert ids must be >= 0")
    return out


class TraceWriter:
    """Appends TraceRecords to a JSONL routing trace (format in the module docstring).

    Use as a context manager; the file appears at `path` only after a clean close.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._partial, "w", encoding="utf-8")
        self.records = 0

    def record(self, step: int, layer: int, experts: Any) -> None:
        """Write one layer call; `experts` is [tokens, top_k] (nested lists, tensor, ndarray)."""
        if self._file.closed:
            raise TraceFormatError(f"trace {self.path} is already closed")
        if int(step) < 0 or int(layer) < 0:
            raise TraceFormatError(f"step and layer must be >= 0, got step={step} layer={layer}")
        rows = _as_int_rows(experts)
        line = {"step": int(step), "layer": int(layer), "tokens": len(rows), "experts": rows}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self.records += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self, complete: bool = True) -> None:
        """Flush and close; if `complete`, publish the file at `path` (atomic rename)."""
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if complete:
            os.replace(self._partial, self.path)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(complete=exc_type is None)


def _parse_line(text: str, where: str) -> TraceRecord:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict) or not {"step", "layer", "tokens", "experts"} <= obj.keys():
        raise TraceFormatError(f"{where}: expected an object with step, layer, tokens, experts")
    step, layer, tokens = obj["step"], obj["layer"], obj["tokens"]
    if not all(type(v) is int and v >= 0 for v in (step, layer, tokens)):
        raise TraceFormatError(f"{where}: step, layer and tokens must be non-negative ints")
    experts = obj["experts"]
    if not isinstance(experts, list) or not all(
        isinstance(row, list) and all(type(e) is int and e >= 0 for e in row) for row in experts
    ):
        raise TraceFormatError(f"{where}: experts must be a list of lists of non-negative ints")
    if len(experts) != tokens:
        raise TraceFormatError(f"{where}: tokens={tokens} but experts has {len(experts)} rows")
    return TraceRecord(step, layer, tuple(tuple(row) for row in experts))


def read_records(path: str | os.PathLike[str]) -> Iterator[TraceRecord]:
    """Yield the TraceRecords of a trace file in order (blank lines are skipped)."""
    p = Path(path)
    if not p.is_file():
        raise TraceFormatError(f"routing trace {p} does not exist (record one, or use --synthetic)")
    with open(p, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if text.strip():
                yield _parse_line(text, f"{p}:{lineno}")


def accesses(records: Sequence[TraceRecord] | Iterator[TraceRecord], *, dedupe: bool = True
             ) -> Iterator[ExpertKey]:
    """Flatten records into (layer, expert) accesses in order.

    dedupe=True: each layer call touches each distinct expert once, in first-use order (a
    batched MoE call loads an expert once for all its tokens). dedupe=False: one access per
    (token, routed expert).
    """
    for rec in records:
        if dedupe:
            yield from ((rec.layer, e) for e in dict.fromkeys(e for row in rec.experts for e in row))
        else:
            yield from ((rec.layer, e) for row in rec.experts for e in row)


def read_trace(path: str | os.PathLike[str], *, dedupe: bool = True) -> Iterator[ExpertKey]:
    """Yield the (layer, expert) access sequence of a trace file, in order (see `accesses`)."""
    return accesses(read_records(path), dedupe=dedupe)


class RoutingTrace:
    """Records every routed-expert decision into a TraceWriter (engine/experts/trace.py).

    Pass as `log=` to `Transformer.forward`; a new step starts when the position changes or the
    layer index does not increase (a new forward call).
    """

    def __init__(self, writer: TraceWriter):
        self.writer = writer
        self.step = -1
        self._last: tuple[int, int] | None = None  # (start, layer)

    def __call__(self, kind: str, layer: int, start: int, selected: torch.Tensor) -> None:
        if kind != "experts":
            return
        if self._last is None or start != self._last[0] or layer <= self._last[1]:
            self.step += 1
        self._last = (start, layer)
        self.writer.record(self.step, layer, selected)
