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
HEADROOM = 1.02  # the converted model is the source's size plus a few headers and padding


class WizardError(RuntimeError):
    """Conversion cannot start or failed; the message says why and what to do."""


def is_converted(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def demo_dir(config: AppConfig) -> Path:
    return config.models_dir / DEMO_NAME


def find_model(config: AppConfig) -> Path | None:
    """--model if given; else the newest converted model under data_dir/models (not the demo)."""
    if config.model is not None:
        return config.model
    if not config.models_dir.is_dir():
        return None
    found = [p for p in config.models_dir.iterdir()
             if p.is_dir() and p.name != DEMO_NAME and is_converted(p)]
    return max(found, key=lambda p: (p / MANIFEST).stat().st_mtime) if found else None


def check_source(path: Path) -> list[str]:
    """Problems with a downloaded checkpoint directory ([] = ready to convert)."""
    if not str(path).strip():
        return ["enter the directory of the downloaded checkpoint"]
    if not path.is_dir():
        return [f"{path} is not a directory"]
    try:
        from converter.preflight import check_source as preflight
    except ImportError:
        return ["this build has no checkpoint validator (converter.preflight is missing); "
                "convert with `dsv4-convert --hf DIR --out DIR` once it is installed"]
    return list(preflight(path))


def source_bytes(path: Path) -> int:
    """Total size of the checkpoint's safetensors files."""
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def free_space_problem(src: Path, dst: Path) -> str | None:
    """One line if the destination's disk cannot hold the converted model, else None."""
    need = int(source_bytes(src) * HEADROOM)
    probe = dst
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if dst.is_dir():
        free += sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())  # resumable
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
