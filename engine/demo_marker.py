"""Whether a model directory is the demo model: a property of the directory, written by whoever
builds the demo (app/demo.py) and read by the engine (`Engine.info["demo"]`), never guessed from
the model's shape.

The marker is a small text file, DEMO_MARKER, in the model directory; its text says why it is there.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_MARKER = "demo-model.txt"
_TEXT = ("This model directory is the dsv4-chat demo model: a tiny network with random weights "
         "(its answers are gibberish). Built by app/demo.py; the engine reports it as the demo.\n")


def is_demo_model(path: str | os.PathLike) -> bool:
    """Whether the model directory `path` carries the demo marker."""
    return (Path(path) / DEMO_MARKER).is_file()


def mark_demo_model(path: str | os.PathLike) -> None:
    """Mark the model directory `path` as the demo model (idempotent)."""
    (Path(path) / DEMO_MARKER).write_text(_TEXT, encoding="utf-8")
