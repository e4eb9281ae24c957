"""bench/ab.py: trees run alternately, each from its own folder, and tabulated with medians and
differences; a failed run is listed and the others go on. The trees here are stand-ins whose
bench/full_depth.py writes a report of full_depth's --json layout with figures of its own."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from bench import ab

_FAKE = textwrap.dedent('''
    """A stand-in bench.full_depth: writes a report for this tree, logs the run's order."""
    import json, os, sys
    from pathlib import Path

    tree = Path(__file__).resolve().parents[1]
    spec = json.loads((tree / "figures.json").read_text())
    args = sys.argv[1:]
    log = Path(os.environ["AB_TEST_LOG"])
    runs = log.read_text().splitlines() if log.is_file() else []
    log.write_text("\\n".join(runs + [tree.name + " " + " ".join(args[:-2])]) + "\\n")
    mine = sum(line.startswith(tree.name + " ") for line in runs)  # this tree's earlier runs
    if spec.get("fail_run") == mine:
        print("out of memory, say")
        sys.exit(3)
    step = spec["step_ms"][mine]
    report = {
        "ceilings": {"hbm_copy": 4.0e12, "h2d_pinned": 5.0e10},
        "bytes_per_token": 10.0e9,
        "runs": [{
            "graphed_step_ms": step + 0.5,
            "followup": {"ttft_s": 0.030},
            "followup_long": {"ttft_s": 0.050},
            "prompts": [{"decode_tok_s": 1e3 / step, "median_step_ms": step, "prefill_tok_s": 6000.0},
                        {"decode_tok_s": 1.0, "median_step_ms": 1.0, "prefill_tok_s": 9000.0}],
        }],
    }
    Path(args[args.index("--json") + 1]).write_text(json.dumps(report))
''')


def _tree(root: Path, name: str, **figures) -> Path:
    tree = root / name
    (tree / "bench").mkdir(parents=True)
    (tree / "bench" / "__init__.py").write_text("")
    (tree / "bench" / "full_depth.py").write_text(_FAKE)
    (tree / "figures.json").write_text(json.dumps(figures))
    return tree


def test_trees_alternate_and_the_table_has_every_run_the_medians_and_the_differences(tmp_path, monkeypatch, capsys):
    log = tmp_path / "order.log"
    monkeypatch.setenv("AB_TEST_LOG", str(log))
    old = _tree(tmp_path, "old", step_ms=[5.0, 6.0, 7.0])
    new = _tree(tmp_path, "new", step_ms=[4.0, 5.0, 6.0])
    out = tmp_path / "reports"
    assert ab.main(["--tree", f"old={old}", "--tree", f"new={new}", "--rounds", "3", "--out", str(out),
                    "--", "--shares", "1", "--tokens", "32"]) == 0
    # alternating, each from its own folder, with the arguments after `--` (then --json FILE)
    assert log.read_text().splitlines() == ["old --shares 1 --tokens 32", "new --shares 1 --tokens 32"] * 3
    assert sorted(p.name for p in out.iterdir()) == [f"{i:02d}-{n}.json" for i, n in
                                                     zip(range(1, 7), ["old", "new"] * 3)]
    final = capsys.readouterr().out.split("bench.ab: run 6")[1]
    # old's second run: 6 ms median step, 166.7 tok/s, graphed 6.5 ms = 2.5 ms roofline / 6.5 -> 38 %
    assert "| 3 | old | 4,000 | 166.7 | 6.00 | 6.50 (38 %) | 30 / 50 | 6,000, 9,000 |" in final
    assert "| 4 | new | 4,000 | 200.0 | 5.00 | 5.50 (45 %) | 30 / 50 | 6,000, 9,000 |" in final
    assert "| old | 3 | 166.7 | 6.00 | 6.50 |" in final  # medians
    assert "| new | 3 | 200.0 (+33.3) | 5.00 (-1.00) | 5.50 (-1.00) |" in final  # against old's
    assert "(differences from old's medians)" in final


def test_a_failed_run_is_listed_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AB_TEST_LOG", str(tmp_path / "order.log"))
    old = _tree(tmp_path, "old", step_ms=[5.0, 5.0])
    new = _tree(tmp_path, "new", step_ms=[4.0, 4.5], fail_run=0)
    assert ab.main(["--tree", f"old={old}", "--tree", f"new={new}", "--", "--tokens", "8"]) == 1
    captured = capsys.readouterr()
    assert "run 2 (new) failed (rc 3)" in captured.err and "out of memory, say" in captured.err
    final = captured.out.split("bench.ab: run 4")[1]
    assert "| 2 | new | failed | | | | | |" in final
    assert "| 4 | new | 4,000 | 222.2 | 4.50 |" in final
    assert "| new | 1 | 222.2 (+22.2) | 4.50 (-0.50) | 5.00 (-0.50) |" in final


def test_bad_trees_and_arguments_are_refused_with_the_fix(tmp_path):
    good = _tree(tmp_path, "good", step_ms=[1.0])
    with pytest.raises(SystemExit, match="has no bench/full_depth.py; give a checkout"):
        ab.main(["--tree", f"a={tmp_path}", "--tree", f"b={good}"])
    with pytest.raises(SystemExit, match="takes NAME=DIR"):
        ab.main(["--tree", str(good), "--tree", f"b={good}"])
    with pytest.raises(SystemExit, match="at least two trees with distinct names"):
        ab.main(["--tree", f"a={good}", "--tree", f"a={good}"])
    with pytest.raises(SystemExit, match="leave --json out"):
        ab.main(["--tree", f"a={good}", "--tree", f"b={good}", "--", "--json", "x.json"])
