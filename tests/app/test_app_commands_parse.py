"""The slash-command parser: pure functions, no app."""

from __future__ import annotations

import pytest

from app import controller
from app.commands import (
    REGISTRY,
    Command,
    CommandError,
    ExportArgs,
    PinArgs,
    SaveArgs,
    SetArgs,
    complete,
    help_lines,
    is_command,
    message_text,
    parse,
    parse_keys,
)


def test_every_registered_command_has_a_handler_and_help():
    assert controller.HANDLERS.keys() == REGISTRY.keys()
    lines = help_lines()
    assert len(lines) == len(REGISTRY)
    for name in REGISTRY:
        assert any(line.startswith(f"/{name}") for line in lines), name


@pytest.mark.parametrize("line, expected", [
    ("/help", Command("help")),
    ("/new", Command("new")),
    ("/QUIT", Command("quit")),
    ("/system You are terse.", Command("system", "You are terse.")),
    ("/system", Command("system", "")),
    ("/set", Command("set", SetArgs(None))),
    ("/set temperature 0.2", Command("set", SetArgs("temperature", 0.2))),
    ("/set top_p 0.9", Command("set", SetArgs("top_p", 0.9))),
    ("/set top_k 40", Command("set", SetArgs("top_k", 40))),
    ("/set max_tokens 128", Command("set", SetArgs("max_tokens", 128))),
    ("/set think on", Command("set", SetArgs("think", True))),
    ("/set THINK off", Command("set", SetArgs("think", False))),
    ("/flush", Command("flush")),
    ("/pin hot 4", Command("pin", PinArgs(hot=4))),
    ("/pin 3:17,4:2", Command("pin", PinArgs(keys=((3, 17), (4, 2))))),
    ("/pin 3:17, 4:2", Command("pin", PinArgs(keys=((3, 17), (4, 2))))),
    ("/unpin", Command("unpin", PinArgs())),
    ("/unpin 0:1", Command("unpin", PinArgs(keys=((0, 1),)))),
    ("/stats", Command("stats")),
    ("/save my-chat", Command("save", SaveArgs("my-chat"))),
    ("/save my-chat --force", Command("save", SaveArgs("my-chat", True))),
    ("/save --force my-chat", Command("save", SaveArgs("my-chat", True))),
    ("/load my-chat", Command("load", "my-chat")),
    ("/export out/chat.md", Command("export", ExportArgs("out/chat.md"))),
    ("/export out/chat.md --force", Command("export", ExportArgs("out/chat.md", True))),
    ("/export --force my chat.md", Command("export", ExportArgs("my chat.md", True))),
    ("/export my  two  spaces.md", Command("export", ExportArgs("my  two  spaces.md"))),
    ("/set save", Command("set", SetArgs("save"))),
    ("/model", Command("model", "")),
    ("/model alpha", Command("model", "alpha")),
    ("/history", Command("history", None)),
    ("/history 3", Command("history", 3)),
    ("/regen", Command("regen")),
    ("/undo", Command("undo")),
    ("  /stats  ", Command("stats")),
])
def test_parse_valid(line, expected):
    assert parse(line) == expected


@pytest.mark.parametrize("line, fragment", [
    ("/bogus", "unknown command /bogus"),
    ("/flsh", "did you mean /flush"),
    ("/", "unknown command /"),
    ("/set temperature", "usage: /set temperature VALUE"),
    ("/set temperature hot", "temperature must be a number, got 'hot'"),
    ("/set top_k 1.5", "top_k must be an integer"),
    ("/set think maybe", "think must be on or off"),
    ("/set color red", "unknown setting 'color'"),
    ("/pin", "usage: /pin hot N"),
    ("/pin hot", "usage: /pin hot N"),
    ("/pin hot 0", "N ≥ 1"),
    ("/pin hot x", "usage: /pin hot N"),
    ("/pin 3-17", "bad expert '3-17': write LAYER:EXPERT"),
    ("/pin 3:x", "bad expert '3:x'"),
    ("/unpin 1:2:3", "bad expert '1:2:3'"),
    ("/save", "missing a name"),
    ("/save --force", "missing a name: /save NAME [--force]"),
    ("/save my chat", "one name, no spaces: /save NAME [--force] (got 'my chat')"),
    ("/load", "missing a name"),
    ("/export", "missing a file"),
    ("/export --force", "missing a file"),
    ("/set save now", "usage: /set save"),
    ("/history x", "usage: /history [N]"),
    ("/history 0", "usage: /history [N]"),
    ("/flush now", "/flush takes no arguments"),
    ("/quit please", "/quit takes no arguments"),
])
def test_parse_errors_are_one_line(line, fragment):
    with pytest.raises(CommandError) as info:
        parse(line)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_is_command_and_escape():
    assert is_command("/help")
    assert not is_command("hello /help")
    assert not is_command("//not a command")
    assert message_text("//not a command") == "/not a command"
    assert message_text("hello /help") == "hello /help"


def test_parse_keys_rejects_empty():
    with pytest.raises(CommandError, match="no experts given"):
        parse_keys(" , ")


def test_complete():
    assert complete("/s") == ["/system", "/set", "/stats", "/save"]
    assert complete("/fl") == ["/flush"]
    assert complete("/x") == []
    assert len(complete("/")) == len(REGISTRY)
