"""Which windows kernels/compressor_pool.py's kernel reads in place (pure host arithmetic, no GPU):
rows of C values at a common pitch, as a prefill chunk's kv values are (a column slice of the
projection's output); anything else takes the reference."""

import torch

from kernels.compressor_pool import pitched_rows


def test_a_column_slice_of_the_projection_is_read_at_its_pitch():
    y = torch.randn(40, 2048)  # [S, 2·c·d]: kv values, then gate logits
    rows = pitched_rows(y[:, :1024].view(10, 4, 1024), 1024)
    assert rows.shape == (40, 2048) and rows.data_ptr() == y.data_ptr()
    assert torch.equal(rows[:, :1024], y[:, :1024])


def test_contiguous_windows_are_read_as_they_are():
    w = torch.randn(6, 4, 256)
    assert torch.equal(pitched_rows(w, 256), w.view(24, 256))


def test_windows_the_kernel_cannot_read_in_place():
    y = torch.randn(40, 2048)
    assert pitched_rows(y[:, 1024:].view(10, 4, 1024), 1024) is None  # the last row's pitch runs past the storage
    assert pitched_rows(y[:, :1024].view(10, 4, 1024).transpose(0, 1), 1024) is None  # windows not in row order
    assert pitched_rows(y.view(40, 1024, 2)[:, :, 0].view(10, 4, 1024), 1024) is None  # every other element
