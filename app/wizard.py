"""First-run logic (no UI): find a converted model, check a download, convert it.

The converter package is imported lazily, so the app starts (and explains what is missing)
even in a build without it.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from app.settings import AppConfig

DEMO_NAME = "demo"
MANIFEST = "manifest.json"
LAST_MODEL = "last-model"  # <data_dir>/last-model: the model directory loaded last (one line)
HEADROOM = 1.02  # the converted model is the source's size plus a few headers and padding


class WizardError(RuntimeError):
    """Conversion cannot start or failed; the message says why and what to do."""


def is_converted(path: Path) -> bool:
    """Whether `path` holds a converted model; False also for a path the system refuses (e.g. a
    name too long)."""
    try:
        return (path / MANIFEST).is_file()
    except OSError:
        return False


def demo_dir(config: AppConfig) -> Path:
    return config.models_dir / DEMO_NAME


def converted_models(config: AppConfig) -> list[Path]:
    """Converted models under data_dir/models, newest first (the demo included, if built)."""
    if not config.models_dir.is_dir():
        return []
    found = [p for p in config.models_dir.iterdir() if p.is_dir() and is_converted(p)]
    return sorted(found, key=lambda p: (p / MANIFEST).stat().st_mtime, reverse=True)


def resolve_model(config: AppConfig, name: Path | str) -> Path:
    """A --model / `/model` argument as a directory: an existing path as given, else a name
    under data_dir/models ("demo" is the demo model); unknown names are returned unchanged
    (loading them names the problem), and so is a path the system refuses to look at (e.g. a
    name too long): never an OSError."""
    path = Path(name).expanduser()
    try:
        if path.is_dir() or path.is_absolute() or len(path.parts) != 1:
            return path
        under = config.models_dir / path.name
        return under if under.is_dir() or path.name == DEMO_NAME else path
    except OSError:
        return path


def last_model(config: AppConfig) -> Path | None:
    """The model loaded last (remembered by `remember_model`), if it is still converted."""
    try:
        text = (config.data_dir / LAST_MODEL).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    path = Path(text) if text else None
    return path if path is not None and is_converted(path) else None


def remember_model(config: AppConfig, path: Path) -> str | None:
    """Make `path` the model the next start opens (the demo included); a one-line problem if
    the data dir cannot be written (the app then just starts as before), else None."""
    try:
        config.data_dir.mkdir(parents=True, exist_ok=True)
        (config.data_dir / LAST_MODEL).write_text(f"{path.resolve()}\n", encoding="utf-8")
    except OSError as err:
        return f"cannot remember the model in {config.data_dir}: {err.strerror or err}"
    return None


def forget_model(config: AppConfig, path: Path) -> None:
    """Stop opening `path` at start-up (it failed to load)."""
    if last_model(config) == path.resolve():
        try:
            (config.data_dir / LAST_MODEL).unlink(missing_ok=True)
        except OSError:
            pass  # then the next start offers the same choices again


def find_model(config: AppConfig) -> Path | None:
    """--model if given (a path or a name under data_dir/models); else the model used last (the
    demo included); else the newest converted model under data_dir/models (not the demo)."""
    if config.model is not None:
        return resolve_model(config, config.model)
    last = last_model(config)
    if last is not None:
        return last
    found = [p for p in converted_models(config) if p.name != DEMO_NAME]
    return found[0] if found else None


def unreadable(path: Path, err: OSError) -> str:
    """The one problem line for a checkpoint path the system refuses (a name too long, no
    permission, ...)."""
    return f"cannot read {path}: {err.strerror or err} — check the directory's path"


def check_source(path: Path) -> list[str]:
    """Problems with a downloaded checkpoint directory ([] = ready to convert); a path the system
    refuses (e.g. a name too long) is one problem line, never an OSError."""
    if not str(path).strip():
        return ["enter the directory of the downloaded checkpoint"]
    try:
        return _check_source(path)
    except OSError as err:
        return [unreadable(path, err)]


def _check_source(path: Path) -> list[str]:
    if not path.is_dir():
        return [f"{path} is not a directory"]
    try:
        from converter.preflight import check_source as preflight
    except ImportError:
        return ["this build has no checkpoint validator (converter.preflight is missing); "
                "convert with `dsv4-convert --hf DIR --out DIR` once it is installed"]
    problems = list(preflight(path))
    if not any("tokenizer" in p for p in problems):  # (a preflight that checks it already said so)
        tok = tokenizer_problem(path)
        if tok:
            problems.append(tok)
    return problems


def tokenizer_problem(path: Path) -> str | None:
    """One line if the checkpoint's tokenizer (its own, else the bundled one the engine uses) has
    more tokens than config.json's vocab_size — the engine could not chat with it — else None.
    An unreadable config.json is not reported here (the preflight names that problem)."""
    import json

    try:
        vocab = json.loads((path / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        from engine.chat import ChatTokenizer, TokenizerError, bundled_tokenizer_dir

        own = (path / "tokenizer.json").is_file()
        tokens = ChatTokenizer.from_dir(path if own else bundled_tokenizer_dir()).vocab_size
    except ImportError:
        return None
    except TokenizerError as err:
        return f"tokenizer: {err}"
    if not isinstance(vocab, int) or tokens <= vocab:
        return None
    return (f"the tokenizer has {tokens} tokens but config.json's vocab_size is {vocab}: a "
            "logits-only test checkpoint that cannot be chatted with (the demo model can)")


def source_bytes(path: Path) -> int:
    """Total size of the checkpoint's safetensors files."""
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def free_space_problem(src: Path, dst: Path) -> str | None:
    """One line if the destination's disk cannot hold the converted model (or the sizes cannot
    be read: the line names the path and the system's reason), else None; never an OSError."""
    try:
        need = int(source_bytes(src) * HEADROOM)
    except OSError as err:
        return unreadable(src, err)
    probe = dst
    try:
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if dst.is_dir():
            free += sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())  # resumable
    except OSError as err:
        return (f"cannot measure the free space for {dst}: {err.strerror or err} — check the "
                "data_dir")
    if free < need:
        gib = 2**30
        return (f"not enough space on {probe}: needs {need / gib:.1f} GiB, "
                f"{free / gib:.1f} GiB free — free space or choose another data_dir")
    return None


def default_destination(config: AppConfig, src: Path) -> Path:
    return config.models_dir / (src.resolve().name or "model")


def run_conversion(
    src: Path, dst: Path, progress: Callable[[Any], None], cancel: threading.Event
) -> Path:
    """Convert `src` into `dst` with the project converter (resumable); returns `dst`.

    `progress` receives converter ConvertProgress events (bytes_done, bytes_total, bytes_per_s,
    eta_s, current); setting `cancel` stops the conversion between files (it resumes later).
    """
    try:
        from converter.convert import convert
    except ImportError as err:
        raise WizardError(f"the converter is not available in this build ({err})") from None
    convert(src, dst, progress=progress, cancel=cancel, resume=True)
    return dst
