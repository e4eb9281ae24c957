"""Application settings: one `AppConfig` merged from flags > environment > TOML file > defaults.

The settings file is TOML, by default `<user config dir>/dsv4-chat/config.toml`:

    model = "/data/dsv4-flash"      # converted model directory (else: newest under data_dir/models)
    data_dir = "/data/dsv4-chat"    # converted models, transcripts, saved conversations
    cache_gb = 40                    # expert-cache budget (GiB); absent = sized automatically
    numerics = "native"              # or "exact"
    device = "cuda"                  # or "cpu"; absent = cuda when available
    backend = "tilelang"             # GPU kernels, or "torch"; absent = tilelang on CUDA when installed
    cuda_graphs = true               # replay decode steps from CUDA graphs (CUDA, converted model)
    cache_policy = "lfu"
    io_threads = 8
    max_seq_len = 4096

    [generation]
    temperature = 0.6
    top_p = 1.0
    top_k = 0
    max_tokens = 512
    think = false
    system = ""

Every key may also come from the environment as `DSV4_<KEY>` (upper case, e.g.
`DSV4_CACHE_GB=20`, `DSV4_TEMPERATURE=0.2`); `DSV4_CONFIG` names the settings file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged
    import tomli as tomllib

import platformdirs

APP_NAME = "dsv4-chat"


class SettingsError(ValueError):
    """A setting has a bad value; the message names the setting, its source and the fix."""


@dataclass(frozen=True)
class GenParams:
    """Sampling settings the user controls with `/set`; mirrors engine.sampling.SamplingParams."""

    temperature: float = 0.6
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    think: bool = False


@dataclass(frozen=True)
class AppConfig:
    """Everything the app needs to start; built once by `load_config`."""

    data_dir: Path
    config_file: Path | None = None
    model: Path | None = None
    demo: bool = False
    plain: bool = False
    cache_gb: float | None = None
    numerics: str = "native"
    device: str | None = None
    backend: str | None = None
    cuda_graphs: bool = True
    cache_policy: str = "lfu"
    io_threads: int = 8  # see EngineConfig.io_threads
    max_seq_len: int = 4096
    system: str = ""
    gen: GenParams = field(default_factory=GenParams)

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def transcripts_dir(self) -> Path:
        return self.data_dir / "transcripts"

    @property
    def saved_dir(self) -> Path:
        return self.data_dir / "saved"


def _to_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


def _choice(*allowed: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return text

    return check


def _positive(kind: type) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise ValueError(f"must be > 0, got {text}")
        return value

    return check


def _path(text: str) -> Path:
    return Path(text).expanduser()


# Settable keys: name -> converter from text (environment) or TOML value (via str()).
_KEYS: dict[str, Callable[[str], Any]] = {
    "model": _path,
    "data_dir": _path,
    "demo": _to_bool,
    "cache_gb": _positive(float),
    "numerics": _choice("native", "exact"),
    "device": _choice("cpu", "cuda"),
    "backend": _choice("torch", "tilelang"),
    "cuda_graphs": _to_bool,
    "cache_policy": str,
    "io_threads": _positive(int),
    "max_seq_len": _positive(int),
    "system": str,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_tokens": _positive(int),
    "think": _to_bool,
}
_GEN_KEYS = {f.name for f in fields(GenParams)}


def default_config_file() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME)) / "config.toml"


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP_NAME))


def _convert(key: str, raw: Any, source: str) -> Any:
    if key not in _KEYS:
        known = ", ".join(sorted(_KEYS))
        raise SettingsError(f"{source}: unknown setting {key!r} (known: {known})")
    text = str(raw).lower() if isinstance(raw, bool) else str(raw)
    try:
        return _KEYS[key](text)
    except ValueError as err:
        raise SettingsError(f"{source}: bad value for {key!r}: {err}") from None


def read_file_settings(path: Path) -> dict[str, Any]:
    """Settings from a TOML file (`[generation]` keys flattened); {} if the file is absent."""
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as err:
        raise SettingsError(f"{path}: not valid TOML ({err}); fix or delete the file") from None
    flat = dict(data)
    gen = flat.pop("generation", {})
    if not isinstance(gen, dict):
        raise SettingsError(f"{path}: 'generation' must be a table ([generation])")
    flat.update(gen)
    return {key: _convert(key, value, str(path)) for key, value in flat.items()}


def read_env_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """Settings from `DSV4_<KEY>` environment variables (DSV4_CONFIG is not a setting)."""
    out = {}
    for name, value in env.items():
        if name.startswith("DSV4_") and name != "DSV4_CONFIG":
            key = name[len("DSV4_") :].lower()
            out[key] = _convert(key, value, f"environment {name}")
    return out


def build_config(
    flags: Mapping[str, Any], env: Mapping[str, str], config_file: Path | None = None
) -> AppConfig:
    """Merge the sources: flags (None = not given) > env > file > defaults; validate."""
    if config_file is None:
        env_file = env.get("DSV4_CONFIG")
        config_file = _path(env_file) if env_file else default_config_file()
    merged: dict[str, Any] = {"data_dir": default_data_dir()}
    merged.update(read_file_settings(config_file))
    merged.update(read_env_settings(env))
    merged.update({k: _convert(k, v, f"--{k.replace('_', '-')}")
                   for k, v in flags.items() if v is not None and k != "plain"})
    gen = GenParams(**{k: merged.pop(k) for k in list(merged) if k in _GEN_KEYS})
    problem = gen_problem(gen)
    if problem:
        raise SettingsError(f"generation settings: {problem}")
    return AppConfig(
        config_file=config_file, plain=bool(flags.get("plain")), gen=gen, **merged
    )


def gen_problem(gen: GenParams) -> str | None:
    """One line naming what is wrong with `gen`, or None when it is valid."""
    if not 0.0 <= gen.temperature <= 2.0:
        return f"temperature must be in [0, 2], got {gen.temperature}"
    if not 0.0 < gen.top_p <= 1.0:
        return f"top_p must be in (0, 1], got {gen.top_p}"
    if gen.top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {gen.top_k}"
    if gen.max_tokens < 1:
        return f"max_tokens must be >= 1, got {gen.max_tokens}"
    return None


def with_gen(config: AppConfig, **changes: Any) -> AppConfig:
    """A copy of `config` with generation settings changed (validated)."""
    gen = replace(config.gen, **changes)
    problem = gen_problem(gen)
    if problem:
        raise SettingsError(problem)
    return replace(config, gen=gen)


def engine_config_kwargs(config: AppConfig, cuda_available: bool, tilelang_available: bool = False) -> dict[str, Any]:
    """Keyword arguments for engine.config.EngineConfig built from the app settings: on CUDA the
    TileLang kernels are the default backend when the package is installed."""
    device = config.device or ("cuda" if cuda_available else "cpu")
    backend = config.backend or ("tilelang" if device == "cuda" and tilelang_available else "torch")
    return {
        "device": device,
        "backend": backend,
        "cuda_graphs": config.cuda_graphs,
        "numerics": config.numerics,
        "cache_policy": config.cache_policy,
        "io_threads": config.io_threads,
        "max_seq_len": config.max_seq_len,
        "cache_bytes": None if config.cache_gb is None else int(config.cache_gb * 2**30),
    }
