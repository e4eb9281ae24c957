"""A TIMING-ONLY expert pack with N routed experts per layer whose expert records take no disk
space: `make_timing_pack(src, dst, N)` (issue 27 item 4).

    python -m bench.timing_pack SRC_PACK DST_PACK --experts 256

The real model addresses 256 experts per layer (12.75 MiB each): 43 layers x 256 records are
~145 GB, more than a benchmark machine's disk. From any converted pack (engine/pack.py) this
writes a pack of the same dimensions with N experts per unit where

* every expert record is a file hole (the file is extended with `ftruncate`, no byte of a record
  is written): it reads as zeros and occupies no disk blocks (`st_blocks` << `st_size`);
* the manifest carries the real sha256 of an all-zeros record for every record, so the engine's
  store checks each record on its first read exactly as it does for a converted pack (nothing
  is disabled), and complete `sha256-pieces` file entries;
* the resident tensors are copied byte for byte, except the routers, which depend on N: a unit's
  `ffn.gate.weight` [E, D] and `ffn.gate.bias` [E] grow to N rows, row e >= E being row e mod E
  rolled by e // E positions along D (bias: bias[e mod E]), so the scores of the new experts are
  distinct and distributed like the old ones (hash layers' tid2eid keep ids < E);
* `global.safetensors` and the tokenizer files are hard-linked (copied across filesystems);
  config.json and the manifest's config say n_routed_experts = N;
* the manifest is marked: top-level `"timing_only": "<why>"` and the same note in `source`.

Every expert computes zero, so the model's outputs are meaningless: the pack exists to time the
expert cache, its tiers and the miss path with the real model's expert count and record size
(use it with forced routing from a real trace, `--routing-trace`). Reading a hole costs no disk
I/O (the kernel zero-fills it), so misses served from "disk" measure the page cache/memory path,
not a drive: the benchmark must say so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import pack as layout  # noqa: E402
from converter.stwriter import TensorSpec, build_header  # noqa: E402
from engine.checkpoint import DTYPES, read_header  # noqa: E402

TIMING_NOTE = ("TIMING ONLY: expert records are file holes (all zeros) and the routers are padded; "
               "outputs are meaningless")
CHUNK = 1 << 24


def zero_record_sha256(record_bytes: int) -> str:
    """sha256 hex of `record_bytes` zero bytes (computed once per pack)."""
    h, block = hashlib.sha256(), bytes(min(record_bytes, CHUNK))
    left = record_bytes
    while left:
        n = min(left, len(block))
        h.update(block[:n])
        left -= n
    return h.hexdigest()


def is_timing_pack(path: str | os.PathLike) -> bool:
    """Whether the converted directory at `path` is a timing-only pack (its manifest says so)."""
    doc = json.loads((Path(path) / layout.MANIFEST).read_text(encoding="utf-8"))
    return bool(doc.get("timing_only"))


def _raw_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file as a dict (insertion order = file order) and the
    offset of its data section."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)), 8 + n


def _grow_router(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """A router tensor with E rows -> n rows (module docstring); other tensors unchanged."""
    e = t.shape[0]
    if name.endswith(".ffn.gate.bias"):
        return t[torch.arange(n) % e].contiguous()
    rows = [t[i % e].roll(i // e) for i in range(n)]
    return torch.stack(rows).contiguous()


def _write_unit(src: Path, dst: Path, tensor: str, n: int, record_bytes: int, zero_digest: bytes) -> dict:
    """Write one unit's file with `n` hole records; returns its manifest file entry."""
    header, data_start = _raw_header(src)
    metadata = header.pop("__metadata__", {})
    infos = {t.name: t for t in read_header(src).tensors}
    order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
    if order[0] != tensor:
        raise SystemExit(f"bench.timing_pack: {src}: the experts tensor {tensor!r} is not first; not a "
                         "version-2 converted pack")
    payload: dict[str, bytes] = {}
    entries = [(tensor, "U8", [n, record_bytes], n * record_bytes)]
    for name in order[1:]:
        h = header[name]
        if name.endswith((".ffn.gate.weight", ".ffn.gate.bias")):
            info = infos[name]
            with open(src, "rb") as f:
                f.seek(info.offset)
                raw = bytearray(f.read(info.nbytes))
            t = torch.frombuffer(raw, dtype=torch.uint8).view(info.torch_dtype).view(info.shape)
            grown = _grow_router(name, t, n)
            payload[name] = grown.view(torch.uint8).numpy().tobytes()
            entries.append((name, h["dtype"], [n] + list(h["shape"][1:]), len(payload[name])))
        else:
            begin, end = h["data_offsets"]
            entries.append((name, h["dtype"], list(h["shape"]), end - begin))
    head = build_header([TensorSpec(name, DTYPES[dtype][0], tuple(shape)) for name, dtype, shape, _ in entries],
                        metadata, layout.ALIGNMENT)  # data 4 KiB aligned, tensors back to back
    hasher = layout.PieceHasher(head)
    for _ in range(n):
        hasher.add_record(zero_digest)
    tmp = dst.with_name(dst.name + ".tmp")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        fout.write(head)
        fout.truncate(len(head) + n * record_bytes)  # the records: one hole, no blocks
        fout.seek(len(head) + n * record_bytes)
        for name, _, _, nbytes in entries[1:]:
            h = hashlib.sha256()
            if name in payload:
                h.update(payload[name])
                fout.write(payload[name])
            else:
                fin.seek(data_start + header[name]["data_offsets"][0])
                left = nbytes
                while left:
                    block = fin.read(min(left, CHUNK))
                    if not block:
                        raise SystemExit(f"bench.timing_pack: {src} ends early in {name!r}; run "
                                         f"`python -m converter.verify {src.parent}`")
                    h.update(block)
                    fout.write(block)
                    left -= len(block)
            hasher.add_tensor(name, h.digest())
        size = fout.tell()
    os.replace(tmp, dst)
    return hasher.finish(size)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def make_timing_pack(src: str | os.PathLike, dst: str | os.PathLike, n_experts: int) -> Path:
    """Write the timing-only pack of `src` with `n_experts` experts per unit at `dst` (module
    docstring); returns `dst`. Kept when `dst` already holds one made with that count."""
    src, dst = Path(src), Path(dst)
    manifest = layout.read_manifest(src)
    k = int(manifest.config.get("num_experts_per_tok", 1))
    if n_experts < max(manifest.count, k):
        raise SystemExit(f"bench.timing_pack: {n_experts} experts per layer is fewer than the source's "
                         f"{manifest.count}; a timing pack only adds experts")
    if (dst / layout.MANIFEST).is_file():
        done = layout.read_manifest(dst)
        if is_timing_pack(dst) and done.count == n_experts and done.record == manifest.record:
            return dst
        raise SystemExit(f"bench.timing_pack: {dst} holds another pack; remove it or pick another folder")
    dst.mkdir(parents=True, exist_ok=True)
    record = manifest.record.record_bytes
    zero = bytes.fromhex(zero_record_sha256(record))
    files = dict(manifest.files)
    unit_files = {u.file: u for u in manifest.units}
    config = dict(manifest.config) | {"n_routed_experts": n_experts}
    for name, entry in manifest.files.items():
        if name in unit_files:
            files[name] = _write_unit(src / name, dst / name, unit_files[name].tensor, n_experts, record, zero)
        elif name == "config.json":
            doc = json.loads((src / name).read_text(encoding="utf-8")) | {"n_routed_experts": n_experts}
            (dst / name).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
            files[name] = {"size": (dst / name).stat().st_size, "checksum": layout.sha256_file(dst / name)}
        else:
            _link_or_copy(src / name, dst / name)
    out = layout.Manifest(config, dict(manifest.source) | {"timing_only": TIMING_NOTE}, manifest.record,
                          n_experts, manifest.units, files)
    doc = out.to_json() | {"timing_only": TIMING_NOTE}
    (dst / (layout.MANIFEST + ".tmp")).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(dst / (layout.MANIFEST + ".tmp"), dst / layout.MANIFEST)  # written last, as the converter does
    return dst


def disk_usage(path: str | os.PathLike) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the files directly in `path`."""
    size = used = 0
    for f in Path(path).iterdir():
        if f.is_file():
            st = f.stat()
            size, used = size + st.st_size, used + st.st_blocks * 512
    return size, used


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src", help="a converted pack (dsv4-convert output)")
    p.add_argument("dst", help="the folder to write the timing-only pack into")
    p.add_argument("--experts", type=int, default=256, help="routed experts per layer (default 256, the real model's)")
    a = p.parse_args(argv)
    try:
        out = make_timing_pack(a.src, a.dst, a.experts)
    except (layout.LayoutError, OSError) as e:
        raise SystemExit(f"bench.timing_pack: {e}") from None
    size, used = disk_usage(out)
    print(f"{out}: {TIMING_NOTE}; {a.experts} experts per layer, {size / 2**30:.2f} GiB apparent, "
          f"{used / 2**30:.2f} GiB on disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
