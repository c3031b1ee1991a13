"""What a run ran under: Python, the numerics-relevant packages, the toolkit's commit and the device.

Every ``summary.json`` and checkpoint records it, and so does every benchmark's JSON last line. A rerun on
one install reproduces a run to every digit, but the pyproject ranges let a rebuilt install pull newer releases,
and the demo has given two different students from the same command on rebuilt installs: two results are
comparable only when these records agree. :func:`differences` names what changed, for the warning on resume
and the note in ``--compare``.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

# The distributions whose versions can change a run's numbers (kernels, tokenization, model code, data).
PACKAGES = ("torch", "transformers", "tokenizers", "accelerate", "datasets", "safetensors", "peft", "numpy",
            "deepspeed", "gguf")
_REPO = Path(__file__).resolve().parents[1]


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``; None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_commit(repo: Path = _REPO) -> str | None:
    """The git commit the toolkit runs from, ``+dirty`` when tracked files changed since; None outside a checkout."""
    if not (repo / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git on the machine, or a broken checkout
        return None
    return head + ("+dirty" if dirty else "")


def environment() -> dict[str, Any]:
    """This process's environment, JSON-ready."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hybrid_distill": package_version("hybrid-distill"),
        "commit": source_commit(),
        "packages": {name: package_version(name) for name in PACKAGES},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cuda": torch.version.cuda,
    }


def differences(before: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """What differs between two :func:`environment` records, e.g. ``["transformers 5.25.0 -> 5.26.0"]``.

    The OS string is left out (a kernel update does not change the numbers); a record that is missing (an older
    checkpoint or log) has nothing to compare, so it gives no differences.
    """
    if not before or not now:
        return []
    out = []
    for key in ("python", "hybrid_distill", "commit", "device", "cuda"):
        if before.get(key) != now.get(key):
            out.append(f"{key} {before.get(key)} -> {now.get(key)}")
    old, new = before.get("packages", {}), now.get("packages", {})
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            out.append(f"{name} {old.get(name) or 'absent'} -> {new.get(name) or 'absent'}")
    return out


def finite_or_null(value: Any) -> Any:
    """``value`` with every float that is not finite, at any depth of dicts, lists and tuples, made None.

    ``json.dumps`` writes such a float as ``NaN`` or ``Infinity``, which Python reads back but strict JSON
    readers (``jq``, browsers, most languages) refuse; null is what they read as "not measured".
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def json_line(result: dict[str, Any]) -> str:
    """A benchmark's JSON last line: ``result`` with the environment it was measured under (key ``environment``),
    as strict JSON (a quantity an arm did not measure, NaN in Python, is written null: :func:`finite_or_null`)."""
    return json.dumps(finite_or_null({**result, "environment": environment()}), allow_nan=False)
