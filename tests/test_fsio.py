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


def _model_folder(path, text: str):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_text(text)
    return path


def test_restore_aside_puts_back_a_folder_a_kill_left_between_replace_dirs_renames(tmp_path, monkeypatch):
    """Killed between the renames, ``final`` is gone and its old copy lies under ``.old-final-<hex>``: the newest
    whole aside goes back, a partial one stays while nothing whole is in place, then goes; names not made by
    replace_dir for this target (another target's, a user's) are never touched."""
    final = tmp_path / "final"
    old = _model_folder(tmp_path / ".old-final-0a1b2c3d", "before")
    older = _model_folder(tmp_path / ".old-final-99999999", "long before")
    os.utime(older, (1, 1))
    partial = tmp_path / ".old-final-12345678"
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # its weights were being removed
    other = _model_folder(tmp_path / ".old-finals-0a1b2c3d", "another target's")
    user = _model_folder(tmp_path / ".old-final-mine", "a user's")
    assert fsio.restore_aside(tmp_path / "absent" / "final", fsio.is_saved_model) is None
    assert fsio.restore_aside(final, lambda p: False) is None  # nothing whole: everything left as found
    assert partial.is_dir() and old.is_dir() and older.is_dir()
    assert fsio.restore_aside(final, fsio.is_saved_model) == old
    assert (final / "model.safetensors").read_text() == "before"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old-final-mine", ".old-finals-0a1b2c3d", "final"]
    assert fsio.restore_aside(final, fsio.is_saved_model) is None  # in place: nothing to do
    assert (final / "model.safetensors").read_text() == "before" and other.is_dir() and user.is_dir()


def test_a_folder_killed_mid_replace_is_restored_by_a_real_replace_dir_sequence(tmp_path, monkeypatch):
    """The same through replace_dir itself: the process dies right after the first rename."""
    final = _model_folder(tmp_path / "final", "v1")
    new = _model_folder(tmp_path / ".tmp-final", "v2")
    real, dead = os.replace, []

    def die_on_second(src, dst):
        if dead or os.fspath(src) == os.fspath(new):  # the kill, after the old folder went aside: no rename after it
            dead.append(src)
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(fsio.os, "replace", die_on_second)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(new, final)
    monkeypatch.undo()
    assert not final.exists() and [p.name.startswith(".old-final-") for p in tmp_path.iterdir()].count(True) == 1
    assert fsio.restore_aside(final, fsio.is_saved_model) is not None
    assert (final / "model.safetensors").read_text() == "v1"


def test_is_saved_model_needs_the_config_and_every_shard_of_the_index(tmp_path):
    import json

    assert fsio.is_saved_model(_model_folder(tmp_path / "one", "w"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text("{}")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "model-00001-of-00002.safetensors").write_text("w")
    assert not fsio.is_saved_model(sharded)  # a shard missing
    (sharded / "model-00002-of-00002.safetensors").write_text("w")
    assert fsio.is_saved_model(sharded)
    (sharded / "config.json").unlink()
    assert not fsio.is_saved_model(sharded)
    (sharded / "config.json").write_text("{}")
    (sharded / "model.safetensors.index.json").write_text("{not json")
    assert not fsio.is_saved_model(sharded)


def test_replace_dir_gives_private_files_the_umasks_permissions(tmp_path):
    """A file created 0600 (safetensors writes its weights so) leaves as 0644 under umask 022; a mode someone
    chose otherwise (0640) stays."""
    new = tmp_path / ".tmp-final"
    (new / "sub").mkdir(parents=True)
    private, chosen, plain = new / "model.safetensors", new / "sub" / "notes.txt", new / "config.json"
    for f in (private, chosen, plain):
        f.write_text("x")
    private.chmod(0o600)
    chosen.chmod(0o640)
    old = os.umask(0o022)
    try:
        replace_dir(new, tmp_path / "final")
    finally:
        os.umask(old)
    mode = {p.name: (p.stat().st_mode & 0o777) for p in (tmp_path / "final").rglob("*") if p.is_file()}
    assert mode == {"model.safetensors": 0o644, "notes.txt": 0o640, "config.json": 0o644}
