"""The kernel manifest: which TileLang kernels a full warm-up built, so that a later process builds
the same set (each a load from TileLang's on-disk cache) without running the model; and kernel
hints: the kernels other manifests of the same shapes list (`shape_key`, `read_hints`), compiled
in parallel before a first full warm-up, which then finds them built.

A manifest is a JSON file in `<TileLang's cache dir>/dsv4-chat-manifests/<key>.json`:

    {"format": 1, "key": "<key>", "shape": "<shape key>",
     "kernels": [{"factory": "kernels.fp8_gemm.fp8_gemv_kernel", "args": [1, 4096, ...], "kwargs": {}}, ...]}

Arguments are JSON scalars or arrays; an array stands for a tuple (factory arguments are hashable,
so no factory takes a list). The key (`manifest_key`) changes with everything that can change
the set of kernels: the model's ModelArgs, the EngineConfig fields that pick shapes and code paths
(prefill_chunk, max_seq_len, numerics, cuda_graphs), whether every expert is resident (a bounded
cache streams experts through other kernels), the model layout (converted or official), the GPU's
compute capability, TileLang's version, the source of the kernels package and the warm-up's plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import threading
from concurrent.futures import as_completed
from pathlib import Path
from typing import Callable, Mapping

from engine.config import EngineConfig, ModelArgs
from engine.experts.io_pool import IOPool

FORMAT = 1
MANIFEST_DIR = "dsv4-chat-manifests"
KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
HINTS_DIR = Path(__file__).resolve().parent / "kernel_hints"


class ManifestError(Exception):
    """A manifest that cannot be used (unreadable, malformed, for another key, naming an unknown
    factory) or whose replay failed; the message is one line."""


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One factory call: `factory` is the qualified name (kernels.backend.kernel_factories)."""

    factory: str
    args: tuple
    kwargs: tuple[tuple[str, object], ...] = ()


def tilelang_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """TileLang's on-disk kernel cache: $TILELANG_CACHE_DIR, else TileLang's default ~/.tilelang/cache
    (bench/full_depth.py's --tilelang-cache sets the variable for its child processes)."""
    return Path(environ.get("TILELANG_CACHE_DIR") or Path("~/.tilelang/cache").expanduser())


def kernels_source_digest(root: Path = KERNELS_DIR) -> str:
    """SHA-256 of the kernels package's Python sources (names and bytes, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def manifest_key(args: ModelArgs, config: EngineConfig, converted: bool, arch: tuple[int, int],
                 tilelang_version: str, source_digest: str, resident: bool, plan: tuple = ()) -> str:
    """The manifest's key: a digest of everything that can change which kernels the engine builds
    (see the module docstring). `resident`: every expert fits the cache (a bounded cache streams
    experts through other kernels: per-expert GEMMs, layered decode graphs). `plan`: the full
    warm-up's steps as tuples of scalars (a manifest recorded by another plan may miss kernels)."""
    inputs = {"model": dataclasses.asdict(args), "prefill_chunk": config.prefill_chunk,
              "max_seq_len": config.max_seq_len, "numerics": config.numerics, "cuda_graphs": config.cuda_graphs,
              "converted": converted, "arch": list(arch), "tilelang": tilelang_version, "kernels": source_digest,
              "resident": resident, "plan": [list(step) for step in plan]}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def shape_key(args: ModelArgs, config: EngineConfig, converted: bool, arch: tuple[int, int],
              tilelang_version: str) -> str:
    """The key of the kernel *shapes* an engine builds: manifest_key's inputs without those that
    only add or drop variants of the same shapes (the model's depth, expert count and hash-layer
    count, the compression ratios' order, max_seq_len, residency, the warm-up plan) or change
    their code (the kernels' source). Kernel hints (`read_hints`) are matched on it."""
    model = dataclasses.asdict(args)
    for name in ("n_layers", "n_routed_experts", "n_hash_layers", "compress_ratios"):
        model.pop(name)
    model["ratios"] = sorted({r for r in args.compress_ratios if r})
    inputs = {"model": model, "prefill_chunk": config.prefill_chunk, "numerics": config.numerics,
              "cuda_graphs": config.cuda_graphs, "converted": converted, "arch": list(arch),
              "tilelang": tilelang_version}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def hint_sources(cache_dir: Path) -> list[Path]:
    """Where kernel hints come from: the hint files shipped in engine/kernel_hints/ (recorded by
    `python -m bench.kernel_hints` on a GPU) and every manifest in TileLang's cache folder."""
    return sorted(HINTS_DIR.glob("*.json")) + sorted((Path(cache_dir) / MANIFEST_DIR).glob("*.json"))


def read_hints(paths, shape: str, factories: Mapping[str, Callable]) -> list[KernelCall]:
    """The calls of every manifest or hint file in `paths` written for `shape` (its "shape"
    field), without repeats, in file order: the kernels an engine of these shapes will probably
    build, to compile in parallel before a full warm-up. Best effort: an unreadable file, another
    shape, a malformed entry, an unknown factory or arguments its signature does not take (a
    manifest an older version of the kernels wrote into the same cache) is skipped."""
    calls: dict[KernelCall, None] = {}
    for path in paths:
        try:
            body = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(body, dict) or body.get("shape") != shape or not isinstance(body.get("kernels"), list):
            continue
        for entry in body["kernels"]:
            if (isinstance(entry, dict) and entry.get("factory") in factories and isinstance(entry.get("args"), list)
                    and isinstance(entry.get("kwargs", {}), dict)):
                try:
                    call = _entry_call(entry)
                    inspect.signature(factories[call.factory]).bind(*call.args, **dict(call.kwargs))
                    calls[call] = None
                except TypeError:  # an argument no factory takes (a JSON object, one too many): not a call
                    continue
    return list(calls)


def manifest_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / MANIFEST_DIR / f"{key}.json"


def built_calls(factories: Mapping[str, object]) -> list[KernelCall]:
    """Every kernel the factories (name -> KernelFactory) have built, in name then build order."""
    return [KernelCall(name, args, tuple(sorted(kwargs.items())))
            for name in sorted(factories) for args, kwargs in factories[name].built()]


def _encode(value):
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ManifestError(f"a kernel factory argument of type {type(value).__name__} cannot be written "
                        "to the kernel manifest")


def _decode(value):
    return tuple(_decode(v) for v in value) if isinstance(value, list) else value


def _entry_call(entry: dict) -> KernelCall:
    """The KernelCall of a manifest entry already checked to have a factory, args and kwargs."""
    return KernelCall(entry["factory"], _decode(entry["args"]),
                      tuple(sorted((k, _decode(v)) for k, v in entry.get("kwargs", {}).items())))


def _one_line(err: Exception) -> str:
    """The exception's type and the first line of its message (compiler errors run to pages)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def write_manifest(path: Path, key: str, calls: list[KernelCall], shape: str = "") -> None:
    """Write the manifest atomically: a temporary file in the same folder, then renamed over `path`
    (a reader sees the old manifest or the new one, never part of one). `shape`: the engine's
    `shape_key`, so that engines of the same shapes can take the manifest as hints."""
    body = {"format": FORMAT, "key": key, "shape": shape,
            "kernels": [{"factory": c.factory, "args": _encode(c.args),
                         "kwargs": {k: _encode(v) for k, v in c.kwargs}} for c in calls]}
    text = json.dumps(body, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_manifest(path: Path, key: str, factories: Mapping[str, object]) -> list[KernelCall]:
    """The calls recorded in the manifest at `path`; raises ManifestError when it is unreadable,
    malformed, written for another key or names a factory not in `factories`."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"kernel manifest {path} cannot be read ({err})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("kernels"), list):
        raise ManifestError(f"kernel manifest {path} is not a format-{FORMAT} manifest")
    if body.get("key") != key:
        raise ManifestError(f"kernel manifest {path} was written for key {body.get('key')!r}, not {key!r}")
    calls = []
    for i, entry in enumerate(body["kernels"]):
        if (not isinstance(entry, dict) or not isinstance(entry.get("args"), list)
                or not isinstance(entry.get("kwargs", {}), dict)):
            raise ManifestError(f"kernel manifest {path}: entry {i} is malformed")
        if entry.get("factory") not in factories:
            raise ManifestError(f"kernel manifest {path}: entry {i} names an unknown kernel factory "
                                f"{entry.get('factory')!r}")
        calls.append(_entry_call(entry))
    return calls


def replay(calls: list[KernelCall], factories: Mapping[str, object], workers: int,
           progress: Callable[[int, int], None], worker_setup: Callable[[], None] | None = None,
           failed: list[str] | None = None) -> None:
    """Call every factory of `calls` with its recorded arguments on `workers` named threads (an
    engine.experts.io_pool.IOPool, "kernel-replay-N", started and joined here; each call runs
    `worker_setup` first; 1 or fewer: in the calling thread). `progress(done, total)` is called in
    the calling thread, before the first call and after each. Raises ManifestError naming the
    first call that failed; the calls not yet started are then cancelled. With a `failed` list
    (hints: best effort), each failure's one-line message is appended to it instead, and the
    other calls go on."""
    total = len(calls)
    progress(0, total)

    def call(c: KernelCall, setup: Callable[[], None] | None) -> None:
        try:
            if setup is not None:
                setup()
            factories[c.factory](*c.args, **dict(c.kwargs))
        except Exception as err:  # a stale entry (TypeError, KernelInputError) or a failed build
            if failed is None:
                raise ManifestError(f"replaying {c.factory}{c.args} failed: {_one_line(err)}") from err
            failed.append(f"{c.factory}{c.args}: {_one_line(err)}")

    if workers <= 1 or total <= 1:
        for done, c in enumerate(calls, 1):
            call(c, None)
            progress(done, total)
        return
    with IOPool(min(workers, total), "kernel-replay") as pool:
        futures = [pool.submit(call, c, worker_setup) for c in calls]
        try:
            for done, fut in enumerate(as_completed(futures), 1):
                fut.result()
                progress(done, total)
        finally:
            for fut in futures:
                fut.cancel()
