"""The app's record of a conversation (what the user sees), independent of the engine.

Saved conversations (`/save NAME`) are JSON files `<data_dir>/saved/NAME.json`:

    {"version": 1, "system": "...", "messages": [
        {"role": "user"|"assistant", "content": "...", "reasoning": "...", "finish": "eos"}, ...]}
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

SAVE_VERSION = 1
ROLES = ("user", "assistant")  # the roles a conversation's messages have
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ConversationError(ValueError):
    """A saved conversation cannot be read or written; the message says why."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "user" | "assistant"
    content: str
    reasoning: str = ""
    finish: str = ""  # assistant only: "eos" | "max_tokens" | "cancelled" | "error"


@dataclass
class Conversation:
    system: str = ""
    messages: list[ChatMessage] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "user")

    def settled(self) -> "Conversation":
        """A copy without a trailing user message that never got an answer."""
        msgs = list(self.messages)
        if msgs and msgs[-1].role == "user":
            msgs.pop()
        return Conversation(self.system, msgs)

    def pending_prompt(self) -> str:
        """The trailing unanswered user message ("" if none)."""
        if self.messages and self.messages[-1].role == "user":
            return self.messages[-1].content
        return ""

    def drop_last_turn(self) -> None:
        """Remove the last user message and everything after it."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "user":
                del self.messages[i:]
                return

    def replace_last_answer(self, answer: ChatMessage) -> None:
        if self.messages and self.messages[-1].role == "assistant":
            self.messages[-1] = answer
        else:
            self.messages.append(answer)

    def check(self, origin: str) -> "Conversation":
        """Itself, if every message is one an engine session can hold: role "user" or
        "assistant", text content and reasoning, reasoning on assistants only. Otherwise raises
        ConversationError naming `origin` (the file it came from), the message and the fix."""
        for number, m in enumerate(self.messages, 1):
            if m.role not in ROLES:
                problem = f"has role {m.role!r} (expected 'user' or 'assistant')"
            elif not isinstance(m.content, str) or not isinstance(m.reasoning, str):
                problem = "has content or reasoning that is not text"
            elif m.reasoning and m.role != "assistant":
                problem = "is a user message with reasoning"
            else:
                continue
            raise ConversationError(f"{origin}: message {number} {problem} — fix or remove it in that file")
        return self

    def to_markdown(self) -> str:
        parts = ["# Conversation\n"]
        if self.system:
            parts.append(f"**System:** {self.system}\n")
        for m in self.messages:
            if m.role == "user":
                parts.append(f"## User\n\n{m.content}\n")
            else:
                parts.append("## Assistant\n")
                if m.reasoning:
                    quoted = "\n".join("> " + line for line in m.reasoning.splitlines())
                    parts.append(f"<details><summary>Thinking</summary>\n\n{quoted}\n\n</details>\n")
                suffix = "" if m.finish in ("", "eos") else f"\n\n*({m.finish})*"
                parts.append(f"{m.content}{suffix}\n")
        return "\n".join(parts)

    def to_json(self) -> str:
        data = {
            "version": SAVE_VERSION,
            "system": self.system,
            "messages": [asdict(m) for m in self.messages],
        }
        return json.dumps(data, ensure_ascii=False, indent=1)

    @classmethod
    def from_json(cls, text: str, origin: str) -> "Conversation":
        """The conversation saved as `text` (see the module's docstring), checked (`check`);
        raises ConversationError naming `origin` if it is not one."""
        try:
            data = json.loads(text)
            if data.get("version") != SAVE_VERSION:
                raise ConversationError(
                    f"{origin}: format version {data.get('version')!r}, this app reads {SAVE_VERSION}"
                )
            msgs = [ChatMessage(**m) for m in data["messages"]]
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            if isinstance(err, ConversationError):
                raise
            raise ConversationError(f"{origin}: not a saved conversation ({err})") from None
        return cls(str(data.get("system", "")), msgs).check(origin)


def check_name(name: str) -> str:
    """A save name is letters, digits, '_', '.', '-' (max 64); raises ConversationError."""
    if not _NAME.match(name):
        raise ConversationError(
            f"bad name {name!r}: use letters, digits, '_', '.', '-' (e.g. /save my-chat)"
        )
    return name


def create_temp(directory: Path, prefix: str, mode: int = 0o666) -> tuple[int, Path]:
    """A new file `<prefix><random>.tmp` in `directory`, opened for writing: (fd, path). The name is
    unique (O_EXCL, retried on a clash), so writers in several processes never share a temp file;
    the file is created with `mode` minus the umask, as open() would (mkstemp forces 0600)."""
    for _ in range(100):
        path = directory / f"{prefix}{secrets.token_hex(6)}.tmp"
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unique temporary name", str(directory))


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` via a temp file + fsync + rename (never half-written).

    A symlink is written through: its target is replaced and the link stays a link. An existing
    file keeps its permission bits; a new one gets 0o666 minus the umask, like any file the user
    creates. Missing parent directories are created. Raises OSError (the file is then as it was,
    and no temp file is left)."""
    try:
        target = path.resolve()
    except RuntimeError:  # Python < 3.13 reports a symlink loop so
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    fd, tmp = create_temp(target.parent, f".{target.name}.", 0o600 if mode is not None else 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(conv: Conversation, saved_dir: Path, name: str, force: bool = False) -> Path:
    """Write `conv` to `<saved_dir>/NAME.json` (atomically); returns the path. An existing save of
    that name is overwritten only with `force`. Raises ConversationError for a bad name, an
    existing save without `force`, or a file that cannot be written (a full disk, a read-only
    directory: the message names the file and the cause)."""
    path = saved_dir / f"{check_name(name)}.json"
    try:
        if not force and path.exists():
            raise ConversationError(f"{path} exists: /save {name} --force overwrites it")
        write_atomic(path, conv.to_json())
    except OSError as err:
        raise ConversationError(f"cannot write {path}: {err.strerror or err}") from None
    return path


def load(saved_dir: Path, name: str) -> Conversation:
    """The conversation saved as NAME in `saved_dir`; raises ConversationError (one line naming
    the file and the problem) if there is none or it cannot be read or is not one."""
    path = saved_dir / f"{check_name(name)}.json"
    if not path.is_file():
        have = sorted(p.stem for p in saved_dir.glob("*.json")) if saved_dir.is_dir() else []
        hint = f"saved: {', '.join(have)}" if have else "nothing saved yet (/save NAME)"
        raise ConversationError(f"no saved conversation {name!r} ({hint})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConversationError(f"{path}: not a saved conversation (not UTF-8 text)") from None
    except OSError as err:
        raise ConversationError(f"cannot read {path}: {err.strerror or err}") from None
    return Conversation.from_json(text, str(path))
