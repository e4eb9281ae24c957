"""The attention window's keys and indices for a prefill chunk (`Attention._window`): read from
the ring as slices, equal to gathering positions mod W, for chunks that wrap the ring or not."""

from __future__ import annotations

import pytest
import torch

from engine.attention import _ring_rows
from engine.state import new_layer_state


def test_ring_rows_are_the_positions_mod_w_in_order():
    ring = torch.arange(8)  # slot p holds p
    for first in range(0, 20):
        for n in range(0, 9):
            got = torch.cat(_ring_rows(ring, first, n))
            assert torch.equal(got, torch.arange(first, first + n) % 8), (first, n)
            assert len(_ring_rows(ring, first, n)) <= 2


def _window_by_gather(w, back, kv, start, ring):
    """The gather formulation: rows at positions mod W, indices by position (the reference)."""
    s = kv.shape[0]
    n_prev = min(start, w - 1)
    prev_pos = torch.arange(start - n_prev, start)
    kv_win = torch.cat((ring[prev_pos % w], kv))
    want = torch.arange(start, start + s).unsqueeze(1) - back.unsqueeze(0)
    idx = torch.where(want >= 0, want - (start - n_prev), -1)
    keep = min(s, w)
    new_ring = ring.clone()
    new_ring[torch.arange(start + s - keep, start + s) % w] = kv[s - keep:]
    return kv_win, idx, new_ring


@pytest.mark.parametrize("start,s", [(0, 5), (0, 8), (3, 20), (7, 1), (9, 3), (13, 6), (6, 8), (100, 17)])
def test_window_equals_the_gather_formulation(start, s):
    from engine.attention import Attention

    w, d = 8, 4
    st = new_layer_state(w, d, 0, 4, torch.float32, "cpu")
    st.window.copy_(torch.randn(w, d))
    kv = torch.randn(s, d)
    back = torch.arange(w - 1, -1, -1)
    want_win, want_idx, want_ring = _window_by_gather(w, back, kv, start, st.window.clone())
    attn = Attention.__new__(Attention)  # only the window's fields
    attn.window, attn.back = w, back
    kv_win, idx = attn._window(kv, start, st)
    assert torch.equal(kv_win, want_win) and torch.equal(idx, want_idx)
    assert torch.equal(st.window, want_ring)
