"""The attention window's keys and indices for a prefill chunk (`PrefillPosition.window_rows`,
the ring's rows before the call, `Attention._update_ring`): read from the ring as slices, equal to
gathering positions mod W, for chunks that wrap the ring or not; and the other index tensors a
call's layers share (`PrefillPosition`), against their per-layer formulations."""

from __future__ import annotations

import pytest
import torch

from engine.attention import _ring_rows
from engine.prefill_position import PrefillPosition
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
    at = PrefillPosition(start, s, w, (), "cpu")
    kv_win = torch.cat(_ring_rows(st.window, start - at.n_prev, at.n_prev) + [kv])
    assert torch.equal(kv_win, want_win) and torch.equal(at.window_rows, want_idx)
    assert at.window_keys == kv_win.shape[0]
    attn = Attention.__new__(Attention)  # only the window's fields
    attn.window = w
    attn._update_ring(kv, at, st)
    assert torch.equal(st.window, want_ring)


@pytest.mark.parametrize("start,s", [(0, 5), (0, 16), (3, 20), (7, 1), (9, 3), (13, 6), (100, 17), (126, 300)])
@pytest.mark.parametrize("r", [4, 128])
def test_shared_indices_equal_each_layers_own(start, s, r):
    """What every layer derived from its positions (the formulations the layers used before the
    call shared them): visible counts, ape rows, the windows completed and their positions, and
    a layer's picks of every visible entry shifted past the window's keys."""
    w = 8
    at = PrefillPosition(start, s, w, (0, r, 4), "cpu")
    positions = torch.arange(start, start + s)
    assert torch.equal(at.pos, positions)
    assert torch.equal(at.visible[r], (positions + 1) // r)
    assert torch.equal(at.ape_row[r], positions % r)
    n_buf = start % r
    n_win = (n_buf + s) // r
    first = (start - n_buf) // r
    assert (at.first_window(r), at.n_windows(r)) == (first, n_win)
    assert torch.equal(at.window_pos[r], (first + torch.arange(n_win)) * r)
    n_entries = (start + s) // r
    assert at.n_entries(r) == n_entries
    chosen = torch.arange(n_entries).expand(s, -1)
    chosen = torch.where(chosen < ((positions + 1) // r).unsqueeze(1), chosen, -1)
    chosen = torch.where(chosen >= 0, chosen + at.window_keys, chosen)
    rows = at.all_rows(r)
    assert torch.equal(rows, torch.cat((at.window_rows, chosen), dim=1))
    assert at.all_rows(r) is rows  # made once for the call's layers


def test_a_call_runs_at_least_one_token_from_position_zero_on():
    with pytest.raises(ValueError, match="tokens from a position"):
        PrefillPosition(0, 0, 8, (4,), "cpu")
    with pytest.raises(ValueError, match="tokens from a position"):
        PrefillPosition(-1, 3, 8, (4,), "cpu")
