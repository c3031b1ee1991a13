"""Layer pairs for the hidden-state and attention-map terms, declared as data.

A pair list is a list of strings:

* ``"s:t"`` — student layer ``s`` ↔ teacher layer ``t`` (0-based, negative counts from the end);
* ``"relative"`` — every student layer ``l`` ↔ teacher layer ``round((l+1)·L_t/L_s) − 1``
  (the depth fraction matches; the last layers always pair);
* ``"derived"`` — for a student made by :func:`distill.student.derive_student`: student layer
  ``i`` (teacher layer ``keep[i]``) ↔ the last teacher layer before the next kept one, so each
  student block learns the output of the teacher span it replaced.

The index of a layer's output is the decoder layer's output (the residual stream after it).
"""

from __future__ import annotations

from collections.abc import Sequence

from core.config import ConfigError


class LayerMapError(ConfigError):
    """A layer pair that does not fit the models."""


def relative_pairs(n_student: int, n_teacher: int) -> list[tuple[int, int]]:
    return [(s, max(0, round((s + 1) * n_teacher / n_student) - 1)) for s in range(n_student)]


def derived_pairs(kept: Sequence[int], n_teacher: int) -> list[tuple[int, int]]:
    """Student layer i replaced teacher layers ``kept[i] .. kept[i+1]-1``: pair it with the last."""
    bounds = list(kept[1:]) + [n_teacher]
    return [(i, b - 1) for i, b in enumerate(bounds)]


def _index(value: str, n: int, side: str, item: str) -> int:
    try:
        idx = int(value)
    except ValueError:
        raise LayerMapError(f"layer pair '{item}': '{value}' is not an integer; write pairs as 's:t'") from None
    if not -n <= idx < n:
        raise LayerMapError(
            f"layer pair '{item}': {side} layer {idx} is out of range for a {n}-layer {side}; "
            f"use 0..{n - 1} (or negative from the end)"
        )
    return idx % n


def parse_layer_pairs(spec: Sequence[str], n_student: int, n_teacher: int,
                      kept: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """``["15:20"]`` / ``["relative"]`` / ``["derived"]`` → sorted unique ``(student, teacher)`` pairs."""
    pairs: list[tuple[int, int]] = []
    for item in spec:
        item = str(item).strip()
        if item == "relative":
            pairs.extend(relative_pairs(n_student, n_teacher))
        elif item == "derived":
            if kept is None:
                raise LayerMapError(
                    "layer map 'derived' needs a student made by derive_student (its config records the kept "
                    "layers); use 'relative' or explicit 's:t' pairs"
                )
            pairs.extend(derived_pairs(kept, n_teacher))
        elif ":" in item:
            s, t = item.split(":", 1)
            pairs.append((_index(s, n_student, "student", item), _index(t, n_teacher, "teacher", item)))
        else:
            raise LayerMapError(f"cannot read layer pair '{item}'; use 's:t', 'relative' or 'derived'")
    return sorted(set(pairs))
