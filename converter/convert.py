"""`dsv4-convert`: official HF checkpoint -> expert-pack layout v2 (converter/layout.py).

Lossless (bytes are copied, never re-quantised; the FP4 expert weights' codes are only
reordered within each byte) and streaming: one resident tensor (in 8 MiB chunks) or one expert
record is in memory at a time, whatever the model size. Each output file
is written under `<name>.tmp`, fsynced, hashed piece by piece on the way, and renamed when
complete; its manifest entry then goes to `.dsv4-convert.json`. A rerun with the same source
(resume, the default) re-verifies the files listed there and writes only what is missing, and
`manifest.json` is written last: the output is byte-identical however often it was interrupted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from converter import mapping, preflight
from converter.stwriter import TensorSpec, aligned_first, build_header
from converter.verify import check_file, verify as verify_dir
from engine import pack as layout
from engine.checkpoint import INDEX_NAME, CheckpointError, TensorIndex, TensorInfo
from engine.config import ModelArgs

CHUNK = 1 << 23  # bytes per read/write when copying a resident tensor


class ConvertError(Exception):
    """The conversion failed; the message says why and what to do."""


class ConvertCancelled(ConvertError):
    """The conversion was cancelled; finished files are kept and a rerun resumes."""


@dataclass(frozen=True)
class ConvertProgress:
    """Progress snapshot delivered to the `progress` callback."""

    bytes_done: int
    bytes_total: int
    bytes_per_s: float  # over the bytes processed by this run (verified or written)
    eta_s: float | None  # None until a rate is known
    current: str  # what is being done, e.g. "writing layer_03.safetensors"


ProgressFn = Callable[[ConvertProgress], None]
FaultHook = Callable[[str], None]


@dataclass
class _OutFile:
    """One planned safetensors output file."""

    name: str
    header: bytes
    specs: list[TensorSpec]  # in data order; the experts tensor (if any) first
    sources: dict[str, TensorInfo]  # resident tensor name -> source
    experts: list[list[TensorInfo]] | None  # [expert][field] sources, record order

    @property
    def size(self) -> int:
        return len(self.header) + sum(s.nbytes for s in self.specs)


def _plan(index: TensorIndex, args: ModelArgs, record: layout.RecordLayout) -> list[_OutFile]:
    resident: dict[str, list[str]] = {}
    for name in index.names():
        target = mapping.classify(name, args)
        if not target.is_expert:
            resident.setdefault(target.file, []).append(name)
    plan = []
    for unit in [None] + mapping.units(args):  # global file first, then layers, then MTP
        fname = mapping.GLOBAL_FILE if unit is None else mapping.unit_file(unit, args)
        specs = [TensorSpec(n, index.info(n).torch_dtype, index.info(n).shape)
                 for n in resident.get(fname, [])]
        specs = aligned_first(specs, layout.ALIGNMENT)
        experts = None
        if unit is not None:
            prefix = mapping.unit_prefix(unit, args)
            experts = [[index.info(f"{prefix}.ffn.experts.{e}.{f}") for f in record.fields]
                       for e in range(args.n_routed_experts)]
            specs.insert(0, TensorSpec(mapping.experts_tensor(unit, args), torch.uint8,
                                       (args.n_routed_experts, record.record_bytes)))
        header = build_header(specs, {"format": "pt"}, alignment=layout.ALIGNMENT)
        plan.append(_OutFile(fname, header, specs, {n: index.info(n) for n in resident.get(fname, [])},
                             experts))
    return plan


def _fingerprint(root: Path, index: TensorIndex) -> dict:
    raw = (root / INDEX_NAME).read_bytes()
    return {"index_sha256": hashlib.sha256(raw).hexdigest(), "total_size": index.total_bytes(),
            "shards": [{"name": f.name, "size": f.stat().st_size} for f in index.files()]}


def _source_config(root: Path) -> dict:
    for candidate in (root / "config.json", root / "inference" / "config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text(encoding="utf-8"))
    raise ConvertError(f"{root}: no config.json")  # preflight reports this first


def _write_all(fd: int, data: memoryview) -> None:
    """Write all of `data` at fd's position."""
    while data:
        data = data[os.write(fd, data):]


def _pread_exact(fd: int, buf: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise ConvertError(f"{what}: source file ended early at byte {offset + done}; the "
                               "shard changed since the preflight check (download it again)")
        done += n


def replace_durably(tmp: Path, final: Path) -> None:
    """Rename `tmp` over `final` and fsync the directory, so the rename survives a crash."""
    os.replace(tmp, final)
    dfd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class _Meter:
    """Counts bytes and calls the progress callback at most every `interval` seconds."""

    def __init__(self, total: int, progress: ProgressFn | None, interval: float = 0.1):
        self.total, self.done, self.worked = total, 0, 0
        self._progress, self._interval = progress, interval
        self._t0 = self._last = time.monotonic()
        self.current = "starting"

    def add(self, n: int, worked: bool = True, force: bool = False) -> None:
        self.done += n
        self.worked += n if worked else 0
        now = time.monotonic()
        if self._progress and (force or now - self._last >= self._interval):
            self._last = now
            rate = self.worked / (now - self._t0) if now > self._t0 and self.worked else 0.0
            eta = (self.total - self.done) / rate if rate else None
            self._progress(ConvertProgress(self.done, self.total, rate, eta, self.current))

    def status(self, current: str) -> None:
        self.current = current
        self.add(0, force=True)


class _Converter:
    """One conversion run (see `convert`)."""

    def __init__(self, src: Path, out: Path, meter: _Meter, cancel: threading.Event | None,
                 fault_hook: FaultHook | None):
        self.src, self.out, self.meter, self.cancel = src, out, meter, cancel
        self.hook = fault_hook or (lambda point: None)
        self._fds: dict[Path, int] = {}

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(self._fds[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise ConvertCancelled("conversion cancelled; finished files are kept: run it again "
                                   "with the same arguments to resume")

    def write(self, f: _OutFile, record: layout.RecordLayout) -> dict:
        """Write one safetensors output file (temp + fsync + rename); returns its entry."""
        tmp, final = self.out / (f.name + ".tmp"), self.out / f.name
        self.meter.status(f"writing {f.name}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            hasher = layout.PieceHasher(f.header)
            _write_all(fd, memoryview(f.header))
            self.hook(f"begin:{f.name}")
            for spec in f.specs:
                if f.experts is not None and spec is f.specs[0]:
                    self._write_records(fd, f, record, hasher)
                else:
                    hasher.add_tensor(spec.name, self._copy(fd, f.sources[spec.name]))
                    self.hook(f"tensor:{f.name}:{spec.name}")
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.hook(f"written:{f.name}")
        replace_durably(tmp, final)
        self.hook(f"renamed:{f.name}")
        return hasher.finish(f.size)

    def _write_records(self, fd: int, f: _OutFile, record: layout.RecordLayout,
                       hasher: layout.PieceHasher) -> None:
        buf = memoryview(bytearray(record.record_bytes))  # padding stays zero: fields never reach it
        view = torch.frombuffer(buf, dtype=torch.uint8)  # the same bytes
        for e, sources in enumerate(f.experts):
            self._check_cancel()
            for field, t in zip(record.fields.values(), sources):
                _pread_exact(self._fd(t.file), buf[field.offset:field.offset + field.nbytes],
                             t.offset, t.name)
            record.to_record_order(view)
            hasher.add_record(hashlib.sha256(buf).digest())
            _write_all(fd, buf)
            self.meter.add(record.record_bytes)
            self.hook(f"record:{f.name}:{e}")

    def _copy(self, fd: int, t: TensorInfo) -> bytes:
        """Copy one resident tensor from its shard; returns the sha256 digest of its bytes."""
        h = hashlib.sha256()
        buf = memoryview(bytearray(min(CHUNK, max(t.nbytes, 1))))
        pos = 0
        while pos < t.nbytes:
            self._check_cancel()
            k = min(len(buf), t.nbytes - pos)
            _pread_exact(self._fd(t.file), buf[:k], t.offset + pos, t.name)
            h.update(buf[:k])
            _write_all(fd, buf[:k])
            pos += k
            self.meter.add(k)
        return h.digest()

    def copy_file(self, name: str) -> dict:
        tmp, final = self.out / (name + ".tmp"), self.out / name
        data = (self.src / name).read_bytes()
        tmp.write_bytes(data)
        replace_durably(tmp, final)
        self.meter.add(len(data))
        return {"size": len(data), "checksum": "sha256:" + hashlib.sha256(data).hexdigest()}


def _load_previous(out: Path, fingerprint: dict, sizes: dict[str, int]) -> dict[str, dict]:
    """File entries of an earlier run with the same source and plan (manifest or state file)."""
    for name in (layout.MANIFEST, layout.STATE):
        try:
            doc = json.loads((out / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if (isinstance(doc, dict) and doc.get("version") == layout.VERSION
                and doc.get("source") == fingerprint and isinstance(doc.get("files"), dict)):
            return {k: v for k, v in doc["files"].items()
                    if isinstance(v, dict) and (k not in sizes or v.get("size") == sizes[k])}
    return {}


def _save_state(out: Path, fingerprint: dict, entries: dict[str, dict]) -> None:
    doc = {"format": layout.FORMAT, "version": layout.VERSION, "source": fingerprint,
           "files": entries}
    tmp = out / (layout.STATE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    replace_durably(tmp, out / layout.STATE)


def convert(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, progress: ProgressFn | None = None,
            cancel: threading.Event | None = None, resume: bool = True, verify: bool = False, *,
            disk_free: preflight.DiskFree | None = None, fault_hook: FaultHook | None = None) -> Path:
    """Convert the HF checkpoint `hf_dir` into `out_dir` (layout v2); returns out_dir.

    Raises preflight.PreflightError (nothing written) when the source or destination is unfit,
    ConvertCancelled when `cancel` is set, ConvertError on failures. `resume=False` discards
    earlier output in `out_dir` first. `verify=True` re-reads the result against the manifest.
    `disk_free(path) -> bytes` replaces the free-space query and `fault_hook(point)` is called at
    named points of the write path (both for tests).
    """
    src, out = Path(hf_dir), Path(out_dir)
    problems = preflight.check_source(src)
    if problems:
        raise preflight.PreflightError(problems)
    args = ModelArgs.from_dir(src)
    try:
        index = TensorIndex.open(src)
    except CheckpointError as e:
        raise preflight.PreflightError([str(e)]) from None
    record = layout.RecordLayout.from_args(args)
    plan = _plan(index, args, record)
    copies = [n for n in layout.COPIED_FILES if (src / n).is_file()]
    fingerprint = _fingerprint(src, index)
    sizes = {f.name: f.size for f in plan} | {n: (src / n).stat().st_size for n in copies}
    previous = _load_previous(out, fingerprint, sizes) if resume else {}
    needed = sum(s for n, s in sizes.items() if n not in previous) + (1 << 20)
    problems = preflight.check_destination(out, needed, src, disk_free)
    if problems:
        raise preflight.PreflightError(problems)

    out.mkdir(parents=True, exist_ok=True)
    if previous:
        _save_state(out, fingerprint, previous)  # the dir reads as unfinished from here on
    for f in sorted(out.iterdir()):
        if layout.is_own_file(f.name) and (f.name.endswith(".tmp") or f.name == layout.MANIFEST
                                           or (not previous and f.name != layout.STATE)):
            f.unlink()
    if not previous:
        (out / layout.STATE).unlink(missing_ok=True)

    meter = _Meter(sum(f.size - len(f.header) for f in plan) + sum(sizes[n] for n in copies),
                   progress)
    run = _Converter(src, out, meter, cancel, fault_hook)
    entries: dict[str, dict] = {}
    try:
        for item in plan + copies:
            name = item if isinstance(item, str) else item.name
            payload = sizes[name] - (0 if isinstance(item, str) else len(item.header))
            if name in previous:
                meter.status(f"checking {name}")
                if check_file(out / name, previous[name], lambda n: None) is None:
                    entries[name] = previous[name]
                    meter.add(payload, worked=False)
                    continue
            run._check_cancel()
            entries[name] = run.copy_file(item) if isinstance(item, str) else run.write(item, record)
            _save_state(out, fingerprint, entries | {k: v for k, v in previous.items()
                                                     if k not in entries and k in sizes})
            run.hook(f"saved:{name}")
    finally:
        run.close()
        index.close()
    manifest = layout.Manifest(_source_config(src), fingerprint, record, args.n_routed_experts,
                               tuple(layout.units_for(args)), entries)
    run.hook("manifest")
    tmp = out / (layout.MANIFEST + ".tmp")
    tmp.write_text(manifest.dumps(), encoding="utf-8")
    replace_durably(tmp, out / layout.MANIFEST)
    (out / layout.STATE).unlink(missing_ok=True)
    meter.status("done")
    if verify:
        meter.status("verifying")
        problems = verify_dir(out)
        if problems:
            raise ConvertError("verification failed:\n  - " + "\n  - ".join(problems))
    return out


# ----------------------------------------------------------------------------- CLI

def _fmt_time(s: float | None) -> str:
    if s is None:
        return "--:--"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _printer(stream) -> ProgressFn:
    """A progress bar redrawn in place on a terminal; a plain line every 5 s otherwise."""
    tty = stream.isatty()
    last = [0.0, ""]

    def show(p: ConvertProgress) -> None:
        frac = p.bytes_done / p.bytes_total if p.bytes_total else 1.0
        text = (f"{frac * 100:5.1f}% {p.bytes_done / 1e9:7.2f}/{p.bytes_total / 1e9:.2f} GB "
                f"{p.bytes_per_s / 1e9:5.2f} GB/s ETA {_fmt_time(p.eta_s)}  {p.current}")
        if tty:
            bar = "#" * int(frac * 30)
            stream.write(f"\r[{bar:<30}] {text}\x1b[K")
            stream.flush()
        elif time.monotonic() - last[0] >= 5 or p.current != last[1]:
            last[0], last[1] = time.monotonic(), p.current
            print(text, file=stream, flush=True)

    return show


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-convert", description=(
        "Convert an official DeepSeek-V4-Flash checkpoint into the streaming expert-pack layout "
        "(lossless, resumable)."))
    ap.add_argument("--hf", help="downloaded checkpoint directory (config.json, "
                    "model.safetensors.index.json, model-*.safetensors)")
    ap.add_argument("--out", help="output directory (new, or an earlier output)")
    ap.add_argument("--verify", action="store_true", help="re-read the output against the manifest")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="keep verified files of an earlier run (default); --no-resume starts over")
    ap.add_argument("--upgrade", metavar="DIR", help="rewrite a model converted by an older version "
                    "(layout 1) in place, without the download; resumable")
    a = ap.parse_args(argv)
    if a.upgrade is not None:
        if a.hf or a.out:
            ap.error("--upgrade DIR takes no --hf or --out")
        return _upgrade_main(a.upgrade, a.verify)
    if not (a.hf and a.out):
        ap.error("--hf and --out are required (or --upgrade DIR)")
    show = _printer(sys.stderr)
    t0 = time.monotonic()
    out, status = _run(lambda: convert(a.hf, a.out, progress=show, resume=a.resume, verify=a.verify),
                       ConvertError)
    if status:
        return status
    size = sum(e["size"] for e in json.loads((out / layout.MANIFEST).read_text())["files"].values())
    print(f"\nconverted {a.hf} -> {out}: {size / 1e9:.2f} GB in {time.monotonic() - t0:.1f} s"
          + (", verified" if a.verify else ""), file=sys.stderr)
    return 0


def _run(work: Callable[[], Path], errors: type[Exception]) -> tuple[Path | None, int]:
    """(work's result, 0), or (None, the exit status) with the message printed: 2 for a
    preflight error, 130 when interrupted, 1 for `errors` and OSError."""
    try:
        return work(), 0
    except preflight.PreflightError as e:
        print(f"dsv4-convert: {e}", file=sys.stderr)
        return None, 2
    except KeyboardInterrupt:
        print("\ndsv4-convert: interrupted; run the same command again to resume", file=sys.stderr)
        return None, 130
    except (errors, OSError) as e:
        print(f"\ndsv4-convert: error: {e}", file=sys.stderr)
        return None, 1


def _upgrade_main(path: str, verify: bool) -> int:
    """`dsv4-convert --upgrade DIR [--verify]` (converter/upgrade.py); the exit status."""
    from converter.upgrade import UpgradeError, upgrade  # imports this module: imported late

    t0 = time.monotonic()
    _, status = _run(lambda: upgrade(path, progress=lambda line: print(line, file=sys.stderr, flush=True)),
                     UpgradeError)
    if status:
        return status
    problems = verify_dir(Path(path)) if verify else []
    if problems:
        print("dsv4-convert: verification failed:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    print(f"upgraded {path} in {time.monotonic() - t0:.1f} s" + (", verified" if verify else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
