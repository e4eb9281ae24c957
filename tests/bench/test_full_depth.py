"""bench/full_depth.py's per-process measurement, run on the CPU (the torch reference, no graphs)
on the tiny model: the figures the yardstick table is made of."""

from __future__ import annotations

import json
import random
import re

import pytest

from bench import ab, full_depth, step_trace
from converter import synth
from converter.convert import convert


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_depth")
    ckpt = synth.write_checkpoint(root / "ckpt", synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))
    return convert(ckpt, root / "pack", resume=False)


def test_a_streamed_process_reports_its_graphed_step_reads_and_prefetch_counters(pack, capsys, tmp_path):
    assert full_depth.main(["--child", "--pack", str(pack), "--share", "0.5", "--device", "cpu", "--prompts", "16",
                            "--tokens", "4", "--max-seq-len", "512", "--io-threads", "2", "--host-profile", "40",
                            "--trace", str(tmp_path)]) == 0
    out = capsys.readouterr()
    r = json.loads(next(line for line in out.out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert r["graphed_step_ms"] > 0 and r["kernels_during_chat"] == 0 and r["pool_bytes"] > r["cache_bytes"] > 0
    # the graphed steps' own reads: some per step at half the pool, all inside the run's total
    assert 0 < 32 * r["step_read_gb"] <= r["miss_gb"]
    assert r["miss_gb_s"] == pytest.approx(r["step_read_gb"] / (r["graphed_step_ms"] / 1e3), rel=0.5)
    lookahead = r["prefetch"]["lookahead"]
    assert lookahead["issued"] > 0 and 0 < lookahead["accuracy"] <= 1
    assert "lookahead prefetch: accuracy" in out.err
    # the host's own calls during the measured steps: the 40 with the most own time
    assert "function calls" in r["host_profile"] and "Ordered by: internal time" in r["host_profile"]
    assert len(re.findall(r"^ +\d+(?:/\d+)? +\d+\.\d+ ", r["host_profile"], re.M)) == 40
    table = full_depth.table([dict(r, label="cpu")], {"hbm_copy": 1e12, "h2d_pinned": 5e10}, 10**9)
    assert "graphed step reads: GB, GB/s (% of H2D); follow-up turn's reads" in table and "| 50 % cpu |" in table
    # steps guessed whole (engine/step_guess.py) take a graph runner: none on the CPU, none shown
    assert r["prompts"][0]["guessed"] == r["guessed"] == 0 and "hit rate; steps guessed whole (redone)" in table
    guessed = dict(r, prompts=[dict(r["prompts"][0], guessed=40, guessed_wrong=3)])
    hit = f"{r['prompts'][0]['hit_rate']:.3f}"
    assert f"| {hit}; 40 (3) |" in full_depth.table([guessed], {"hbm_copy": 1e12, "h2d_pinned": 5e10}, 10**9)
    # the follow-up turn's own reads, per second of that turn
    f = r["followup"]
    assert 0 < f["read_gb"] <= r["miss_gb"]
    assert f["read_gb_s"] == pytest.approx(f["read_gb"] / (f["prefill_s"] + f["decode_s"]))
    # a second, longer follow-up: about 32 new tokens (27 message tokens and the chat template's)
    assert 28 <= r["followup_long"]["new_tokens"] <= 36 and r["followup_long"]["ttft_s"] > 0
    assert f"({r['followup_long']['new_tokens']} new) |" in table
    # bench.ab reads this run's figures from a --json report of this layout
    figures = ab.Figures.of({"ceilings": {"hbm_copy": 1e12}, "bytes_per_token": 10**9, "runs": [r]})
    assert figures.graphed_step_ms == r["graphed_step_ms"] and figures.roofline_ms == 1.0
    assert figures.followup_ttft_ms == (1e3 * f["ttft_s"], 1e3 * r["followup_long"]["ttft_s"])
    assert figures.prefill_tok_s == (r["prompts"][0]["prefill_tok_s"],) and figures.decode_tok_s > 0
    # the Chrome trace of 4 more steps: the runner's steps are in it
    events = json.loads((tmp_path / "trace_0.5.json").read_text())["traceEvents"]
    assert sum(bool(re.fullmatch(r"engine/runtime\.py\(\d+\): step", e.get("name", ""))) for e in events) == 4
    # bench.step_trace reads it: 4 steps, none of whose time is on a device (the CPU has none)
    steps = step_trace.summarise(step_trace.read_events(tmp_path / "trace_0.5.json"), 10)
    assert len(steps) == 4 and all(s.wall > 0 and s.compute == s.copy == 0 for s in steps)
    assert "engine/experts/provider.py: acquire" in step_trace.host_calls(step_trace.read_events(
        tmp_path / "trace_0.5.json"), 4)


def test_no_lookahead_turns_the_hints_off(pack, capsys):
    assert full_depth.main(["--child", "--pack", str(pack), "--share", "0.5", "--device", "cpu", "--prompts", "16",
                            "--tokens", "4", "--max-seq-len", "512", "--io-threads", "2", "--no-lookahead"]) == 0
    out = capsys.readouterr()
    r = json.loads(next(line for line in out.out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    lookahead = r["prefetch"]["lookahead"]
    assert lookahead["hinted"] == lookahead["issued"] == 0 and r["miss_gb"] > 0


def test_forced_routing_takes_a_stand_in_lookahead(pack, capsys, tmp_path):
    """--routing-trace with --lookahead-accuracy 1: the forced layers (3 and 4) are hinted, and
    every routed expert of a hinted layer was named by its hint."""
    rng = random.Random(0)
    lines = ["pos,layer,n,e0,e1,e2,e3,e4,e5,w0,w1,w2,w3,w4,w5"]
    for t in range(8):
        for layer in (3, 4):
            lines.append(",".join(map(str, [t, layer, 6, *rng.sample(range(16), 6), .3, .3, .2, .1, .05, .05])))
    trace = tmp_path / "t.csv"
    trace.write_text("\n".join(lines) + "\n")
    assert full_depth.main(["--child", "--pack", str(pack), "--share", "0.5", "--device", "cpu", "--prompts", "16",
                            "--tokens", "4", "--max-seq-len", "512", "--io-threads", "2", "--routing-trace",
                            str(trace), "--lookahead-accuracy", "1"]) == 0
    out = capsys.readouterr()
    r = json.loads(next(line for line in out.out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    lookahead = r["prefetch"]["lookahead"]
    assert lookahead["routed"] > 0 and lookahead["predicted"] == lookahead["routed"] and lookahead["issued"] > 0
    assert "a stand-in right 100% of the time" in r["routing"]
