"""`dsv4-chat`: parse flags, merge settings (flags > DSV4_* environment > TOML file > defaults),
then run the TUI, the line-mode chat (--plain), or one prompt (`dsv4-chat run PROMPT`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from app.settings import AppConfig, SettingsError, build_config
from engine.reproducible import pin_cpu_math


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one line (`dsv4-chat: error: …`), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_chat_options(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    """The options shared by `dsv4-chat` and its subcommands (model, engine and generation
    settings). On a subcommand they are added with `suppress=True`, so an option given before the
    subcommand's name is not reset by the subcommand's defaults."""

    def default(value):
        return argparse.SUPPRESS if suppress else value

    p.add_argument("--model", type=Path, default=default(None), help="converted model directory")
    p.add_argument("--demo", action="store_true", default=default(None),
                   help="use the embedded tiny demo model (random weights)")
    p.add_argument("--config", type=Path, default=default(None), help="settings file (TOML)")
    p.add_argument("--cache-gb", type=float, default=default(None),
                   help="expert-cache budget in GiB (default: what the memory plan leaves)")
    p.add_argument("--memory-gb", type=float, default=default(None),
                   help="cap on the whole memory plan in GiB (default: the device's free memory; "
                        "unified memory: 90%% of the machine)")
    p.add_argument("--numerics", choices=("native", "exact"), default=default(None))
    p.add_argument("--device", choices=("cpu", "cuda"), default=default(None))
    p.add_argument("--backend", choices=("torch", "tilelang"), default=default(None),
                   help="kernel backend (default: tilelang on CUDA when installed, else torch)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=default(None),
                   help="run every decode step eagerly instead of replaying CUDA graphs")
    p.add_argument("--max-tokens", type=int, default=default(None), help="longest answer, in tokens")
    p.add_argument("--temperature", type=float, default=default(None),
                   help="sampling temperature in [0, 2] (0 = greedy)")
    p.add_argument("--system", default=default(None), help="system prompt")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="dsv4-chat",
        description="Chat with DeepSeek-V4-Flash on a streaming MoE engine.",
        epilog="Settings file: --config, else $DSV4_CONFIG, else the user config dir's "
               "dsv4-chat/config.toml. Every setting may also be given as DSV4_<KEY>.",
    )
    add_chat_options(p)
    p.add_argument("--warm-up", action="store_true",
                   help="load the model and compile every GPU kernel it can need (kept in TileLang's "
                        "on-disk cache for later starts), then exit")
    p.add_argument("--plain", action="store_true",
                   help="line-mode chat (no TUI); without a terminal on stdin, answers go to "
                        "stdout and everything else to stderr")
    commands = p.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="answer one prompt and exit (like `ollama run`)",
                              description="Answer one prompt: the answer on stdout, statistics on "
                                          "stderr; exit 1 if the turn fails.")
    run.add_argument("prompt", nargs="*", help="the prompt (words are joined); none: read stdin")
    add_chat_options(run, suppress=True)
    return p


def config_from_namespace(args: argparse.Namespace, env: dict[str, str]) -> AppConfig:
    options = vars(args)
    flags = {
        "model": options["model"].expanduser() if options.get("model") else None,
        "plain": options.get("plain") or options.get("command") == "run",
        **{key: options.get(key) for key in ("demo", "cache_gb", "memory_gb", "numerics", "device", "backend",
                                              "cuda_graphs", "max_tokens", "temperature", "system")},
    }
    config_file = options["config"].expanduser() if options.get("config") else None
    if config_file is not None and not config_file.is_file():
        raise SettingsError(f"--config {config_file}: no such file")
    return build_config(flags, env, config_file)


def config_from_args(argv: list[str] | None, env: dict[str, str]) -> AppConfig:
    return config_from_namespace(parser().parse_args(argv), env)


def main(argv: list[str] | None = None) -> int:
    pin_cpu_math()  # before any model work (engine/reproducible.py)
    rest = sys.argv[1:] if argv is None else argv
    if rest[:1] == ["serve"]:  # `dsv4-chat serve ...`: the HTTP API (app/server/cli.py)
        from app.server.cli import main as serve_main

        return serve_main(rest[1:])
    args = parser().parse_args(argv)
    try:
        config = config_from_namespace(args, dict(os.environ))
    except SettingsError as err:
        print(f"dsv4-chat: {err}", file=sys.stderr)
        return 2
    for line in config.warnings:
        print(f"dsv4-chat: {line}", file=sys.stderr)
    if args.warm_up:
        from app.plain import warm_up

        return warm_up(config)
    if args.command == "run":
        from app.plain import run_once

        return run_once(config, " ".join(args.prompt))
    if config.plain:
        from app.plain import main as plain_main

        return plain_main(config) or 0
    from app.app import ChatApp

    ChatApp(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
