"""`dsv4-chat`: parse flags, merge settings (flags > DSV4_* environment > TOML file > defaults),
then run the TUI (or the line-mode chat with --plain)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from app.settings import AppConfig, SettingsError, build_config
from engine.reproducible import pin_cpu_math


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-chat",
        description="Chat with DeepSeek-V4-Flash on a streaming MoE engine.",
        epilog="Settings file: --config, else $DSV4_CONFIG, else the user config dir's "
               "dsv4-chat/config.toml. Every setting may also be given as DSV4_<KEY>.",
    )
    p.add_argument("--model", type=Path, help="converted model directory")
    p.add_argument("--demo", action="store_true", default=None,
                   help="use the embedded tiny demo model (random weights)")
    p.add_argument("--plain", action="store_true", help="line-mode chat (no TUI)")
    p.add_argument("--config", type=Path, help="settings file (TOML)")
    p.add_argument("--cache-gb", type=float, help="expert-cache budget in GiB")
    p.add_argument("--numerics", choices=("native", "exact"))
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--backend", choices=("torch", "tilelang"),
                   help="kernel backend (default: tilelang on CUDA when installed, else torch)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                   help="run every decode step eagerly instead of replaying CUDA graphs")
    return p


def config_from_args(argv: list[str] | None, env: dict[str, str]) -> AppConfig:
    args = parser().parse_args(argv)
    flags = {
        "model": args.model.expanduser() if args.model else None,
        "demo": args.demo,
        "plain": args.plain,
        "cache_gb": args.cache_gb,
        "numerics": args.numerics,
        "device": args.device,
        "backend": args.backend,
        "cuda_graphs": args.cuda_graphs,
    }
    config_file = args.config.expanduser() if args.config else None
    if config_file is not None and not config_file.is_file():
        raise SettingsError(f"--config {config_file}: no such file")
    return build_config(flags, env, config_file)


def main(argv: list[str] | None = None) -> int:
    pin_cpu_math()  # before any model work (engine/reproducible.py)
    rest = sys.argv[1:] if argv is None else argv
    if rest[:1] == ["serve"]:  # `dsv4-chat serve ...`: the HTTP API (app/server/cli.py)
        from app.server.cli import main as serve_main

        return serve_main(rest[1:])
    try:
        config = config_from_args(argv, dict(os.environ))
    except SettingsError as err:
        print(f"dsv4-chat: {err}", file=sys.stderr)
        return 2
    if config.plain:
        try:
            from app.plain import main as plain_main
        except ModuleNotFoundError as err:
            if err.name != "app.plain":
                raise
            print("dsv4-chat: line mode (--plain) is not in this build", file=sys.stderr)
            return 2
        return plain_main(config) or 0
    from app.app import ChatApp

    ChatApp(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
