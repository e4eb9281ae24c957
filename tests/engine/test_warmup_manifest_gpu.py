"""The kernel manifest on CUDA: a later process replays it (then warms up with every kernel built)
and still compiles nothing and captures no decode graph during a chat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from converter import synth
from converter.convert import convert

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]

# One process: load on the TileLang backend, then a five-turn chat with prompts of ~3 to ~2,000
# tokens; prints the load's phases, the kernels built at load and during the chat.
CHILD = r'''
import json, sys, time
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import TurnFinished
from engine.sampling import SamplingParams
from kernels.backend import built_kernels, compiled_kernels

phases = []
t = time.perf_counter()
eng = Engine.load(sys.argv[1], EngineConfig(device="cuda", backend="tilelang", max_seq_len=8192),
                  progress=lambda p: phases.append(p.phase))
load_s = time.perf_counter() - t
at_load, built = compiled_kernels(), built_kernels()
captured = eng.runtime.runner.captures
sess = eng.new_session()
for words in (3, 40, 700, 1500, 12):
    events = list(eng.generate(sess, " ".join(f"w{i % 97}" for i in range(words)),
                               SamplingParams(temperature=0.0, max_tokens=8)))
    assert isinstance(events[-1], TurnFinished), events[-1]
eng_captures = eng.runtime.runner.captures
eng.close()
print("RESULT " + json.dumps({"phases": sorted(set(phases)), "load_s": load_s, "at_load": at_load,
                              "during_chat": compiled_kernels() - at_load,
                              "captured_in_chat": eng_captures - captured,
                              "compiled_in_chat": sorted(built_kernels() - built)}))
'''


def _run(pack: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", CHILD, str(pack)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=1200)
    found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and found, out.stderr[-4000:]
    return json.loads(found[-1][len("RESULT "):])


def test_a_later_process_replays_the_manifest_and_compiles_nothing_during_a_chat(tmp_path):
    src = synth.write_checkpoint(tmp_path / "hf", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    pack = convert(src, tmp_path / "conv")
    first = _run(pack)  # writes the manifest (or replays one an earlier run wrote)
    later = _run(pack)
    assert "loading kernels" in later["phases"] and "compiling kernels" not in later["phases"], later
    assert "warming up" in later["phases"] and later["captured_in_chat"] == 0, later
    assert first["captured_in_chat"] == 0, first
    # the manifest holds every kernel the first process built (a test running beside this one on
    # the same TileLang cache may have rewritten the manifest of this key with more: its hints)
    assert later["at_load"] >= first["at_load"]
    assert later["at_load"] > 0 and later["during_chat"] == 0 and first["during_chat"] == 0, (first, later)
