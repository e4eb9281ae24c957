"""kernels/bf16_gemm.py's row buckets for cuBLAS (run on the CPU: plain torch, no kernel)."""

from __future__ import annotations

import torch

from kernels.bf16_gemm import CUBLAS_ROW_BUCKET, cublas_rows, pad_rows_for_cublas


def test_pad_rows_for_cublas_keeps_the_rows_and_rounds_the_count():
    x = torch.randn(300, 64)
    xp = pad_rows_for_cublas(x)
    assert xp.shape == (2 * CUBLAS_ROW_BUCKET, 64) and torch.equal(xp[:300], x)
    assert pad_rows_for_cublas(x[:16]).shape == (16, 64)  # chunks that short come in powers of two
    assert pad_rows_for_cublas(x[:256]).data_ptr() == x.data_ptr()  # a multiple: no copy
    w = torch.randn(32, 64)
    assert torch.allclose((pad_rows_for_cublas(x) @ w.t())[:300], x @ w.t(), atol=1e-5)  # rows independent
    assert [cublas_rows(m) for m in (1, 16, 17, 256, 257, 2064)] == [1, 16, 256, 256, 512, 2304]
