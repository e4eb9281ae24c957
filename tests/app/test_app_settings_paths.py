"""Path settings and the settings file's name: empty values refused from every source, and a name
the system refuses (too long, a directory) reported in one line, never a traceback."""

from __future__ import annotations

import pytest

from app.__main__ import main
from app.settings import SettingsError, build_config

LONG = "x" * 300  # longer than NAME_MAX (255): os.stat raises ENAMETOOLONG


def _build(flags=None, env=None, config_file=None):
    return build_config(flags or {}, env or {}, config_file, cuda_available=False, tilelang_available=False)


@pytest.fixture(autouse=True)
def _no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("DSV4_CONFIG", raising=False)


@pytest.mark.parametrize("name", ["DSV4_DATA_DIR", "DSV4_MODEL"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_path_variable_is_refused_not_the_current_directory(name, value):
    key = name[len("DSV4_"):].lower()
    with pytest.raises(SettingsError) as info:
        _build(env={name: value})
    assert str(info.value) == (f"environment {name}: bad value for {key!r}: empty path {value!r} (it is not "
                               f"taken as the current directory); set {name} to a valid value or unset it")


@pytest.mark.parametrize("key", ["data_dir", "model"])
def test_an_empty_path_in_the_settings_file_is_refused(tmp_path, key):
    path = tmp_path / "config.toml"
    path.write_text(f'{key} = ""\n')
    with pytest.raises(SettingsError) as info:
        _build(config_file=path)
    assert str(info.value) == (f"{path}: bad value for {key!r}: empty path '' (it is not taken as the "
                               f"current directory); correct {key!r} in this file or remove it")


def test_an_empty_model_flag_is_refused(capsys, tmp_path):
    assert main(["run", "--demo", "--model", "", "hi"]) == 2
    assert capsys.readouterr().err == ("dsv4-chat: --model: bad value for 'model': empty path '' (it is not "
                                       "taken as the current directory); give --model a valid value or "
                                       "leave it out\n")


def test_an_empty_settings_file_name_is_refused_from_flag_and_environment(capsys, tmp_path, monkeypatch):
    default = tmp_path / "config" / "dsv4-chat" / "config.toml"
    with pytest.raises(SettingsError) as info:
        _build(env={"DSV4_CONFIG": ""})
    assert str(info.value) == f"DSV4_CONFIG is empty: name the settings file (TOML), or unset it to use {default}"
    assert main(["run", "--demo", "--config", "", "hi"]) == 2
    assert capsys.readouterr().err == (
        f"dsv4-chat: --config is empty: name the settings file (TOML), or leave it out to use {default}\n")


def test_a_settings_file_name_too_long_is_one_line(capsys, monkeypatch):
    assert main(["run", "--demo", "--config", LONG, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4-chat: --config xxx") and err.endswith(
        ": cannot use this path (File name too long)\n") and err.count("\n") == 1
    monkeypatch.setenv("DSV4_CONFIG", LONG)
    assert main(["run", "--demo", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4-chat: DSV4_CONFIG xxx") and err.endswith(
        ": cannot use this path (File name too long)\n") and len(err) < 200


def test_a_directory_as_settings_file_is_named_a_directory(capsys, tmp_path):
    assert main(["run", "--demo", "--config", str(tmp_path), "hi"]) == 2
    assert capsys.readouterr().err == (
        f"dsv4-chat: --config {tmp_path}: is a directory; name the settings file (TOML) in it\n")
