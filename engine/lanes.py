"""A step's two lanes: work the step's chain of kernels need not wait for runs beside it.

A one-token decode step is a chain of ~38 dependent kernels per layer, most of them a few
microseconds of latency over little data, so the step's time is the chain's length. Some of a
layer's work reads only what the chain made earlier and is read only at a later join: the
compressors and the indexer beside the query projections, the shared expert beside the routed
ones. `Lanes.side()` queues such work on a second CUDA stream, forked from the current stream
at that point; `join()` makes the current stream wait for everything queued there. Captured in
a CUDA graph the fork and the join become the graph's edges, so the side work runs concurrently
with the chain. Kernels are the same and see the same inputs, so results are bitwise those of one
stream.

Rules the callers keep:
* everything the side work reads is made before `side()` is entered (it waits for the current
  stream at entry) or earlier on the side stream itself, and stays referenced until `join()`;
* nothing reads the side work's results before `join()`, and every `side()` of a step is joined
  before the step (or the captured segment) ends;
* a kernel that reads a buffer before its programmatic-launch wait (kernels/pdl.py's exception)
  relies on its predecessor in its stream not writing it: the first kernel after a side block
  follows the last one before it (engine/moe.py's routed experts then follow the router).

Off CUDA (`Lanes(None)`, the CPU reference) both run in place: one stream, the same order.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class Lanes:
    """The side stream of one device's steps (None: no CUDA, work runs in place)."""

    def __init__(self, device: torch.device | None):
        """A side stream on `device` when it is a CUDA device; else the in-place lanes."""
        on_cuda = device is not None and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_cuda else None
        self._unjoined = False  # work queued on the side stream since the last join

    @property
    def forks(self) -> bool:
        """Whether `side()` runs its work on another stream (the current one's next kernel then
        follows a different predecessor than in program order)."""
        return self.stream is not None

    @contextmanager
    def side(self) -> Iterator[None]:
        """Queue the block's device work on the side stream, after everything queued on the
        current stream so far (and on the side stream before)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self._unjoined = True
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """The current stream waits for everything queued on the side stream since the last join
        (nothing when nothing was: inside a graph capture, waiting for a stream outside it would
        invalidate the capture)."""
        if self._unjoined:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self._unjoined = False
