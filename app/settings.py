"""Application settings: one `AppConfig` merged from flags > environment > TOML file > defaults.

The settings file is TOML, by default `<user config dir>/dsv4-chat/config.toml`:

    model = "/data/dsv4-flash"      # converted model directory (else: newest under data_dir/models)
    data_dir = "/data/dsv4-chat"    # converted models, transcripts, saved conversations
    cache_gb = 40                    # expert-cache budget (GiB); absent = sized by the memory plan
    host_cache_gb = 64               # pinned host-RAM expert tier (GiB, discrete GPU); absent = the whole pool if RAM allows
    memory_gb = 100                  # cap on the whole memory plan (GiB); absent = what the machine has free
    numerics = "native"              # or "exact"
    device = "cuda"                  # or "cpu"; absent = cuda when available
    backend = "tilelang"             # GPU kernels, or "torch"; absent = tilelang on CUDA when installed
    cuda_graphs = true               # replay decode steps from CUDA graphs (CUDA, converted model)
    cache_policy = "next-use"              # or lru, lfu, slru, arc, lfu-aging (bench/cache_replay.py)
    io_threads = 8                   # expert reads in flight, 1..256 (MAX_IO_THREADS)
    max_seq_len = 4096

    [generation]
    temperature = 0.6                # [0, 2]; 0 = greedy
    top_p = 1.0                      # (0, 1]
    top_k = 0                        # 0..1,048,576 (MAX_TOP_K); 0 = off
    max_tokens = 512                 # 1..1,048,576 (MAX_TOKENS)
    think = false
    system = ""

Every key may also come from the environment as `DSV4_<KEY>` (upper case, e.g.
`DSV4_CACHE_GB=20`, `DSV4_TEMPERATURE=0.2`); `DSV4_CONFIG` names the settings file (which must
exist, like `--config`). Every value is type-checked (TOML and flag values by their type,
environment text by parsing) and range-checked the same from every source; a bad one is one
`SettingsError` line naming the source (`environment DSV4_<KEY>`, the file, the `--flag`), the
setting, the value, the expected type or range, and the fix (correct or drop it in that source).
Budgets and sizes must be finite and > 0; the counts have a maximum (`MAX_TOP_K`, `MAX_TOKENS`,
`MAX_IO_THREADS`), far above any useful value: a typo is refused here, not carried to the engine
(or by `/set save` into the file, where TOML allows 64-bit integers only), and io_threads cannot
exhaust the system's threads while the model loads. A path (`model`, `data_dir`, `DSV4_CONFIG`,
`--config`) must not be empty, from any source: an empty one is refused, never taken as the
current directory (leave the setting out for its default). `data_dir` must be a directory or
not exist yet (it is created when first written): a file there, or on its way, is refused at
start (whether it can be written is only known when writing: see app/demo.py). A `DSV4_*`
variable that is no setting is ignored with a warning (`AppConfig.warnings`). The engine settings
become one `engine.config.EngineConfig` (`AppConfig.engine`, GiB converted to bytes once) and the
`[generation]` ones one `engine.sampling.SamplingParams` (`AppConfig.gen`; `think` sets `thinking`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged
    import tomli as tomllib

import platformdirs

from engine.config import ConfigError, EngineConfig
from engine.memory_plan import MemoryPlanError, gib_to_bytes
from engine.sampling import SamplingParams

APP_NAME = "dsv4-chat"


# The largest top_k: far above any vocabulary (DeepSeek-V4's is 129,280); one >= the vocabulary keeps
# every token, like 0.
MAX_TOP_K = 2**20
# The largest max_tokens: the model's longest context (max_position_embeddings); no answer is longer.
MAX_TOKENS = 2**20
# The most expert-read threads (the default is 8; each is an OS thread started with the model).
MAX_IO_THREADS = 256


class SettingsError(ValueError):
    """A setting has a bad value; the message names the setting, its source and the fix."""


# The settings file's [generation] keys -> the engine.sampling.SamplingParams fields they set.
GENERATION_KEYS: dict[str, str] = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                                   "max_tokens": "max_tokens", "think": "thinking"}


def resolve_engine_config(cuda_available: bool | None = None, tilelang_available: bool | None = None,
                          **settings: Any) -> EngineConfig:
    """The EngineConfig of the app's engine settings (EngineConfig field names; `device` and
    `backend` None = automatic): the device is cuda when available, the backend tilelang on CUDA
    when the package is installed, else torch. None for an availability = look it up."""
    device = settings.pop("device", None)
    backend = settings.pop("backend", None)
    if device is None:
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        device = "cuda" if cuda_available else "cpu"
    if backend is None:
        if tilelang_available is None and device == "cuda":
            from kernels.backend import tilelang_available as installed

            tilelang_available = installed()
        backend = "tilelang" if device == "cuda" and tilelang_available else "torch"
    try:
        return EngineConfig(device=device, backend=backend, **settings)
    except ConfigError as err:
        raise SettingsError(f"engine settings: {err}") from None


@dataclass(frozen=True)
class AppConfig:
    """Everything the app needs to start; built once by `build_config`. `engine` is passed to the
    engine whole (budgets already in bytes); `gen` is the sampling of every turn."""

    data_dir: Path
    config_file: Path | None = None
    model: Path | None = None
    demo: bool = False
    plain: bool = False
    engine: EngineConfig = field(default_factory=resolve_engine_config)
    system: str = ""
    gen: SamplingParams = field(default_factory=SamplingParams)
    warnings: tuple[str, ...] = ()  # one line each, for stderr (e.g. an unknown DSV4_* variable)
    # the settings a DSV4_<KEY> variable gave (flags aside): they override the file at every start
    from_env: frozenset[str] = frozenset()

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def transcripts_dir(self) -> Path:
        return self.data_dir / "transcripts"

    @property
    def saved_dir(self) -> Path:
        return self.data_dir / "saved"


class _Key:
    """How one setting is read: its type (checked on TOML and flag values, parsed from environment
    text) and an optional range/choice check on the typed value."""

    def __init__(self, kind: str, check: Callable[[Any], str | None] | None = None) -> None:
        self.kind = kind  # "bool", "int", "number", "text" or "path"
        self.check = check

    @property
    def expected(self) -> str:
        return {"bool": "true or false", "int": "an integer", "number": "a number",
                "text": "a string", "path": "a path (string)"}[self.kind]

    def from_text(self, text: str) -> Any:
        """The value of an environment variable's text (ValueError names the expected type)."""
        try:
            if self.kind == "bool":
                low = text.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if self.kind == "int":
                return int(text)
            if self.kind == "number":
                return float(text)
        except ValueError:
            expected = "true/false" if self.kind == "bool" else self.expected
            raise ValueError(f"expected {expected}, got {text!r}") from None
        return _path(text) if self.kind == "path" else text

    def from_value(self, value: Any) -> Any:
        """A TOML or flag value as this setting's type (ValueError names value and type)."""
        kind = self.kind
        ok = {"bool": isinstance(value, bool),
              "int": isinstance(value, int) and not isinstance(value, bool),
              "number": isinstance(value, (int, float)) and not isinstance(value, bool),
              "text": isinstance(value, str),
              "path": isinstance(value, (str, Path))}[kind]
        if not ok:
            raise ValueError(f"expected {self.expected}, got {value!r} ({_type_name(value)})")
        if kind == "number":
            return float(value)
        return _path(value) if kind == "path" else value

    def validate(self, value: Any) -> Any:
        problem = self.check(value) if self.check is not None else None
        if problem:
            raise ValueError(problem)
        return value


def _path(value: str | Path) -> Path:
    """A path setting's value as a Path (`~` expanded). An empty (or blank) text is refused with
    ValueError: Path("") is the current directory, which no one means by leaving a value empty."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"empty path {value!r} (it is not taken as the current directory)")
    return Path(value).expanduser()


def check_config_file(text: str | Path, source: str) -> Path:
    """The settings file named by `source` ("--config", "DSV4_CONFIG") as a Path, which must be an
    existing regular file. SettingsError (one line naming the source, the path and the fix) for
    an empty name, a missing file, a directory, or a path the system refuses (e.g. too long)."""
    if isinstance(text, str) and not text.strip():
        leave_out = "unset it" if source.startswith("DSV4_") else "leave it out"
        raise SettingsError(f"{source} is empty: name the settings file (TOML), or {leave_out} "
                            f"to use {default_config_file()}")
    path = Path(text).expanduser()
    try:
        if path.is_file():
            return path
        if path.is_dir():
            raise SettingsError(f"{source} {path}: is a directory; name the settings file (TOML) in it")
    except OSError as err:
        raise SettingsError(f"{source} {_short(path)}: cannot use this path ({err.strerror or err})") from None
    raise SettingsError(f"{source} {path}: no such file")


def _short(path: Path, limit: int = 80) -> str:
    """`path` for an error line: at most `limit` characters (a 300-character name is elided)."""
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit // 2]}…{text[-limit // 2:]}"


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            dict: "a table", list: "an array", type(None): "null"}.get(type(value), type(value).__name__)


def _choice(*allowed: str) -> Callable[[Any], str | None]:
    def check(value: str) -> str | None:
        return None if value in allowed else f"expected one of {', '.join(allowed)}, got {value!r}"

    return check


def _positive(value: float) -> str | None:
    """Budgets and sizes: finite and > 0 (NaN and inf refused)."""
    if value != value or value in (float("inf"), float("-inf")):
        return f"must be a finite number > 0, got {value}"
    return None if value > 0 else f"must be > 0, got {value}"


def _in_range(low: float, high: float, low_open: bool = False, note: str = "") -> Callable[[Any], str | None]:
    """A check that the value is in [low, high] ((low, high] with `low_open`); NaN is refused.
    `note` follows the range in the message (e.g. "(0 = off)")."""
    shown = f"{'(' if low_open else '['}{low}, {high}]" + (f" {note}" if note else "")

    def check(value: float) -> str | None:
        inside = (low < value if low_open else low <= value) and value <= high
        return None if inside else f"must be in {shown}, got {value}"

    return check


def _data_dir(path: Path) -> str | None:
    """`data_dir` must be a directory, or not exist yet with a directory as its nearest existing
    ancestor (it is created when first written); a file there or on the way can never be one."""
    try:
        for at in (path, *path.parents):
            if at.exists():
                if at.is_dir():
                    return None
                return (f"{path} is a file, not a directory" if at == path
                        else f"{path} is inside {at}, a file, not a directory")
    except OSError as err:  # e.g. a name too long for the filesystem
        return f"cannot use {_short(path)} ({err.strerror or err})"
    return None


def _gib(value: float) -> str | None:
    """A memory budget in GiB: `_positive`, and bytes that `gib_to_bytes` can count."""
    problem = _positive(value)
    if problem is None:
        try:
            gib_to_bytes(value, "")
        except MemoryPlanError:
            problem = f"must be a number of GiB that fits in bytes, got {value}"
    return problem


# Settable keys: name -> how it is read and checked.
_KEYS: dict[str, _Key] = {
    "model": _Key("path"),
    "data_dir": _Key("path", _data_dir),
    "demo": _Key("bool"),
    "cache_gb": _Key("number", _gib),
    "host_cache_gb": _Key("number", _gib),
    "memory_gb": _Key("number", _gib),
    "numerics": _Key("text", _choice("native", "exact")),
    "device": _Key("text", _choice("cpu", "cuda")),
    "backend": _Key("text", _choice("torch", "tilelang")),
    "cuda_graphs": _Key("bool"),
    "cache_policy": _Key("text"),
    "io_threads": _Key("int", _in_range(1, MAX_IO_THREADS)),
    "max_seq_len": _Key("int", _positive),
    "system": _Key("text"),
    "temperature": _Key("number", _in_range(0, 2)),
    "top_p": _Key("number", _in_range(0, 1, low_open=True)),
    "top_k": _Key("int", _in_range(0, MAX_TOP_K, note="(0 = off)")),
    "max_tokens": _Key("int", _in_range(1, MAX_TOKENS)),
    "think": _Key("bool"),
}
# The settings that configure the engine (AppConfig.engine): EngineConfig fields, budgets in GiB.
_ENGINE_KEYS = ("cache_gb", "host_cache_gb", "memory_gb", "numerics", "device", "backend", "cuda_graphs",
                "cache_policy", "io_threads", "max_seq_len")
# DSV4_* variables that are not settings but are read by dsv4-chat.
_ENV_NOT_SETTINGS = ("DSV4_CONFIG",)


def default_config_file() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP_NAME))


def _fix(key: str, source: str) -> str:
    """How to fix a bad value of `key` in `source` ("environment DSV4_<KEY>", "--flag" or the file)."""
    if source.startswith("environment "):
        name = source[len("environment "):]
        return f"set {name} to a valid value or unset it"
    if source.startswith("--"):
        return f"give {source} a valid value or leave it out"
    return f"correct {key!r} in this file or remove it"


def _convert(key: str, raw: Any, source: str) -> Any:
    """`raw` (environment text when `source` is one, else a TOML/flag value) as setting `key`,
    type- and range-checked; SettingsError: `SOURCE: bad value for 'KEY': PROBLEM; FIX`."""
    if key not in _KEYS:
        known = ", ".join(sorted(_KEYS))
        raise SettingsError(f"{source}: unknown setting {key!r} (known: {known})")
    spec = _KEYS[key]
    try:
        value = spec.from_text(raw) if source.startswith("environment ") else spec.from_value(raw)
        return spec.validate(value)
    except ValueError as err:
        raise SettingsError(f"{source}: bad value for {key!r}: {err}; {_fix(key, source)}") from None


def read_file_settings(path: Path) -> dict[str, Any]:
    """Settings from a TOML file (`[generation]` keys flattened); {} if the file is absent.
    SettingsError (one line) if it cannot be read or holds a bad setting."""
    try:
        if not path.is_file():
            return {}
    except OSError as err:  # e.g. a name too long for the filesystem
        raise SettingsError(f"{_short(path)}: cannot use this settings file ({err.strerror or err})") from None
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise SettingsError(f"{path}: not valid TOML ({err}); fix or delete the file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SettingsError(f"{path}: cannot read the settings file ({err})") from None
    return settings_from_toml(data, str(path))


def settings_from_toml(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """The settings of a parsed settings file (`[generation]` keys flattened), each converted
    and checked; SettingsError names `origin` (the file) and the bad setting."""
    flat = dict(data)
    gen = flat.pop("generation", {})
    if not isinstance(gen, dict):
        raise SettingsError(f"{origin}: 'generation' must be a table ([generation])")
    flat.update(gen)
    return {key: _convert(key, value, origin) for key, value in flat.items()}


def read_env_settings(env: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """Settings from `DSV4_<KEY>` environment variables, and one warning per `DSV4_*` variable
    that is no setting (ignored: another tool may own it). DSV4_CONFIG names the file."""
    out, warnings = {}, []
    for name, value in sorted(env.items()):
        if not name.startswith("DSV4_") or name in _ENV_NOT_SETTINGS:
            continue
        key = name[len("DSV4_"):].lower()
        if key not in _KEYS:
            near = difflib.get_close_matches(key, list(_KEYS), n=1)
            hint = f"; did you mean DSV4_{near[0].upper()}?" if near else ""
            warnings.append(f"warning: environment {name} is not a dsv4-chat setting (ignored{hint})")
            continue
        out[key] = _convert(key, value, f"environment {name}")
    return out, warnings


def build_config(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: Path | None = None, *,
    cuda_available: bool | None = None, tilelang_available: bool | None = None,
) -> AppConfig:
    """Merge the sources: flags (None = not given) > env > file > defaults; each value is checked
    where it is read, so a SettingsError names its source. A set but
    empty DSV4_CONFIG, or an empty path setting from any source, is refused (SettingsError),
    never read as the current directory. `AppConfig.from_env` names the settings the
    environment gave, whether or not a flag overrode them now. The engine
    settings become `AppConfig.engine` here, once (GiB -> bytes; an unset device or backend is
    chosen from `cuda_available`/`tilelang_available`, None = looked up)."""
    if config_file is None:
        if "DSV4_CONFIG" in env:
            config_file = check_config_file(env["DSV4_CONFIG"], "DSV4_CONFIG")
        else:
            config_file = default_config_file()
    merged: dict[str, Any] = {"data_dir": default_data_dir()}
    merged.update(read_file_settings(config_file))
    env_settings, warnings = read_env_settings(env)
    merged.update(env_settings)
    merged.update({k: _convert(k, v, f"--{k.replace('_', '-')}")
                   for k, v in flags.items() if v is not None and k != "plain"})
    gen = {GENERATION_KEYS[k]: merged.pop(k) for k in list(merged) if k in GENERATION_KEYS}
    engine = {k: merged.pop(k) for k in list(merged) if k in _ENGINE_KEYS}
    for key in ("cache_gb", "host_cache_gb", "memory_gb"):
        engine[key.replace("_gb", "_bytes")] = gib_to_bytes(engine.pop(key, None), key)
    return AppConfig(
        config_file=config_file, plain=bool(flags.get("plain")), gen=SamplingParams(**gen),
        engine=resolve_engine_config(cuda_available, tilelang_available, **engine),
        warnings=tuple(warnings), from_env=frozenset(env_settings), **merged
    )


def gen_problem(gen: Mapping[str, Any]) -> str | None:
    """One line naming what is wrong with the SamplingParams fields in `gen` (the settings'
    ranges, narrower than the engine's: `_KEYS`), e.g. "top_k must be in [0, 1048576] (0 = off),
    got -1", or None when they are valid."""
    for key in ("temperature", "top_p", "top_k", "max_tokens"):
        if key in gen:
            try:
                _KEYS[key].validate(gen[key])
            except ValueError as err:
                return f"{key} {err}"
    return None


def with_gen(config: AppConfig, **changes: Any) -> AppConfig:
    """A copy of `config` with generation settings changed (validated); `changes` are keyed by
    the settings file's names (GENERATION_KEYS: `think` sets `thinking`)."""
    unknown = sorted(set(changes) - set(GENERATION_KEYS))
    if unknown:
        raise SettingsError(f"unknown generation setting {unknown[0]!r} (known: {', '.join(GENERATION_KEYS)})")
    fields_ = {f: getattr(config.gen, f) for f in GENERATION_KEYS.values()}
    fields_.update({GENERATION_KEYS[k]: v for k, v in changes.items()})
    problem = gen_problem(fields_)
    if problem:
        raise SettingsError(problem)
    return replace(config, gen=replace(config.gen, **fields_))


def generation_settings(gen: SamplingParams) -> dict[str, Any]:
    """The settings file's [generation] keys and values for `gen` (GENERATION_KEYS)."""
    return {key: getattr(gen, name) for key, name in GENERATION_KEYS.items()}
