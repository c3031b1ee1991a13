"""The package layout holds: packages depend downward only, and no function grows past a page."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a package may import only itself and packages to its left.
ORDER = ("attention", "core", "eval", "serve", "distill")
MAX_FUNCTION_LINES = 100


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level module)`` of every import in ``path``, at module level or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", ORDER)
def test_packages_import_only_downward(package):
    allowed = set(ORDER[: ORDER.index(package) + 1])
    ours = set(ORDER) | {"recipes", "bench", "tests"}
    upward = [f"{path.relative_to(ROOT)}:{line} imports {mod}"
              for path in _package_files(package) for line, mod in _imports(path)
              if mod in ours and mod not in allowed]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_order_check_would_see_an_upward_import(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from serve.engine import Engine\n")
    assert _imports(bad) == [(2, "serve")]


def test_recipes_import_the_library_like_any_script():
    for path in sorted((ROOT / "recipes").glob("*.py")):
        text = path.read_text()
        assert "sys.path.insert" not in text, f"{path.name} inserts a path"
        assert "noqa: E402" not in text, f"{path.name} marks imports noqa: E402"


def test_no_function_longer_than_a_page():
    long = []
    for package in (*ORDER, "recipes"):
        for path in _package_files(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over a page:\n" + "\n".join(long)
