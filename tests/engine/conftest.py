"""Fixtures of the engine's graph-runner tests: the no-flip tiny model converted once per module,
and opened with every expert in the arena."""

from __future__ import annotations

from pathlib import Path

import pytest

from converter.convert import convert
from engine.weights import open_model


@pytest.fixture(scope="module")
def packed(separated_ckpt, tmp_path_factory) -> Path:
    """The no-flip tiny model (tests/conftest.py), converted."""
    return convert(separated_ckpt, tmp_path_factory.mktemp("out") / "pack")


@pytest.fixture
def files(packed):
    """The converted model opened with every expert loaded into the arena (closed afterwards)."""
    files = open_model(packed)
    try:
        assert files.experts.load_all()
        yield files
    finally:
        files.close()
