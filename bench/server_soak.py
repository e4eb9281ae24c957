"""`dsv4-chat serve` under load: KV reuse figures, then a soak with the server's RSS sampled.

Starts the server as a subprocess (`python -m app serve`, the demo model unless --model), then

1. reuse: a three-turn conversation (a long system prompt, short user turns), streamed; prints
   turn 3's prefill tokens, reused tokens, server TTFT and client TTFT (request sent -> first
   content chunk), median over --reps conversations. Then the same on a second server started
   with --max-sessions 0 (no reuse), for comparison.
2. soak: --requests short requests (max_tokens 4) in conversations of 4 turns, alternating
   streamed and non-streamed, every 10th a client that disconnects after its first token;
   the server's VmRSS (/proc/<pid>/status) is sampled every 10 requests. Prints the samples
   and the growth after the warm-up (first 20 requests).

    python bench/server_soak.py                     # demo model, 200 requests
    python bench/server_soak.py --model DIR --device cuda --requests 500
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(60))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class Server:
    """`python -m app serve ...` on a free port; the data dir holds the demo model."""

    def __init__(self, args, extra: list[str]) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "app", "serve", "--port", str(self.port)] + extra
        cmd += ["--model", str(args.model)] if args.model else ["--demo"]
        if args.device:
            cmd += ["--device", args.device]
        env = dict(os.environ, PYTHONPATH=str(ROOT), DSV4_DATA_DIR=str(args.data_dir))
        self.log = open(args.data_dir / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=600)
        deadline = time.monotonic() + 600
        while True:
            try:
                self.client.models.list()
                break
            except openai.APIConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start; see {self.log.name}")
                time.sleep(0.5)

    def stats(self) -> dict:
        return self.client.get("/stats", cast_to=object)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def streamed_turn(client, messages, max_tokens) -> tuple[str, float, object]:
    """(answer, client TTFT s, usage) of one streamed request."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    for chunk in client.chat.completions.create(model="x", messages=messages, max_tokens=max_tokens, seed=1,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts), ttft or 0.0, usage


def reuse_figures(server: Server, reps: int, max_tokens: int) -> dict:
    rows = []
    for r in range(reps):
        msgs = [{"role": "system", "content": f"[{r}] {SYSTEM}"}]
        for user in ("Hello.", "What is a cache?", "And why reuse it?"):
            msgs.append({"role": "user", "content": user})
            text, ttft, usage = streamed_turn(server.client, msgs, max_tokens)
            msgs.append({"role": "assistant", "content": text})
        turn = server.stats()["requests"]["recent_turns"][-1]
        rows.append({"prompt": usage.prompt_tokens, "reused": usage.prompt_tokens_details.cached_tokens,
                     "prefill": turn["prefill_tokens"], "server_ttft": turn["ttft_s"], "client_ttft": ttft})
    return {k: statistics.median(row[k] for row in rows) for k in rows[0]}


def soak(server: Server, n: int, max_tokens: int) -> list[tuple[int, int]]:
    samples = [(0, rss_bytes(server.proc.pid))]
    msgs: list[dict] = []
    for i in range(1, n + 1):
        if (i - 1) % 4 == 0:
            msgs = [{"role": "system", "content": f"Conversation {i}."}]
        msgs.append({"role": "user", "content": f"Question {i}?"})
        if i % 10 == 0:  # a client that leaves after the first token
            stream = server.client.chat.completions.create(model="x", messages=msgs, max_tokens=64, stream=True)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            stream.close()
            msgs.pop()
        elif i % 2:
            text, _, _ = streamed_turn(server.client, msgs, max_tokens)
            msgs.append({"role": "assistant", "content": text})
        else:
            out = server.client.chat.completions.create(model="x", messages=msgs, max_tokens=max_tokens)
            msgs.append({"role": "assistant", "content": out.choices[0].message.content})
        if i % 10 == 0:
            samples.append((i, rss_bytes(server.proc.pid)))
    return samples


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="converted model directory (default: the demo model)")
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--data-dir", type=Path, help="where the demo model is built (default: a temp dir)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--reps", type=int, default=3, help="conversations per reuse figure")
    p.add_argument("--max-tokens", type=int, default=4)
    args = p.parse_args()
    tmp = None
    if args.data_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="dsv4-soak-")
        args.data_dir = Path(tmp.name)
    args.data_dir.mkdir(parents=True, exist_ok=True)

    figures = {}
    for label, extra in (("reuse", ["--max-sessions", "4"]), ("no reuse", ["--max-sessions", "0"])):
        server = Server(args, extra)
        try:
            figures[label] = reuse_figures(server, args.reps, args.max_tokens)
            if label == "reuse":
                samples = soak(server, args.requests, args.max_tokens)
                final = server.stats()
        finally:
            server.close()

    print(f"turn 3 of a conversation (median of {args.reps}), max_tokens {args.max_tokens}:")
    print(f"{'':10} {'prompt':>7} {'reused':>7} {'prefill':>8} {'server TTFT':>12} {'client TTFT':>12}")
    for label, f in figures.items():
        print(f"{label:10} {f['prompt']:7.0f} {f['reused']:7.0f} {f['prefill']:8.0f} "
              f"{1e3 * f['server_ttft']:9.1f} ms {1e3 * f['client_ttft']:9.1f} ms")
    print(f"\nsoak: {args.requests} requests; server RSS (MiB) after request n:")
    print("  " + "  ".join(f"{i}:{rss / 2**20:.1f}" for i, rss in samples))
    warm = [rss for i, rss in samples if i >= 20]
    print(f"after the warm-up (request 20): first {warm[0] / 2**20:.1f} MiB, max {max(warm) / 2**20:.1f}, "
          f"last {warm[-1] / 2**20:.1f}, growth {(warm[-1] - warm[0]) / 2**20:+.1f} MiB "
          f"(max - first {(max(warm) - warm[0]) / 2**20:+.1f})")
    r = final["requests"]
    print(f"server: completed {r['completed']}, cancelled {r['cancelled']}, failed {r['failed']}, "
          f"rejected {r['rejected']}, reuse rate {r['reuse_rate']:.2f}, sessions {final['sessions']}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
