"""The converter's command lines live apart from its library (issue 29): converter/cli.py is
`dsv4-convert`, converter/synth_cli.py is `dsv4-synth`; the library modules parse no arguments and
convert.py and upgrade.py do not import each other."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from converter import cli, synth_cli

ROOT = Path(__file__).resolve().parents[2]


def _imports(module: str) -> set[str]:
    """Every module `converter/<module>.py` imports (top level or inside functions)."""
    tree = ast.parse((ROOT / "converter" / f"{module}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_python_m_converter_cli_help_runs_and_names_the_command():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "converter.cli", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: dsv4-convert")
    for flag in ("--hf", "--out", "--verify", "--no-resume", "--logits-only", "--upgrade"):
        assert flag in run.stdout


@pytest.mark.parametrize("main, prog", [(cli.main, "dsv4-convert"), (synth_cli.main, "dsv4-synth")])
def test_entry_point_help_exits_0(main, prog, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog}")


@pytest.mark.parametrize("module", ["convert", "synth", "upgrade"])
def test_the_library_modules_parse_no_arguments(module):
    imported = _imports(module)
    assert "argparse" not in imported
    assert not any(name.startswith("converter.cli") or name.startswith("converter.synth_cli")
                   for name in imported)


def test_convert_and_upgrade_do_not_import_each_other():
    assert not any(n.startswith("converter.upgrade") for n in _imports("convert"))
    assert not any(n.startswith("converter.convert") for n in _imports("upgrade"))


def test_pyproject_scripts_point_at_the_cli_modules():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    scripts = {}
    in_scripts = False
    for line in text.splitlines():
        if line.startswith("["):
            in_scripts = line.strip() == "[project.scripts]"
        elif in_scripts and "=" in line:
            name, target = (part.strip().strip('"') for part in line.split("=", 1))
            scripts[name] = target
    assert scripts["dsv4-convert"] == "converter.cli:main"
    assert scripts["dsv4-synth"] == "converter.synth_cli:main"
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func))
