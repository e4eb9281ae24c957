"""app.backend.EngineLike, the engine facade as the app drives it: the real Engine and the app
tests' FakeEngine both provide every member with a signature that accepts the app's calls."""

from __future__ import annotations

import inspect

import pytest
from fake_engine import FakeEngine, FakeSession

from app.backend import EngineLike, SessionLike
from engine.engine import Engine
from engine.session import Session

MEMBERS = ["info", "new_session", "generate", "regenerate", "undo", "flush_cache", "pin", "pin_hot", "unpin",
           "cache_contents", "stats", "close"]


def _members(protocol) -> list[str]:
    return [name for name in vars(protocol) if not name.startswith("_")]


def test_the_protocol_lists_the_facade_the_app_uses():
    assert _members(EngineLike) == MEMBERS
    assert _members(SessionLike) == ["messages", "position"]


@pytest.mark.parametrize("impl", [Engine, FakeEngine])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_engine_accepts_the_protocols_calls(impl, name):
    want, have = getattr(EngineLike, name), getattr(impl, name)
    if isinstance(want, property):
        assert isinstance(have, property)
        return
    want_params = list(inspect.signature(want).parameters.values())
    have_params = list(inspect.signature(have).parameters.values())
    assert [p.name for p in have_params[:len(want_params)]] == [p.name for p in want_params]
    for w, h in zip(want_params, have_params):
        assert h.kind == w.kind and (w.default is inspect.Parameter.empty or h.default == w.default), (w, h)
    assert all(p.default is not inspect.Parameter.empty for p in have_params[len(want_params):])


@pytest.mark.parametrize("impl", [Session, FakeSession])
def test_each_session_has_what_the_app_reads(impl):
    session = impl(lambda: None) if impl is Session else impl()
    assert list(session.messages) == [] and session.position == 0
