"""Keypress-to-screen latency of the chat app while an answer streams.

Runs ChatApp on a recording terminal driver (everything Textual would send to a terminal is
rendered and timestamped, then dropped), starts a long answer, and types marker characters
into the prompt at random intervals. A press's latency is the time from posting the key to
the first terminal write that contains its marker. Prints percentiles, with an idle baseline.

    python bench/ui_latency.py                         # fake engine, 500 tok/s
    python bench/ui_latency.py --tok-s 2000 --presses 300
    python bench/ui_latency.py --engine real --model DIR   # the real engine (once it exists)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from textual import events
from textual.drivers.headless_driver import HeadlessDriver

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "app"))

from app.app import ChatApp  # noqa: E402
from app.backend import RealBackend  # noqa: E402
from app.settings import AppConfig  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

MARKERS = "¤§¶µøæþðßŧ"  # characters no answer text here contains
WIDTH, HEIGHT = 120, 40


def recording_driver(writes: list[tuple[float, str]]) -> type[HeadlessDriver]:
    """A terminal driver class that appends (time, data) of every write to `writes`; the app
    renders for it exactly as for a real terminal (it does not report itself headless)."""

    class RecordingDriver(HeadlessDriver):
        @property
        def is_headless(self) -> bool:
            return False

        def _get_terminal_size(self) -> tuple[int, int]:
            return WIDTH, HEIGHT

        def write(self, data: str) -> None:
            writes.append((time.perf_counter(), data))

    return RecordingDriver


async def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"ui_latency: timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def measure(app: ChatApp, writes: list[tuple[float, str]], presses: int, streaming: bool,
                  rng: random.Random) -> list[float]:
    """Latencies (ms) of `presses` keypresses; with `streaming`, while an answer streams."""
    prompt = app.chat.prompt
    prompt.load_text("")
    latencies: list[float] = []
    for i in range(presses):
        if streaming and app.service.busy != "turn":
            break
        marker = MARKERS[i % len(MARKERS)]
        if i % len(MARKERS) == 0:
            prompt.load_text("")
            await asyncio.sleep(0.03)
        start = len(writes)
        t0 = time.perf_counter()
        app.post_message(events.Key(marker, marker))

        def painted() -> bool:
            return any(marker in data for _, data in writes[start:])

        await wait_until(painted, 5.0, f"keypress {i} to reach the screen")
        t1 = next(t for t, data in writes[start:] if marker in data)
        latencies.append((t1 - t0) * 1e3)
        await asyncio.sleep(rng.uniform(0.01, 0.04))
    return latencies


class GcPauses:
    """Durations (ms) of the cyclic collector's full (generation 2) passes while registered."""

    def __init__(self) -> None:
        self.full_ms: list[float] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] == 2:
            self.full_ms.append((time.perf_counter() - self._start) * 1e3)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def report(name: str, ms: list[float]) -> None:
    if not ms:
        print(f"{name:<10} no samples")
        return
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
    print(f"{name:<10} n={len(ms):<4} median {statistics.median(ms):6.1f} ms · "
          f"p90 {q[89]:6.1f} · p99 {q[98]:6.1f} · max {max(ms):6.1f}")


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="ui-latency-") as tmp:
        await run_in(Path(tmp), args)


async def run_in(data: Path, args: argparse.Namespace) -> None:
    """The measurement, with transcripts written under the temporary `data` dir."""
    if args.engine == "fake":
        from fake_engine import FakeBackend, FakeEngine

        words = [f"word{i}" + ("\n\n" if i % 60 == 59 else "") for i in range(args.tokens)]
        answer = " ".join(words)  # paragraphs of 60 words, like a real long answer
        backend = FakeBackend(FakeEngine(answer=answer, step_delay=1.0 / args.tok_s))
        model = data / "model"
    else:
        if args.model is None:
            raise SystemExit("ui_latency: --engine real needs --model DIR")
        backend, model = RealBackend(), args.model
    config = AppConfig(data_dir=data, model=model, gen=SamplingParams(max_tokens=args.tokens))
    writes: list[tuple[float, str]] = []
    app = ChatApp(config, backend, offer_resume=False, driver_class=recording_driver(writes))
    task = asyncio.create_task(app.run_async())
    await wait_until(lambda: app.service.ready and app.service.busy is None, 600, "the engine")
    rng = random.Random(0)
    idle = await measure(app, writes, min(50, args.presses), streaming=False, rng=rng)
    app.chat.prompt.load_text("Tell me a long story.")
    app.chat.prompt.submit()
    await wait_until(lambda: app._answer is not None and app._answer.answer_text, 60, "tokens")
    t0, text0 = time.perf_counter(), app._answer.answer_text
    with GcPauses() as pauses:
        busy = await measure(app, writes, args.presses, streaming=True, rng=rng)
    seconds = time.perf_counter() - t0
    text = app._answer.answer_text if app._answer else text0
    chars_per_s = (len(text) - len(text0)) / seconds
    if args.engine == "fake":  # one token per word; its tok/s figure is synthetic
        rate = f"{(len(text.split()) - len(text0.split())) / seconds:.0f} tok/s decoded"
    else:
        rate = f"{app.service.latest_stats.tok_per_s:.1f} tok/s decoded (engine's figure)"
    app.service.cancel()
    await wait_until(lambda: app.service.busy is None, 60, "the turn to stop")
    app.exit()
    await task
    print(f"terminal {WIDTH}x{HEIGHT}, engine {args.engine}: {rate}, "
          f"{chars_per_s:.0f} chars/s reached the transcript while streaming")
    report("idle", idle)
    report("streaming", busy)
    longest = f", longest {max(pauses.full_ms):.1f} ms" if pauses.full_ms else ""
    print(f"full GC passes while streaming: {len(pauses.full_ms)}{longest}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("fake", "real"), default="fake")
    p.add_argument("--model", type=Path, help="converted model directory (--engine real)")
    p.add_argument("--tok-s", type=float, default=500.0, help="fake engine decode rate")
    p.add_argument("--tokens", type=int, default=20000, help="answer length (tokens)")
    p.add_argument("--presses", type=int, default=200)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
