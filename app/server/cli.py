"""`dsv4-chat serve`: load the engine as the app would (same settings, flags > DSV4_* > file >
defaults) and serve it over HTTP with uvicorn, on 127.0.0.1 unless --host says otherwise.

`add_options` puts the server's own options on the `serve` subcommand of `dsv4-chat`'s parser
(app.__main__), whose shared options may come before or after `serve`; `run` serves a parsed
namespace."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from app.heap import HeapFreeze
from app.options import config_from_namespace
from app.settings import SettingsError


DESCRIPTION = ("Serve the model over an OpenAI-compatible HTTP API (POST /v1/chat/completions, "
               "GET /v1/models, /v1/stats, /health).")


def add_options(p: argparse.ArgumentParser) -> None:
    """The server's own options (the model, engine and generation options are `dsv4-chat`'s)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* requests")
    p.add_argument("--max-queue", type=int, default=8,
                   help="requests that may wait behind the running one; more get 429 (default 8)")
    p.add_argument("--max-sessions", type=int, default=4,
                   help="conversations whose KV state is kept for reuse, least recently used evicted "
                        "(default 4; 0 = no reuse)")
    p.add_argument("--max-state-gb", type=float,
                   help="bound on the kept conversations' state, GiB (default: only --max-sessions)")
    p.add_argument("--keepalive", type=float, default=10.0,
                   help="seconds between SSE keep-alive comments while a request waits or prefills (default 10)")


def _problem(args: argparse.Namespace) -> str | None:
    if not 0 < args.port < 65536:
        return f"--port must be in 1-65535, got {args.port}"
    if args.max_queue < 0 or args.max_sessions < 0:
        return "--max-queue and --max-sessions must be >= 0"
    if args.keepalive <= 0:
        return f"--keepalive must be > 0 seconds, got {args.keepalive}"
    if args.max_state_gb is not None and args.max_state_gb <= 0:
        return f"--max-state-gb must be > 0, got {args.max_state_gb}"
    if args.api_key is not None and not args.api_key.strip():
        return "--api-key must not be empty"
    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable()):
        return "--api-key must be printable ASCII: HTTP clients send it in a header"
    return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    """`dsv4-chat serve` with its parsed options (app.__main__); the exit status."""
    problem = _problem(args)
    if problem:
        print(f"dsv4-chat serve: {problem}", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from app.server.api import ServerConfig, build_app
        from app.server.runner import Server, bind_problem
    except ModuleNotFoundError as err:
        print(f"dsv4-chat serve: {err.name} is missing; install the server extra: pip install 'dsv4-chat[server]'",
              file=sys.stderr)
        return 2
    try:
        config = config_from_namespace(args, dict(os.environ))
    except SettingsError as err:
        print(f"dsv4-chat serve: {err}", file=sys.stderr)
        return 2
    problem = bind_problem(args.host, args.port)
    if problem:
        print(f"dsv4-chat serve: {problem}", file=sys.stderr)
        return 2
    from app.plain import load_engine  # the same model choice and progress lines as --plain

    try:
        engine = load_engine(config, sys.stderr)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    except Exception as exc:  # a model that cannot be loaded: one line, no traceback
        print(f"dsv4-chat serve: cannot load the model: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if not _loopback(args.host) and args.api_key is None:
        print(f"dsv4-chat serve: warning: listening on {args.host} without --api-key: anyone who can reach "
              "this port can use the model", file=sys.stderr)
    server_config = ServerConfig(api_key=args.api_key, max_queue=args.max_queue, max_sessions=args.max_sessions,
                                 max_state_bytes=None if args.max_state_gb is None else int(args.max_state_gb * 2**30),
                                 keepalive_s=args.keepalive, defaults=config.gen, system=config.system or None)
    heap = HeapFreeze()
    try:
        heap.freeze()  # the engine is built: keep full GC passes off the requests' path (app/heap.py)
        app = build_app(engine, server_config)
        Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5),
               app.state.api.worker).run()
    except KeyboardInterrupt:  # uvicorn raises Ctrl+C again once it has shut down cleanly
        return 130
    finally:
        heap.release()
        engine.close()
    return 0
