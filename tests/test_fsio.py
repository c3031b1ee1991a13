"""core/fsio.py replace_dir and core/checkpoint.py clean_partial: a folder is replaced without ever losing
both copies, whether the replacing rename fails or the process dies between the two renames."""

from __future__ import annotations

import os

import pytest

from core import fsio
from core.checkpoint import COMPLETE, checkpoint_root, clean_partial, complete_checkpoints, tmp_dir
from core.fsio import replace_dir


def _folder(path, text: str, complete: bool = False):
    path.mkdir(parents=True)
    (path / "weights.txt").write_text(text)
    if complete:
        (path / COMPLETE).write_text("")
    return path


def test_replace_dir_moves_the_new_folder_in_and_removes_the_old(tmp_path):
    target, new = _folder(tmp_path / "final", "old"), _folder(tmp_path / ".tmp-final", "new")
    assert replace_dir(new, target) == target
    assert (target / "weights.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_replace_dir_puts_the_old_folder_back_when_the_new_one_cannot_take_its_name(tmp_path, monkeypatch):
    target, new = _folder(tmp_path / "final", "old"), _folder(tmp_path / ".tmp-final", "new")
    real = os.replace

    def failing(src, dst):
        if os.fspath(src) == os.fspath(new):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(fsio.os, "replace", failing)
    with pytest.raises(OSError, match="No space left"):
        replace_dir(new, target)
    assert (target / "weights.txt").read_text() == "old"  # not left under its aside name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".old-")]


def test_clean_partial_restores_a_checkpoint_a_kill_left_only_under_its_aside_name(tmp_path):
    root = checkpoint_root(tmp_path)
    _folder(root / "step-2", "two", complete=True)
    # killed between replace_dir's renames while re-saving step 4: the old step-4 aside, the new one in tmp
    _folder(root / ".old-step-4-0a1b2c3d", "four", complete=True)
    _folder(tmp_dir(tmp_path, 4), "four again", complete=True)
    _folder(root / ".old-step-6-0a1b2c3d", "torn")  # no COMPLETE: not a checkpoint, removed
    _folder(root / "step-8", "eight", complete=True)
    _folder(root / ".old-step-8-0a1b2c3d", "eight before")  # step-8 exists: the aside copy is stale
    clean_partial(tmp_path)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-2", "step-4", "step-8"]
    assert (root / "step-4" / "weights.txt").read_text() == "four"
    assert (root / "step-8" / "weights.txt").read_text() == "eight"
    assert sorted(p.name for p in root.iterdir()) == ["step-2", "step-4", "step-8"]
