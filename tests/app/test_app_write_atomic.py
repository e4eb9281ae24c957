"""conversation.write_atomic (used by /export, /save and /set save): a symlink is written
through, permission bits are kept, a new file gets the usual mode."""

from __future__ import annotations

import os
import stat

import pytest

from app.conversation import write_atomic


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    real = tmp_path / "dotfiles" / "config.toml"
    real.parent.mkdir()
    real.write_text("old\n")
    os.chmod(real, 0o640)
    link = tmp_path / "config.toml"
    link.symlink_to(real)
    write_atomic(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new\n" and _mode(real) == 0o640
    assert sorted(p.name for p in real.parent.iterdir()) == ["config.toml"]  # no temp file left


def test_an_existing_file_keeps_its_mode_and_a_new_one_gets_the_umask_default(tmp_path, umask_022):
    shared = tmp_path / "shared.md"
    shared.write_text("x")
    os.chmod(shared, 0o664)
    write_atomic(shared, "y")
    assert _mode(shared) == 0o664 and shared.read_text() == "y"
    new = tmp_path / "sub" / "chat.md"
    write_atomic(new, "hello")
    assert _mode(new) == 0o644 and new.read_text() == "hello"


def test_a_symlink_loop_is_an_os_error(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OSError):
        write_atomic(loop, "x")
