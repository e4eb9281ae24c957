"""`dsv4-chat --plain` in scripts and `dsv4-chat run`: answers alone on stdout, everything else on
stderr, a non-zero exit after an error; autosave in line mode and its faults (a full or read-only
data dir, an unwritable history file); `--plain --demo` from a fresh data dir."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fake_engine import ANSWER, THINKING, FakeEngine

from app.autosave import read_transcript
from app.demo import DEMO_NOTICE
from app.plain import PlainChat, history_for, main, run_once
from app.settings import AppConfig, resolve_engine_config
from engine.memory_plan import gib_to_bytes
from engine.sampling import SamplingParams
from converter import synth
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import EngineFailure, TextDelta

ROOT = Path(__file__).resolve().parents[2]
WARNING = "! warning: autosave is off: cannot write the transcript"


def lines_of(*items: str):
    it = iter(items)

    def read() -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def chat(config: AppConfig, *lines: str, strict: bool = True, engine: FakeEngine | None = None):
    """Run PlainChat on a fake engine; returns (status, stdout text, stderr text, engine)."""
    engine = engine or FakeEngine()
    out, err = io.StringIO(), io.StringIO()
    status = PlainChat(engine, config, lines_of(*lines), out, err, strict=strict).run()
    return status, out.getvalue(), err.getvalue(), engine


def transcripts(config: AppConfig) -> list[Path]:
    return sorted(config.transcripts_dir.glob("*.jsonl")) if config.transcripts_dir.is_dir() else []


def test_script_mode_answers_alone_on_stdout(config):
    status, out, err, _ = chat(config, "/set think on", "why?", "/stats")
    assert status == 0
    assert out == ANSWER + "\n"  # not the thinking, statistics, notes or prompts
    assert f"(thinking) {THINKING}\n" in err and "think = on" in err
    assert "tokens (eos)" in err and "expert cache:" in err


def test_script_mode_exits_1_after_an_error_and_handles_the_rest(config):
    engine = FakeEngine()
    engine.fail_next = "the turn failed: boom"
    status, out, err, _ = chat(config, "first", "/undo", "/undo", "/nonsense", "second", engine=engine)
    assert status == 1
    assert out == ANSWER + "\n"  # the second message was still answered
    assert "! the turn failed: boom\n" in err and "! unknown command /nonsense" in err
    assert err.count("! nothing to undo") == 2
    # a terminal session is not a script: the same errors leave the status at 0
    engine.fail_next = "boom"
    assert chat(config, "first", "/undo", strict=False, engine=engine)[0] == 0


def test_plain_autosaves_like_the_tui(config):
    engine = FakeEngine()
    engine.fail_next = "boom"  # a failed turn leaves no message in the transcript
    status, *_ = chat(config, "lost", "q1", "/regen", "/undo", "q2", "/system be brief", "q3", engine=engine)
    assert status == 1  # the failed turn
    by_system = {read_transcript(path)[0].system: path for path in transcripts(config)}
    assert sorted(by_system) == ["", "be brief"]
    conv, closed = read_transcript(by_system[""])
    assert closed and [(m.role, m.content) for m in conv.messages] == [("user", "q2"), ("assistant", ANSWER)]
    conv, closed = read_transcript(by_system["be brief"])
    assert closed
    assert [m.content for m in conv.messages] == ["q3", ANSWER] and conv.messages[1].finish == "eos"


class FailingWrite:
    """Stands in for os.write in app.autosave: `ok` calls succeed, then each call writes half of
    its bytes and raises `code` (a disk that fills up mid-record)."""

    def __init__(self, ok: int, code: int) -> None:
        self.ok, self.code, self.real = ok, code, os.write

    def __call__(self, fd, data) -> int:
        if self.ok > 0:
            self.ok -= 1
            return self.real(fd, data)
        self.real(fd, bytes(data[: len(data) // 2]))
        raise OSError(self.code, os.strerror(self.code))


def test_full_data_dir_turns_autosave_off_and_the_chat_goes_on(config, monkeypatch):
    # first write: start + "q1"; second: the answer; the third (q2) meets a full disk
    monkeypatch.setattr("app.autosave.os.write", FailingWrite(2, errno.ENOSPC))
    status, out, err, _ = chat(config, "q1", "q2", "/new", "q3")
    assert status == 0  # every answer was delivered; the warning is not a failed turn
    assert out == (ANSWER + "\n") * 3
    assert err.count(WARNING) == 1 and "(No space left on device)" in err
    path, = transcripts(config)
    records = [json.loads(line) for line in path.read_text().splitlines()]  # no torn line
    assert [r.get("content") for r in records] == [None, "q1", ANSWER]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_read_only_data_dir_turns_autosave_off_and_the_chat_goes_on(config, monkeypatch):
    def refuse(path, flags, mode=0o777):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr("app.autosave.os.open", refuse)
    status, out, err, _ = chat(config, "q1", "q2")
    assert status == 0 and out == (ANSWER + "\n") * 2
    assert err.count(WARNING) == 1 and "(Read-only file system)" in err
    assert transcripts(config) == []


def test_unwritable_history_file_falls_back_to_memory_once(tmp_path):
    warnings = []
    blocked = tmp_path / "file"
    blocked.write_text("")
    history = history_for(blocked / "plain_history", warnings.append)  # its folder is a file
    history.append_string("one")
    assert list(history.get_strings()) == ["one"]
    assert len(warnings) == 1 and warnings[0].startswith("input history is kept in memory only")
    # writable at start, then the file becomes unusable (here: replaced by a directory)
    warnings.clear()
    path = tmp_path / "plain_history"
    history = history_for(path, warnings.append)
    history.append_string("a")
    path.unlink()
    path.mkdir()
    history.append_string("b")
    history.append_string("c")
    assert list(history.get_strings()) == ["a", "b", "c"]
    assert warnings == [f"input history is kept in memory only: cannot use {path} (Is a directory)"]


# ---- the real engine on the tiny synthetic model -----------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    return synth.write_checkpoint(out, synth.tiny_config(vocab_size=129280), synth.SynthOptions(seed=0))


def clean_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_DATA_HOME=str(tmp_path / "data"), PYTHONPATH=str(ROOT), **extra)
    return env


def test_piped_plain_and_run_print_the_same_answer(ckpt, tmp_path):
    args = ["--model", str(ckpt), "--numerics", "exact", "--max-tokens", "3", "--temperature", "0"]
    env = clean_env(tmp_path, DSV4_DEBUG="1")  # an unrelated DSV4_ variable: a warning, not fatal
    piped = subprocess.run([sys.executable, "-m", "app", "--plain", *args], input="Hello\n",
                           capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert piped.returncode == 0, piped.stderr
    answer = piped.stdout
    assert answer.strip() and answer.endswith("\n") and answer.count("\n") >= 1
    assert ">>>" not in answer and "[3 tokens" not in answer and "dsv4-chat" not in answer
    err = piped.stderr
    assert "environment DSV4_DEBUG is not a dsv4-chat setting (ignored)" in err
    assert "dsv4-chat --plain · " in err and ">>> " in err and "[3 tokens (max_tokens)" in err
    path, = (tmp_path / "data" / "dsv4-chat" / "transcripts").glob("*.jsonl")
    conv, closed = read_transcript(path)
    assert closed and [m.content for m in conv.messages] == ["Hello", answer[:-1]]
    once = subprocess.run([sys.executable, "-m", "app", "run", *args, "Hello"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert once.returncode == 0, once.stderr
    assert once.stdout == answer  # greedy: the same answer, and nothing else on stdout
    assert "[3 tokens (max_tokens)" in once.stderr


def test_run_reads_stdin_and_fails_with_status_1(ckpt, tmp_path):
    config = AppConfig(data_dir=tmp_path / "data", model=ckpt, engine=resolve_engine_config(numerics="exact"),
                       gen=SamplingParams(temperature=0.0, max_tokens=2))
    out, err = io.StringIO(), io.StringIO()
    assert run_once(config, "", io.StringIO("Hello\n"), out, err) == 0
    assert out.getvalue().strip() and "[2 tokens (max_tokens)" in err.getvalue()
    short = AppConfig(data_dir=tmp_path / "data", model=ckpt,
                      engine=resolve_engine_config(numerics="exact", max_seq_len=8),
                      gen=SamplingParams(temperature=0.0, max_tokens=2))
    out, err = io.StringIO(), io.StringIO()
    assert run_once(short, "a prompt that is longer than eight tokens, by quite a few words", None,
                    out, err) == 1
    assert out.getvalue() == "" and "over the context limit" in err.getvalue()
    assert run_once(config, "  ", io.StringIO(""), out, err) == 2
    assert not (tmp_path / "data" / "transcripts").exists()  # `run` autosaves nothing


def test_plain_demo_from_a_fresh_data_dir(tmp_path):
    """`--plain --demo` builds the demo model (synthesis, conversion) and answers."""
    config = AppConfig(data_dir=tmp_path / "fresh", demo=True, gen=SamplingParams(temperature=0.0, max_tokens=3))
    out, err = io.StringIO(), io.StringIO()
    assert main(config, io.StringIO("Hello\n"), out, err) == 0, err.getvalue()
    log = err.getvalue()
    assert "writing the demo checkpoint: 7/7 shards" in log
    assert "converting: 100% of" in log and DEMO_NOTICE in log
    assert out.getvalue().strip() and "[3 tokens (max_tokens)" in log
    assert (config.models_dir / "demo" / "manifest.json").is_file()
    path, = transcripts(config)
    assert [m.content for m in read_transcript(path)[0].messages][0] == "Hello"


def test_warm_up_loads_prints_the_plan_and_exits(ckpt, tmp_path):
    """`dsv4-chat --warm-up`: the load's phases (memory plan, warm-up) on stderr, then exit 0;
    a plan that cannot fit is one line and exit 2."""
    from app.plain import warm_up

    config = AppConfig(data_dir=tmp_path / "data", model=ckpt, engine=resolve_engine_config(numerics="exact"))
    err = io.StringIO()
    assert warm_up(config, err) == 0, err.getvalue()
    log = err.getvalue()
    assert "memory plan: 1/1 plan · resident weights" in log and "expert cache" in log
    assert "warm-up: 2/2 shapes · kernels ready" in log and "ready in " in log
    tight = AppConfig(data_dir=tmp_path / "data", model=ckpt, engine=resolve_engine_config(
        numerics="exact", memory_bytes=gib_to_bytes(0.25, "memory_gb")))
    err = io.StringIO()
    assert warm_up(tight, err) == 2
    assert "the model does not fit" in err.getvalue() and "--memory-gb" in err.getvalue()
    assert "Traceback" not in err.getvalue()


def test_plain_gives_heap_pages_back_after_every_turn(config):
    calls = []
    out = io.StringIO()
    chat = PlainChat(FakeEngine(), config, lines_of("first", "second"), out, io.StringIO(), strict=True,
                     trim=lambda: calls.append("trim"))
    assert chat.run() == 0
    assert calls == ["trim", "trim"]


def test_plain_freezes_the_heap_once_loaded_and_hands_it_back(config, monkeypatch):
    """Like the TUI (app/heap.py): the turns run with the loaded engine's objects frozen (full GC
    passes skip them), and the freeze is released when the chat ends."""
    import gc

    import app.plain

    seen = []

    class Recording(FakeEngine):
        def generate(self, *args, **kwargs):
            seen.append(gc.get_freeze_count())
            return super().generate(*args, **kwargs)

    monkeypatch.setattr(app.plain, "_open", lambda config, log: (Recording(), 0))
    out = io.StringIO()
    assert main(config, io.StringIO("hello\n"), out, io.StringIO()) == 0
    assert out.getvalue() == ANSWER + "\n"
    assert len(seen) == 1 and seen[0] > 1000  # the engine and everything imported before it
    assert gc.get_freeze_count() == 0


def test_a_line_that_is_not_utf8_is_refused_and_the_next_one_answered(config):
    status, out, err, engine = chat(config, "caf\udce9 au lait", "after")  # b"caf\xe9" read as surrogateescape
    assert status == 1 and out == ANSWER + "\n"
    assert "! this text is not UTF-8 (byte 0xE9) at character 4; it was not sent: send UTF-8 text\n" in err
    path, = transcripts(config)
    assert [m.content for m in read_transcript(path)[0].messages] == ["after", ANSWER]


class Output(io.StringIO):
    """A stdout whose writes fail with `error` after the first `ok` of them."""

    def __init__(self, error: OSError, ok: int = 1) -> None:
        super().__init__()
        self.error, self.ok = error, ok

    def write(self, text: str) -> int:
        if self.ok <= 0:
            raise self.error
        self.ok -= 1
        return super().write(text)


def test_output_that_goes_away_stops_the_chat_with_status_1_and_no_traceback(ckpt, tmp_path, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)  # "Exception ignored in: <generator ...>"
    config = AppConfig(data_dir=tmp_path / "data", model=ckpt, engine=resolve_engine_config(numerics="exact"),
                       gen=SamplingParams(temperature=0.0, max_tokens=8))
    err = io.StringIO()
    assert run_once(config, "Hello", None, Output(BrokenPipeError(errno.EPIPE, "Broken pipe")), err) == 1
    assert "Traceback" not in err.getvalue() and "stopped" not in err.getvalue()  # | head: quietly
    err = io.StringIO()
    assert run_once(config, "Hello", None, Output(OSError(errno.ENOSPC, "No space left on device")), err) == 1
    assert err.getvalue().endswith("dsv4-chat: stopped: No space left on device (writing the output)\n")
    err = io.StringIO()
    assert main(config, io.StringIO("one\ntwo\n"), Output(BrokenPipeError(errno.EPIPE, "Broken pipe")), err) == 1
    path, = transcripts(config)  # the conversation up to the failing write is kept
    assert [m.content for m in read_transcript(path)[0].messages][0] == "one"
    monkeypatch.setattr(sys, "stdout", None)  # `dsv4-chat run hi >&-`
    err = io.StringIO()
    assert run_once(config, "Hello", None, None, err) == 2
    assert err.getvalue() == ("dsv4-chat: the standard output is closed; give the answers somewhere to go "
                              "(e.g. > answers.txt)\n")
    assert unraisable == []


def test_a_turn_closed_after_its_engine_ends_quietly_and_bad_text_is_one_failure(ckpt):
    engine = Engine.load(ckpt, EngineConfig(numerics="exact"), warmup=False)
    session = engine.new_session()
    events = engine.generate(session, "caf\udce9", SamplingParams(temperature=0.0, max_tokens=4), threading.Event())
    failure, = list(events)
    assert isinstance(failure, EngineFailure) and "not valid Unicode" in failure.message
    events = engine.generate(session, "Hello", SamplingParams(temperature=0.0, max_tokens=50), threading.Event())
    next(ev for ev in events if isinstance(ev, TextDelta))
    engine.close()
    events.close()  # raised "generator ignored GeneratorExit" once the engine had dropped its runtime


def test_pin_and_unpin_report_what_happened_as_the_tui_does(config):
    status, out, err, _ = chat(config, "/pin hot 3", "hi", "/unpin 4:4", "/pin 0:0,0:0,0:1", "/unpin 0:1,1:1",
                               "/unpin", "/unpin", "/set think on")
    lines = [line.removeprefix(">>> ") for line in err.splitlines()]
    assert "nothing to pin yet: no expert has been used (ask something first)" in lines
    assert "none of 4:4 was pinned" in lines
    assert "pinned 2 expert(s): 0:0, 0:1" in lines
    assert "unpinned 0:1 · not pinned: 1:1" in lines
    assert lines.count("unpinned all experts") == 1 and "no experts were pinned" in lines
    assert "think = on" in lines
