"""Fixtures for the app tests: a config in a temp data dir and a fake-engine backend."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_engine import FakeBackend, FakeEngine

from app.settings import AppConfig


@pytest.fixture
def config(tmp_path: Path) -> AppConfig:
    """Settings pointing at a temp data dir and an (irrelevant to the fake) model dir."""
    return AppConfig(data_dir=tmp_path / "data", model=tmp_path / "model")


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(FakeEngine())
