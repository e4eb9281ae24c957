"""Where the tokens of a graphed prefill chunk sit, as static device tensors (engine.decode_graph).

A chunk step runs `size` token slots at once with static shapes: the first `n` are the chunk's
tokens at positions p0..p0+n-1, the rest repeat the last token and are never committed (their
keys, compressor rows and entries go nowhere a real token reads). Everything that depends on p0
and n is an index computed here on the host, once per chunk for every layer, and uploaded in one
copy into a buffer that never moves, so one captured graph serves every position:

* keys: a layer gathers its window from K = cat(the chunk's new keys [size], its key buffer
  `LayerState.kv` [W + capacity]) — the ring before the chunk, then the compressed entries at
  rows size + W.. (`entry_offset`). `window_rows` [size, W] are query t's positions
  p-W+1..p in K (-1 before position 0); `ring_src` [W] the K row each ring row holds after the
  chunk (a real token's key, or its own old row).
* per compression ratio r, over KV = cat(the compressor's open-window rows [r], the chunk's
  projections [size]) and, for overlap compressors, PV = cat(the previous window's first half
  [r], KV's first half): `win_src` [nw, r] the rows of each window the chunk completes (nw =
  (r - 1 + size) // r slots; the unused ones pool the chunk's own rows, whose gate logits are
  finite), `prev_src` [nw, r] the rows of the
  window before each, `entry` [nw] the entry each writes (unused slots: the entry still open
  after the chunk, which no query sees before it is completed and written again), `buf_src` [r]
  and `prev_next` [r] the open window's rows and the previous window's first half after the
  chunk, `ape_row` [size] = p mod r, `visible` [size] = (p + 1) // r entries complete at each
  query.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import prod

import torch

from engine.decode_position import upload

# Token slots of a chunk step (engine.decode_graph.DecodeRunner.chunk): a prefill chunk of up to
# this many tokens runs as one graph replay; its GEMV kernels take at most 16 rows
# (kernels.fp4_moe.GEMV_MAX_M).
CHUNK_SLOTS = 16


class ChunkPosition:
    """Static device views of a chunk's token ids and position facts; `set(p0, ids)` fills them."""

    def __init__(self, window: int, ratios: Iterable[int], size: int, device: torch.device | str):
        self.window, self.size = window, size
        self.ratios = tuple(sorted({r for r in ratios if r}))
        self.entry_offset = size + window  # where entry 0 is in K
        shapes = [("ids", (size,)), ("pos", (size,)), ("last", (1,)), ("window_rows", (size, window)),
                  ("ring_src", (window,))]
        for r in self.ratios:
            nw = self.windows(r)
            shapes += [(f"ape_row{r}", (size,)), (f"win_src{r}", (nw, r)), (f"prev_src{r}", (nw, r)),
                       (f"entry{r}", (nw,)), (f"buf_src{r}", (r,)), (f"prev_next{r}", (r,)),
                       (f"visible{r}", (size,))]
        total = sum(prod(shape) for _, shape in shapes)
        self._buf = torch.zeros(total, dtype=torch.long, device=device)
        views, at = {}, 0
        for name, shape in shapes:
            views[name] = self._buf[at:at + prod(shape)].view(shape)
            at += prod(shape)
        self.ids, self.pos, self.last = views["ids"], views["pos"], views["last"]
        self.window_rows, self.ring_src = views["window_rows"], views["ring_src"]
        self.ape_row, self.win_src, self.prev_src, self.entry, self.buf_src, self.prev_next, self.visible = (
            {r: views[f"{name}{r}"] for r in self.ratios}
            for name in ("ape_row", "win_src", "prev_src", "entry", "buf_src", "prev_next", "visible"))

    def windows(self, r: int) -> int:
        """Window slots of ratio r a chunk may complete: (r - 1 + size) // r."""
        return (r - 1 + self.size) // r

    def values(self, p0: int, ids: Sequence[int]) -> list[int]:
        """The buffer's contents for tokens `ids` (1..size of them) from position p0, in layout order."""
        n, s, w = len(ids), self.size, self.window
        if not 1 <= n <= s or p0 < 0:
            raise ValueError(f"a chunk step takes 1..{s} tokens from a position >= 0, got {n} at {p0}")
        if n > w:
            raise ValueError(f"a chunk step's tokens must fit the window ({w}), got {n}")
        out = [int(t) for t in ids] + [int(ids[-1])] * (s - n)
        out += [p0 + t for t in range(s)] + [n - 1]
        for t in range(s):
            for q in range(p0 + t - w + 1, p0 + t + 1):
                out.append(-1 if q < 0 else q - p0 if q >= p0 else s + q % w)
        ring = [s + j for j in range(w)]
        for t in range(n):
            ring[(p0 + t) % w] = t
        out += ring
        for r in self.ratios:
            out += self._ratio_values(r, p0, n)
        return out

    def _ratio_values(self, r: int, p0: int, n: int) -> list[int]:
        s, nw = self.size, self.windows(r)

        def row(q: int) -> int:  # position q's row in KV: its open-window row, or its chunk row
            return q % r if q < p0 else r + q - p0

        w0, w1 = p0 // r, (p0 + n) // r  # the open window before and after the chunk
        win_src, prev_src, entry = [], [], []
        for i in range(nw):
            e = w0 + i
            if e < w1:
                win_src += [row(e * r + j) for j in range(r)]
                prev_src += list(range(r)) if i == 0 else [r + row((e - 1) * r + j) for j in range(r)]
                entry.append(e)
            else:  # pools the chunk's own rows: finite gate logits (an open row's may all be -inf)
                win_src += [r + j % s for j in range(r)]
                prev_src += list(range(r))
                entry.append(w1)
        buf_src = [row(w1 * r + j) if w1 * r + j < p0 + n else j for j in range(r)]
        prev_next = [r + row((w1 - 1) * r + j) for j in range(r)] if w1 > w0 else list(range(r))
        return ([(p0 + t) % r for t in range(s)] + win_src + prev_src + entry + buf_src + prev_next
                + [(p0 + t + 1) // r for t in range(s)])

    def set(self, p0: int, ids: Sequence[int]) -> None:
        """Upload the facts of `ids` at p0.. (one host-to-device copy, ordered on the current stream)."""
        upload(self._buf, self.values(p0, ids))
