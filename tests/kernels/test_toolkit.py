"""kernels.toolkit's input checks, shared by the kernel wrappers (run on the CPU: no kernel is built)."""

from __future__ import annotations

import pytest

from kernels.toolkit import KernelInputError, check_fp4_parts


def test_fp4_parts_outside_the_arena_row_or_misaligned_are_refused_by_name():
    n, k = 4, 64  # a part: 128 weight bytes, 8 scale bytes
    check_fp4_parts("caller", 256, (0, 128), 16, (0, 8), n, k)  # two parts filling both rows exactly
    for w_row, w_offs, s_row, s_offs in ((256, (8, 136), 16, (0, 8)),  # misaligned weight
                                         (250, (0, 112), 16, (0, 8)),  # row length not a multiple of 16
                                         (256, (0, 144), 16, (0, 8)),  # weight past the row's end
                                         (256, (0, 128), 15, (0, 8))):  # scales past theirs
        with pytest.raises(KernelInputError, match="^caller: the weight must lie inside the arena row"):
            check_fp4_parts("caller", w_row, w_offs, s_row, s_offs, n, k)
