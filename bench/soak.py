"""Soak: many short turns on the demo model through the app's own `Engine`; does RSS or turn time drift?

    python bench/soak.py [--turns 1000] [--per-session 20] [--max-tokens 4] [--data-dir DIR] [--json]

Builds (or reuses, with --data-dir) the demo model with app/demo.py `ensure_demo_model`, loads it
with `Engine.load` on the CPU (default), then runs `--turns` turns of a short user message each,
greedy by default. `--per-session K` starts a new conversation every K turns; `--per-session 0`
keeps one conversation until the next turn would not fit `--max-seq-len`, then starts a new one.
Every `--every` turns it samples the process RSS (engine/memory.py `process_rss`) and the median
turn time of the turns since the previous sample. At the end: a table (turn, RSS MiB, median turn
ms), and the RSS slope in MiB per 100 turns, a least-squares fit over the samples of the second
half of the run (so that warm-up and the first cache fills are left out). `--json` prints one
JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.demo import ensure_demo_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.events import EngineFailure, TurnFinished  # noqa: E402
from engine.memory import process_rss  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

MIB = 1 << 20
CHAT_MARGIN = 8  # tokens of chat format around a user message and an answer (role markers, EOS)
PROMPTS = ("hello", "what is a mixture of experts?", "tell me a short story", "and then?",
           "count to five", "why is the sky blue?", "summarise that", "thanks")


def slope_per_100(samples: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of (turn, MiB) points, in MiB per 100 turns (None under two points)."""
    if len(samples) < 2:
        return None
    xs, ys = [float(t) for t, _ in samples], [m for _, m in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def run(engine: Engine, turns: int, per_session: int, params: SamplingParams, every: int,
        log=None, trim=None) -> dict:
    """Run the soak on a loaded engine; returns the samples, the slope and the counts. `trim`
    (e.g. app.heap_trim's glibc malloc_trim) is called after every turn when given."""
    limit = engine.config.max_seq_len
    samples = [{"turn": 0, "rss_mib": process_rss() / MIB, "median_turn_ms": None, "position": 0}]
    if log is not None:
        log(samples[0])
    window: list[float] = []
    session, in_session, sessions, tokens = engine.new_session(), 0, 1, 0
    finish: dict[str, int] = {}
    t_run = time.perf_counter()
    for turn in range(1, turns + 1):
        text = f"{PROMPTS[turn % len(PROMPTS)]} ({turn})"
        need = len(session.ids) + len(engine.tokenizer.encode(text)) + params.max_tokens + CHAT_MARGIN
        if (per_session and in_session >= per_session) or (not per_session and in_session and need >= limit):
            session.release()
            session, in_session, sessions = engine.new_session(), 0, sessions + 1
        t0 = time.perf_counter()
        last = None
        for event in engine.generate(session, text, params):
            last = event
        window.append((time.perf_counter() - t0) * 1000.0)
        if isinstance(last, EngineFailure):
            raise RuntimeError(f"turn {turn} failed: {last.message}")
        if not isinstance(last, TurnFinished):
            raise RuntimeError(f"turn {turn} ended without TurnFinished ({last!r})")
        if trim is not None:
            trim()
        tokens += last.stats.completion_tokens
        finish[last.stats.finish_reason] = finish.get(last.stats.finish_reason, 0) + 1
        in_session += 1
        if turn % every == 0 or turn == turns:
            sample = {"turn": turn, "rss_mib": process_rss() / MIB, "median_turn_ms": statistics.median(window),
                      "position": len(session.ids)}
            samples.append(sample)
            window = []
            if log is not None:
                log(sample)
    tail = [(s["turn"], s["rss_mib"]) for s in samples if s["turn"] >= turns / 2]
    return {"turns": turns, "per_session": per_session, "sessions": sessions, "completion_tokens": tokens,
            "finish_reasons": finish, "seconds": time.perf_counter() - t_run, "samples": samples,
            "slope_mib_per_100_turns": slope_per_100(tail), "slope_points": len(tail)}


def _row(sample: dict) -> str:
    ms = sample["median_turn_ms"]
    return f"{sample['turn']:>6}  {sample['rss_mib']:>8.1f}  {'-' if ms is None else f'{ms:.0f}':>10}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--per-session", type=int, default=20,
                    help="turns per conversation; 0: one conversation until the context limit, then a new one")
    ap.add_argument("--every", type=int, default=50, help="sample RSS and turn time every N turns")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data-dir", type=Path, default=None, help="where the demo model lives (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--trim", action="store_true",
                    help="give freed heap pages back after every turn (glibc malloc_trim, as the server does): "
                         "tells allocator retention from a leak")
    args = ap.parse_args(argv)
    if args.turns < 1 or args.every < 1 or args.per_session < 0 or args.max_tokens < 1:
        ap.error("--turns, --every and --max-tokens must be >= 1, --per-session >= 0")

    tmp = None
    if args.data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="dsv4-soak-")
        data_dir = Path(tmp.name)
    else:
        data_dir = args.data_dir
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else \
        (lambda line: print(line, flush=True))
    try:
        t0 = time.perf_counter()
        model_dir = ensure_demo_model(data_dir, lambda p: None)
        config = EngineConfig(device=args.device, max_seq_len=args.max_seq_len)
        with Engine.load(model_dir, config) as engine:
            say(f"demo model {model_dir} loaded in {time.perf_counter() - t0:.1f} s; {args.turns} turns, "
                f"per session {args.per_session or 'until the context limit'}, max_tokens {args.max_tokens}, "
                f"temperature {args.temperature}, device {args.device}")
            say(f"{'turn':>6}  {'RSS MiB':>8}  {'median ms':>10}")
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
            trim = None
            if args.trim:
                from app.heap_trim import heap_trimmer

                trim = heap_trimmer()
            result = run(engine, args.turns, args.per_session, params, args.every, lambda s: say(_row(s)), trim)
    finally:
        if tmp is not None:
            tmp.cleanup()
    result.update(max_tokens=args.max_tokens, temperature=args.temperature, device=args.device,
                  max_seq_len=args.max_seq_len)
    slope = result["slope_mib_per_100_turns"]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        first, last = result["samples"][0], result["samples"][-1]
        print(f"{result['turns']} turns in {result['sessions']} conversation(s), {result['seconds']:.0f} s; "
              f"RSS {first['rss_mib']:.1f} -> {last['rss_mib']:.1f} MiB; slope over the second half "
              f"({result['slope_points']} samples): "
              + ("n/a" if slope is None else f"{slope:+.2f} MiB per 100 turns"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
