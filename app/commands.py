"""Slash commands: the registry (name → usage, help, argument parser) and pure parsing.

`parse(line)` turns "/pin hot 4" into `Command("pin", PinArgs(hot=4))` or raises `CommandError`
with a one-line message for the user. Nothing here touches the app; what each command does lives
in `app.controller` (one handler per registry entry), shared by the TUI and `--plain`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable

SET_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "think")


class CommandError(ValueError):
    """A command line the user typed is wrong; str() is a one-line explanation."""


@dataclass(frozen=True)
class Command:
    name: str
    args: Any = None


@dataclass(frozen=True)
class SetArgs:
    key: str | None  # None: show the current settings
    value: Any = None


@dataclass(frozen=True)
class ExportArgs:
    file: str
    force: bool = False  # overwrite an existing file / create a missing directory


@dataclass(frozen=True)
class SaveArgs:
    name: str
    force: bool = False  # overwrite an existing save of that name


@dataclass(frozen=True)
class PinArgs:
    hot: int | None = None  # pin the N most used experts
    keys: tuple[tuple[int, int], ...] = ()  # or these (layer, expert) pairs


@dataclass(frozen=True)
class Spec:
    usage: str
    help: str
    parse: Callable[[str], Any]


def _no_args(name: str) -> Callable[[str], None]:
    def parse(rest: str) -> None:
        if rest:
            raise CommandError(f"/{name} takes no arguments")

    return parse


def _text(rest: str) -> str:
    return rest


def _required(what: str, usage: str) -> Callable[[str], str]:
    def parse(rest: str) -> str:
        if not rest:
            raise CommandError(f"missing {what}: {usage}")
        return rest

    return parse


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("on", "true", "yes", "1"):
        return True
    if low in ("off", "false", "no", "0"):
        return False
    raise CommandError(f"think must be on or off, got {text!r}")


_SET_CONVERT: dict[str, Callable[[str], Any]] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_tokens": int,
    "think": _bool,
}


def parse_set(rest: str) -> SetArgs:
    parts = rest.split()
    if not parts:
        return SetArgs(None)
    key = parts[0].lower()
    if key == "save":
        if len(parts) != 1:
            raise CommandError("usage: /set save (writes the current settings to the settings file)")
        return SetArgs("save")
    if key not in _SET_CONVERT:
        raise CommandError(f"unknown setting {parts[0]!r}; one of: {', '.join(SET_KEYS)}, or save")
    if len(parts) != 2:
        raise CommandError(f"usage: /set {key} VALUE")
    try:
        value = _SET_CONVERT[key](parts[1])
    except ValueError as err:
        if isinstance(err, CommandError):
            raise
        kind = "an integer" if _SET_CONVERT[key] is int else "a number"
        raise CommandError(f"{key} must be {kind}, got {parts[1]!r}") from None
    return SetArgs(key, value)


def parse_keys(text: str) -> tuple[tuple[int, int], ...]:
    """"3:17,4:2" → ((3, 17), (4, 2)); raises CommandError naming the bad item."""
    keys = []
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        layer, sep, expert = item.partition(":")
        if not sep or not layer.isdigit() or not expert.isdigit():
            raise CommandError(f"bad expert {item!r}: write LAYER:EXPERT, e.g. 3:17")
        keys.append((int(layer), int(expert)))
    if not keys:
        raise CommandError("no experts given: write LAYER:EXPERT[,LAYER:EXPERT…]")
    return tuple(dict.fromkeys(keys))  # each once, in the order given


def parse_pin(rest: str) -> PinArgs:
    parts = rest.split()
    if not parts:
        raise CommandError("usage: /pin hot N  or  /pin L:E[,L:E…]")
    if parts[0].lower() == "hot":
        if len(parts) != 2 or not parts[1].isdigit() or int(parts[1]) < 1:
            raise CommandError("usage: /pin hot N (N ≥ 1, the number of most-used experts)")
        return PinArgs(hot=int(parts[1]))
    return PinArgs(keys=parse_keys(rest))


def _with_force(rest: str) -> tuple[str, bool]:
    """"TEXT [--force]" (--force may also come first) -> (TEXT as typed between them, inner spaces
    included; whether --force was given)."""
    text = rest.strip()
    if text == "--force" or text.startswith("--force "):
        return text[len("--force"):].strip(), True
    if text.endswith(" --force"):
        return text[:-len("--force")].strip(), True
    return text, False


def parse_export(rest: str) -> ExportArgs:
    """"FILE.md [--force]": `_with_force`."""
    file, force = _with_force(rest)
    if not file:
        raise CommandError("missing a file: /export FILE.md [--force]")
    return ExportArgs(file, force)


def parse_save(rest: str) -> SaveArgs:
    """"NAME [--force]": `_with_force`, one word."""
    name, force = _with_force(rest)
    if not name:
        raise CommandError("missing a name: /save NAME [--force]")
    if len(name.split()) > 1:
        raise CommandError(f"one name, no spaces: /save NAME [--force] (got {' '.join(name.split())!r})")
    return SaveArgs(name, force)


def _history(rest: str) -> int | None:
    if not rest:
        return None
    if not rest.isdigit() or int(rest) < 1:
        raise CommandError("usage: /history [N] (N: a number from the /history list)")
    return int(rest)


def parse_unpin(rest: str) -> PinArgs:
    return PinArgs(keys=parse_keys(rest)) if rest else PinArgs()


REGISTRY: dict[str, Spec] = {
    "help": Spec("/help", "list the commands", _no_args("help")),
    "new": Spec("/new", "start a new conversation (the current one stays in /history)", _no_args("new")),
    "system": Spec("/system [TEXT]", "set the system prompt (starts a new chat; the current one "
                   "stays in /history); no text: show it", _text),
    "set": Spec("/set KEY VALUE", f"set {', '.join(SET_KEYS)}; no key: show them; "
                "/set save: keep them for the next start", parse_set),
    "model": Spec("/model [NAME]", "list the converted models; NAME: switch to it", _text),
    "history": Spec("/history [N]", "list past conversations (also Ctrl+P); N: reopen one", _history),
    "flush": Spec("/flush", "evict every unpinned expert from the GPU cache (the host RAM tier keeps its copies)",
                  _no_args("flush")),
    "pin": Spec("/pin hot N | /pin L:E,…", "keep experts in the cache through /flush", parse_pin),
    "unpin": Spec("/unpin [L:E,…]", "unpin these experts (no list: all)", parse_unpin),
    "stats": Spec("/stats", "detailed statistics: per-layer hit rates, cache, memory", _no_args("stats")),
    "save": Spec("/save NAME [--force]", "save the conversation (--force: overwrite a save of that "
                 "name)", parse_save),
    "load": Spec("/load NAME", "load a saved conversation", _required("a name", "/load NAME")),
    "export": Spec("/export FILE.md [--force]", "write the conversation as Markdown (--force: "
                   "overwrite, or create the directory)", parse_export),
    "regen": Spec("/regen", "answer the last message again", _no_args("regen")),
    "undo": Spec("/undo", "drop the last question and answer", _no_args("undo")),
    "quit": Spec("/quit", "leave (the conversation stays in /history)", _no_args("quit")),
}


def is_command(line: str) -> bool:
    """Lines starting with one '/' are commands; '//text' sends '/text' as a message."""
    return line.startswith("/") and not line.startswith("//")


def message_text(line: str) -> str:
    """What a line that is not a command sends: itself, or '/text' for '//text'."""
    return line[1:] if line.startswith("//") else line


def parse(line: str) -> Command:
    """Parse a command line; raises CommandError with a one-line explanation."""
    body = line.strip()[1:]
    name, _, rest = body.partition(" ")
    name = name.lower()
    if name not in REGISTRY:
        matches = [f"/{m}" for m in difflib.get_close_matches(name, REGISTRY, n=2, cutoff=0.6)]
        hint = f" — did you mean {' '.join(matches)}?" if matches else " — /help lists them"
        raise CommandError(f"unknown command /{name}{hint}")
    return Command(name, REGISTRY[name].parse(rest.strip()))


def complete(prefix: str) -> list[str]:
    """Command names ("/pin", …) that start with `prefix` (which starts with '/')."""
    stem = prefix[1:].lower()
    return [f"/{name}" for name in REGISTRY if name.startswith(stem)]


def help_lines() -> list[str]:
    width = max(len(s.usage) for s in REGISTRY.values())
    return [f"{s.usage:<{width}}  {s.help}" for s in REGISTRY.values()]
