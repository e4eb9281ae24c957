"""`/set save`: write generation settings into the settings file's `[generation]` table.

Only the settings given are written (the controller passes those changed with `/set` in this
session); everything else in the file is kept as written, comments included. A key the file
already sets has its value replaced in place (a comment after the value is kept), however TOML
spells where it lives: a `[generation]` table (`[ generation ]`, `["generation"]` too) or dotted
keys at top level (`generation.temperature = 0.5`). A new key goes after the file's last
generation key, in the same spelling, or into a `[generation]` table appended at the end.

Line endings are kept: every line keeps its own (CRLF or LF), and the lines added (and an end
added to a last line that had none) take the file's first line's (LF for a new file). Lines are
split at "\n" only, so a raw U+2028 or form feed inside a string is no line break.

Before it replaces the file, the result is parsed (tomllib) and must hold exactly the old file's
values plus the new ones, and pass the app's own checks; otherwise (e.g. an inline table
`generation = {...}`, which cannot be edited in place) nothing is written and a SettingsError
names the file and what to change.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged
    import tomli as tomllib

from app.conversation import write_atomic
from app.settings import GENERATION_KEYS, SettingsError, settings_from_toml


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string


def _name(word: str) -> str:
    """A regex for a TOML key `word`, bare or quoted."""
    w = re.escape(word)
    return f"(?:{w}|\"{w}\"|'{w}')"


_GEN = _name("generation")
_HEADER = re.compile(r"^\s*\[(?P<array>\[)?\s*(?P<name>[^\]]*?)\s*\]")  # [table] or [[array]]
_INLINE = re.compile(rf"^\s*{_GEN}\s*=")  # generation = {...}: not editable in place
_KEYVAL = re.compile(r"^\s*[^\s#=\[][^=]*=")  # any key = value line


def _outside_strings(lines: list[str]) -> list[bool]:
    """For each line, whether it starts outside a multi-line string (a header-looking line inside
    one is no header). Approximate; the parse check after the edit catches what it misses."""
    out, open_quote = [], None
    for line in lines:
        out.append(open_quote is None)
        i = 0
        while i < len(line):
            if open_quote is None and line[i] == "#":
                break
            three = line[i:i + 3]
            if open_quote is None and three in ('"""', "'''"):
                open_quote, i = three, i + 3
            elif open_quote is not None and three == open_quote:
                open_quote, i = None, i + 3
            else:
                i += 1
    return out


def _with_value(line: str, lead_end: int, value: str) -> str:
    """`line` (`KEY = OLD  # comment`) with OLD replaced by `value`, the comment kept."""
    lead, rest = line[:lead_end], line[lead_end:]
    for i, ch in enumerate(rest):
        if ch != "#":
            continue
        try:
            tomllib.loads("v =" + rest[:i])  # the value ends here: the rest is a comment
        except tomllib.TOMLDecodeError:
            continue  # a '#' inside a string
        gap = rest[:i][len(rest[:i].rstrip()):] or " "
        return f"{lead} {value}{gap}{rest[i:]}"
    return f"{lead} {value}"


def _lines(text: str) -> tuple[list[str], list[str], str]:
    """`text` split at "\n": the lines without their ends; each line's end ("\r\n" or "\n"; a
    last line without one gets the newline); and the text's newline (its first line's end, "\n"
    when the text has no line end at all)."""
    parts = text.split("\n")
    last = parts.pop()  # after the last "\n": "" when the text ends with one
    ends = ["\r\n" if part.endswith("\r") else "\n" for part in parts]
    lines = [part[:-1] if part.endswith("\r") else part for part in parts]
    newline = ends[0] if ends else "\n"
    if last:
        lines.append(last)
        ends.append(newline)
    return lines, ends, newline


def _edit(text: str, values: Mapping[str, Any], origin: str) -> str:
    """`text` with the generation settings `values` set (see the module docstring)."""
    lines, ends, newline = _lines(text)
    outside = _outside_strings(lines)
    table: str | None = ""  # the current table's name ("" = top level, None = an array of tables)
    found: dict[str, tuple[int, int]] = {}  # key -> (line index, end of its `KEY =` part)
    in_table_last = header_at = dotted_last = None
    owner = None  # whose value the last content line was: "table", "dotted" or None (another's)
    for i, line in enumerate(lines):
        stripped = line.strip()
        if outside[i] and (not stripped or stripped.startswith("#")):
            continue
        header = _HEADER.match(line) if outside[i] else None
        if header:
            table = None if header["array"] else header["name"]
            owner = None
            if table is not None and re.fullmatch(_GEN, table):
                header_at = in_table_last = i
            continue
        if outside[i] and _KEYVAL.match(line):  # a new key: whose is it?
            if table == "" and _INLINE.match(line):
                raise SettingsError(
                    f"{origin}: cannot save the settings: [generation] is written inline "
                    "(generation = {...}), which /set save cannot edit; write it as a [generation] "
                    "table, one key a line, then /set save again")
            in_gen_table = table is not None and bool(re.fullmatch(_GEN, table))
            dotted = table == "" and re.match(rf"^\s*{_GEN}\s*\.", line) is not None
            owner = "table" if in_gen_table else "dotted" if dotted else None
            for key in values:
                pattern = (rf"^\s*{_name(key)}\s*=" if in_gen_table
                           else rf"^\s*{_GEN}\s*\.\s*{_name(key)}\s*=" if dotted else None)
                m = re.match(pattern, line) if pattern else None
                if m:
                    found[key] = (i, m.end())
        # a key's line, or the continuation of its value (a multi-line string or array)
        if owner == "table":
            in_table_last = i
        elif owner == "dotted":
            dotted_last = i
    for key, (i, end) in found.items():
        lines[i] = _with_value(lines[i], end, _toml_value(values[key]))
    new = [key for key in values if key not in found]
    if new and header_at is not None:
        at, prefix = in_table_last, ""
    elif new and dotted_last is not None:
        at, prefix = dotted_last, "generation."
    else:
        at, prefix = None, ""
    added = [f"{prefix}{key} = {_toml_value(values[key])}" for key in new]
    if at is not None:
        lines[at + 1:at + 1] = added
        ends[at + 1:at + 1] = [newline] * len(added)
    elif added:
        while lines and not lines[-1].strip():
            lines.pop()
            ends.pop()
        table = ([""] if lines else []) + ["[generation]"] + added
        lines += table
        ends += [newline] * len(table)
    return "".join(line + end for line, end in zip(lines, ends))


def save_generation(path: Path, values: Mapping[str, Any]) -> None:
    """Write the generation settings `values` (keyed by the settings file's names, e.g.
    {"temperature": 0.3}) into the settings file `path` (created if absent; a symlink is written
    through). Raises SettingsError naming `path` and the fix (the file is then unchanged) or
    OSError."""
    unknown = sorted(set(values) - set(GENERATION_KEYS))
    if unknown:
        raise SettingsError(f"unknown generation setting {unknown[0]!r} (known: {', '.join(GENERATION_KEYS)})")
    try:
        # bytes decoded, not read_text: its universal newlines would turn CRLF into LF
        old = path.read_bytes().decode("utf-8") if path.is_file() else ""
    except UnicodeDecodeError as err:
        raise SettingsError(f"{path}: cannot read the settings file ({err}); fix or delete it") from None
    try:
        old_data = tomllib.loads(old)
    except tomllib.TOMLDecodeError as err:
        raise SettingsError(f"{path}: not valid TOML ({err}); fix it, then /set save again") from None
    text = _edit(old, values, str(path))
    expected = copy.deepcopy(old_data)
    gen = expected.setdefault("generation", {})
    if isinstance(gen, dict):
        gen.update(values)
    try:
        new_data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        new_data = None
    if new_data != expected:
        keys = ", ".join(values)
        raise SettingsError(
            f"{path}: cannot save the settings: /set save cannot edit how this file writes its "
            f"[generation] table; set {keys} in that table by hand (one `key = value` a line)")
    try:
        settings_from_toml(new_data, str(path))  # the app must be able to read what it writes
    except SettingsError as err:
        raise SettingsError(f"cannot save the settings ({err})") from None
    write_atomic(path, text)
