"""Packages import only downwards: app -> converter -> engine -> kernels (issue 29).

Every import statement of every module is read with `ast`, including the ones inside functions
(a lazy import is still a dependency). bench/ and tests/ sit above everything and are not checked.
"""

from __future__ import annotations

import ast
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
