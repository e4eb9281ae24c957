"""Where the tokens of an eager forward call sit: index tensors every layer of the call shares.

An eager call (a prompt, a prefill chunk) runs S tokens at positions start..start+S-1 through
every layer (engine/attention.py `Attention.__call__`). Whatever depends on the positions alone
is the same in every layer of a compression ratio: the window branch's key rows, the positions
themselves, per ratio r the count of entries visible to each query, the ape row of each token,
the windows the call completes and, in a layer without an indexer, its picks of every visible
entry. Derived in each layer they were ~750 torch ops (launches on CUDA) of a chunk at 43 layers,
whose host time bounds a 728-token chunk on the H200 (docs/performance-log.md, 2026-12-03); made
here once per call they are a dozen.

Rows of a layer's keys: `keys` = the ring's tokens before `start` (up to W-1 of them), the S new
ones, then (compressed layers) the compressor's entries 0..n_entries(r)-1.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class PrefillPosition:
    """The shared index tensors of S tokens at start.. (all int64, on `device`).

    * `pos` [S]: the positions;
    * `n_prev`: ring tokens before `start` among the keys (min(start, W-1)); `window_keys` =
      n_prev + S, where the entries begin;
    * `window_rows` [S, W]: query t's keys at positions p-W+1..p as key rows, -1 before 0;
    per compression ratio r of `ratios`:
    * `visible[r]` [S]: (p + 1) // r, the entries complete at each query;
    * `ape_row[r]` [S]: p mod r;
    * `window_pos[r]` [n_win]: the first positions (entry·r) of the entries the call completes
      (with the tokens buffered before it), entries `first_window(r)`..;
    * `all_rows(r)` [S, W + n_entries(r)]: `window_rows`, then every entry slot's key row, -1
      for those not visible at the query (a layer without an indexer attends to all of them).
    """

    def __init__(self, start: int, size: int, window: int, ratios: Iterable[int], device: torch.device | str):
        if start < 0 or size < 1:
            raise ValueError(f"an eager call runs >= 1 tokens from a position >= 0, got {size} at {start}")
        self.start, self.size, self.window = start, size, window
        self.pos = torch.arange(start, start + size, device=device)
        self.n_prev = min(start, window - 1)
        self.window_keys = self.n_prev + size
        back = torch.arange(window - 1, -1, -1, device=device)  # W-1 .. 0
        # query start + i, key start + i - back[j]: row n_prev + i - back[j]; -1 before position 0
        self.window_rows = (torch.arange(self.n_prev, self.window_keys, device=device).unsqueeze(1)
                            - back.unsqueeze(0)).clamp_min(-1)
        self.visible, self.ape_row, self.window_pos = {}, {}, {}
        self._all_rows: dict[int, torch.Tensor] = {}
        for r in sorted({r for r in ratios if r}):
            self.visible[r] = (self.pos + 1) // r
            self.ape_row[r] = self.pos % r
            first, end = self.first_window(r), self.n_entries(r)
            self.window_pos[r] = torch.arange(first * r, end * r, r, device=device)

    def n_entries(self, r: int) -> int:
        """Entries of ratio r complete after the call."""
        return (self.start + self.size) // r

    def first_window(self, r: int) -> int:
        """The first entry of ratio r the call completes (the window open before it)."""
        return self.start // r

    def n_windows(self, r: int) -> int:
        """Entries of ratio r the call completes."""
        return self.n_entries(r) - self.first_window(r)

    def all_rows(self, r: int) -> torch.Tensor:
        """[S, W + n_entries(r)] key rows of the window, then of every entry slot (-1 where not
        visible at the query); made on first use, shared by the call's layers of ratio r."""
        rows = self._all_rows.get(r)
        if rows is None:
            n = self.n_entries(r)
            slots = torch.arange(n, device=self.pos.device).expand(self.size, -1)
            picks = torch.where(slots < self.visible[r].unsqueeze(1), slots + self.window_keys, -1)
            rows = self._all_rows[r] = torch.cat((self.window_rows, picks), dim=1)
        return rows
