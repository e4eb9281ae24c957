"""The demo model: a tiny synthetic checkpoint (random weights, real tokenizer), converted once.

`<data_dir>/models/demo/` is created atomically: built in a temporary directory next to it and
renamed into place only when complete, so a half-built demo never looks usable.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from app.wizard import DEMO_NAME, MANIFEST, WizardError, is_converted
from engine.demo_marker import is_demo_model, mark_demo_model
from engine.events import LoadProgress

DEMO_NOTICE = ("demo model: a tiny network with RANDOM weights and the real tokenizer — "
               "answers are gibberish; it shows the engine, cache and UI at work")

ProgressFn = Callable[[Any], None]
BuildFn = Callable[[Path, Path, ProgressFn], None]


def _synth_progress(progress: ProgressFn) -> Callable[[str], None]:
    """Turn synth's "[k/n] shard…" log lines into LoadProgress events."""

    def log(line: str) -> None:
        m = re.match(r"\[(\d+)/(\d+)\]\s*([^:]*)", line)
        done, total = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        progress(LoadProgress("writing the demo checkpoint", done, total, "shards",
                              m.group(3) if m else line))

    return log


def build_with_converter(work_dir: Path, out_dir: Path, progress: ProgressFn) -> None:
    """Write the synthetic checkpoint into `work_dir` and convert it into `out_dir`."""
    try:
        from converter import convert, synth
    except ImportError as err:
        raise WizardError(f"cannot build the demo model: converter missing ({err})") from None
    ckpt = work_dir / "checkpoint"
    synth.write_checkpoint(ckpt, synth.chat_tiny_config(), synth.SynthOptions(seed=0),
                           log=_synth_progress(progress))
    convert.convert(ckpt, out_dir, progress=progress, cancel=threading.Event(), resume=False)


def outdated(converted: Path) -> bool:
    """Whether a converted directory's manifest names another layout version than this build's
    converter writes (a demo built by an older build: rebuilt, it is only a few MB)."""
    try:
        from engine.pack import VERSION
        return json.loads((converted / MANIFEST).read_text(encoding="utf-8")).get("version") != VERSION
    except ImportError:  # no converter: nothing to rebuild with
        return False
    except (OSError, ValueError, AttributeError):  # unreadable: the engine's open names the problem
        return False


def current(target: Path) -> bool:
    """Whether `target` holds a complete demo model that this build can load as it is."""
    return is_converted(target) and not outdated(target) and is_demo_model(target)


def ensure_demo_model(data_dir: Path, progress: ProgressFn, build: BuildFn | None = None) -> Path:
    """The converted demo model under `data_dir/models/demo`, marked as the demo for the engine
    (engine/demo_marker.py), building it on first use (and again when an older build left it in
    another layout version or unmarked). A data dir it cannot write (read-only, not a directory)
    is a WizardError naming the data_dir setting and the fix, before anything is built."""
    models = data_dir / "models"
    target = models / DEMO_NAME
    if current(target):
        return target
    try:
        models.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=models))
    except OSError as err:
        raise WizardError(f"cannot write the data dir {data_dir} ({err.strerror or err}): set data_dir "
                          "(DSV4_DATA_DIR, or data_dir in the settings file) to a directory you can write"
                          ) from None
    try:
        out = work / "converted"
        (build or build_with_converter)(work, out, progress)
        if not is_converted(out):
            raise WizardError("building the demo model produced no manifest.json")
        mark_demo_model(out)
        if current(target):  # another instance built it meanwhile (and may be loading it): keep theirs
            return target
        if target.exists():  # a stale demo: incomplete, or in an older layout version
            shutil.rmtree(target)
        try:
            out.rename(target)
        except OSError:
            if not is_converted(target):  # not another instance winning the race
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
