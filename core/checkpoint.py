"""Training checkpoints that a kill can never leave half-written.

A checkpoint is written into ``checkpoints/.tmp-step-N`` and renamed to ``checkpoints/step-N``
only once every file is on disk (and ``COMPLETE`` marks it), so ``resume=latest`` can only pick a
whole one. Layout of ``step-N/``: the accelerate state (``model.safetensors`` with ``student.*`` and
``projectors.*`` keys, optimizer, scheduler, RNG states), ``student/`` (the student's config,
generation config and tokenizer: enough to rebuild it for export), ``config.yaml`` (the resolved
recipe config) and ``trainer_state.json`` (step, loss history, initial metrics, and the number of
processes and global batch that wrote it: a resume must run on as many processes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from core.config import ConfigError
from core.fsio import replace_dir, restore_aside

COMPLETE = "COMPLETE"
_STEP = re.compile(r"^step-(\d+)$")


class CheckpointError(ConfigError):
    """A missing, torn or foreign checkpoint."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Whole checkpoints, oldest first (temporary or unmarked folders are ignored)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


class TrainingDiverged(ConfigError):
    """The loss became NaN/inf; the last good checkpoint is kept."""

    exit_code = 3


class NonFiniteWeights(TrainingDiverged):
    """A step left NaN/inf in the trained weights (its loss was still finite); its checkpoint is refused."""


def _local_shard(p: torch.Tensor) -> torch.Tensor:
    """What this process holds of parameter ``p``, and what its checkpoint saves: under DeepSpeed ZeRO-3 the
    partition in ``ds_tensor``; elsewhere the tensor itself.

    Under ZeRO-3 the partition is read even while the full parameter is gathered (persistent small parameters, or
    one still held after a forward): the optimizer step writes the partition, and the gathered copy is the one
    from before that step until the next gather.
    """
    shard = getattr(p, "ds_tensor", None)
    return p if shard is None else shard


def nonfinite_weights(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, str | None]:
    """``(how many tensors hold a NaN/inf, the first such name)`` of ``named`` (this process's shards only).

    One float64 sum per tensor and a single device sync: a NaN or inf anywhere makes the sum non-finite (inf
    and -inf give NaN), and float64 cannot overflow on the sum of finite fp32/bf16/fp16 values. No mask the
    size of the tensor is allocated, so the check costs a read of the weights and nothing more.
    """
    names, sums = [], []
    for name, p in named:
        t = _local_shard(p).detach()
        if t.numel() == 0:
            continue
        names.append(name)
        sums.append(torch.sum(t, dtype=torch.float64).reshape(1))
    if not sums:
        return 0, None
    device = sums[0].device
    bad = ~torch.isfinite(torch.cat([s.to(device) for s in sums]))
    count = int(bad.sum())
    return count, (names[int(bad.nonzero()[0])] if count else None)


def refuse_nonfinite(named: Iterable[tuple[str, torch.Tensor]], output_dir: str | Path, step: int,
                     reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Raise :class:`NonFiniteWeights` before checkpoint ``step`` is written if any trained tensor in ``named``
    holds a NaN/inf (an optimizer step that overflowed while the loss it followed was finite).

    Nothing is written and nothing is pruned: the run stops on the newest complete checkpoint before ``step``,
    which the one-line error names. ``reduce`` sums a 1-element tensor over processes (every process must call
    this, with its own shards), so that all of them stop together when one shard is bad.
    """
    count, first = nonfinite_weights(named)
    if reduce is not None:
        count = int(reduce(torch.tensor([float(count)])).item())
    if not count:
        return
    last, resume = last_good(output_dir, step)
    raise NonFiniteWeights(
        f"step {step} left NaN/inf in {count} trained weight tensor(s){f' (first: {first})' if first else ''} "
        f"while its loss was finite; checkpoint step-{step} was not written and none was removed; the last good "
        f"checkpoint is {last or 'none'}: lower lr or enable clipping (max_grad_norm), then {resume}")


def last_good(output_dir: str | Path, step: int) -> tuple[Path | None, str]:
    """The newest complete checkpoint before ``step`` (1-based; the step that went wrong) and how to resume
    from it. After ``resume=`` an older step, later checkpoints of the abandoned steps are still on disk until
    the next save: ``resume=latest`` would go back to them, so those are named by path."""
    good = [p for p in complete_checkpoints(output_dir) if int(_STEP.match(p.name).group(1)) < step]
    last = good[-1] if good else None
    resume = ("start again without resume=" if last is None
              else "resume=latest" if last == latest_checkpoint(output_dir) else f"resume={last}")
    return last, resume


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    ckpts = complete_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def resolve_resume(resume: str, output_dir: str | Path) -> Path:
    """``latest`` or a path → a complete checkpoint directory."""
    if resume == "latest":
        path = latest_checkpoint(output_dir)
        if path is None:
            raise CheckpointError(
                f"resume=latest but {checkpoint_root(output_dir)} holds no complete checkpoint; "
                "start without resume= (or with overwrite=true)"
            )
        return path
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; pass resume=latest or an existing step-N folder")
    if not (path / COMPLETE).is_file() or not (path / "trainer_state.json").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt; resume from an older step-N folder")
    return path


def tmp_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f".tmp-step-{step}"


def finalize(output_dir: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Mark the temporary folder complete, rename it to ``step-N`` and prune (main process): ``step-N`` and the
    ``keep_last - 1`` newest before it stay; any past it (the run a resume from an older step rewound) go."""
    tmp = tmp_dir(output_dir, step)
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
    (tmp / COMPLETE).write_text("")
    final = replace_dir(tmp, checkpoint_root(output_dir) / f"step-{step}")  # fsyncs, then renames
    # The one just written is always kept. Checkpoints past it belong to the run a resume from an older step
    # rewound (its metrics lines are already gone): left, resume=latest would go back to them. Older ones are
    # kept up to keep_last in all.
    ckpts = complete_checkpoints(output_dir)  # by step: the ones before final are older, after it newer
    at = ckpts.index(final)
    older, newer = ckpts[:at], ckpts[at + 1:]
    for old in newer:
        print(f"removed checkpoint {old.name}: past step {step}, in the steps a resume from an older checkpoint "
              "rewound", flush=True)
        _remove(old)
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        _remove(old)
    return final


def _remove(path: Path) -> None:
    """Delete a complete checkpoint so that a kill at any moment leaves nothing that looks complete: renamed
    first to a temporary name (:func:`clean_partial` removes what a kill leaves of it), then deleted."""
    aside = path.with_name(f".tmp-{path.name}-pruned")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(path, aside)
    except OSError:  # cannot rename: unmark it, then delete it where it is (pruning never stops a run)
        (path / COMPLETE).unlink(missing_ok=True)
        aside = path
    shutil.rmtree(aside, ignore_errors=True)


def clean_partial(output_dir: str | Path) -> None:
    """Remove temporary folders left by a killed run (never a complete ``step-N`` checkpoint).

    A run killed between :func:`core.fsio.replace_dir`'s two renames left a complete ``step-N`` only under
    its aside name ``.old-step-N-<hex>``: that one is renamed back, not removed.
    """
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return
    for target in {root / old.name[len(".old-"):].rsplit("-", 1)[0] for old in root.glob(".old-step-*")}:
        restore_aside(target, lambda p: (p / COMPLETE).is_file())
    for p in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:
        shutil.rmtree(p, ignore_errors=True)


def model_config(path: Path) -> dict[str, Any] | None:
    """The model's ``config.json`` saved in checkpoint ``path`` (``student/``), or None when unreadable.

    It records what the run decided before training and must not decide again on resume: a pruned
    student's shape and kept units, a retrofit's head roles.
    """
    try:
        return json.loads((Path(path) / "student" / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise CheckpointError(f"checkpoint {path} has an unreadable trainer_state.json; resume from another step") from None
