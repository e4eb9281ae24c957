"""Bitwise-reproducible CPU matrix products.

The engine promises the same logits whether a layer's weights come from the official files, a
converted directory or the streaming expert cache. On the CPU, torch's float32 matrix products
go to MKL, whose default code path may round differently for the same values at a different
memory alignment (seen on an AMD EPYC with AVX-512: the streamed and the in-memory model then
differ in the last bits). MKL's conditional numerical reproducibility (`MKL_CBWR`) fixes one code
path per CPU; its STRICT mode is the one Intel documents as bitwise reproducible whatever the
alignment and thread count. On that machine the comparisons pass with "AUTO" and "AUTO,STRICT".

MKL reads the variable at its first BLAS call, so the entry points call `pin_cpu_math` before
any model work; a value the user has set is kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

MKL_CBWR = "AUTO,STRICT"  # the CPU's best code path, in MKL's strict reproducible mode


def pin_cpu_math(environ: MutableMapping[str, str] | None = None) -> str:
    """Set MKL_CBWR (unless already set) in `environ` (default: this process's); returns it."""
    env = os.environ if environ is None else environ
    return env.setdefault("MKL_CBWR", MKL_CBWR)
