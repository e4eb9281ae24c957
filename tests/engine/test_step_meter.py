"""StepMeter: a step update re-measures the memory budget at most every MEMORY_REFRESH_S, and
`refresh` (called while the device runs a prompt's last chunk) spares the next update its
measurement."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.runtime import StepResult
from engine.stats import StepTiming
from engine.step_meter import MEMORY_REFRESH_S, StepMeter


def _meter():
    measured = []

    def memory():
        measured.append(len(measured))
        return f"budget {len(measured)}"
    return StepMeter(lambda: SimpleNamespace(bytes_read=0), memory), measured


def _result() -> StepResult:
    return StepResult(logits=torch.zeros(4), tokens=8, seconds=0.01, timing=StepTiming())


def test_a_refresh_spares_the_next_update_its_measurement():
    meter, measured = _meter()
    meter.start_turn(0)
    meter.refresh()
    assert len(measured) == 1
    stats = meter.step(_result(), 8, None)
    assert len(measured) == 1 and stats.memory == "budget 1" and stats.position == 8


def test_updates_measure_at_most_every_refresh_interval(monkeypatch):
    meter, measured = _meter()
    clock = [100.0]
    monkeypatch.setattr("engine.step_meter.time.perf_counter", lambda: clock[0])
    meter.step(_result(), 8, None)
    meter.step(_result(), 9, 0.05)
    assert len(measured) == 1
    clock[0] += MEMORY_REFRESH_S
    assert meter.step(_result(), 10, 0.05).memory == "budget 2"
    meter.refresh()
    assert len(measured) == 3
