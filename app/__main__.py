"""`dsv4-chat`: parse flags, merge settings (flags > DSV4_* environment > TOML file > defaults),
then run the TUI, the line-mode chat (--plain), one prompt (`dsv4-chat run PROMPT`) or the HTTP
API (`dsv4-chat serve`, app/server/cli.py)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from app.options import add_chat_options, config_from_namespace
from app.server import cli as serve_cli
from app.settings import AppConfig, SettingsError
from engine.reproducible import pin_cpu_math


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one line (`dsv4-chat: error: …`), not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
    serve = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API "
                                              "(needs the server extra)", description=serve_cli.DESCRIPTION)
    serve_cli.add_options(serve)
    add_chat_options(serve, suppress=True)
    return p


def config_from_args(argv: list[str] | None, env: dict[str, str]) -> AppConfig:
    return config_from_namespace(parser().parse_args(argv), env)


def main(argv: list[str] | None = None) -> int:
    pin_cpu_math()  # before any model work (engine/reproducible.py)
    args = parser().parse_args(argv)
    if args.command == "serve":  # its settings and errors are its own (app/server/cli.py)
        return serve_cli.run(args)
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
