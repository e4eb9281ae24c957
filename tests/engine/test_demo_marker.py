""""demo" is a property of the model directory (engine/demo_marker.py): app/demo.py marks the demo
it builds, Engine.info reports the marker, and nothing is guessed from the model's shape."""

from __future__ import annotations

import json
import os

import pytest

from app.demo import ensure_demo_model
from converter import synth
from engine import pack
from engine.config import EngineConfig
from engine.demo_marker import DEMO_MARKER, is_demo_model, mark_demo_model
from engine.engine import Engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    return synth.write_checkpoint(out, synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))


def _info_demo(path) -> bool:
    eng = Engine.load(path, EngineConfig(numerics="exact"), warmup=False)
    try:
        return eng.info["demo"]
    finally:
        eng.close()


def test_the_marker_file_decides(tmp_path):
    assert not is_demo_model(tmp_path)
    mark_demo_model(tmp_path)
    mark_demo_model(tmp_path)  # idempotent
    assert is_demo_model(tmp_path) and os.listdir(tmp_path) == [DEMO_MARKER]
    (tmp_path / DEMO_MARKER).unlink()
    assert not is_demo_model(tmp_path)


def test_engine_info_reports_the_marker_not_the_shape(ckpt):
    assert _info_demo(ckpt) is False  # a tiny random model, but unmarked
    mark_demo_model(ckpt)
    try:
        assert _info_demo(ckpt) is True
    finally:
        (ckpt / DEMO_MARKER).unlink()


def test_ensure_demo_model_marks_the_demo_and_rebuilds_an_unmarked_one(tmp_path):
    calls = []

    def build(work, out, progress):
        calls.append(work)
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"version": pack.VERSION}))

    path = ensure_demo_model(tmp_path, print, build=build)
    assert is_demo_model(path) and len(calls) == 1
    assert ensure_demo_model(tmp_path, print, build=build) == path and len(calls) == 1
    (path / DEMO_MARKER).unlink()  # a demo built before the marker existed
    assert ensure_demo_model(tmp_path, print, build=build) == path
    assert is_demo_model(path) and len(calls) == 2 and os.listdir(tmp_path / "models") == ["demo"]
