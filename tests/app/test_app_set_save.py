"""/set save: only what /set changed is written, into the [generation] table however the file
spells it; what cannot be edited in place is refused naming the real file."""

from __future__ import annotations

import os

import pytest

from app.commands import parse
from app.controller import Controller, Reply
from app.settings import SettingsError, build_config
from app.settings_writer import save_generation


def _config(path, flags=None, env=None):
    return build_config(flags or {}, env or {}, path, cuda_available=False, tilelang_available=False)


def _controller(path, flags=None, env=None) -> Controller:
    return Controller(_config(path, flags, env), autosave=False)


def test_set_save_writes_only_what_set_changed_not_flags_or_environment(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[generation]\ntop_p = 0.9\n")
    ctl = _controller(path, flags={"max_tokens": 8}, env={"DSV4_TEMPERATURE": "0.1"})
    assert ctl.apply(parse("/set save")) == Reply(
        "nothing to save: no setting was changed with /set KEY VALUE in this session")
    assert path.read_text() == "[generation]\ntop_p = 0.9\n"
    ctl.apply(parse("/set top_k 5"))
    ctl.apply(parse("/set think on"))
    assert ctl.apply(parse("/set save")) == Reply(
        f"saved top_k = 5, think = true to {path} (used from the next start)")
    assert path.read_text() == "[generation]\ntop_p = 0.9\ntop_k = 5\nthink = true\n"
    again = _config(path).gen
    assert (again.top_k, again.thinking, again.top_p) == (5, True, 0.9)
    assert (again.max_tokens, again.temperature) == (512, 0.6)  # the one-offs stayed one-offs


@pytest.mark.parametrize("before, after", [
    ("cache_gb = 20\ngeneration.temperature = 0.5  # warm\ngeneration.system = \"a # b\"\n",
     "cache_gb = 20\ngeneration.temperature = 0.3  # warm\ngeneration.system = \"a # b\"\n"
     "generation.top_k = 5\n"),
    ("# mine\n[ generation ]  # sampling\ntemperature = 0.9 # t\n\n# the end\n",
     "# mine\n[ generation ]  # sampling\ntemperature = 0.3 # t\ntop_k = 5\n\n# the end\n"),
    ("[\"generation\"]\n'top_k' = 3\n", "[\"generation\"]\n'top_k' = 5\ntemperature = 0.3\n"),
    ('io_threads = 2\n[generation]\nsystem = """\n[other]\ntemperature = 1\n"""\n',
     'io_threads = 2\n[generation]\nsystem = """\n[other]\ntemperature = 1\n"""\ntemperature = 0.3\ntop_k = 5\n'),
    ('model = "/m"\n', 'model = "/m"\n\n[generation]\ntemperature = 0.3\ntop_k = 5\n'),
])
def test_the_generation_table_is_found_however_toml_spells_it(tmp_path, before, after):
    path = tmp_path / "config.toml"
    path.write_text(before)
    save_generation(path, {"temperature": 0.3, "top_k": 5})
    assert path.read_text() == after
    gen = _config(path).gen
    assert (gen.temperature, gen.top_k) == (0.3, 5)


@pytest.mark.parametrize("text, message", [
    ("generation = { temperature = 0.5 }\n",
     "{path}: cannot save the settings: [generation] is written inline (generation = {{...}}), which "
     "/set save cannot edit; write it as a [generation] table, one key a line, then /set save again"),
    ("temperature = \n", "{path}: not valid TOML (Invalid value (at line 1, column 15)); fix it, "
                         "then /set save again"),
])
def test_what_cannot_be_edited_is_refused_naming_the_real_file(tmp_path, text, message):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(SettingsError) as info:
        save_generation(path, {"temperature": 0.3})
    assert str(info.value) == message.format(path=path) and ".check" not in str(info.value)
    assert path.read_text() == text and os.listdir(tmp_path) == ["config.toml"]


def test_set_save_through_a_symlinked_settings_file_keeps_the_link(tmp_path):
    real = tmp_path / "dotfiles" / "config.toml"
    real.parent.mkdir()
    real.write_text("cache_gb = 20\n")
    os.chmod(real, 0o644)
    link = tmp_path / "config.toml"
    link.symlink_to(real)
    ctl = _controller(link)
    ctl.apply(parse("/set temperature 0.2"))
    assert ctl.apply(parse("/set save")).error is False
    assert link.is_symlink() and os.stat(real).st_mode & 0o777 == 0o644
    assert real.read_text() == "cache_gb = 20\n\n[generation]\ntemperature = 0.2\n"


def test_set_save_says_when_the_environment_overrides_the_saved_value(tmp_path):
    """A DSV4_<KEY> variable wins over the file at every start: /set save still writes the value,
    and its one line says which variable will override it and how to let the saved one apply."""
    path = tmp_path / "config.toml"
    path.write_text("[generation]\ntemperature = 0.9\n")
    ctl = _controller(path, env={"DSV4_TEMPERATURE": "0.1", "DSV4_TOP_P": "0.5"})
    ctl.apply(parse("/set temperature 0.3"))
    ctl.apply(parse("/set top_k 5"))
    assert ctl.apply(parse("/set save")) == Reply(
        f"saved temperature = 0.3, top_k = 5 to {path} (used from the next start); but DSV4_TEMPERATURE is "
        "set in the environment and overrides the saved temperature at every start: unset it to use the "
        "saved value")
    assert path.read_text() == "[generation]\ntemperature = 0.3\ntop_k = 5\n"
    assert _config(path, env={"DSV4_TEMPERATURE": "0.1"}).gen.temperature == 0.1  # what the note says
    assert _config(path).gen.temperature == 0.3
    both = _controller(path, env={"DSV4_TEMPERATURE": "0.1", "DSV4_TOP_K": "2"})
    both.apply(parse("/set top_k 7"))
    both.apply(parse("/set temperature 0.4"))
    assert both.apply(parse("/set save")).text.endswith(
        "; but DSV4_TOP_K and DSV4_TEMPERATURE are set in the environment and override the saved top_k, "
        "temperature at every start: unset them to use the saved values")


@pytest.mark.parametrize("before, after", [
    ("# mine\r\ncache_gb = 20\r\n\r\n[generation]\r\ntemperature = 0.9  # warm\r\n",
     "# mine\r\ncache_gb = 20\r\n\r\n[generation]\r\ntemperature = 0.3  # warm\r\ntop_k = 5\r\n"),
    ('model = "/m"\r\n', 'model = "/m"\r\n\r\n[generation]\r\ntemperature = 0.3\r\ntop_k = 5\r\n'),
    # mixed endings: each kept line keeps its own, new lines take the first line's
    ("cache_gb = 1\r\nio_threads = 2\n[generation]\r\ntop_k = 1",
     "cache_gb = 1\r\nio_threads = 2\n[generation]\r\ntop_k = 5\r\ntemperature = 0.3\r\n"),
    # a raw U+2028 inside a string is no line break
    ('system = "a\u2028b"\n[generation]\n', 'system = "a\u2028b"\n[generation]\ntemperature = 0.3\ntop_k = 5\n'),
])
def test_set_save_keeps_the_files_line_endings(tmp_path, before, after):
    path = tmp_path / "config.toml"
    path.write_bytes(before.encode())
    save_generation(path, {"temperature": 0.3, "top_k": 5})
    assert path.read_bytes() == after.encode()
    gen = _config(path).gen
    assert (gen.temperature, gen.top_k) == (0.3, 5)
