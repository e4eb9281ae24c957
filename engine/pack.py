"""The converted "expert pack" layout, version 2: the engine's input format, written
by converter/convert.py. On-disk contract:

A directory holding
  * `manifest.json` (written last: a directory without it is an unfinished conversion):
        {"format": "dsv4-expert-pack", "version": 2,
         "config": {the HF config.json of the source},
         "source": {"index_sha256": hex, "total_size": int, "shards": [{"name", "size"}, ...],
                    "shard_fingerprints": {name: {"header_sha256": hex, "mtime_ns": int}}},
         "experts": {"record_bytes": R, "alignment": 4096, "count": E,
                     "fields": {"w1.weight": {"offset", "nbytes", "dtype", "shape"}, "w1.scale": ..,
                                "w3.weight": .., "w3.scale": .., "w2.weight": .., "w2.scale": ..},
                     "units": [{"layer": L, "file": "layer_LL.safetensors",
                                "tensor": "layers.L.ffn.experts"}, ...,
                               {"layer": n_layers, "file": "mtp.safetensors",
                                "tensor": "mtp.0.ffn.experts"}]},
         "files": {name: entry}}
  * `global.safetensors`, `layer_LL.safetensors` per decoder layer, `mtp.safetensors`: valid
    safetensors files whose data section starts at a multiple of 4096 (the JSON header is padded
    with spaces). Resident tensors keep their official names, dtypes, shapes and bytes. A unit's
    routed experts are ONE uint8 tensor `{prefix}.ffn.experts` of shape [E, R], first in the data
    section: record e (bytes e*R .. (e+1)*R) holds expert e's six tensors back to back at the field
    offsets, zero padded so R is a multiple of 4096. One expert = one aligned read. The scales
    keep their source bytes; the FP4 weights (the `.weight` fields) hold the source's codes in
    kernels/reference.py's record order (a bit permutation within each byte, lossless; version 1
    kept the official nibble order, which the GPU kernels decode in more instructions;
    converter/upgrade.py rewrites a version-1 directory in place).
  * tokenizer and config files copied from the source (config.json, generation_config.json,
    tokenizer.json, tokenizer_config.json, those present).

File entries. A plain file: {"size": n, "checksum": "sha256:<hex of the file>"}. A safetensors
file is hashed in pieces, so one pass both checks it and names a corrupt part:
    {"size": n, "checksum": "sha256-pieces:<hex>", "header": {"bytes": H, "sha256": hex},
     "tensors": {name: sha256 hex of its bytes} (resident tensors),
     "records": [sha256 hex of record 0, 1, ...] (only files with experts)}
where H is the offset of the data section and the checksum is the sha256 of the concatenated
32-byte digests of the header bytes and then of every piece in file order (a resident tensor is
one piece, the experts tensor is one piece per record).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint import DTYPES
from engine.config import ModelArgs
from kernels.reference import EXPERT_FIELDS, fp4_official_order, fp4_record_order

FORMAT = "dsv4-expert-pack"
VERSION = 2  # 2: FP4 weights in record order
ALIGNMENT = 4096
MANIFEST = "manifest.json"
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


GLOBAL_FILE = "global.safetensors"
MTP_FILE = "mtp.safetensors"


class LayoutError(Exception):
    """A converted directory or its manifest is missing, unfinished, corrupt or of another version."""


# Names. A "unit" is a decoder layer index 0..n_layers-1, or n_layers for the MTP block (the layer
# index the engine uses for `mtp.0`).

def layer_file(layer: int) -> str:
    return f"layer_{layer:02d}.safetensors"


def units(args: ModelArgs) -> list[int]:
    """Units that have routed experts: decoder layers, then the MTP block (unit n_layers)."""
    return list(range(args.n_layers + args.n_mtp_layers))


def unit_prefix(unit: int, args: ModelArgs) -> str:
    return "mtp.0" if unit == args.n_layers else f"layers.{unit}"


def unit_file(unit: int, args: ModelArgs) -> str:
    return MTP_FILE if unit == args.n_layers else layer_file(unit)


def experts_tensor(unit: int, args: ModelArgs) -> str:
    """Name of the packed uint8 [n_routed_experts, record_bytes] tensor of a unit."""
    return f"{unit_prefix(unit, args)}.ffn.experts"


def expert_fields(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The six tensors of one routed expert, in record order: field -> (dtype, shape) (§B.3)."""
    d, i = args.dim, args.moe_inter_dim
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for w, (rows, cols) in (("w1", (i, d)), ("w3", (i, d)), ("w2", (d, i))):
        out[f"{w}.weight"] = ("I8", (rows, cols // 2))  # packed fp4, two codes a byte
        out[f"{w}.scale"] = ("F8_E8M0", (rows, cols // 32))  # one e8m0 scale per 32 inputs
    return {f: out[f] for f in EXPERT_FIELDS}


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class FieldLayout:
    """One expert tensor inside a record: bytes [offset, offset + nbytes) as `dtype` `shape`."""

    offset: int
    nbytes: int
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    def to_json(self) -> dict:
        return {"offset": self.offset, "nbytes": self.nbytes, "dtype": self.dtype,
                "shape": list(self.shape)}


@dataclass(frozen=True)
class RecordLayout:
    """Where an expert's six tensors sit in its record, and the padded record size."""

    record_bytes: int
    fields: dict[str, FieldLayout]  # in record order (EXPERT_FIELDS)
    alignment: int = ALIGNMENT

    @classmethod
    def from_args(cls, args: ModelArgs) -> "RecordLayout":
        fields, offset = {}, 0
        for name, (dtype, shape) in expert_fields(args).items():
            nbytes = _numel(shape) * DTYPES[dtype][0].itemsize
            fields[name] = FieldLayout(offset, nbytes, dtype, shape)
            offset += nbytes
        return cls(round_up(offset, ALIGNMENT), fields)

    def to_json(self) -> dict:
        return {"record_bytes": self.record_bytes, "alignment": self.alignment,
                "fields": {k: f.to_json() for k, f in self.fields.items()}}

    @classmethod
    def from_json(cls, doc: dict) -> "RecordLayout":
        try:
            fields = {k: FieldLayout(int(f["offset"]), int(f["nbytes"]), str(f["dtype"]),
                                     tuple(int(x) for x in f["shape"]))
                      for k, f in sorted(doc["fields"].items(), key=lambda kv: kv[1]["offset"])}
            layout = cls(int(doc["record_bytes"]), fields, int(doc["alignment"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LayoutError(f"manifest 'experts' record layout is malformed ({e!r})") from None
        layout.check()
        return layout

    def check(self) -> None:
        """Raise LayoutError unless the fields are the six expert tensors inside the record."""
        if list(self.fields) != list(EXPERT_FIELDS):
            raise LayoutError(f"record fields are {list(self.fields)}, expected "
                              f"{list(EXPERT_FIELDS)}")
        if self.alignment != ALIGNMENT or self.record_bytes % ALIGNMENT:
            raise LayoutError(f"record_bytes {self.record_bytes} / alignment {self.alignment} "
                              f"must be multiples of {ALIGNMENT}")
        for name, f in self.fields.items():
            if f.dtype not in DTYPES or DTYPES[f.dtype][0].itemsize != 1:
                raise LayoutError(f"record field {name!r} has dtype {f.dtype!r}; expected I8 or "
                                  "F8_E8M0")
            if f.nbytes != _numel(f.shape) or f.offset < 0 or f.offset + f.nbytes > self.record_bytes:
                raise LayoutError(f"record field {name!r} ({f}) does not fit a "
                                  f"{self.record_bytes}-byte record")

    def to_record_order(self, record: torch.Tensor) -> None:
        """Rewrite the FP4 weights of one record as read from a checkpoint (uint8 [record_bytes],
        official order) into record order, in place."""
        self._reorder(record, fp4_record_order)

    def to_official_order(self, record: torch.Tensor) -> None:
        """The inverse of `to_record_order`, in place (the record as version 1 stored it)."""
        self._reorder(record, fp4_official_order)

    def _reorder(self, record: torch.Tensor, order) -> None:
        for name, f in self.fields.items():
            if name.endswith(".weight"):  # the FP4 codes; the scales keep their bytes
                part = record[f.offset:f.offset + f.nbytes]
                part.copy_(order(part))

    def unpack(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-copy views of the six tensors in one record (uint8 [record_bytes], any device)."""
        # record[offset : offset + nbytes] (uint8) -> view as the 1-byte dtype -> [rows, cols]
        return {name: record[f.offset:f.offset + f.nbytes].view(DTYPES[f.dtype][0]).view(f.shape)
                for name, f in self.fields.items()}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Unit:
    """One packed experts tensor: decoder layer `layer` (n_layers = MTP) in `file` as `tensor`."""

    layer: int
    file: str
    tensor: str


def units_for(args: ModelArgs) -> list[Unit]:
    return [Unit(u, unit_file(u, args), experts_tensor(u, args)) for u in units(args)]


def model_files(args: ModelArgs) -> list[str]:
    """The safetensors files a converted model of `args` consists of: global, then each unit's."""
    return [GLOBAL_FILE] + [unit_file(u, args) for u in units(args)]


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest.json (see the module docstring)."""

    config: dict
    source: dict
    record: RecordLayout
    count: int  # experts per unit
    units: tuple[Unit, ...]
    files: dict[str, dict]

    def to_json(self) -> dict:
        experts = self.record.to_json() | {
            "count": self.count,
            "units": [{"layer": u.layer, "file": u.file, "tensor": u.tensor} for u in self.units]}
        return {"format": FORMAT, "version": VERSION, "config": self.config, "source": self.source,
                "experts": experts, "files": self.files}

    def dumps(self) -> str:
        """The exact manifest.json text (deterministic: sorted keys, no timestamps)."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    def unit(self, layer: int) -> Unit:
        for u in self.units:
            if u.layer == layer:
                return u
        raise LayoutError(f"the converted model has no routed experts for layer {layer} "
                          f"(units: {[u.layer for u in self.units]})")

    def main_units(self, n_layers: int) -> tuple[Unit, ...]:
        """The units of the decoder layers 0..n_layers-1 (`n_layers` of the model's config): the
        experts the engine routes. The MTP block's unit (layer n_layers) stays in the pack for a
        user of the block, but the engine does not run it (engine/model.py, with_mtp=False)."""
        return tuple(u for u in self.units if u.layer < n_layers)

    def pool_bytes(self, n_layers: int) -> int:
        """The engine's expert pool: bytes of the records of the main layers' routed experts
        (`main_units`; the MTP block's excluded), the 'everything' cache budget."""
        return len(self.main_units(n_layers)) * self.count * self.record.record_bytes


def parse_manifest(doc: object, where: str = MANIFEST) -> Manifest:
    """Validate a manifest document (its structure and every file entry: `entry_problem`);
    raises LayoutError naming the problem."""
    if not isinstance(doc, dict):
        raise LayoutError(f"{where}: not a JSON object")
    if doc.get("format") != FORMAT:
        raise LayoutError(f"{where}: format is {doc.get('format')!r}, expected {FORMAT!r}")
    if doc.get("version") != VERSION:
        fix = ("upgrade it in place with `dsv4-convert --upgrade DIR`, or convert the checkpoint again"
               if doc.get("version") == 1 else "convert the checkpoint again")
        raise LayoutError(f"{where}: layout version {doc.get('version')!r} is not supported (this "
                          f"engine reads version {VERSION}); {fix}")
    try:
        exp, files = doc["experts"], doc["files"]
        units = tuple(Unit(int(u["layer"]), str(u["file"]), str(u["tensor"])) for u in exp["units"])
        manifest = Manifest(dict(doc["config"]), dict(doc["source"]), RecordLayout.from_json(exp),
                            int(exp["count"]), units, dict(files))
    except (KeyError, TypeError, ValueError) as e:
        raise LayoutError(f"{where}: malformed manifest ({e!r}); convert again") from None
    for name, entry in manifest.files.items():
        problem = entry_problem(name, entry)
        if problem:
            raise LayoutError(f"{where}: {problem}; convert again")
    for u in units:
        if u.file not in manifest.files:
            raise LayoutError(f"{where}: experts file {u.file} is not in the file list")
    return manifest


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str_map(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def entry_problem(name: object, entry: object) -> str | None:
    """Why `name: entry` is not a well-formed file entry of a manifest (module docstring, "File
    entries"), or None: `name` is a plain file name the converter writes (no path, no temporary,
    not the manifest or a state file), `entry` an object with an int `size` >= 0 and a `checksum`
    string; a "sha256-pieces:" entry also has `header` {"bytes": int, "sha256": str}, `tensors`
    {name: str} and, optionally, `records` [str, ...]. (Whether the values agree with the file is
    converter/verify.py's business.)"""
    if not (isinstance(name, str) and is_listed_file(name)):
        return f"it lists {str(name)[:80]!r}, not a file of a converted model"
    what = f"the entry of {name}"
    if not isinstance(entry, dict):
        return f"{what} is not a JSON object"
    if not _is_int(entry.get("size")) or entry["size"] < 0:
        return f"{what} has no 'size' (a whole number of bytes)"
    checksum = entry.get("checksum")
    if not isinstance(checksum, str) or not checksum.startswith(("sha256:", "sha256-pieces:")):
        return f"{what} has no 'checksum' of a known kind (sha256: or sha256-pieces:)"
    if checksum.startswith("sha256-pieces:"):
        header = entry.get("header")
        if not (isinstance(header, dict) and _is_int(header.get("bytes"))
                and isinstance(header.get("sha256"), str)):
            return f"{what} has no 'header' {{'bytes': int, 'sha256': str}}"
        if not _is_str_map(entry.get("tensors")):
            return f"{what} has no 'tensors' object of tensor name -> sha256"
        records = entry.get("records", [])
        if not (isinstance(records, list) and all(isinstance(r, str) for r in records)):
            return f"{what} has a 'records' that is not a list of sha256 strings"
    return None


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Read `<path>/manifest.json` and check every listed file exists with its size (no hashing)."""
    root = Path(path)
    where = root / MANIFEST
    if not where.is_file():
        hint = (" but it holds converted files: the conversion did not finish; rerun dsv4-convert "
                "with the same arguments to complete it") if any(root.glob("*.safetensors*")) else ""
        raise LayoutError(f"{root}: no {MANIFEST}{hint}")
    try:
        doc = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LayoutError(f"{where}: unreadable ({e}); convert again") from None
    manifest = parse_manifest(doc, str(where))
    for name, entry in manifest.files.items():
        f = root / name
        size = f.stat().st_size if f.is_file() else None
        if size != entry.get("size"):
            raise LayoutError(f"{f}: {'missing' if size is None else f'{size} bytes'}, the manifest "
                              f"says {entry.get('size')} bytes; run `dsv4-convert --verify "
                              f"{root}` and rerun dsv4-convert to repair it")
    return manifest


STATE = ".dsv4-convert.json"  # progress of an unfinished conversion (file entries done so far)
UPGRADE_STATE = ".dsv4-upgrade.json"  # progress of an unfinished upgrade (converter/upgrade.py)
_OWN = re.compile(r"(manifest\.json|global\.safetensors|layer_\d+\.safetensors|mtp\.safetensors|"
                  r"\.dsv4-convert\.json|\.dsv4-upgrade\.json|"
                  + "|".join(re.escape(f) for f in COPIED_FILES) + r")(\.tmp)?")


def is_own_file(name: str) -> bool:
    """Whether a file name in an output directory is one the converter writes (or its temp)."""
    return _OWN.fullmatch(name) is not None


def is_listed_file(name: str) -> bool:
    """Whether `name` is a file a finished conversion lists in its manifest (an own file that is
    neither a temporary, the manifest nor a state file)."""
    return is_own_file(name) and not name.endswith(".tmp") and name not in (MANIFEST, STATE,
                                                                            UPGRADE_STATE)


def is_converted(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST).is_file()


class PieceHasher:
    """Builds a safetensors file entry piece by piece (module docstring, 'File entries')."""

    def __init__(self, header: bytes):
        self._tree = hashlib.sha256()
        digest = hashlib.sha256(header).digest()
        self._tree.update(digest)
        self.entry: dict = {"header": {"bytes": len(header), "sha256": digest.hex()}, "tensors": {}}

    def add_tensor(self, name: str, digest: bytes) -> None:
        self._tree.update(digest)
        self.entry["tensors"][name] = digest.hex()

    def add_record(self, digest: bytes) -> None:
        self._tree.update(digest)
        self.entry.setdefault("records", []).append(digest.hex())

    def finish(self, size: int) -> dict:
        return self.entry | {"size": size, "checksum": "sha256-pieces:" + self._tree.hexdigest()}


def sha256_file(path: Path, chunk: int = 1 << 23) -> str:
    """'sha256:<hex>' of a whole (small) file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()
