"""Giving freed heap memory back to the OS between requests.

Every turn allocates and frees tensors of a different size (prompt lengths vary), and glibc's
allocator keeps much of what is freed, spread over its per-thread arenas: under a stream of
requests the server's RSS then climbs without bound although nothing stays allocated
(bench/server_soak.py: +164 MiB over 600 short requests on the demo model). `malloc_trim(0)`
returns those free pages. The server's worker calls it when it goes idle, the TUI's engine
service and `--plain` after every turn (bench/soak.py --trim: +3.54 -> +0.20 MiB per 100 turns on
the demo model). Other C libraries: no trimmer.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Callable


def heap_trimmer() -> Callable[[], None] | None:
    """A function releasing free heap pages (glibc's malloc_trim), or None off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def release() -> None:
        trim(0)

    return release
