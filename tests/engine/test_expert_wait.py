"""`ExpertUsage.wait_s`, the steps' "expert wait": seconds the host was blocked on expert reads,
not the provider's bookkeeping around them (lookups, holds, admissions, hints, use counts), which
is the MoE's time, or the graph's in a replayed step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from converter.convert import convert
from converter.synth import SynthOptions, tiny_config, write_checkpoint
from engine import pack as layout
from engine.weights import open_model

SLOW = 0.05  # seconds added to each bookkeeping call or read below


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", tiny_config(), SynthOptions(seed=1))


@pytest.fixture(scope="module")
def packed(source: Path, tmp_path_factory) -> Path:
    return convert(source, tmp_path_factory.mktemp("out") / "pack")


@pytest.fixture
def streaming(packed):
    """A streaming provider (host arena) with room for 8 experts, layer 0's 0..3 resident."""
    record = layout.read_manifest(packed).record.record_bytes
    files = open_model(packed, cache_bytes=8 * record)
    p = files.experts
    p.acquire(0, [0, 1, 2, 3])
    p.release(0)
    yield p
    files.close()


def slowed(monkeypatch, obj, name: str) -> None:
    """`obj.name` takes SLOW seconds longer."""
    fn = getattr(obj, name)

    def slow(*args, **kwargs):
        time.sleep(SLOW)
        return fn(*args, **kwargs)

    monkeypatch.setattr(obj, name, slow)


def test_bookkeeping_on_resident_experts_is_no_wait(streaming, monkeypatch):
    """Every expert resident, no read pending (a warm cache, or a layered step's acquire run while
    its segment is on the device): no wait, however long the lookups and counting take."""
    p = streaming
    slowed(monkeypatch, p.cache, "lookup")
    slowed(monkeypatch, p, "_record")
    before = p.usage.wait_s
    t0 = time.perf_counter()
    p.acquire(0, [0, 1])
    p.release(0)
    assert [e for e, _ in p.experts(0, [2, 3])] == [2, 3]
    p.record(0, [0, 1])
    p.settle_records()
    assert time.perf_counter() - t0 >= 4 * SLOW + SLOW  # the bookkeeping did take its time
    assert p.usage.wait_s - before < SLOW / 2


@pytest.mark.parametrize("path", ["acquire", "experts"])
def test_a_read_the_host_waits_for_is_a_wait(streaming, monkeypatch, path):
    p = streaming
    slowed(monkeypatch, p.store, "read_into")  # on the provider's I/O thread
    before = p.usage.wait_s
    if path == "acquire":
        p.acquire(1, [5])
        p.release(1)
    else:
        assert [e for e, _ in p.experts(1, [5])] == [5]
    assert p.usage.wait_s - before >= SLOW * 0.9
    assert p.stats().layer_misses[1] == 1  # one read, the one waited for


def test_an_official_checkpoints_expert_fetch_is_a_wait(source, monkeypatch):
    """Without a cache every expert is read from the shards as it is handed out: that read is the
    wait."""
    files = open_model(source)
    try:
        p = files.experts
        slowed(monkeypatch, p, "fetch")
        before = p.usage.wait_s
        assert [e for e, _ in p.experts(0, [1, 2])] == [1, 2]
        assert p.usage.wait_s - before >= 2 * SLOW * 0.9
    finally:
        files.close()
