"""A step's lanes: work the step's chain of kernels need not wait for runs beside it.

A one-token decode step is a chain of ~38 dependent kernels per layer, most of them a few
microseconds of latency over little data, so the step's time is the chain's length. Some of a
layer's work reads only what the chain made earlier and is read only at a later join: the
compressors and the indexer beside the query projections, the shared expert beside the routed
ones. `Lanes.side(lane)` queues such work on side stream `lane` (SIDE_LANES of them), forked
from the current stream at that point; `join()` makes the current stream wait for everything
queued on them. Captured in a CUDA graph the forks and the joins become the graph's edges, so
the side work runs concurrently with the chain, and two side lanes' work with each other (a CSA
layer's indexer keys beside its attention keys). Kernels are the same and see the same inputs,
so results are bitwise those of one stream.

Rules the callers keep:
* everything the side work reads is made before `side()` is entered (it waits for the current
  stream at entry) or earlier on the same side lane, never on another side lane, and what was
  made off the lane stays referenced until `join()`: freed earlier, its memory goes back to the
  stream that made it, whose next allocation may take it while the lane still reads it
  (tests/engine/test_decode_graph.py checks the lanes' inputs at every join);
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


SIDE_LANES = 2  # a CSA layer's attention compressor beside its indexer's work (engine/attention.py)


class Lanes:
    """The side streams of one device's steps (none: no CUDA, work runs in place)."""

    def __init__(self, device: torch.device | None):
        """SIDE_LANES side streams on `device` when it is a CUDA device; else the in-place lanes."""
        on_cuda = device is not None and device.type == "cuda"
        self.streams = [torch.cuda.Stream(device) for _ in range(SIDE_LANES)] if on_cuda else []
        self._unjoined: set[int] = set()  # the side lanes with work queued since the last join

    @property
    def forks(self) -> bool:
        """Whether `side()` runs its work on another stream (the current one's next kernel then
        follows a different predecessor than in program order)."""
        return bool(self.streams)

    @contextmanager
    def side(self, lane: int = 0) -> Iterator[None]:
        """Queue the block's device work on side lane `lane` (0 .. SIDE_LANES - 1), after
        everything queued on the current stream so far (and on that lane before)."""
        if not 0 <= lane < SIDE_LANES:
            raise ValueError(f"side lane {lane} does not exist: there are {SIDE_LANES} (0 .. {SIDE_LANES - 1})")
        if not self.streams:
            yield
            return
        stream = self.streams[lane]
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        self._unjoined.add(lane)
        with torch.cuda.stream(stream):
            yield

    def join(self) -> None:
        """The current stream waits for everything queued on the side lanes since the last join
        (nothing for a lane with nothing queued: inside a graph capture, waiting for a stream
        outside it would invalidate the capture)."""
        for lane in sorted(self._unjoined):
            stream = self.streams[lane]
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self._unjoined.clear()
