"""Checks run before a conversion writes anything: source checkpoint and destination disk.

`check_source(path)` returns human-readable problems (empty = the source can be converted):
config validation (`ModelArgs`), the index, every shard it names present and exactly the size
its header describes, every tensor's dtype and shape against spec §B.3 (as implied by the
config) and, unless told not to, that the tokenizer fits the model's vocabulary
(`check_tokenizer`). `check_destination` checks the output directory and the free disk space.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from converter import mapping
from engine import pack as layout
from engine.checkpoint import INDEX_NAME, CheckpointError, read_header
from engine.config import ConfigError, ModelArgs

MAX_LISTED = 5  # problems of one kind listed by name before "and N more"
GATE = "layers.0.ffn.gate.weight"  # [n_routed_experts, dim]: the experts count of the shards

DiskFree = Callable[[Path], int]


class PreflightError(Exception):
    """The conversion cannot start; `problems` lists why (each a complete sentence)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("cannot convert:\n  - " + "\n  - ".join(self.problems))


def _listed(kind: str, items: list[str]) -> str:
    more = f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
    return f"{kind}: {', '.join(items[:MAX_LISTED])}{more}"


def _read_weight_map(root: Path, problems: list[str]) -> dict[str, str] | None:
    index = root / INDEX_NAME
    if not index.is_file():
        problems.append(f"{index} is missing; a DeepSeek-V4-Flash download has it next to the "
                        "model-*.safetensors shards: fetch it")
        return None
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("'weight_map' is empty or not an object")
        wrong = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
        if wrong is not None:  # (JSON object keys are always strings)
            raise ValueError(f"the value of {wrong!r} in 'weight_map' is not a shard file name "
                             "(a string)")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        problems.append(f"{index} is not a valid safetensors index ({e!r}); download it again")
        return None
    return weight_map


def source_shapes(root: Path, problems: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Read every shard header named by the index; append problems; name -> (dtype, shape)."""
    weight_map = _read_weight_map(root, problems)
    if weight_map is None:
        return {}
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    where: dict[str, str] = {}
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (root / s).is_file()]
    if missing:
        problems.append(_listed(f"{len(missing)} of {len(shards)} shards named in {INDEX_NAME} "
                                "are missing (incomplete download? fetch them)", missing))
    for shard in shards:
        path = root / shard
        if shard in missing:
            continue
        try:
            header = read_header(path)
        except CheckpointError as e:
            problems.append(f"shard {shard} is unreadable: {e}")
            missing.append(shard)
            continue
        data_end = max((t.offset + t.nbytes for t in header.tensors), default=0)
        size = path.stat().st_size
        if header.tensors and size != data_end:
            problems.append(f"shard {shard} is {size:,} bytes but its header describes {data_end:,} "
                            "bytes; the file is damaged (interrupted download?): fetch it again")
        for t in header.tensors:
            found[t.name] = (t.dtype, tuple(t.shape))
            where[t.name] = shard
    wrong_place = [n for n, s in weight_map.items() if s not in missing and where.get(n) != s]
    if wrong_place:
        problems.append(_listed(f"{len(wrong_place)} tensors named in {INDEX_NAME} are not in the "
                                "shard it names (index and shards do not match; download again)",
                                wrong_place))
    return found


TOKENIZER_JSON = ("tokenizer_config.json", "generation_config.json")  # copied; must be JSON objects


def _json_problem(path: Path) -> str | None:
    """Why `path` (present) is not a readable UTF-8 JSON object, with the fix; None if it is."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        return f"{path} cannot be read ({e.strerror or e}); make it readable"
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError
        return f"{path} is not readable JSON ({e}); download it again"
    if not isinstance(doc, dict):
        return f"{path} is not a JSON object; download it again"
    return None


def check_tokenizer(root: Path, args: ModelArgs) -> list[str]:
    """Problems that stop a model converted from `root` from chatting (the engine refuses to load
    it): `tokenizer.json` cannot be read or has more tokens than the model's vocab_size, or
    `tokenizer_config.json` / `generation_config.json` is not a readable JSON object (each
    checked only when present); [] otherwise."""
    problems = [p for name in TOKENIZER_JSON if (root / name).is_file()
                and (p := _json_problem(root / name)) is not None]
    path = root / "tokenizer.json"
    if not path.is_file():
        return problems
    from tokenizers import Tokenizer  # the engine's tokenizer library (engine/chat.py)

    try:
        n = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the library raises its own exception type for a malformed file
        return problems + [f"{path} is not a readable tokenizer ({e}); download it again"]
    if n > args.vocab_size:
        return problems + [f"{path} has {n:,} tokens but the model's vocab_size is {args.vocab_size:,}: a model "
                "converted with it cannot chat (the engine refuses to load it); put the tokenizer that "
                "belongs to this checkpoint next to it, or convert with --logits-only for the logits "
                "tools (python -m engine.logits) only"]
    return problems


def check_source(path: str | os.PathLike, tokenizer: bool = True) -> list[str]:
    """Problems that would stop converting the HF checkpoint at `path` (empty list = OK);
    `tokenizer=False` leaves out `check_tokenizer` (a model for the logits tools only)."""
    root = Path(path)
    if not root.is_dir():
        return [f"{root} is not a directory; point at the downloaded DeepSeek-V4-Flash checkpoint "
                "(config.json, model.safetensors.index.json, model-*.safetensors)"]
    problems: list[str] = []
    args = None
    try:
        args = ModelArgs.from_dir(root)
    except ConfigError as e:
        problems.append(str(e))
    found = source_shapes(root, problems)
    if problems or args is None:  # tensor checks would only repeat the shard problems
        return problems
    gate = found.get(GATE)  # checked first: the inventory has 6 names per expert and unit
    if gate is not None and gate[1][:1] != (args.n_routed_experts,):
        return [f"{root / 'config.json'}: n_routed_experts is {args.n_routed_experts:,} but {GATE} "
                f"(one row per expert) is {list(gate[1])}: the config does not belong to these "
                "shards; download config.json again"]
    expected = mapping.expected_inventory(args)
    absent = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if absent:
        problems.append(_listed(f"{len(absent)} tensors of the spec §B.3 inventory are missing",
                                absent))
    if extra:
        problems.append(_listed(f"{len(extra)} tensors are not part of DeepSeek-V4-Flash "
                                "(spec §B.3; wrong model or config?)", extra))
    bad = [f"{n} is {found[n][0]} {list(found[n][1])}, expected {want[0]} {list(want[1])}"
           for n, want in expected.items() if n in found and found[n] != want]
    if bad:
        problems.append(_listed(f"{len(bad)} tensors have the wrong dtype or shape for this config "
                                "(spec §B.3)", bad))
    if tokenizer:
        problems += check_tokenizer(root, args)
    return problems


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing ancestor)."""
    return shutil.disk_usage(_existing_ancestor(path)).free


def holds_conversion(out: Path) -> bool:
    """Whether directory `out` holds an earlier conversion (finished: manifest.json; unfinished:
    the state file). Only then are its files with converter names the converter's own: in any
    other directory every file is foreign, whatever its name."""
    return (out / layout.MANIFEST).is_file() or (out / layout.STATE).is_file()


def check_destination(out_dir: str | os.PathLike, needed: int, source: str | os.PathLike,
                      disk_free: DiskFree | None = None) -> list[str]:
    """Problems with writing `needed` more bytes of conversion output into `out_dir`: it (or a
    directory above it) is a file, it is the source, it holds files that are not the converter's
    own (every file, unless it holds an earlier conversion: `holds_conversion`), or the disk is
    too full."""
    out, problems = Path(out_dir), []
    base = _existing_ancestor(out)
    if not base.is_dir():
        what = "exists and is not a directory" if base == out.absolute() else \
            f"lies below {base}, which is a file, not a directory"
        return [f"--out {out} {what}; choose another --out"]
    if out.resolve() == Path(source).resolve():
        return [f"--out {out} is the source directory; choose a new directory"]
    if out.is_dir():
        ours = holds_conversion(out)
        foreign = sorted(f.name for f in out.iterdir()
                         if not (ours and layout.is_own_file(f.name) and f.is_file()))
        if foreign:
            problems.append(_listed(f"--out {out} holds files that are not conversion output; "
                                    "choose an empty or new directory", foreign))
    free = (disk_free or free_bytes)(base)
    if free < needed:
        problems.append(f"not enough free disk space on {base}: the conversion needs "
                        f"{needed / 1e9:.2f} GB more, {free / 1e9:.2f} GB are free; free some space "
                        "or choose another --out")
    return problems
