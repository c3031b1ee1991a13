"""What several test modules share that is not library code."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that imports the checkout: ``ROOT`` first on ``PYTHONPATH``, whatever
    the caller's own ``PYTHONPATH`` holds kept after it (replacing it would hide packages installed there)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
