"""`python -m engine generate --ckpt DIR --prompt TEXT`: one answer, for scripts.

The answer text streams to stdout; load progress and a statistics line go to stderr. Exit
status 0 on success, 1 if the turn failed, 2 on bad arguments, an unusable model directory or a
prompt over the context limit (the engine's turn refuses it: engine.events.ContextOverflow).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from engine import cli_args
from engine.reproducible import pin_cpu_math


def parser() -> argparse.ArgumentParser:
    p = cli_args.Parser(prog="python -m engine", description="DeepSeek-V4-Flash engine tools")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer one prompt")
    cli_args.add_engine_args(g)
    g.add_argument("--prompt", required=True, help="the user message")
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--think", action="store_true", help="thinking mode")
    return p


def _model_args(path: Path):
    """The ModelArgs of a model directory (a converted one's manifest, else its config.json);
    raises ConfigError (or OSError/ValueError for an unreadable manifest)."""
    from engine.config import ModelArgs

    manifest = path / "manifest.json"
    if manifest.is_file():
        return ModelArgs.from_dict(json.loads(manifest.read_text(encoding="utf-8"))["config"], str(manifest))
    return ModelArgs.from_dir(path)


def generate(a: argparse.Namespace) -> int:
    from engine.config import ConfigError
    from engine.engine import Engine
    from engine.events import ContextOverflow, EngineFailure, TextDelta, TurnFinished
    from engine.memory_plan import MemoryPlanError
    from engine.sampling import SamplingError, SamplingParams

    try:
        params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                max_tokens=a.max_tokens, seed=a.seed, thinking=a.think)
        config = cli_args.engine_config_from_args(a)
    except (SamplingError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        model = _model_args(Path(a.ckpt))
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        model = None  # an unusable directory: Engine.load names the problem
    if model is not None:
        try:
            model.check_seq_len(a.max_seq_len, "--max-seq-len")
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        engine = Engine.load(a.ckpt, config)
    except MemoryPlanError as exc:  # does not fit: the numbers and the fix
        print(f"error: cannot load {a.ckpt}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # unusable model directory: one line
        print(f"error: cannot load {a.ckpt}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(engine.plan.lines()), file=sys.stderr)
    status = 1
    try:
        session = engine.new_session(system=a.system)
        for ev in engine.generate(session, a.prompt, params, threading.Event()):
            if isinstance(ev, TextDelta):
                if ev.channel == "answer" or a.think:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            elif isinstance(ev, TurnFinished):
                s = ev.stats
                sys.stdout.write("\n")
                print(f"[{s.prompt_tokens} prompt tokens, {s.completion_tokens} generated ({s.finish_reason}), "
                      f"TTFT {s.ttft_s:.2f} s, {s.tok_per_s:.1f} tok/s]", file=sys.stderr)
                status = 0
            elif isinstance(ev, ContextOverflow):  # refused before any step: the engine's chat advice, reworded
                print(f"error: the prompt is {ev.prompt_tokens} tokens, over the context limit of {ev.limit}: "
                      "shorten it or raise --max-seq-len", file=sys.stderr)
                status = 2
            elif isinstance(ev, EngineFailure):
                print(f"error: {ev.message}", file=sys.stderr)
    finally:
        engine.close()
    return status


def main(argv: list[str] | None = None) -> int:
    pin_cpu_math()  # before any model work (engine/reproducible.py)
    a = parser().parse_args(argv)
    if a.command == "generate":
        return generate(a)
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
