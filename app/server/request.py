"""Parse and validate the body of `POST /v1/chat/completions` into a `ChatRequest`.

Accepted fields (anything else is a 400 naming the field): messages, model, stream,
stream_options.include_usage, max_tokens / max_completion_tokens, temperature, top_p, top_k,
seed, stop (a string or up to 4), n (1 only), user (ignored), and thinking on/off as
`thinking: true|false`, DeepSeek's `thinking: {"type": "enabled"|"disabled"}` or
`chat_template_kwargs: {"thinking": bool}`. Fields that clients send with OpenAI's defaults
(`NEUTRAL`: frequency_penalty 0, presence_penalty 0, logprobs false, logit_bias {}) are accepted
at those values only. Messages: leading system (or developer) messages
become the system prompt; then user/assistant messages, the last one from the user. Content is a
string or a list of `{"type": "text", "text": ...}` parts. Unset sampling fields take the
server's defaults (the app's [generation] settings).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from app.server.errors import bad_request
from app.settings import MAX_TOKENS, MAX_TOP_K
from engine.chat import Message, not_unicode
from engine.sampling import SamplingError, SamplingParams

FIELDS = frozenset({"messages", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                    "temperature", "top_p", "top_k", "seed", "stop", "n", "user", "thinking",
                    "chat_template_kwargs"}) | {"frequency_penalty", "presence_penalty", "logprobs", "logit_bias"}
# fields this server does not implement, accepted at the value that means "off" (OpenAI's default)
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "logit_bias": {}}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "reasoning_content"})
MAX_STOPS = 4


@dataclass(frozen=True)
class ChatRequest:
    """One validated chat completion request."""

    system: str | None
    history: tuple[Message, ...]  # user/assistant messages before the last user message
    user: str  # the last user message: the turn to answer
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    stops: tuple[str, ...] = ()
    model: str | None = None

    def conversation(self) -> list[Message]:
        """The whole prompt as engine messages (system first)."""
        head = [Message("system", self.system)] if self.system else []
        return head + list(self.history) + [Message("user", self.user)]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(value: str, where: str) -> str:
    """`value`, or a 400 if it holds a lone UTF-16 surrogate (JSON allows one; no tokenizer does)."""
    bad = not_unicode(value)
    if bad is not None:
        raise bad_request(f"{where} holds an unpaired UTF-16 surrogate ({value[bad]!r} at character "
                          f"{bad}); send valid Unicode text", param=where)
    return value


def _content(value, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: only text content parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported", param=where)
            parts.append(_text(part["text"], where))
        return "".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", param=where)


def _messages(value) -> tuple[str | None, list[Message], str]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    system: list[str] = []
    turns: list[Message] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'", param=where)
        unknown = sorted(set(m) - MESSAGE_FIELDS)
        if unknown:
            raise bad_request(f"{where}: unsupported field {unknown[0]!r} (tools and function calls are not "
                              "supported; a message has role, content)", param=f"{where}.{unknown[0]}")
        role = m.get("role")
        text = _content(m.get("content"), f"{where}.content")
        if role in ("system", "developer"):
            if turns:
                raise bad_request(f"{where}: a system message may only come before the user and assistant "
                                  "messages", param=where)
            system.append(text)
        elif role in ("user", "assistant"):
            turns.append(Message(role, text))
        else:
            raise bad_request(f"{where}: role must be system, user or assistant, got {role!r}",
                              param=f"{where}.role")
    if not turns or turns[-1].role != "user":
        raise bad_request("the last message must come from the user (role 'user')", param="messages")
    return ("\n\n".join(system) or None), turns[:-1], turns[-1].content


def _thinking(body: dict, default: bool) -> bool:
    value = body.get("thinking")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"thinking"} or not isinstance(kwargs.get("thinking", False), bool):
            raise bad_request("'chat_template_kwargs' accepts only {\"thinking\": true|false}",
                              param="chat_template_kwargs")
        if "thinking" in kwargs:
            value = kwargs["thinking"] if value is None else value
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, dict) and set(value) == {"type"} and value["type"] in ("enabled", "disabled"):
        return value["type"] == "enabled"
    raise bad_request("'thinking' must be true, false or {\"type\": \"enabled\"|\"disabled\"}", param="thinking")


def parse_chat_request(raw: bytes, defaults: SamplingParams) -> ChatRequest:
    """The request in `raw` (JSON bytes), or an ApiError (400) naming the first problem."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad_request(f"the request body is not valid JSON ({err}); send a JSON object") from None
    except RecursionError:
        raise bad_request("the request body nests arrays or objects too deeply; send a flat chat request") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad_request(f"unsupported field {unknown[0]!r}; this server accepts: {', '.join(sorted(FIELDS))}",
                          param=unknown[0])
    for name, off in NEUTRAL.items():
        if body.get(name) not in (None, off):
            raise bad_request(f"'{name}' is not supported; leave it out or send {json.dumps(off)}", param=name)
    system, history, user = _messages(body.get("messages"))

    def number(name, lo, hi, lo_open=False):
        v = body.get(name)
        if v is None:
            return None
        if not _is_number(v) or not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            raise bad_request(f"'{name}' must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}",
                              param=name)
        return float(v)

    def integer(name, lo, hi):
        v = body.get(name)
        if v is None:
            return None
        if not _is_int(v) or not lo <= v <= hi:
            raise bad_request(f"'{name}' must be an integer in [{lo}, {hi:,}], got {v!r}", param=name)
        return v

    max_tokens = integer("max_completion_tokens", 1, MAX_TOKENS)
    legacy = integer("max_tokens", 1, MAX_TOKENS)
    if max_tokens is not None and legacy is not None and max_tokens != legacy:
        raise bad_request("'max_tokens' and 'max_completion_tokens' differ; send one of them", param="max_tokens")
    max_tokens = max_tokens or legacy or defaults.max_tokens
    temperature = number("temperature", 0.0, 2.0)
    top_p = number("top_p", 0.0, 1.0, lo_open=True)
    top_k = integer("top_k", 0, MAX_TOP_K)
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -2**63 <= seed < 2**64):
        raise bad_request(f"'seed' must be a 64-bit integer, got {seed!r}", param="seed")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_request("'n' must be 1 (one completion per request)", param="n")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise bad_request(f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} of them", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad_request("'stream_options' accepts only {\"include_usage\": true|false}", param="stream_options")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("'user' must be a string", param="user")
    try:
        params = SamplingParams(temperature=defaults.temperature if temperature is None else temperature,
                                top_p=defaults.top_p if top_p is None else top_p,
                                top_k=defaults.top_k if top_k is None else top_k,
                                max_tokens=max_tokens, seed=seed, thinking=_thinking(body, defaults.thinking))
    except SamplingError as err:  # the checks above keep to the engine's ranges; this names any other
        raise bad_request(str(err)) from None
    return ChatRequest(system, tuple(history), user, params, stream,
                       bool(options and options.get("include_usage")), tuple(stops), model)
