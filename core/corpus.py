"""The built-in offline corpus: docstrings of the Python standard library.

Why this one: it is real English prose written by people (explanations, caveats, examples), it is
present on every machine that can run the toolkit so it needs no download, its licence (PSF)
allows the use, and it is large enough (about 1 MB of text, ~250K SmolLM2 tokens) for a demo.
Held-out text comes from different *files* than training text (a stable hash of the file's path
decides), so evaluation never sees a training docstring.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sysconfig
from pathlib import Path

BUILTIN = "builtin:stdlib-docs"
_MIN_DOC_CHARS = 300


def heldout(key: str, fraction: float) -> bool:
    """A stable coin flip per ``key``: True for about ``fraction`` of keys."""
    h = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)
    return (h % 10_000) < fraction * 10_000


def stdlib_docs(split: str, heldout_fraction: float = 0.1) -> list[str]:
    """Docstrings (≥ 300 chars) of the standard library's modules, classes and functions."""
    return list(_stdlib_docs(split, heldout_fraction))


@functools.lru_cache(maxsize=4)
def _stdlib_docs(split: str, heldout_fraction: float) -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "__pycache__"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip & set(rel.parts):
            continue
        if heldout(str(rel), heldout_fraction) != (split == "eval"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef)))]
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= _MIN_DOC_CHARS:
                docs.append(doc)
    return tuple(docs)
