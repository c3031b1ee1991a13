"""core.rundir: overwrite=true deletes only a run folder of ours; dangerous places are never used."""

from pathlib import Path

import pytest

from core.config import ConfigError
from core.rundir import CHECKOUT, MARKER, check_output_dir, check_replaceable, claim_output_dir, is_run_dir


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (files with their bytes), to compare before/after."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """Run from a scratch folder with a home of its own, so nothing real is ever at stake."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    return tmp_path


def test_a_new_folder_is_created_and_marked(elsewhere):
    out = claim_output_dir(elsewhere / "runs" / "a")
    assert out.is_dir() and is_run_dir(out) and [p.name for p in out.iterdir()] == [MARKER]


def test_an_empty_folder_becomes_ours(elsewhere):
    (elsewhere / "empty").mkdir()
    assert is_run_dir(claim_output_dir(elsewhere / "empty"))


def test_overwrite_replaces_a_run_of_ours(elsewhere):
    out = claim_output_dir(elsewhere / "run")
    (out / "summary.json").write_text("{}")
    (out / "checkpoints" / "step-2").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already holds a run; pass resume=latest .* overwrite=true"):
        check_output_dir(out)
    claim_output_dir(out, overwrite=True)
    assert [p.name for p in out.iterdir()] == [MARKER]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_someone_elses_files_is_never_touched(elsewhere, overwrite):
    notes = elsewhere / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("precious")
    before = tree(elsewhere)
    match = "has no .hybrid-distill-run marker.*nothing was deleted" if overwrite else "not a run of ours"
    with pytest.raises(ConfigError, match=match) as err:
        claim_output_dir(notes, overwrite=overwrite)
    assert "\n" not in str(err.value)
    assert tree(elsewhere) == before


def test_an_unmarked_older_run_can_be_resumed_but_not_overwritten(elsewhere):
    old = elsewhere / "old"
    (old / "checkpoints" / "step-2").mkdir(parents=True)
    before = tree(elsewhere)
    with pytest.raises(ConfigError, match="resume=latest continues it"):
        claim_output_dir(old)
    with pytest.raises(ConfigError, match="nothing was deleted"):
        claim_output_dir(old, overwrite=True)
    assert claim_output_dir(old, resume="latest") == old
    assert tree(elsewhere) == before  # resuming adopts nothing: still unmarked


_PLACES = [
    ("cwd", lambda t: Path.cwd(), "is the current folder"),
    ("dot", lambda t: Path("."), "is the current folder"),
    ("parent-of-cwd", lambda t: t, "contains the current folder"),
    ("home", lambda t: Path.home(), "is your home folder"),
    ("tilde", lambda t: Path("~"), "is your home folder"),
    ("checkout", lambda t: CHECKOUT, "contains the hybrid-distill checkout"),
    ("checkout-parent", lambda t: CHECKOUT.parent, "contains the hybrid-distill checkout"),
]
# overwrite=true is only ever tried on the scratch places (a bug must never reach the real checkout).
_SCRATCH = {"cwd", "dot", "parent-of-cwd", "home", "tilde"}


@pytest.mark.parametrize("where, why, overwrite", [
    pytest.param(where, why, overwrite, id=f"{name}-overwrite={overwrite}")
    for name, where, why in _PLACES for overwrite in (False, True) if not overwrite or name in _SCRATCH
])
def test_dangerous_places_are_refused_even_when_marked(elsewhere, where, why, overwrite):
    path = where(elsewhere)
    for p in {Path.cwd(), Path.home(), elsewhere}:
        (p / MARKER).write_text("")
    (Path.cwd() / "mine.txt").write_text("keep")
    before = tree(elsewhere)
    with pytest.raises(ConfigError, match=why) as err:
        claim_output_dir(path, overwrite=overwrite)
    assert "\n" not in str(err.value) and "output_dir=runs/NAME" in str(err.value)
    assert tree(elsewhere) == before


def test_root_is_refused(elsewhere):
    with pytest.raises(ConfigError, match="is the filesystem root"):
        check_output_dir("/")


def test_a_file_and_a_symlink_are_refused(elsewhere):
    (elsewhere / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        claim_output_dir(elsewhere / "f")
    run = claim_output_dir(elsewhere / "run")
    (elsewhere / "link").symlink_to(run)
    with pytest.raises(ConfigError, match="symbolic link; nothing was deleted"):
        claim_output_dir(elsewhere / "link", overwrite=True)
    assert is_run_dir(run)


def test_resume_latest_needs_the_folder(elsewhere):
    with pytest.raises(ConfigError, match="resume=latest but .* does not exist"):
        claim_output_dir(elsewhere / "missing", resume="latest")
    assert not (elsewhere / "missing").exists()
    # A checkpoint path from elsewhere may start a new folder (it is then ours).
    assert is_run_dir(claim_output_dir(elsewhere / "new", resume=str(elsewhere / "x" / "step-2")))


def test_check_replaceable_for_caches_and_exports(elsewhere):
    cache = elsewhere / "cache"
    cache.mkdir()
    (cache / "meta.json").write_text("{}")
    check_replaceable(cache, (cache / "meta.json").is_file(), "a teacher cache")
    notes = elsewhere / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not a teacher cache; nothing was deleted"):
        check_replaceable(notes, False, "a teacher cache")
    with pytest.raises(ConfigError, match="is the current folder"):
        check_replaceable(".", True, "a teacher cache")
