"""The command-line options every `dsv4-chat` command shares (the TUI, `--plain`, `run`, `serve`):
the model, engine and generation settings, and how they become an `AppConfig` (flags > DSV4_*
environment > settings file > defaults, app/settings.py)."""

from __future__ import annotations

import argparse
from app.settings import AppConfig, build_config, check_config_file


def add_chat_options(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    """The options shared by `dsv4-chat` and its subcommands (model, engine and generation
    settings). On a subcommand they are added with `suppress=True`, so an option given before the
    subcommand's name is not reset by the subcommand's defaults."""

    def default(value):
        return argparse.SUPPRESS if suppress else value

    p.add_argument("--model", default=default(None), help="converted model directory")
    p.add_argument("--demo", action="store_true", default=default(None),
                   help="use the embedded tiny demo model (random weights)")
    p.add_argument("--config", default=default(None), help="settings file (TOML)")
    p.add_argument("--cache-gb", type=float, default=default(None),
                   help="expert-cache budget in GiB (default: what the memory plan leaves)")
    p.add_argument("--host-cache-gb", type=float, default=default(None),
                   help="cap on the pinned host-RAM expert tier in GiB (discrete GPU; default: the whole "
                        "expert pool when free RAM allows)")
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


def config_from_namespace(args: argparse.Namespace, env: dict[str, str]) -> AppConfig:
    """The AppConfig of parsed options and the environment. `--model` and `--config` arrive as
    text (None = not given), so an empty one is refused rather than read as "."; every problem
    is one SettingsError line (a missing file, a directory, a name the system refuses)."""
    options = vars(args)
    flags = {
        "model": options.get("model"),
        "plain": options.get("plain") or options.get("command") == "run",
        **{key: options.get(key) for key in ("demo", "cache_gb", "host_cache_gb", "memory_gb", "numerics", "device", "backend",
                                              "cuda_graphs", "max_tokens", "temperature", "system")},
    }
    given = options.get("config")
    config_file = None if given is None else check_config_file(given, "--config")
    return build_config(flags, env, config_file)
