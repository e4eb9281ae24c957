"""The engine's command-line options and their checks, shared by its entry points (`python -m
engine generate`, `python -m engine.logits`): `add_engine_args` declares them once, spelled as
dsv4-chat spells the same settings (app/__main__.py), and `engine_config_from_args` turns them
into one EngineConfig. Each bad value becomes one `prog: error: ...` line and exit status 2, at
parse time where the value alone decides, never a traceback."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.memory_plan import MemoryPlanError, gib_to_bytes


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the usage stays available with --help)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def positive_gb(text: str) -> float:
    """A cache budget in GB: a finite number above 0 (not nan, inf, 0 or negative) whose bytes
    `gib_to_bytes` can count (not 1e300)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GB, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of GB above 0, got {text!r}")
    try:
        gib_to_bytes(value, "")
    except MemoryPlanError:
        raise argparse.ArgumentTypeError(f"expected a number of GB that fits in bytes, got {text!r}") from None
    return value


def positive_int(text: str) -> int:
    """An integer above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number above 0, got {text!r}")
    return value


def device(text: str) -> str:
    """A torch device this machine has: cpu, or cuda / cuda:N with a CUDA GPU present."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has no usable CUDA GPU "
                                             "(torch.cuda.is_available() is false); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} "
                                             "CUDA GPU(s), numbered from 0")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: the engine runs on cpu or cuda")
    return text


def output_file(text: str) -> Path:
    """A file path whose folder exists (the file itself is created or replaced)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    if not path.absolute().parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {str(path.absolute().parent)!r} does not exist; "
                                         "create it or choose another path")
    return path


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """--cache-gb, --host-cache-gb and --memory-gb, as every entry point spells them (engine/memory_plan.py)."""
    p.add_argument("--cache-gb", type=positive_gb, default=None,
                   help="expert cache budget in GiB (converted layout); default: what the memory plan leaves")
    p.add_argument("--host-cache-gb", type=positive_gb, default=None,
                   help="cap on the pinned host-RAM expert tier in GiB (discrete GPU); default: the whole "
                        "expert pool when free RAM allows")
    p.add_argument("--memory-gb", type=positive_gb, default=None,
                   help="cap on the whole memory plan in GiB (weights, state, workspace, expert cache); "
                        "default: the device's free memory (unified memory: 90 %% of the machine)")


def memory_bytes(a: argparse.Namespace) -> dict[str, int | None]:
    """EngineConfig's cache_bytes, host_cache_bytes and memory_bytes from the parsed options."""
    return {"cache_bytes": gib_to_bytes(a.cache_gb, "--cache-gb"),
            "host_cache_bytes": gib_to_bytes(a.host_cache_gb, "--host-cache-gb"),
            "memory_bytes": gib_to_bytes(a.memory_gb, "--memory-gb")}


def add_engine_args(p: argparse.ArgumentParser, numerics: str = "native", turns: bool = True) -> None:
    """The options every engine entry point shares: --ckpt (or --model, as dsv4-chat says),
    --numerics (default `numerics`), --device, --backend, --cache-gb and --memory-gb; with `turns`
    (a tool that runs chat turns) also --max-seq-len and --no-cuda-graphs, else those stay at
    EngineConfig's defaults."""
    p.add_argument("--ckpt", "--model", dest="ckpt", required=True,
                   help="model directory (converted or official layout)")
    p.add_argument("--numerics", choices=("native", "exact"), default=numerics)
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--backend", choices=("torch", "tilelang"), default=EngineConfig.backend,
                   help="kernel backend (tilelang: CUDA only)")
    add_memory_args(p)
    if turns:
        p.add_argument("--max-seq-len", type=positive_int, default=EngineConfig.max_seq_len,
                       help="context limit in tokens, at most the model's max_position_embeddings")
        p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                       help="run every decode step eagerly instead of replaying CUDA graphs")
    else:
        p.set_defaults(max_seq_len=EngineConfig.max_seq_len, cuda_graphs=EngineConfig.cuda_graphs)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of options parsed by a parser that `add_engine_args` built (the GiB figures
    converted to bytes here, once); raises ConfigError for a combination EngineConfig refuses."""
    return EngineConfig(device=a.device, numerics=a.numerics, backend=a.backend, max_seq_len=a.max_seq_len,
                        cuda_graphs=a.cuda_graphs, **memory_bytes(a))
