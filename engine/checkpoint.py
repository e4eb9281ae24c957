"""TensorIndex: name -> zero-copy tensor over a directory of safetensors files (spec §B).

On-disk contract (safetensors, little-endian):

    [u64 N][N bytes of JSON header][data section]

The header is a JSON object ``{name: {"dtype": str, "shape": [int, ...],
"data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}`` (metadata optional).
Offsets are relative to the start of the data section (byte 8 + N); ``end - begin`` must equal
``prod(shape) * itemsize``. ``F4`` (packed fp4) counts elements in ``shape``, two per byte.

Accepted layouts (`TensorIndex.open`):
  * an official HF checkpoint: a directory with ``model.safetensors.index.json`` (``weight_map``:
    tensor -> shard file) plus the shards, or the path of such an index file. Only the shards
    it names are read; every name it lists must be in that shard's header (tensors a shard holds
    beyond the index are included as well);
  * a directory of ``*.safetensors`` files without an index (the converted layout);
  * a single ``.safetensors`` file.

Every header is parsed and checked when the index is opened, so a truncated or inconsistent
checkpoint fails there with a `CheckpointError`, never later with a wrong tensor. Each file is
then mapped once (read-only ``mmap``, at open); `TensorIndex.get` returns views of that mapping,
no bytes are copied or read until used. The returned tensors must not be written to (the pages
are read-only: a write crashes the process). A file shrunk on disk while open makes reads of
its lost part fault (SIGBUS), as with any mmap.

`TensorIndex.close` drops the index's references to the mappings; tensors already handed out
stay valid, because each view keeps its mapping alive, and a mapping is unmapped when its last
view is freed. After close, `get` raises `CheckpointError`.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.reference import EXPERT_FIELDS

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library enforces

# safetensors dtype -> (torch dtype of the returned view, bits per header element)
DTYPES = types.MappingProxyType(
    {
        "F8_E4M3": (torch.float8_e4m3fn, 8),
        "F8_E5M2": (torch.float8_e5m2, 8),
        "F8_E8M0": (torch.float8_e8m0fnu, 8),
        "F4": (torch.float4_e2m1fn_x2, 4),  # header shape counts fp4 values; view packs 2/byte
        "I8": (torch.int8, 8),
        "U8": (torch.uint8, 8),
        "BOOL": (torch.bool, 8),
        "I16": (torch.int16, 16),
        "I32": (torch.int32, 32),
        "I64": (torch.int64, 64),
        "F16": (torch.float16, 16),
        "BF16": (torch.bfloat16, 16),
        "F32": (torch.float32, 32),
        "F64": (torch.float64, 64),
    }
)

_HF_SHARD = re.compile(r"-\d+-of-\d+\.safetensors$")


class CheckpointError(Exception):
    """A checkpoint file or index is missing, corrupt or inconsistent (message says which)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: `shape` is what `get` returns, `offset` is absolute in `file`."""

    name: str
    file: Path
    dtype: str  # safetensors dtype string, e.g. "F8_E4M3"
    torch_dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Header:
    """One parsed, validated safetensors header."""

    metadata: dict[str, str]
    tensors: list[TensorInfo]


def _fail(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}")


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor_info(path: Path, name: str, entry: object, data_start: int, size: int) -> TensorInfo:
    """Validate one header entry against the file size and build its TensorInfo."""
    if not isinstance(entry, dict):
        raise _fail(path, f"header entry for tensor {name!r} is not an object; corrupt header")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise _fail(
            path,
            f"tensor {name!r} has unknown dtype {dtype!r}; supported: {', '.join(DTYPES)}",
        )
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"tensor {name!r} has invalid shape {shape!r}; corrupt header")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _fail(path, f"tensor {name!r} has invalid data_offsets {offsets!r}; corrupt header")
    torch_dtype, bits = DTYPES[dtype]
    count = math.prod(shape)
    span = offsets[1] - offsets[0]
    if count * bits != span * 8:
        raise _fail(
            path,
            f"tensor {name!r}: shape {shape} x {dtype} needs {count * bits / 8:g} bytes but "
            f"data_offsets {offsets} span {span}; corrupt header",
        )
    if bits == 4:
        if not shape or shape[-1] % 2:
            raise _fail(path, f"F4 tensor {name!r} needs an even last dimension, got {shape}")
        shape = shape[:-1] + [shape[-1] // 2]  # [..., K] fp4 values -> [..., K/2] packed pairs
    end = data_start + offsets[1]
    if end > size:
        raise _fail(
            path,
            f"tensor {name!r} ends at byte {end} but the file has only {size} bytes; the file "
            "is truncated (incomplete download or copy?) or its header is corrupt; fetch it again",
        )
    return TensorInfo(name, path, dtype, torch_dtype, tuple(shape), data_start + offsets[0], span)


def read_header(path: Path) -> _Header:
    """Parse and validate the header of one safetensors file (reads only the header bytes)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise _fail(
                    path,
                    f"file is {size} bytes, shorter than the 8-byte header length; it is "
                    "truncated or not a safetensors file",
                )
            f.seek(0)
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                raise _fail(
                    path,
                    f"header length field says {n} bytes but only {size - 8} follow; the file "
                    "is truncated or not a safetensors file",
                )
            if n > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {n} exceeds {MAX_HEADER_BYTES}; corrupt file")
            raw = f.read(n)
    except OSError as e:
        raise _fail(path, f"cannot read: {e.strerror or e}") from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise _fail(path, f"header is not valid JSON ({e}); corrupt or not safetensors") from e
    if not isinstance(header, dict):
        raise _fail(path, f"header is a JSON {type(header).__name__}, not an object; corrupt file")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _fail(path, "__metadata__ must be an object of string to string; corrupt header")
    infos = [_tensor_info(path, k, v, 8 + n, size) for k, v in header.items()]
    by_start = sorted((t for t in infos if t.nbytes), key=lambda t: t.offset)
    for prev, t in zip(by_start, by_start[1:]):
        if t.offset < prev.offset + prev.nbytes:
            raise _fail(
                path,
                f"tensors {prev.name!r} and {t.name!r} overlap (bytes {prev.offset}.."
                f"{prev.offset + prev.nbytes} and {t.offset}..{t.offset + t.nbytes}); "
                "corrupt header",
            )
    return _Header(metadata, infos)


def _read_index(index: Path) -> dict[str, str]:
    """Return the weight_map (tensor -> shard file name) of an HF index file."""
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise _fail(index, "index file does not exist") from e
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _fail(index, f"index is not valid JSON ({e}); download it again") from e
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise _fail(index, "index has no 'weight_map' object of tensor name -> file name")
    if not weight_map:
        raise _fail(index, "index 'weight_map' lists no tensors; download it again")
    return weight_map


def _locate(path: Path) -> tuple[Path | None, list[Path]]:
    """Resolve `path` to (index file or None, safetensors files to read)."""
    if path.is_dir():
        index = path / INDEX_NAME
        if index.is_file():
            return index, []
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise _fail(
                path,
                f"no {INDEX_NAME} and no *.safetensors files; point at a checkpoint directory",
            )
        if any(_HF_SHARD.search(f.name) for f in files):
            raise _fail(
                path,
                f"{INDEX_NAME} is missing but the directory holds HF shards ({files[0].name}, "
                "...); the download looks incomplete: fetch the index file too",
            )
        return None, files
    if path.suffix == ".json":
        return path, []
    if path.is_file():
        return None, [path]
    raise _fail(path, "does not exist; expected a checkpoint directory, index or .safetensors")


class TensorIndex:
    """Read-only view of every tensor in a checkpoint; see the module docstring."""

    def __init__(self, infos: dict[str, TensorInfo], metadata: dict[Path, dict[str, str]]):
        """Use `TensorIndex.open`; this maps each file and builds the base byte views."""
        self._infos = infos
        self._metadata = metadata
        self._bases: dict[tuple[Path, int], torch.Tensor] = {}
        self._closed = False
        if sys.byteorder != "little":
            raise CheckpointError("safetensors data is little-endian; this host is big-endian")
        # One uint8 tensor over each file, per start residue r needed so that a tensor at
        # absolute offset o with itemsize s can be viewed as (o - r) % s == 0 on base r.
        needed: dict[Path, set[int]] = {f: set() for f in metadata}
        for t in infos.values():
            needed[t.file].add(t.offset % t.torch_dtype.itemsize)
        for file, residues in needed.items():
            try:
                with open(file, "rb") as f:
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise _fail(file, f"cannot memory-map: {e}") from e
            with warnings.catch_warnings():  # torch warns that the buffer is read-only: known
                warnings.simplefilter("ignore", UserWarning)
                for r in residues:
                    self._bases[(file, r)] = torch.frombuffer(mapping, dtype=torch.uint8, offset=r)

    @classmethod
    def open(cls, path: str | Path) -> TensorIndex:
        """Open a checkpoint directory, HF index file or single safetensors file, validating it."""
        path = Path(path)
        index, files = _locate(path)
        weight_map = None
        if index is not None:
            weight_map = _read_index(index)
            files = [index.parent / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise _fail(
                    index.parent,
                    f"{len(missing)} shard(s) named in {index.name} are missing "
                    f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
                    "the download looks incomplete: fetch the missing files",
                )
        infos: dict[str, TensorInfo] = {}
        metadata: dict[Path, dict[str, str]] = {}
        for file in files:
            header = read_header(file)
            metadata[file] = header.metadata
            for t in header.tensors:
                if t.name in infos:
                    raise _fail(
                        file,
                        f"tensor {t.name!r} is also in {infos[t.name].file}; a tensor must "
                        "live in one file only (mixed or duplicated downloads?)",
                    )
                infos[t.name] = t
        for name, shard in (weight_map or {}).items():
            if name not in infos or infos[name].file != index.parent / shard:
                where = f" (it is in {infos[name].file.name})" if name in infos else ""
                raise _fail(
                    index.parent / shard,
                    f"{index.name} maps tensor {name!r} to this file but its header lacks "
                    f"it{where}; index and shards do not match: download them again",
                )
        return cls(infos, metadata)

    def __enter__(self) -> TensorIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the mappings; tensors handed out stay valid (they keep their mapping alive)."""
        self._bases.clear()
        self._closed = True

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        """Location, dtype and shape of one tensor."""
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(
                f"tensor {name!r} is not in this checkpoint ({len(self._infos)} tensors in "
                f"{len(self._metadata)} files)"
            ) from None

    def get(self, name: str) -> torch.Tensor:
        """Zero-copy, read-only CPU view of one tensor (do not write to it)."""
        t = self.info(name)
        if self._closed:
            raise CheckpointError(f"cannot get {name!r}: the TensorIndex is closed")
        r = t.offset % t.torch_dtype.itemsize
        raw = self._bases[(t.file, r)][t.offset - r : t.offset - r + t.nbytes]
        return raw.view(t.torch_dtype).reshape(t.shape)

    def get_expert(self, layer: int, e: int, prefix: str = "layers") -> dict[str, torch.Tensor]:
        """The six tensors of routed expert `e` of `{prefix}.{layer}` (MTP: prefix "mtp", 0)."""
        base = f"{prefix}.{layer}.ffn.experts.{e}."
        missing = [k for k in EXPERT_FIELDS if base + k not in self._infos]
        if missing:
            raise CheckpointError(
                f"expert {base[:-1]!r} lacks {', '.join(missing)} in this checkpoint"
            )
        return {k: self.get(base + k) for k in EXPERT_FIELDS}

    def files(self) -> list[Path]:
        """The safetensors files of this checkpoint, in sorted order."""
        return list(self._metadata)

    def metadata(self, file: str | Path) -> dict[str, str]:
        """The ``__metadata__`` of one file (full path or file name); {} if it has none."""
        file = Path(file)
        for f, meta in self._metadata.items():
            if f == file or (file.name == str(file) and f.name == file.name):
                return dict(meta)
        n = len(self._metadata)
        raise CheckpointError(f"{file}: not a file of this checkpoint ({n} files)")

    def total_bytes(self) -> int:
        """Sum of the tensor payloads in bytes (the index's ``total_size``)."""
        return sum(t.nbytes for t in self._infos.values())
