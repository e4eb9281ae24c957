"""Settings out of range: one line naming the source (DSV4_<KEY>, the file, the flag), the setting,
the value, the allowed range and the fix, for every source alike; top_k, max_tokens and io_threads
have a documented maximum; a data_dir that cannot be a directory is a settings error at start."""

from __future__ import annotations

import pytest

from app.__main__ import main
from app.commands import parse
from app.controller import Controller, Reply
from app.demo import ensure_demo_model
from app.settings import MAX_IO_THREADS, MAX_TOKENS, MAX_TOP_K, SettingsError, build_config
from app.wizard import WizardError

BIG = 2**64  # past any 64-bit integer


@pytest.fixture(autouse=True)
def _no_user_dirs(tmp_path, monkeypatch):
    """No user settings file or data dir: a test that reached model work would write nothing there."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    for name in ("DSV4_CONFIG", "DSV4_DATA_DIR", "DSV4_IO_THREADS", "DSV4_TEMPERATURE"):
        monkeypatch.delenv(name, raising=False)


def _build(tmp_path, flags=None, env=None, config_file=None):
    return build_config(flags or {}, env or {}, config_file or tmp_path / "absent.toml",
                        cuda_available=False, tilelang_available=False)


@pytest.mark.parametrize("name, value, problem", [
    ("DSV4_TEMPERATURE", "-1", "must be in [0, 2], got -1.0"),
    ("DSV4_TEMPERATURE", "nan", "must be in [0, 2], got nan"),
    ("DSV4_TOP_P", "5", "must be in (0, 1], got 5.0"),
    ("DSV4_TOP_K", "-3", f"must be in [0, {MAX_TOP_K}] (0 = off), got -3"),
    ("DSV4_MAX_TOKENS", "0", f"must be in [1, {MAX_TOKENS}], got 0"),
    ("DSV4_IO_THREADS", "0", f"must be in [1, {MAX_IO_THREADS}], got 0"),
])
def test_an_out_of_range_environment_value_names_the_variable_the_range_and_the_fix(tmp_path, name, value, problem):
    key = name[len("DSV4_"):].lower()
    with pytest.raises(SettingsError) as info:
        _build(tmp_path, env={name: value})
    assert str(info.value) == (f"environment {name}: bad value for {key!r}: {problem}; "
                               f"set {name} to a valid value or unset it")


def test_an_out_of_range_value_names_its_file_or_flag_too(tmp_path, capsys, monkeypatch):
    path = tmp_path / "config.toml"
    path.write_text("[generation]\ntemperature = -1\n")
    with pytest.raises(SettingsError) as info:
        _build(tmp_path, config_file=path)
    assert str(info.value) == (f"{path}: bad value for 'temperature': must be in [0, 2], got -1.0; "
                               "correct 'temperature' in this file or remove it")
    assert main(["--temperature", "3"]) == 2
    assert capsys.readouterr().err == ("dsv4-chat: --temperature: bad value for 'temperature': must be in "
                                       "[0, 2], got 3.0; give --temperature a valid value or leave it out\n")


@pytest.mark.parametrize("key", ["top_k", "max_tokens"])
def test_top_k_and_max_tokens_past_their_maximum_are_refused_from_every_source(tmp_path, key):
    limit = {"top_k": MAX_TOP_K, "max_tokens": MAX_TOKENS}[key]
    assert getattr(_build(tmp_path, env={f"DSV4_{key.upper()}": str(limit)}).gen, key) == limit
    for value in (limit + 1, 2**63, BIG):
        with pytest.raises(SettingsError, match=rf"^environment DSV4_{key.upper()}: bad value for '{key}': "
                                                rf"must be in \[\d, {limit}\]"):
            _build(tmp_path, env={f"DSV4_{key.upper()}": str(value)})
        path = tmp_path / "config.toml"
        path.write_text(f"[generation]\n{key} = {value}\n")
        with pytest.raises(SettingsError, match=rf"^{path}: bad value for '{key}': must be in \[\d, {limit}\]"):
            _build(tmp_path, config_file=path)
    with pytest.raises(SettingsError, match=rf"^--max-tokens: bad value for 'max_tokens': must be in \[1, {MAX_TOKENS}\]"):
        _build(tmp_path, flags={"max_tokens": BIG})


@pytest.mark.parametrize("key", ["top_k", "max_tokens"])
def test_set_refuses_top_k_and_max_tokens_past_their_maximum_and_keeps_the_value(tmp_path, key):
    ctl = Controller(_build(tmp_path), autosave=False)
    before = ctl.gen
    reply = ctl.apply(parse(f"/set {key} {BIG}"))
    assert isinstance(reply, Reply) and reply.error and "\n" not in reply.text
    assert reply.text.startswith(f"{key} must be in [") and reply.text.endswith(f"got {BIG}")
    assert ctl.gen == before


def test_too_many_io_threads_is_a_settings_error_not_a_model_load_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DSV4_IO_THREADS", "1000000")
    assert main(["run", "--demo", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"dsv4-chat: environment DSV4_IO_THREADS: bad value for 'io_threads': must be in [1, {MAX_IO_THREADS}], "
        "got 1000000; set DSV4_IO_THREADS to a valid value or unset it\n")


def test_a_data_dir_that_is_a_file_is_a_settings_error_naming_the_setting_and_the_fix(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(SettingsError) as info:
        _build(tmp_path, env={"DSV4_DATA_DIR": str(blocker)})
    assert str(info.value) == (f"environment DSV4_DATA_DIR: bad value for 'data_dir': {blocker} is a file, "
                               "not a directory; set DSV4_DATA_DIR to a valid value or unset it")
    path = tmp_path / "config.toml"
    path.write_text(f'data_dir = "{blocker / "inside"}"\n')
    with pytest.raises(SettingsError) as info:
        _build(tmp_path, config_file=path)
    assert str(info.value) == (f"{path}: bad value for 'data_dir': {blocker / 'inside'} is inside {blocker}, "
                               "a file, not a directory; correct 'data_dir' in this file or remove it")
    monkeypatch.setenv("DSV4_DATA_DIR", str(blocker))
    assert main(["run", "--demo", "hi"]) == 2  # before any model work: no "cannot load the model"
    err = capsys.readouterr().err
    assert err.startswith("dsv4-chat: environment DSV4_DATA_DIR: bad value for 'data_dir'") and err.count("\n") == 1
    assert blocker.read_text() == "x"
    assert _build(tmp_path, env={"DSV4_DATA_DIR": str(tmp_path / "new" / "dir")}).data_dir == tmp_path / "new" / "dir"


def test_a_data_dir_the_demo_cannot_be_built_in_names_the_setting_and_the_fix(tmp_path):
    """The check at start cannot know every refusal (a read-only mount, /sys): the demo build,
    which must write there, names data_dir and the fix, not a model load error."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    data_dir = blocker / "data"
    with pytest.raises(WizardError) as info:
        ensure_demo_model(data_dir, lambda p: None, build=lambda work, out, progress: None)
    assert str(info.value) == (f"cannot write the data dir {data_dir} (Not a directory): set data_dir "
                               "(DSV4_DATA_DIR, or data_dir in the settings file) to a directory you can write")
