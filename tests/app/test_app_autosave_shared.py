"""Two instances continuing the same transcript (both reopened it with /history N): neither
loses the other's records, and concurrent writers never collide on a temp file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from app.autosave import Autosaver, _records, read_transcript
from app.conversation import ChatMessage

RECORDS = 150  # per writer: enough for two processes' writes to overlap many times


def test_two_savers_on_one_transcript_keep_each_others_turns(tmp_path):
    first = Autosaver(tmp_path, "sys")
    first.user("q0")
    first.assistant(ChatMessage("assistant", "a0", "", "eos"))
    first.close()
    a = Autosaver(tmp_path, path=first.path, on_error=_no_error)
    b = Autosaver(tmp_path, path=first.path, on_error=_no_error)
    a.user("from a")
    b.user("from b")
    a.assistant(ChatMessage("assistant", "answer a", "", "eos"))
    b.assistant(ChatMessage("assistant", "answer b", "", "eos"))
    a.close()
    b.close()
    contents = [r.get("content") for r in _records(first.path) if r["type"] == "message"]
    assert contents == ["q0", "a0", "from a", "from b", "answer a", "answer b"]
    assert read_transcript(first.path)[1]  # closed
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]  # no temp file left


def _no_error(message: str) -> None:
    raise AssertionError(message)


WRITER = """
import sys
from pathlib import Path
from app.autosave import Autosaver
path, tag, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
errors = []
saver = Autosaver(path.parent, path=path, on_error=errors.append)
for i in range(n):
    saver.user(f"{tag}{i}")
saver.close()
print("\\n".join(errors))
"""


def test_two_processes_writing_one_transcript_at_once_lose_nothing(tmp_path):
    first = Autosaver(tmp_path)
    first.user("start")
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(first.path), tag, str(RECORDS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for tag in ("a", "b")]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["", ""]  # no autosave error in either
    contents = [r.get("content") for r in _records(first.path) if r["type"] == "message"]
    for tag in ("a", "b"):
        assert [c for c in contents if c[0] == tag] == [f"{tag}{i}" for i in range(RECORDS)]
    assert contents[0] == "start" and len(contents) == 1 + 2 * RECORDS
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]
