"""`/set save`: write the generation settings into the settings file's `[generation]` table.

Everything else in the file is kept as written (comments included); the `[generation]` table's
sampling keys are replaced by the current values (its other lines, e.g. `system`, are kept), appended at the end (TOML allows a table after all top-level keys).
The result is read back with the app's own parser before it replaces the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from app.conversation import write_atomic
from app.settings import SettingsError, generation_settings, read_file_settings
from engine.sampling import SamplingParams


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string


def generation_table(gen: SamplingParams) -> str:
    return "[generation]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in generation_settings(gen).items())


def save_generation(path: Path, gen: SamplingParams) -> None:
    """Write `gen` as the `[generation]` table of the settings file `path` (created if absent).
    Raises SettingsError (the file is then unchanged) or OSError."""
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    kept: list[str] = []
    other_gen: list[str] = []  # lines of the old table that set something else (e.g. system)
    in_gen = False
    for line in old.splitlines():
        header = line.strip()
        if header.startswith("[") and not header.startswith("[["):
            in_gen = header.split("#")[0].strip() == "[generation]"
            if in_gen:
                continue
        if not in_gen:
            kept.append(line)
        elif header.split("=")[0].strip() not in generation_settings(gen) and header:
            other_gen.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    table = generation_table(gen) + "".join(f"{line}\n" for line in other_gen)
    text = "\n".join(kept) + ("\n\n" if kept else "") + table
    probe = path.with_name(f".{path.name}.check")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        probe.write_text(text, encoding="utf-8")
        read_file_settings(probe)  # the app must be able to read what it writes
    except SettingsError as err:
        raise SettingsError(f"{path}: cannot save the settings ({err})") from None
    finally:
        probe.unlink(missing_ok=True)
    write_atomic(path, text)
