"""Re-check a converted directory against its manifest: the manifest against its own config,
then each file's size and checksums piece by piece.

`read(dir)` parses the manifest (NotConverted: there is none; layout.LayoutError: it is
unreadable, malformed or of another layout version). `check(dir, manifest)` returns every problem
found, by file: the manifest's own (`manifest_problems`: experts count, record layout and units
that disagree with its config, a file the model needs or the directory holds that it does not
list, a config.json that differs from its config) under "manifest.json", and for each listed
file every corrupt piece (`check_file`: the header, each corrupt resident tensor, each corrupt
expert record, named) or that it is missing, of the wrong size or cannot be read. `verify(dir)`
is the flat list of all of them.

`python -m converter.verify DIR` prints every problem or "OK"; exit status 0 when intact, 1 when
anything is corrupt (a file or the manifest), 2 when DIR is not a converted model. The checksum
scheme is in engine/pack.py ("File entries").
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

from engine import pack as layout
from engine.checkpoint import INDEX_NAME
from engine.config import ConfigError, ModelArgs

CHUNK = 1 << 23
REWRITE = "rerun dsv4-convert with the same arguments to rewrite it"


class NotConverted(Exception):
    """The directory holds no manifest.json: not a converted model, or a conversion that did not
    finish; the message says which and what to do."""


def _pread_exact(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise EOFError(f"unexpected end of file at byte {offset + done}")
        done += n


def _hash_range(fd: int, offset: int, nbytes: int, buf: memoryview) -> bytes:
    h = hashlib.sha256()
    pos = 0
    while pos < nbytes:
        k = min(len(buf), nbytes - pos)
        _pread_exact(fd, buf[:k], offset + pos)
        h.update(buf[:k])
        pos += k
    return h.digest()


def _check_records(name: str, fd: int, tname: str, t: dict, hbytes: int, records: list[str],
                   buf: memoryview, tree, tick: Callable[[int], None]) -> list[str]:
    """Every corrupt record of one packed experts tensor (one problem naming them all)."""
    begin, _ = t["data_offsets"]
    count, rbytes = t["shape"]
    unit = tname[:-len(".ffn.experts")]
    if count != len(records):
        return [f"{name}: {count} expert records but the manifest lists {len(records)}; {REWRITE}"]
    rec = memoryview(bytearray(rbytes)) if rbytes > len(buf) else buf[:rbytes]
    bad = []
    for e in range(count):
        d = _hash_range(fd, hbytes + begin + e * rbytes, rbytes, rec)
        if d.hex() != records[e]:
            bad.append(e)
        tree.update(d)
        tick(rbytes)
    if len(bad) == 1:
        at = hbytes + begin + bad[0] * rbytes
        return [f"{name}: routed expert {bad[0]} of {unit} (record bytes {at}..{at + rbytes}) does not "
                f"match its checksum; the file is corrupt: {REWRITE}"]
    if bad:
        return [f"{name}: {len(bad)} routed experts of {unit} do not match their checksums: "
                f"{', '.join(map(str, bad))} (records of {rbytes} bytes from byte {hbytes + begin}); "
                f"the file is corrupt: {REWRITE}"]
    return []


def _check_pieces(path: Path, fd: int, entry: dict, size: int, tick: Callable[[int], None]) -> list[str]:
    """Every corrupt piece of a safetensors file: the header (then nothing else: the pieces'
    places come from it), else each resident tensor and each expert record that differs."""
    name = path.name
    hbytes = entry["header"]["bytes"]
    if not 8 <= hbytes <= size:
        return [f"{name}: the manifest says its header is {hbytes:,} bytes, outside 8..{size:,} (the "
                f"file's size): the manifest entry is corrupt; {REWRITE}"]
    header = bytearray(hbytes)
    _pread_exact(fd, memoryview(header), 0)
    tree = hashlib.sha256()
    digest = hashlib.sha256(header).digest()
    if digest.hex() != entry["header"]["sha256"]:
        return [f"{name}: the safetensors header is corrupt (checksum mismatch); {REWRITE}"]
    tree.update(digest)
    n = int.from_bytes(header[:8], "little")
    meta = json.loads(header[8:8 + n])
    meta.pop("__metadata__", None)
    buf = memoryview(bytearray(CHUNK))
    problems: list[str] = []
    for tname, t in sorted(meta.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = t["data_offsets"]
        if tname.endswith(".ffn.experts") and t["dtype"] == "U8":
            problems += _check_records(name, fd, tname, t, hbytes, entry.get("records", []), buf, tree,
                                       tick)
        else:
            d = _hash_range(fd, hbytes + begin, end - begin, buf)
            if d.hex() != entry["tensors"].get(tname):
                problems.append(f"{name}: tensor {tname} does not match its checksum; the file is "
                                f"corrupt: {REWRITE}")
            tree.update(d)
            tick(end - begin)
    if not problems and "sha256-pieces:" + tree.hexdigest() != entry["checksum"]:
        return [f"{name}: file checksum does not match the manifest (manifest edited or stale?)"]
    return problems


def _unreadable(name: str, e: OSError) -> str:
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    return (f"{name}: cannot read it ({e.strerror or e}{f', {code}' if code else ''}): make it "
            "readable (or check the disk: dmesg), then verify again")


def check_file(path: Path, entry: object, tick: Callable[[int], None] | None = None) -> list[str]:
    """Every problem of one output file against its manifest entry ([] = intact): a malformed
    entry, missing, wrong size, unreadable (with the errno), or each corrupt piece."""
    tick = tick or (lambda n: None)
    name = path.name
    problem = layout.entry_problem(name, entry)
    if problem:
        return [f"{layout.MANIFEST}: {problem}; {REWRITE}"]
    try:
        if not path.exists():
            return [f"{name} is missing"]
        if not path.is_file():
            return [f"{name} is not a regular file; move it away and {REWRITE}"]
        size = path.stat().st_size
        if size != entry["size"]:
            return [f"{name} is {size:,} bytes, the manifest says {entry['size']:,}"]
        if entry["checksum"].startswith("sha256:"):
            ok = layout.sha256_file(path) == entry["checksum"]
            tick(size)
            return [] if ok else [f"{name} does not match its checksum; the file is corrupt: {REWRITE}"]
        fd = os.open(path, os.O_RDONLY)
        try:
            return _check_pieces(path, fd, entry, size, tick)
        finally:
            os.close(fd)
    except OSError as e:
        return [_unreadable(name, e)]
    except (EOFError, ValueError, KeyError, TypeError) as e:
        return [f"{name}: cannot be checked ({e!r}); the file or the manifest is corrupt: {REWRITE}"]


def _not_converted(root: Path) -> NotConverted:
    if not root.is_dir():
        return NotConverted(f"{root} is not a directory: not a converted model (dsv4-convert --hf SRC "
                            "--out DIR makes one)")
    names = [f.name for f in root.iterdir()]
    if layout.STATE in names or any(layout.is_own_file(n) and ".safetensors" in n for n in names):
        return NotConverted(f"{root} has no {layout.MANIFEST}: the conversion did not finish; run "
                            "dsv4-convert --hf SRC --out DIR again to complete it")
    if INDEX_NAME in names:
        return NotConverted(f"{root} has no {layout.MANIFEST} or {layout.STATE}: it is a downloaded "
                            f"checkpoint, not a converted model; convert it with dsv4-convert --hf "
                            f"{root} --out DIR, then verify DIR")
    return NotConverted(f"{root} has no {layout.MANIFEST}: not a converted model (dsv4-convert --hf "
                        "SRC --out DIR makes one)")


def read(path: str | os.PathLike) -> layout.Manifest:
    """The parsed manifest of the converted directory `path`. Raises NotConverted when there is
    no manifest.json, layout.LayoutError (the message has the fix) when it cannot be read or
    parsed, is malformed or of another layout version."""
    root = Path(path)
    where = root / layout.MANIFEST
    if not where.is_file():
        raise _not_converted(root)
    try:
        doc = json.loads(where.read_text(encoding="utf-8"))
    except OSError as e:
        raise layout.LayoutError(_unreadable(str(where), e)) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise layout.LayoutError(f"{where}: not readable JSON ({e}): the manifest is corrupt; rerun "
                                 "dsv4-convert --hf SRC --out DIR: it converts the model again") from None
    return layout.parse_manifest(doc, str(where))


def manifest_problems(root: Path, manifest: layout.Manifest) -> list[str]:
    """Where the manifest disagrees with its own config (what the engine relies on): experts
    count, record layout and units, a file the model needs that it does not list, a file it lists
    that the model has not, a file with a converter name in the directory that it does not list,
    the copied config.json differing from its config."""
    where = root / layout.MANIFEST
    fix = f"the manifest is corrupt: {REWRITE}"
    try:
        args = ModelArgs.from_dict(manifest.config, f"{where} 'config'")
    except (ConfigError, TypeError) as e:
        return [f"{e}; {fix}"]
    problems = []
    if manifest.count != args.n_routed_experts:
        problems.append(f"{where}: experts count is {manifest.count}, its config says "
                        f"n_routed_experts = {args.n_routed_experts}; {fix}")
    if manifest.record != layout.RecordLayout.from_args(args):
        problems.append(f"{where}: the experts' record layout does not match its config "
                        f"(hidden_size, moe_intermediate_size); {fix}")
    if list(manifest.units) != layout.units_for(args):
        problems.append(f"{where}: the experts' units do not match its config's layers; {fix}")
    needed = layout.model_files(args) + ["config.json"]
    missing = [n for n in needed if n not in manifest.files]
    if missing:
        problems.append(f"{where}: does not list {', '.join(missing)}, which the model needs; {fix}")
    extra = sorted(set(manifest.files) - set(needed) - set(layout.COPIED_FILES))
    if extra:
        problems.append(f"{where}: lists {', '.join(extra)}, which this model has not; {fix}")
    unlisted = sorted(n for n in os.listdir(root) if layout.is_listed_file(n) and n not in manifest.files)
    if unlisted:  # a finished conversion lists every file it leaves (a stale one is removed)
        problems.append(f"{where}: does not list {', '.join(unlisted)}, in {root} (so unchecked); {fix}")
    if "config.json" in manifest.files and not check_file(root / "config.json",
                                                          manifest.files["config.json"]):
        try:
            differs = json.loads((root / "config.json").read_text(encoding="utf-8")) != manifest.config
        except (OSError, ValueError):
            differs = False  # check_file reports the file itself
        if differs:
            problems.append(f"{where}: its config differs from config.json; {fix}")
    return problems


def check(path: str | os.PathLike, manifest: layout.Manifest,
          tick: Callable[[int], None] | None = None) -> dict[str, list[str]]:
    """Every problem of the converted directory `path`, by file name (the manifest's own under
    "manifest.json"); only names with problems appear ({} = intact)."""
    root = Path(path)
    found = {layout.MANIFEST: manifest_problems(root, manifest)}
    for name, entry in sorted(manifest.files.items()):
        found[name] = check_file(root / name, entry, tick)
    return {name: problems for name, problems in found.items() if problems}


def verify(path: str | os.PathLike, tick: Callable[[int], None] | None = None) -> list[str]:
    """Every problem of the converted directory `path` (`read`, then `check`), one line each
    (empty list = intact)."""
    try:
        manifest = read(path)
    except (NotConverted, layout.LayoutError) as e:
        return [str(e)]
    return [p for problems in check(path, manifest, tick).values() for p in problems]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m converter.verify",
                                 description="Re-check a dsv4-convert output directory.")
    ap.add_argument("dir", help="converted directory (holds manifest.json)")
    args = ap.parse_args(argv)
    try:
        manifest = read(args.dir)
    except NotConverted as e:
        print(f"NOT CONVERTED: {e}")
        return 2
    except layout.LayoutError as e:
        print(f"CORRUPT: {e}")
        return 1
    problems = [p for ps in check(args.dir, manifest).values() for p in ps]
    for p in problems:
        print(f"CORRUPT: {p}")
    if problems:
        return 1
    total = sum(e["size"] for e in manifest.files.values())
    print(f"OK: {args.dir}: {len(manifest.files)} files, {total / 1e9:.3f} GB match the manifest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
