"""DecodePosition: the host-computed position facts equal what the layers used to derive on the
device from the position tensor (ring rows, buffer rows, entries, visible counts)."""

import pytest
import torch

from engine.decode_position import DecodePosition


@pytest.mark.parametrize("p", [0, 1, 3, 4, 7, 126, 127, 128, 129, 511, 1000, 4095])
def test_position_facts_equal_the_device_derivations(p):
    at = DecodePosition(128, (0, 4, 128, 4, 0), "cpu")
    assert at.ratios == (4, 128)
    at.set(p)
    pos = torch.tensor([p])
    back = torch.arange(127, -1, -1)
    want = pos - back
    assert torch.equal(at.window_rows, torch.where(want >= 0, want % 128, -1).unsqueeze(0))
    assert at.pos.item() == p and at.window_row.item() == p % 128 and at.host == p
    for r in (4, 128):
        assert (at.row[r].item(), at.entry[r].item(), at.visible[r].item()) == (p % r, p // r, (p + 1) // r)
        assert at.first[r].item() == (p // r) * r  # the entry's first position: where it is rotated


def test_views_stay_put_across_steps():
    """Captured graphs read the same storage every step: `set` writes in place."""
    at = DecodePosition(8, (4,), "cpu")
    ptrs = (at.pos.data_ptr(), at.window_rows.data_ptr(), at.visible[4].data_ptr())
    at.set(5)
    at.set(9)
    assert (at.pos.data_ptr(), at.window_rows.data_ptr(), at.visible[4].data_ptr()) == ptrs
    assert at.window_rows.tolist() == [[2, 3, 4, 5, 6, 7, 0, 1]] and at.visible[4].item() == 2


def test_negative_position_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        DecodePosition(8, (4,), "cpu").set(-1)
