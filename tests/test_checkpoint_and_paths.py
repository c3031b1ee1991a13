"""Checkpoint pruning (after a resume from an older step, and under a kill), ``output_dir`` / ``resume`` written
with ``~``, zero-padded integers in configs, resuming a checkpoint whose config lacks a newer list key, and the
durability of the converted demo teacher."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from core import checkpoint as ckpt
from core.checkpoint import (
    COMPLETE,
    checkpoint_root,
    complete_checkpoints,
    finalize,
    latest_checkpoint,
    tmp_dir,
)


def _complete(root, step: int, text: str = "w") -> None:
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_text(text)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (folder / COMPLETE).write_text("")


def _save(out, step: int, keep: int) -> None:
    tmp = tmp_dir(out, step)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_text("new")
    finalize(out, step, {"step": step}, keep)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_checkpoint_just_written_after_resuming_from_an_older_one_is_kept_and_is_the_latest(tmp_path, keep):
    """Resumed from step-2 while step-4 and step-6 (the run it rewound) are on disk: saving step-3 must keep step-3
    and make it what ``resume=latest`` picks; the abandoned step-4/step-6 must not outlive it."""
    root = checkpoint_root(tmp_path)
    for step in (2, 4, 6):
        _complete(root, step, "old run")
    _save(tmp_path, 3, keep)
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert "step-3" in names
    assert latest_checkpoint(tmp_path) == root / "step-3"
    assert (root / "step-3" / "model.safetensors").read_text() == "new"
    assert len(names) <= keep
    if keep >= 2:
        assert "step-2" in names  # an older checkpoint of the same trajectory is kept within keep_checkpoints


def test_pruning_keeps_the_newest_ones_in_a_plain_run(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step, 2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-4", "step-6"]
    assert sorted(p.name for p in checkpoint_root(tmp_path).iterdir()) == ["step-4", "step-6"]


def test_a_kill_while_pruning_never_leaves_a_half_deleted_checkpoint_that_looks_complete(tmp_path, monkeypatch):
    """A kill during the deletion of an old checkpoint must not leave a folder that still carries COMPLETE with its
    weights gone (``resume=.../step-2`` would then pick a torn checkpoint)."""
    root = checkpoint_root(tmp_path)
    _complete(root, 2)
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl"):
        (root / "step-2" / name).write_text("x")

    class Killed(BaseException):
        pass

    def rmtree_killed_midway(path, ignore_errors=False):
        from pathlib import Path

        if not Path(path).exists():
            return
        files = sorted(p for p in Path(path).iterdir() if p.name != COMPLETE)
        files[0].unlink()  # the kill lands after the first file went
        raise Killed

    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree_killed_midway)
    with pytest.raises(Killed):
        _save(tmp_path, 4, 1)
    monkeypatch.undo()
    for folder in complete_checkpoints(tmp_path):  # whatever looks complete is whole
        assert len(list(folder.iterdir())) >= 3 and (folder / "model.safetensors").is_file()
        if folder.name == "step-2":
            assert (folder / "optimizer.bin").is_file()
    ckpt.clean_partial(tmp_path)  # the next start clears what the kill left
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]


@dataclasses.dataclass
class _Cfg:
    output_dir: str = "runs/x"
    overwrite: bool = False
    resume: str | None = None
    mixed_precision: str = "no"
    grad_accum: int = 1
    tracker: str = "none"
    threads: int = 0


def test_an_output_dir_written_with_a_tilde_is_the_folder_the_run_writes_to(tmp_path, monkeypatch):
    """``output_dir: ~/runs/x`` in a YAML file (YAML does not expand ``~``): the folder claimed and the folder every
    later write uses (``cfg.output_dir``: the Run, final/, the resume) must be the same one."""
    import distill.training as training

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(training, "make_accelerator", lambda cfg, out: SimpleNamespace(
        num_processes=1, is_main_process=True, wait_for_everyone=lambda: None))
    monkeypatch.setattr(training, "setup_threads", lambda *args: None)
    config = tmp_path / "c.yaml"
    config.write_text("output_dir: ~/runs/x\n")
    cfg, _acc, out = training.start_run(_Cfg, ["--config", str(config)])
    assert out == home / "runs" / "x" and (out / ".hybrid-distill-run").is_file()
    run = training.Run(cfg, _acc, tracker_project="t", progress="t")
    assert run.out.resolve() == out.resolve()
    assert not (tmp_path / "~").exists()


@dataclasses.dataclass
class _Numbers:
    seed: int = 0
    lr: float = 1e-3
    steps: list[int] = dataclasses.field(default_factory=list)


@pytest.mark.parametrize("text, want", [("010", 10), ("0042", 42), ("08", 8), ("0", 0), ("0x10", 16), ("0o10", 8)])
def test_a_zero_padded_number_keeps_its_decimal_value_on_the_command_line_and_in_yaml(tmp_path, text, want):
    """YAML 1.1 reads ``010`` as octal 8 (while ``08`` stays 8): ``seed=0042`` must not silently become 34.
    Octal needs its explicit ``0o`` prefix, as in YAML 1.2."""
    from core.config import parse_config

    assert parse_config(_Numbers, [f"seed={text}"]).seed == want
    assert parse_config(_Numbers, [f"steps=[{text}, 1]"]).steps == [want, 1]
    config = tmp_path / "c.yaml"
    config.write_text(f"seed: {text}\n")
    assert parse_config(_Numbers, ["--config", str(config)]).seed == want


def test_resume_accepts_a_checkpoint_path_written_with_a_tilde(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    _complete(checkpoint_root(home / "runs" / "x"), 4)
    assert ckpt.resolve_resume("~/runs/x/checkpoints/step-4", tmp_path / "elsewhere") == (
        home / "runs" / "x" / "checkpoints" / "step-4")


def test_resume_tolerates_a_list_key_an_older_checkpoint_lacks_while_it_holds_its_default(tmp_path):
    """A key the saved config lacks counts as unchanged at its default: a list key's default comes from its
    ``default_factory``, and must count the same (else every older checkpoint is refused once one is added)."""
    import yaml

    from core.config import ConfigError, check_resume_config, save_config
    from distill.config import RESUME_SAFE, DistillConfig

    cfg = DistillConfig(attn_layers=[])
    save_config(cfg, tmp_path / "config.yaml")
    data = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del data["attn_layers"], data["hidden_layers"]  # both at their defaults: [] and ["derived"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    check_resume_config(tmp_path / "config.yaml", cfg, RESUME_SAFE)
    with pytest.raises(ConfigError, match=r"hidden_layers: <absent> → \['0:1'\]"):
        check_resume_config(tmp_path / "config.yaml", dataclasses.replace(cfg, hidden_layers=["0:1"]), RESUME_SAFE)


def test_the_converted_demo_teacher_is_on_disk_before_its_folder_takes_the_cache_name(tmp_path, monkeypatch):
    """The SmolLM2 cache is reused whenever ``config.json`` and ``model.safetensors`` exist: renamed in before its
    bytes are on disk, a power cut leaves an empty ``model.safetensors`` that every later run fails to load."""
    import os

    import transformers

    from core import models

    class _Config:
        bos_token_id = eos_token_id = pad_token_id = 0

    class _Model:
        config = _Config()

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

        def save_pretrained(self, path, **kwargs):
            os.makedirs(path, exist_ok=True)
            for name in ("config.json", "model.safetensors"):
                with open(os.path.join(path, name), "w") as f:
                    f.write("{}")

    class _Tok:
        def save_pretrained(self, path):
            with open(os.path.join(path, "tokenizer.json"), "w") as f:
                f.write("{}")

    monkeypatch.setattr(models, "smollm2_gguf", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(transformers, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda *a, **k: _Tok()))
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", SimpleNamespace(
        from_pretrained=lambda *a, **k: _Model(), from_config=lambda *a, **k: _Model()))
    monkeypatch.setattr(transformers, "GenerationConfig", lambda **k: None)
    synced: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    renamed_after: list[list[str]] = []

    def replace(src, dst):
        renamed_after.append(list(synced))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = models.smollm2_dir(tmp_path / "cache" / "smollm2")
    assert (target / "model.safetensors").is_file()
    assert renamed_after and any(p.endswith("model.safetensors") for p in renamed_after[-1])
    assert any(os.path.basename(p) == "cache" for p in synced)  # the rename itself made durable
