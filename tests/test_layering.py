"""Packages import only downwards: app -> converter -> engine -> kernels (issue 29).

Every import statement of every module is read with `ast`, including the ones inside functions
(a lazy import is still a dependency). bench/ and tests/ sit above everything and are not checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("app", "converter", "engine", "kernels")  # each may import itself and those after it


def imported_packages(source: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def upward_imports(package: str, source: str) -> list[tuple[int, str]]:
    """The imports in a module of `package` that name a package above it in ORDER."""
    above = ORDER[:ORDER.index(package)]
    return [(line, name) for line, name in imported_packages(source) if name in above]


def test_no_package_imports_one_above_it():
    problems = []
    for package in ORDER:
        files = sorted((ROOT / package).rglob("*.py"))
        assert files, f"package {package}/ has no modules"
        for path in files:
            for line, name in upward_imports(package, path.read_text(encoding="utf-8")):
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {name} "
                                f"(order {' -> '.join(ORDER)})")
    assert not problems, "\n".join(problems)


def test_the_check_sees_top_level_lazy_and_from_imports():
    source = ("import kernels.reference\nfrom engine.pack import VERSION\n"
              "def f():\n    import converter.convert\n    from app import demo\n"
              "from . import sibling\n")
    assert upward_imports("engine", source) == [(4, "converter"), (5, "app")]
    assert upward_imports("kernels", source) == [(2, "engine"), (4, "converter"), (5, "app")]
    assert upward_imports("app", source) == []


def test_every_name_imported_from_kernels_exists():
    """The GPU tests, the benches and the TileLang backend import kernel modules where CPU runs
    never go: every `from kernels.X import name`, `X.name` after `from kernels import X`, and
    module name "kernels.X" (kernels/backend.py's table) in the tree must still resolve, so that a
    renamed kernel module or function is caught on the CPU."""
    import importlib

    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        if ".venv" in path.parts or not {"app", "bench", "converter", "engine", "kernels", "tests"} & {
                path.relative_to(ROOT).parts[0]}:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {}  # local name -> kernels module, from `from kernels import X [as Y]`
        wanted = []  # (line, module, attribute)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "kernels":
                    for a in node.names:
                        wanted.append((node.lineno, "kernels", a.name))
                        aliases[a.asname or a.name] = f"kernels.{a.name}"
                elif node.module.startswith("kernels."):
                    wanted += [(node.lineno, node.module, a.name) for a in node.names]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"kernels\.\w+", node.value)):  # importlib.import_module("kernels.X")
                wanted.append((node.lineno, node.value, None))
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                wanted.append((node.lineno, aliases[node.value.id], node.attr))
        for line, module, name in wanted:
            try:
                mod = importlib.import_module(module)
                if module == "kernels":
                    importlib.import_module(f"kernels.{name}")
                elif name is not None and not hasattr(mod, name):
                    raise AttributeError(name)
            except (ImportError, AttributeError) as e:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {module}{'.' + name if name else ''} ({e!r})")
    assert not problems, "\n".join(problems)


def test_no_private_kernel_name_is_imported_from_another_file():
    """A `_name` of a kernels module is that module's own: no other file imports it."""
    problems = []
    for package in ("app", "bench", "converter", "engine", "kernels", "tests"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] == "kernels"):
                    problems += [f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
                                 for a in node.names if a.name.startswith("_")]
    assert not problems, "\n".join(problems)
