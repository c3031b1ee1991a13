"""Run folders: only a folder that holds a run of ours may be replaced.

A training recipe writes :data:`MARKER` into ``output_dir`` when it creates the folder, before it
writes anything else. ``overwrite=true`` then deletes a folder only if that marker is there, so a
typo'd ``output_dir=notes`` (or ``.``, or ``~``) can never lose files we did not write. Places no
run should ever live in — ``/``, the home folder, the current folder, a folder that contains the
current folder or this checkout — are refused outright, marker or not.

Two steps, because under ``accelerate launch`` every process checks but only one may act:

* :func:`check_output_dir` (every process, before anything is loaded): is this folder usable for
  this ``overwrite``/``resume``? Touches nothing.
* :func:`claim_output_dir` (main process only): checks again, removes the old run when
  ``overwrite`` allows it, creates the folder and writes the marker.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from core.config import ConfigError
from core.config import check_output_dir as check_writable_dir

MARKER = ".hybrid-distill-run"
"""Written into every run folder when the run starts; its presence is what makes a folder ours."""

CHECKOUT = Path(__file__).resolve().parents[1]
RUN_FILES = ("checkpoints", "final", "summary.json")
"""What a folder that already holds a (possibly older, unmarked) run contains."""


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _forbidden(path: Path) -> str | None:
    """Why ``path`` (resolved) may never be a run folder, or ``None``."""
    cwd = Path.cwd().resolve()
    home = Path.home().resolve()
    if path == Path(path.anchor):
        return "is the filesystem root"
    if path == home:
        return "is your home folder"
    if _is_within(CHECKOUT, path):  # before the current folder: a checkout's parent often holds both
        return "contains the hybrid-distill checkout"
    if _is_within(cwd, path):
        return "is the current folder" if path == cwd else "contains the current folder"
    return None


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder that a recipe of ours created (it holds :data:`MARKER`)."""
    return (Path(path) / MARKER).is_file()


def check_output_dir(path: str | os.PathLike, overwrite: bool = False, resume: str | None = None) -> Path:
    """Refuse an ``output_dir`` that this run must not use; touch nothing. Returns ``Path(path)``.

    * a path outside any run's business (root, home, the current folder or one holding it, the
      checkout) → refused;
    * a file, a path under a file, or a place this process cannot write → refused;
    * an existing, non-empty folder without the marker → refused (``overwrite`` would delete files
      we did not write; writing a run into it would mix them with ours), except with ``resume=``,
      which deletes nothing and so may continue a run written before markers existed;
    * a run of ours without ``resume``/``overwrite`` → refused, naming both;
    * ``resume=latest`` on a folder that does not exist → refused.
    """
    out = Path(path).expanduser()
    where = out.resolve()
    why = _forbidden(where)
    if why:
        raise ConfigError(f"output_dir {out} {why}; a run needs its own folder, e.g. output_dir=runs/NAME")
    if overwrite and out.is_symlink():
        raise ConfigError(f"overwrite=true refused: output_dir {out} is a symbolic link; nothing was deleted; "
                          "point output_dir= at the folder itself")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file; choose a folder path")
    check_writable_dir(out, "output_dir")  # a path under a file, or an unwritable place: refused now, not at mkdir
    if not out.exists():
        if resume == "latest":
            raise ConfigError(f"resume=latest but {out} does not exist; check output_dir=, or start without resume=")
        return out
    ours = is_run_dir(out)
    has_run = any((out / n).exists() for n in RUN_FILES)
    if resume is not None:
        return out
    if not ours and any(out.iterdir()):
        if overwrite:
            raise ConfigError(f"overwrite=true refused: {out} has no {MARKER} marker, so it is not a run folder "
                              "of ours; nothing was deleted; delete it yourself or choose another output_dir=")
        hint = "resume=latest continues it, or " if has_run else ""
        raise ConfigError(f"output_dir {out} already holds files that are not a run of ours; {hint}choose a new "
                          "or empty output_dir=")
    if has_run and not overwrite:
        raise ConfigError(f"{out} already holds a run; pass resume=latest to continue it, overwrite=true to "
                          "replace it, or another output_dir=")
    return out


def claim_output_dir(path: str | os.PathLike, overwrite: bool = False, resume: str | None = None) -> Path:
    """:func:`check_output_dir`, then (with ``overwrite``) remove our old run, create the folder, mark it.

    Call on the main process only. With ``resume`` nothing is removed, and the marker is added only
    if the folder is created here: an older, unmarked run being resumed stays unmarked (it keeps
    refusing ``overwrite``) rather than being adopted along with whatever else it holds.
    """
    out = check_output_dir(path, overwrite, resume)
    if overwrite and out.exists() and is_run_dir(out):
        shutil.rmtree(out)
    if out.exists():
        if resume is None and not is_run_dir(out):  # an empty folder: it becomes ours
            (out / MARKER).write_text("")
        return out
    out.mkdir(parents=True)
    (out / MARKER).write_text("")
    return out


def check_replaceable(path: str | os.PathLike, ours: bool, what: str) -> None:
    """Refuse ``overwrite=true`` on ``path`` unless it is ``what`` we wrote (``ours``) in a sane place.

    For outputs that are not training runs (a teacher cache, an export), whose own files say what
    they are: ``ours`` is that evidence (e.g. the cache's ``meta.json``). An empty folder is always
    replaceable; root, home, the current folder and the checkout never are.
    """
    out = Path(path).expanduser()
    why = _forbidden(out.resolve())
    if why:
        raise ConfigError(f"overwrite=true refused: {out} {why}; nothing was deleted; choose output_dir=runs/NAME")
    if out.is_dir() and not ours and any(out.iterdir()):
        raise ConfigError(f"overwrite=true refused: {out} is not {what}; nothing was deleted; delete it yourself "
                          "or choose another output_dir=")
