"""`dsv4-convert --upgrade DIR`: a version-1 expert pack rewritten as the current version in place,
without the source checkpoint (engine/pack.py; version 2 stores the FP4 expert weights'
codes in record order, nothing else differs).

Only the files holding routed experts change. Each is rewritten to `<name>.tmp` in one pass, piece
by piece (header and resident tensors copied, each expert record reordered), every piece checked
against the version-1 manifest on the way, so a corrupt piece stops the upgrade and is named;
then fsynced and renamed over the original, and its new entry saved to `.dsv4-upgrade.json`. The
version-1 manifest stays until every file is done (the engine refuses the directory meanwhile),
then the new manifest replaces it. A rerun after an interruption skips the files already done; no
file is ever half old and half new.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from converter.durable import replace_durably
from engine import pack as layout
from engine.checkpoint import CheckpointError, read_header

CHUNK = 1 << 23  # bytes per read of a resident tensor


class UpgradeError(Exception):
    """The directory cannot be upgraded; the message says why and what to do."""


class UpgradeCancelled(UpgradeError):
    """Cancelled; files already upgraded are kept and a rerun resumes."""


def _read_exact(f: BinaryIO, buf: memoryview, name: str) -> None:
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])
        if not n:
            raise UpgradeError(f"{name} ended early: the file is truncated; convert the checkpoint again")
        done += n


def _upgrade_file(path: Path, entry: dict, record: layout.RecordLayout,
                  cancel: threading.Event | None) -> dict:
    """Rewrite one experts file (temp + fsync + rename), checking it against its version-1
    `entry`; returns its new entry. A file already rewritten (an upgrade stopped between its
    rename and saving its entry) is recognised by its first record and only checked."""
    name, tmp = path.name, path.with_name(path.name + ".tmp")
    rewritten = False  # the file holds version-2 records already
    try:
        tensors = read_header(path).tensors
    except CheckpointError as e:
        raise UpgradeError(f"{e}; convert the checkpoint again") from None

    def corrupt(what: str) -> UpgradeError:
        return UpgradeError(f"{name}: {what} does not match its checksum; the file is corrupt and "
                            "cannot be upgraded: convert the checkpoint again from the download")

    with open(path, "rb") as src, open(tmp, "wb") as dst:
        try:
            header = bytearray(int(entry["header"]["bytes"]))
            _read_exact(src, memoryview(header), name)
            if hashlib.sha256(header).hexdigest() != entry["header"]["sha256"]:
                raise corrupt("the safetensors header")
            hasher = layout.PieceHasher(bytes(header))
            dst.write(header)
            buf = memoryview(bytearray(max(CHUNK, record.record_bytes)))
            at = len(header)  # the pieces follow one another (engine/pack.py)
            for t in sorted(tensors, key=lambda t: t.offset):
                if t.offset != at:
                    raise UpgradeError(f"{name}: tensor {t.name} starts at byte {t.offset}, not {at}; "
                                       "the file is not a converter output: convert the checkpoint again")
                at += t.nbytes
                tname = t.name
                if tname.endswith(".ffn.experts"):  # [E, R]: one piece per record
                    if t.nbytes != len(entry["records"]) * record.record_bytes:
                        raise UpgradeError(f"{name}: {tname} holds {t.nbytes} bytes, not the manifest's "
                                           f"{len(entry['records'])} records; convert the checkpoint again")
                    rec = buf[:record.record_bytes]
                    view = torch.frombuffer(rec, dtype=torch.uint8)  # the same bytes
                    for e, want in enumerate(entry["records"]):
                        if cancel is not None and cancel.is_set():
                            raise UpgradeCancelled("upgrade cancelled; upgraded files are kept: run "
                                                   "it again to resume")
                        _read_exact(src, rec, name)
                        if e == 0 and hashlib.sha256(rec).hexdigest() != want:
                            rewritten = _official_digest(view, record) == want
                        if (_official_digest(view, record) if rewritten
                                else hashlib.sha256(rec).hexdigest()) != want:
                            raise corrupt(f"routed expert {e} of {tname[:-len('.ffn.experts')]}")
                        if not rewritten:
                            record.to_record_order(view)
                        hasher.add_record(hashlib.sha256(rec).digest())
                        dst.write(rec)
                else:
                    h, left = hashlib.sha256(), t.nbytes
                    while left:
                        part = buf[:min(left, len(buf))]
                        _read_exact(src, part, name)
                        h.update(part)
                        dst.write(part)
                        left -= len(part)
                    if h.hexdigest() != entry["tensors"].get(tname):
                        raise corrupt(f"tensor {tname}")
                    hasher.add_tensor(tname, h.digest())
            dst.flush()
            os.fsync(dst.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if rewritten:
        tmp.unlink()
    else:
        replace_durably(tmp, path)
    return hasher.finish(entry["size"])


def _official_digest(rec: torch.Tensor, record: layout.RecordLayout) -> str:
    """sha256 hex of a record-order record's bytes put back into official order."""
    back = rec.clone()
    record.to_official_order(back)
    return hashlib.sha256(back.numpy()).hexdigest()


def _load_state(root: Path, source: dict) -> dict[str, dict]:
    """Entries of the files an interrupted upgrade of this pack already rewrote."""
    try:
        doc = json.loads((root / layout.UPGRADE_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("source") != source or not isinstance(doc.get("files"), dict):
        return {}
    return dict(doc["files"])


def _save_state(root: Path, source: dict, done: dict[str, dict]) -> None:
    tmp = root / (layout.UPGRADE_STATE + ".tmp")
    tmp.write_text(json.dumps({"version": layout.VERSION, "source": source, "files": done}, indent=1,
                              sort_keys=True))
    replace_durably(tmp, root / layout.UPGRADE_STATE)


def upgrade(out_dir: str | os.PathLike, progress: Callable[[str], None] | None = None,
            cancel: threading.Event | None = None) -> Path:
    """Upgrade the converted directory `out_dir` from layout version 1 to layout.VERSION in place
    (module docstring); returns it, untouched when it already is current.

    Raises UpgradeError when it is not a finished conversion of version 1 or current, or a piece
    is corrupt (nothing of that file changes), UpgradeCancelled when `cancel` is set."""
    root = Path(out_dir)
    say = progress or (lambda line: None)
    where = root / layout.MANIFEST
    try:
        doc = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UpgradeError(f"{where}: unreadable ({e}); only a finished conversion can be upgraded") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if version == layout.VERSION:
        say(f"{root} is already at layout version {layout.VERSION}")
        return root
    if version != 1:
        raise UpgradeError(f"{where}: layout version {version!r} cannot be upgraded (only version 1 "
                           "can); convert the checkpoint again")
    try:  # version 1 has version 2's manifest structure
        old = layout.parse_manifest(doc | {"version": layout.VERSION}, str(where))
    except layout.LayoutError as e:
        raise UpgradeError(str(e)) from None
    done = _load_state(root, old.source)
    for unit in old.units:
        if unit.file in done:
            continue
        if cancel is not None and cancel.is_set():
            raise UpgradeCancelled("upgrade cancelled; upgraded files are kept: run it again to resume")
        say(f"upgrading {unit.file}")
        entry, path = old.files[unit.file], root / unit.file
        size = path.stat().st_size if path.is_file() else None
        if size != entry.get("size"):
            raise UpgradeError(f"{path}: {'missing' if size is None else f'{size} bytes'}, the manifest "
                               f"says {entry.get('size')} bytes; it cannot be upgraded: convert the "
                               "checkpoint again from the download")
        try:
            done[unit.file] = _upgrade_file(path, entry, old.record, cancel)
        except (KeyError, TypeError, ValueError) as e:  # the entry or the header is not what v1 wrote
            raise UpgradeError(f"{path}: its manifest entry or safetensors header is malformed ({e!r}); "
                               "convert the checkpoint again") from None
        _save_state(root, old.source, done)
    new = layout.Manifest(old.config, old.source, old.record, old.count, old.units, old.files | done)
    tmp = root / (layout.MANIFEST + ".tmp")
    tmp.write_text(new.dumps(), encoding="utf-8")
    replace_durably(tmp, where)
    (root / layout.UPGRADE_STATE).unlink(missing_ok=True)
    say(f"{root} upgraded to layout version {layout.VERSION}")
    return root
