"""Official HF checkpoint -> expert-pack layout v2 (engine/pack.py).

Lossless (bytes are copied, never re-quantised; the FP4 expert weights' codes are only
reordered within each byte) and streaming: one resident tensor (in 8 MiB chunks) or one expert
record is in memory at a time, whatever the model size. Each output file
is written under `<name>.tmp`, fsynced, hashed piece by piece on the way, and renamed when
complete; its manifest entry then goes to `.dsv4-convert.json`. A rerun with the same source
(resume, the default) re-verifies the files listed there and writes only what is missing, and
`manifest.json` is written last: the output is byte-identical however often it was interrupted.

Resume trusts an earlier output file only if the source it came from is unchanged: the manifest's
"source" records each shard's size, the sha256 of its header and its modification time
(`shard_fingerprints`), and a copied file (config, tokenizer) is compared by content. An output
file read from a shard that differs in any of these is converted again, and a notice says which
shard changed and how. (A shard edited in place with its size, header and modification time
restored is not detected: `--no-resume` converts everything again.)

The `dsv4-convert` command line around this library is converter/cli.py.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from converter import mapping, preflight
from converter.durable import replace_durably
from converter.stwriter import TensorSpec, aligned_first, build_header
from converter.verify import check_file, verify as verify_dir
from engine import pack as layout
from engine.checkpoint import INDEX_NAME, CheckpointError, TensorIndex, TensorInfo
from engine.config import ModelArgs

CHUNK = 1 << 23  # bytes per read/write when copying a resident tensor


class ConvertError(Exception):
    """The conversion failed; the message says why and what to do."""


class _IOFailure(Exception):
    """An OSError while doing `op` on `path`; `convert` turns it into a ConvertError with the fix."""

    def __init__(self, op: str, path: Path, error: OSError):
        super().__init__(op, path, error)
        self.op, self.path, self.error = op, path, error


@contextmanager
def _io(op: str, path: Path) -> Iterator[None]:
    """Raise an OSError inside as an _IOFailure naming the operation and the file."""
    try:
        yield
    except OSError as e:
        raise _IOFailure(op, path, e) from e


def _io_message(failure: _IOFailure, out: Path, remaining: int, free: int | None) -> str:
    """One line: the operation, the file, what happened and the fix (the rerun resumes). Only
    sources are read: their fixes are about the source file, the others' about --out."""
    e, where = failure.error, f"{failure.op} {failure.path}"
    again = "run the same command again: it resumes"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        now = "" if free is None else f"; {free / 1e9:.2f} GB are free now"
        return (f"{where}: no space left on the device: free {remaining / 1e9:.2f} GB at {out} (what "
                f"the rest of the conversion writes{now}) and {again}")
    what = e.strerror or str(e)
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    what += f" ({code})" if code else ""
    if failure.op == "reading" and e.errno in (errno.EACCES, errno.EPERM):
        return f"{where}: {what}: make it readable and {again}"
    if failure.op == "reading":
        return (f"{where}: {what}: the source file cannot be read; check the disk (dmesg) or download "
                f"that file again, then {again}")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{where}: {what}: make {failure.path.parent} writable (or choose another --out) and {again}"
    return f"{where}: {what}: check the disk (dmesg, free space) and {again}"


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


def _shard_fingerprint(path: Path) -> dict:
    """{"header_sha256", "mtime_ns"} of one source shard (reads only its header)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        header = head + f.read(n)
        mtime = os.fstat(f.fileno()).st_mtime_ns
    return {"header_sha256": hashlib.sha256(header).hexdigest(), "mtime_ns": mtime}


def _fingerprint(root: Path, index: TensorIndex) -> dict:
    raw = (root / INDEX_NAME).read_bytes()
    return {"index_sha256": hashlib.sha256(raw).hexdigest(), "total_size": index.total_bytes(),
            "shards": [{"name": f.name, "size": f.stat().st_size} for f in index.files()],
            "shard_fingerprints": {f.name: _shard_fingerprint(f) for f in index.files()}}


def _dependencies(plan: list[_OutFile]) -> dict[str, set[str]]:
    """Output file name -> names of the source shards its bytes are read from."""
    deps = {}
    for f in plan:
        infos = list(f.sources.values()) + [t for fields in (f.experts or []) for t in fields]
        deps[f.name] = {t.file.name for t in infos}
    return deps


def _changed_shards(old: dict, new: dict) -> dict[str, list[str]]:
    """Source shard name -> how it differs from the earlier run's fingerprint `old`."""
    old_sizes = {s.get("name"): s.get("size") for s in old.get("shards", []) if isinstance(s, dict)}
    old_fps = old.get("shard_fingerprints")
    old_fps = old_fps if isinstance(old_fps, dict) else {}
    changed = {}
    for shard in new["shards"]:
        name, fp = shard["name"], old_fps.get(shard["name"])
        why = []
        if old_sizes.get(name) != shard["size"]:
            why.append("size")
        if not isinstance(fp, dict):
            why.append("no fingerprint recorded by the earlier run")
        else:
            if fp.get("header_sha256") != new["shard_fingerprints"][name]["header_sha256"]:
                why.append("header")
            if fp.get("mtime_ns") != new["shard_fingerprints"][name]["mtime_ns"]:
                why.append("modification time")
        if why:
            changed[name] = why
    return changed


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
                               "shard changed since the preflight check: download it again, then run "
                               "the same command again: it resumes")
        done += n


class ProgressMeter:
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

    def __init__(self, src: Path, out: Path, meter: ProgressMeter, cancel: threading.Event | None,
                 fault_hook: FaultHook | None):
        self.src, self.out, self.meter, self.cancel = src, out, meter, cancel
        self.hook = fault_hook or (lambda point: None)
        self._fds: dict[Path, int] = {}

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            with _io("reading", path):  # a source shard
                self._fds[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(self._fds[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return self._fds[path]

    def _read(self, t: TensorInfo, buf: memoryview, offset: int) -> None:
        """Fill buf from t's shard at `offset` (an absolute file offset)."""
        fd = self._fd(t.file)
        with _io("reading", t.file):
            _pread_exact(fd, buf, offset, f"reading {t.name} from {t.file}")

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
        with _io("creating", tmp):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with _io("writing", tmp):
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
        with _io("renaming", tmp):
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
                self._read(t, buf[field.offset:field.offset + field.nbytes], t.offset)
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
            self._read(t, buf[:k], t.offset + pos)
            h.update(buf[:k])
            _write_all(fd, buf[:k])
            pos += k
            self.meter.add(k)
        return h.digest()

    def copy_file(self, name: str) -> dict:
        tmp, final = self.out / (name + ".tmp"), self.out / name
        with _io("reading", self.src / name):
            data = (self.src / name).read_bytes()
        try:
            with _io("writing", tmp):
                tmp.write_bytes(data)
        except _IOFailure:
            tmp.unlink(missing_ok=True)
            raise
        with _io("renaming", tmp):
            replace_durably(tmp, final)
        self.meter.add(len(data))
        return {"size": len(data), "checksum": "sha256:" + hashlib.sha256(data).hexdigest()}


def _load_previous(out: Path, src: Path, fingerprint: dict, sizes: dict[str, int],
                   deps: dict[str, set[str]], notice: Callable[[str], None]) -> dict[str, dict]:
    """File entries of an earlier run (manifest or state file) that came from the same source and
    plan; `notice` is told why any others are converted again."""
    for name in (layout.MANIFEST, layout.STATE):
        try:
            doc = json.loads((out / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not (isinstance(doc, dict) and doc.get("version") == layout.VERSION
                and isinstance(doc.get("source"), dict) and isinstance(doc.get("files"), dict)):
            continue
        old = doc["source"]
        if (old.get("index_sha256"), old.get("total_size")) != (fingerprint["index_sha256"],
                                                                fingerprint["total_size"]):
            notice(f"the source's {INDEX_NAME} differs from the one {out} was converted from: "
                   "converting everything again")
            return {}
        files = {k: v for k, v in doc["files"].items() if layout.entry_problem(k, v) is None}
        for k in sorted(set(files) - set(deps)):  # copied files: compared by content (small)
            if (src / k).is_file() and layout.sha256_file(src / k) != files[k].get("checksum"):
                notice(f"source file {k} changed since the earlier conversion: copying it again")
                files.pop(k)
        files = {k: v for k, v in files.items() if k not in sizes or v.get("size") == sizes[k]}
        changed = _changed_shards(old, fingerprint)
        for shard, why in sorted(changed.items()):
            stale = sorted(k for k in files if shard in deps.get(k, ()))
            if stale:
                notice(f"source shard {shard} changed since the earlier conversion ({', '.join(why)}): "
                       f"converting {', '.join(stale)} again")
            for k in stale:
                files.pop(k)
        return files
    return {}


def _save_state(out: Path, fingerprint: dict, entries: dict[str, dict]) -> None:
    doc = {"format": layout.FORMAT, "version": layout.VERSION, "source": fingerprint,
           "files": entries}
    tmp = out / (layout.STATE + ".tmp")
    with _io("writing", tmp):
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
        replace_durably(tmp, out / layout.STATE)


def _convert_files(src: Path, out: Path, args: ModelArgs, index: TensorIndex,
                   record: layout.RecordLayout, plan: list[_OutFile], copies: list[str],
                   sizes: dict[str, int], fingerprint: dict, previous: dict[str, dict],
                   entries: dict[str, dict], meter: "ProgressMeter", cancel: threading.Event | None,
                   fault_hook: FaultHook | None) -> None:
    """Write (or keep, verified) every planned file into `entries`, then the manifest.

    Removes files only in a directory that holds an earlier conversion (preflight.holds_conversion;
    check_destination refuses any other that is not empty), and there only files with the
    converter's names: temporaries, the manifest, earlier output not kept (`previous`) and, last,
    whatever this run did not write (a copied file no longer in the source). The state file is
    written before anything else, so an interrupted run always leaves a directory a rerun resumes."""
    with _io("creating", out):
        out.mkdir(parents=True, exist_ok=True)
    ours = preflight.holds_conversion(out)
    if previous:
        _save_state(out, fingerprint, previous)  # the dir reads as unfinished from here on
    for f in sorted(out.iterdir()) if ours else ():
        if layout.is_own_file(f.name) and (f.name.endswith(".tmp") or f.name == layout.MANIFEST
                                           or (not previous and f.name != layout.STATE)):
            with _io("removing", f):
                f.unlink()
    if not previous:
        _save_state(out, fingerprint, {})  # the dir reads as an unfinished conversion from here on

    run = _Converter(src, out, meter, cancel, fault_hook)
    try:
        for item in plan + copies:
            name = item if isinstance(item, str) else item.name
            payload = sizes[name] - (0 if isinstance(item, str) else len(item.header))
            if name in previous:
                meter.status(f"checking {name}")
                if not check_file(out / name, previous[name]):
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
    for f in sorted(out.iterdir()):  # e.g. a tokenizer file removed from the source since then
        if layout.is_own_file(f.name) and f.name not in entries and f.name != layout.STATE:
            with _io("removing", f):
                f.unlink()
    manifest = layout.Manifest(_source_config(src), fingerprint, record, args.n_routed_experts,
                               tuple(layout.units_for(args)), entries)
    run.hook("manifest")
    tmp = out / (layout.MANIFEST + ".tmp")
    with _io("writing", tmp):
        tmp.write_text(manifest.dumps(), encoding="utf-8")
        replace_durably(tmp, out / layout.MANIFEST)
    with _io("removing", out / layout.STATE):
        (out / layout.STATE).unlink(missing_ok=True)


@contextmanager
def _only_writer(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the directory `out` (made here; removed again if it is still
    empty when the conversion is refused or fails) while the conversion reads and writes it: a
    second conversion into the same directory (the wizard in another terminal, dsv4-convert) is
    refused at once instead of interleaving its writes. Where `out` cannot be made (a file in the
    way), nothing is locked and check_destination says why; a filesystem without flock is
    written unlocked."""
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise preflight.PreflightError([f"another conversion is writing into --out {out} right now; wait for "
                                            "it to finish (a rerun then resumes or keeps its output), or choose "
                                            "another --out"]) from None
        except OSError:
            pass  # no flock here (some network filesystems): unlocked
        yield
    except BaseException:
        if made:
            try:
                out.rmdir()  # only if still empty: nothing was written
            except OSError:
                pass
        raise
    finally:
        os.close(fd)


def convert(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, progress: ProgressFn | None = None,
            cancel: threading.Event | None = None, resume: bool = True, verify: bool = False, *,
            disk_free: preflight.DiskFree | None = None, fault_hook: FaultHook | None = None,
            notice: Callable[[str], None] | None = None, check_tokenizer: bool = False) -> Path:
    """Convert the HF checkpoint `hf_dir` into `out_dir` (layout v2); returns out_dir.

    Raises preflight.PreflightError (nothing written) when the source or destination is unfit,
    ConvertCancelled when `cancel` is set, ConvertError on failures. `resume=False` discards
    earlier output in `out_dir` first. `verify=True` re-reads the result against the manifest.
    `check_tokenizer=True` refuses a tokenizer.json with more tokens than vocab_size
    (preflight.check_tokenizer; dsv4-convert does, unless --logits-only). `notice(line)` receives
    what the user should know but is no failure (e.g. why earlier output is converted again).
    `disk_free(path) -> bytes` replaces the free-space query and `fault_hook(point)` is called at
    named points of the write path (both for tests). An OSError becomes a ConvertError naming the
    operation, the file and the fix (for a full disk: how many GB to free; a rerun resumes).
    """
    src, out = Path(hf_dir), Path(out_dir)
    problems = preflight.check_source(src, tokenizer=check_tokenizer)
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
    notes = notice or (lambda line: None)
    try:
        with _only_writer(out):
            previous = _load_previous(out, src, fingerprint, sizes, _dependencies(plan), notes) if resume else {}
            needed = sum(s for n, s in sizes.items() if n not in previous) + (1 << 20)
            problems = preflight.check_destination(out, needed, src, disk_free)
            if problems:
                raise preflight.PreflightError(problems)

            entries: dict[str, dict] = {}
            meter = ProgressMeter(sum(f.size - len(f.header) for f in plan) + sum(sizes[n] for n in copies),
                           progress)
            try:
                _convert_files(src, out, args, index, record, plan, copies, sizes, fingerprint, previous,
                               entries, meter, cancel, fault_hook)
            except _IOFailure as failure:
                remaining = sum(n for k, n in sizes.items() if k not in entries) + (1 << 20)
                try:
                    free = (disk_free or preflight.free_bytes)(out)
                except OSError:
                    free = None
                raise ConvertError(_io_message(failure, out, remaining, free)) from None
            meter.status("done")
            if verify:
                meter.status("verifying")
                problems = verify_dir(out)
                if problems:
                    raise ConvertError("verification failed:\n  - " + "\n  - ".join(problems))
            return out
    finally:
        index.close()
