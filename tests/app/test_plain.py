"""`dsv4-chat --plain` end to end through a pseudo-terminal, the line loop in-process, and
`python -m engine generate`, all on the tiny synthetic model with the real tokenizer."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from app.plain import PlainChat, turn_line
from app.settings import AppConfig
from converter import synth
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-B]|\x1b[=>]|\r")
TURN = re.compile(r"\[(\d+) tokens \((\w+)\) · prefill (\d+) tok, (\d+) reused")
# Make the pty the child's controlling terminal (so Ctrl-C is a SIGINT), then run the program.
LAUNCH = ("import fcntl, os, sys, termios; os.setsid(); fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
          "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    return synth.write_checkpoint(out, synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))


def env_for(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), DSV4_DATA_DIR=str(tmp_path / "data"),
               DSV4_TEMPERATURE="0", DSV4_MAX_TOKENS="4", TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1",
               PYTHONPATH=str(ROOT), **extra)
    return env


class Terminal:
    """A child process on a pseudo-terminal; `expect` waits for a pattern in the cleaned output."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH] + argv, stdin=slave, stdout=slave,
                                     stderr=slave, env=env, cwd=ROOT, close_fds=True)
        os.close(slave)
        self.raw = ""
        self.pos = 0  # `expect` searches from here

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if ready:
            try:
                self.raw += os.read(self.master, 65536).decode("utf-8", "replace")
            except OSError:  # the child closed the terminal
                time.sleep(timeout)

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {pattern!r}; output:\n{self.text[-6000:]}")
            self._read(0.1)

    def wait_for(self, condition, timeout: float = 60.0) -> None:
        """Read until condition(cleaned output) is true."""
        deadline = time.monotonic() + timeout
        while not condition(self.text):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; output:\n{self.text[-6000:]}")
            self._read(0.1)

    def enter(self, line: str, pattern: str | None, submit: bool = True) -> re.Match | None:
        """Wait for the next prompt, type `line` (+ Enter), then wait for `pattern` if given."""
        self.expect(r">>>")
        self.send(line + ("\r" if submit else ""))
        return self.expect(pattern) if pattern else None

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


def test_plain_mode_through_a_pseudo_terminal(ckpt, tmp_path):
    term = Terminal(["-m", "app", "--plain", "--model", str(ckpt), "--numerics", "exact"], env_for(tmp_path))
    try:
        term.expect(r"/help for commands")
        first = term.enter("Hello there", TURN.pattern)
        assert first.group(2) == "max_tokens" and int(first.group(4)) == 0
        term.enter("Tell me more\\", r"\.\.\.")  # a trailing backslash continues on a new line
        term.send("about it\r")
        second = term.expect(TURN.pattern)
        assert int(second.group(4)) > int(first.group(3))  # the first turn's tokens were reused
        term.enter("/set max_tokens 500", r"max_tokens = 500")
        term.enter("Keep going", None)
        term.wait_for(lambda t: "Keep going" in t and re.search(r"\n\s*\S\S", t.rsplit("Keep going", 1)[1]))
        term.send("\x03")  # Ctrl-C stops the answer, not the program
        term.expect(r"\(answer stopped\)")
        stopped = term.expect(TURN.pattern)
        assert stopped.group(2) == "cancelled" and 0 < int(stopped.group(1)) < 500
        term.enter("/set max_tokens 4", r"max_tokens = 4")
        term.enter("/undo", r"dropped the last question and answer")
        regen = term.enter("/regen", TURN.pattern)
        assert int(regen.group(3)) == 0  # regenerate starts from the kept prompt snapshot
        term.enter("/stats", r"hit rate: 100\.0% cumulative")
        term.expect(r"memory \(unified")
        term.enter("half typed", None, submit=False)
        term.send("\x03")  # Ctrl-C at the prompt clears the line
        term.expect(r"\^C \(Ctrl-D or /quit to leave\)")
        term.enter("/quit", None)
        assert term.proc.wait(30) == 0
    finally:
        term.close()


def test_plain_loop_commands_in_process(ckpt, tmp_path):
    eng = Engine.load(ckpt, EngineConfig(numerics="exact"), warmup=False)
    lines = iter(["Hi", "/stats", "/system Be brief.", "/system", "Hello", "/regen", "/undo", "/undo",
                  "/pin 1:2", "/pin 9:0", "/unpin", "/flush", "/set top_p 0", "/set", f"/export {tmp_path}/x.md",
                  "//slash message", "/nonsense", "/quit", "never read"])

    def read() -> str:
        return next(lines)

    out = io.StringIO()
    config = AppConfig(data_dir=tmp_path, gen=SamplingParams(temperature=0.0, max_tokens=3))
    chat = PlainChat(eng, config, read, out)
    try:
        assert chat.run() == 0
    finally:
        eng.close()
    text = out.getvalue()
    turns = TURN.findall(text)
    assert len(turns) == 4  # Hi, Hello, /regen, //slash message
    assert turns[2][2] == "0"  # /regen ran no prefill
    assert "system prompt set — new conversation" in text and "system prompt: Be brief." in text
    assert "! nothing to undo" in text
    assert "! no expert 9:0" in text and "! nothing to pin: this model has no expert cache" in text  # official layout
    assert "! top_p must be in (0, 1]" in text
    assert f"exported 0 turn(s) to {tmp_path}/x.md" in text and (tmp_path / "x.md").is_file()  # after two /undo
    assert "unknown command /nonsense" in text
    assert chat.session.messages[0].content == "/slash message"
    assert next(lines) == "never read"


def test_turn_line_names_the_reuse():
    from engine.stats import TurnStats

    line = turn_line(TurnStats(prompt_tokens=30, completion_tokens=5, prefill_s=0.5, decode_s=1.0, ttft_s=0.6,
                               tok_per_s=4.0, finish_reason="eos", prefill_tokens=10, reused_tokens=20))
    assert line.startswith("[5 tokens (eos) · prefill 10 tok, 20 reused, 0.50 s · TTFT 0.60 s · 4.0 tok/s")


def test_engine_generate_cli(ckpt, tmp_path):
    run = subprocess.run([sys.executable, "-m", "engine", "generate", "--ckpt", str(ckpt), "--prompt", "Hello",
                          "--max-tokens", "3", "--temperature", "0", "--numerics", "exact"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env_for(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    assert "5 prompt tokens, 3 generated (max_tokens)" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "engine", "generate", "--ckpt", str(tmp_path / "missing"),
                          "--prompt", "x"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=env_for(tmp_path))
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_unwritable_history_file_on_a_terminal(ckpt, tmp_path):
    """One warning, then the chat works with an in-memory history: no traceback per line."""
    (tmp_path / "data" / "plain_history").mkdir(parents=True)  # the history file cannot be opened
    term = Terminal(["-m", "app", "--plain", "--model", str(ckpt), "--numerics", "exact"], env_for(tmp_path))
    try:
        term.expect(r"! warning: input history is kept in memory only: cannot use \S+plain_history")
        term.expect(r"/help for commands")
        term.enter("Hello there", TURN.pattern)
        term.expect(r">>>")
        term.send("\x1b[A")  # Up: the in-memory history holds the last line
        term.expect(r"Hello there")
        term.send("\x15/quit\r")  # Ctrl-U clears the line
        assert term.proc.wait(30) == 0
        assert "Traceback" not in term.text and term.text.count("input history is kept in memory") == 1
    finally:
        term.close()


def test_stats_lines_show_the_host_tier_when_there_is_one():
    from dataclasses import replace

    from app.plain import stats_lines
    from engine.stats import CacheSnapshot, MemoryBudget, StepStats, StepTiming, TierSnapshot

    GiB = 2**30
    cache = CacheSnapshot(capacity_bytes=8 * GiB, used_bytes=6 * GiB, entries=480, capacity_entries=640, pinned=0,
                          hits=750, misses=250, evictions=9, bytes_read=3 * GiB, hit_rate=0.75, hit_rate_window=0.9)
    stats = StepStats("decode", 1, 10, StepTiming(1.0, 2.0, 3.0, 4.0), 42.5, 1.5, cache,
                      MemoryBudget(False, 141 * GiB, (("expert cache", 8 * GiB), ("free", 133 * GiB))))
    assert not any("host RAM tier" in line for line in stats_lines(stats))
    tier = TierSnapshot(capacity_bytes=16 * GiB, used_bytes=4 * GiB, entries=320, capacity_entries=1280,
                        ram_hits=240, disk_reads=10, hit_rate=0.96)
    lines = stats_lines(replace(stats, cache=replace(cache, tier=tier)))
    assert ("host RAM tier: 320/1280 entries, 4.00 GiB of 16.00 GiB; the cache's misses: 240 from RAM (96.0%), "
            "10 read from disk") in lines
    lines = stats_lines(replace(stats, cache=replace(cache, tier=replace(tier, filling=True))))
    assert any(line.endswith("10 read from disk; filling in the background") for line in lines)
    failed = replace(tier, fill_error="filling the host RAM tier stopped at expert 3 of layer 7: EIO")
    lines = stats_lines(replace(stats, cache=replace(cache, tier=failed)))
    assert any(line.endswith("its background fill stopped: filling the host RAM tier stopped at expert 3 of "
                             "layer 7: EIO") for line in lines)
