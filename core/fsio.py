"""Durable file writes: what a run says it wrote is on disk, whole, even if the machine dies next.

A rename is atomic but not durable until its directory is fsynced, and a file's bytes are not on
disk until the file is. Every checkpoint, final model, export, summary and config goes through these
helpers: write under a temporary name, fsync the files, rename, fsync the parent. An existing target
is replaced first and deleted after (never deleted before its replacement is in place).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of directory ``path`` (creations, renames) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds: nothing more can be done
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    root = Path(root)
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(dirpath)


def share_like_umask(root: str | os.PathLike) -> None:
    """Give ``root`` (a file or a folder) and everything under it that is private to its owner (no group or
    other bits: 0600, 0700) the permissions a plain ``open`` / ``mkdir`` gives under the process's umask (0644
    and 0755 under the usual 022). Modes someone chose otherwise (0640) are left as they were.

    Writers that go through a temporary file (safetensors' ``save_file``, so ``save_pretrained``'s weights)
    create it 0600, and ``tempfile.mkdtemp`` its folder 0700, while the config and tokenizer beside them are
    0644: a job under another user of a shared folder could read everything but the weights.
    """
    mask = os.umask(0)
    os.umask(mask)
    root = Path(root)
    for p in [root, *(root.rglob("*") if root.is_dir() else ())]:
        mode = p.lstat().st_mode
        if not stat.S_ISLNK(mode) and mode & 0o077 == 0:
            os.chmod(p, (0o777 if stat.S_ISDIR(mode) else 0o666) & ~mask)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a binary file that becomes ``path`` only once whole: a reader sees the old file or the
    new one, never a mix, and a failure leaves the old one (e.g. ``lambda f: fig.savefig(f, format="png")``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` with :func:`atomic_write`."""
    atomic_write(path, lambda f: f.write(text.encode()))


def replace_dir(tmp: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Move the finished folder ``tmp`` to ``target`` durably; an old ``target`` goes only afterwards.

    The old folder is first renamed aside (``.old-<name>-<hex>``, a dot name like every temp name), then the
    new one takes its name; if that second rename fails the old folder is put back. A process killed
    between the two renames leaves the old folder only under the aside name: whoever cleans up after a
    killed run must restore it (:func:`restore_aside`, :func:`core.checkpoint.clean_partial`), not delete it.
    """
    tmp, target = Path(tmp), Path(target)
    share_like_umask(tmp)
    fsync_tree(tmp)
    old = None
    if target.exists():
        old = target.with_name(f".old-{target.name}-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old is not None and not target.exists():
            os.replace(old, target)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def restore_aside(target: str | os.PathLike, complete: Callable[[Path], bool]) -> Path | None:
    """Undo what a kill inside :func:`replace_dir` left of ``target``; return the folder put back, if any.

    Killed between the two renames, ``target`` is missing and the old folder is whole under its aside name
    ``.old-<name>-<hex>``: the newest aside that ``complete`` accepts is renamed back. Killed while removing
    the old folder after a successful swap, ``target`` exists and a partial aside remains: it is removed.
    Only names :func:`replace_dir` makes for this very ``target`` are touched. Several processes may call
    this at once: one rename wins, the others find ``target`` back.
    """
    target = Path(target)
    parent = target.parent
    if not parent.is_dir():
        return None
    ours = re.compile(rf"^\.old-{re.escape(target.name)}-[0-9a-f]{{8}}$")
    asides = [p for p in parent.iterdir() if ours.match(p.name) and p.is_dir() and not p.is_symlink()]
    restored = None
    if not target.exists():
        for old in sorted(asides, key=lambda p: p.stat().st_mtime, reverse=True):
            if complete(old):
                try:
                    os.replace(old, target)
                except OSError:  # another process put it back first
                    return None
                fsync_dir(parent)
                restored = old
                break
    if target.exists():
        for old in asides:
            if old != restored:
                shutil.rmtree(old, ignore_errors=True)
    return restored


def is_saved_model(path: Path) -> bool:
    """Whether ``path`` holds a whole ``save_pretrained`` folder: ``config.json`` and its safetensors weights
    (one file, or an index whose shards are all there)."""
    if not (path / "config.json").is_file():
        return False
    if (path / "model.safetensors").is_file():
        return True
    index = path / "model.safetensors.index.json"
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return bool(shards) and all((path / s).is_file() for s in shards)
