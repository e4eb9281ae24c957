"""Durable file replacement, shared by the converter's writers (convert.py, upgrade.py)."""

from __future__ import annotations

import os
from pathlib import Path


def replace_durably(tmp: Path, final: Path) -> None:
    """Rename `tmp` over `final` and fsync the directory, so the rename survives a crash."""
    os.replace(tmp, final)
    dfd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
