"""Bad recipe and CLI input, table-driven: one-line error, the exact exit code, nothing on disk changed.

Every case runs the real CLI entry point in-process (``sys.argv`` + the recipe's ``main`` under
``run_cli``, or the module's ``main(argv)``) from a scratch world: the current folder, ``$HOME``, a
folder of someone's notes, a finished-looking run of ours with a checkpoint, an older unmarked run.
The whole world is snapshotted before and compared after, so a case that deleted, created or
rewrote anything fails. Most cases must fail before any model is loaded; the few that need a model
use the built-in tiny-random one. Two end-to-end cases run the recipe as a subprocess, exactly as
issue 11 reported them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import run_cli, save_config
from core.rundir import MARKER
from tests.helpers import ROOT, child_env

TINY = str(ROOT / "recipes/configs/tiny.yaml")
RETRO = str(ROOT / "recipes/configs/retrofit_tiny.yaml")


def tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A scratch world; the current folder and $HOME point into it."""
    from core.config import parse_config
    from distill.config import DistillConfig

    w = {name: tmp_path / name for name in ("cwd", "home", "notes", "run", "oldrun")}
    for p in w.values():
        p.mkdir()
    (w["cwd"] / "mine.txt").write_text("my own file")
    (w["home"] / "thesis.tex").write_text("years of work")
    (w["notes"] / "a.txt").write_text("precious")
    # A finished run of ours (8 steps) with its last checkpoint.
    saved = parse_config(DistillConfig, ["--config", TINY, "max_steps=8", f"output_dir={w['run']}"])
    step = w["run"] / "checkpoints" / "step-8"
    step.mkdir(parents=True)
    (w["run"] / MARKER).write_text("")
    (w["run"] / "summary.json").write_text(json.dumps({"steps": 8}))
    save_config(saved, w["run"] / "config.yaml")
    save_config(saved, step / "config.yaml")
    (step / "trainer_state.json").write_text(json.dumps({"step": 8, "history": [], "evals": [], "init": {}}))
    (step / "COMPLETE").write_text("")
    # A run written before run folders were marked.
    (w["oldrun"] / "checkpoints").mkdir()
    (w["oldrun"] / "summary.json").write_text("{}")
    # Files for config errors.
    (tmp_path / "bad.yaml").write_text("max_steps: [1, 2\n")
    (tmp_path / "list.yaml").write_text("- max_steps\n- 2\n")
    (tmp_path / "unknown.yaml").write_text("max_steps: 2\nlearning_rate: 1\n")
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "model").mkdir()  # a folder that is not a model
    w.update(root=tmp_path, bad=tmp_path / "bad.yaml", listyaml=tmp_path / "list.yaml",
             unknown=tmp_path / "unknown.yaml", afile=tmp_path / "afile", model=tmp_path / "model",
             step=step, missing=tmp_path / "missing")
    monkeypatch.chdir(w["cwd"])
    monkeypatch.setenv("HOME", str(w["home"]))
    return w


def _recipe(module: str):
    def call(argv: list[str]) -> int:
        mod = __import__(f"recipes.{module}", fromlist=["main"])
        old = sys.argv
        sys.argv = [f"recipes/{module}.py", *argv]
        try:
            run_cli(mod.main)
        except SystemExit as stop:
            return int(stop.code or 0)
        finally:
            sys.argv = old
        return 0
    return call


def _export(argv: list[str]) -> int:
    from recipes.export import main

    try:
        run_cli(lambda: main(argv))
    except SystemExit as stop:
        return int(stop.code or 0)
    return 0


def _gate(argv: list[str]) -> int:
    from eval.gate import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from distill.plan import main

    return main(argv)


CLIS = {"distill": _recipe("distill"), "retrofit": _recipe("retrofit"), "cache_teacher": _recipe("cache_teacher"),
        "export": _export, "gate": _gate, "plan": _plan}
D = ["--config", TINY]
R = ["--config", RETRO]
GATE = ["--candidate", "{model}", "--baseline", "{model}"]

# (id, cli, argv, exit code, text the one stderr line must contain)
CASES = [
    # -- numbers out of range or not finite: refused by core.config before anything loads
    ("lr-nan", "distill", [*D, "lr=nan", "output_dir={missing}"], 2, "lr must be a finite number > 0, got nan"),
    ("lr-inf", "distill", [*D, "lr=.inf", "output_dir={missing}"], 2, "lr must be a finite number > 0, got inf"),
    ("lr-zero", "distill", [*D, "lr=0", "output_dir={missing}"], 2, "lr must be > 0, got 0"),
    ("temperature-nan", "distill", [*D, "temperature=nan", "output_dir={missing}"], 2,
     "temperature must be a finite number > 0, got nan"),
    ("weight-decay-negative", "distill", [*D, "weight_decay=-1", "output_dir={missing}"], 2,
     "weight_decay must be >= 0, got -1"),
    ("min-lr-ratio-negative", "distill", [*D, "min_lr_ratio=-5", "output_dir={missing}"], 2,
     "min_lr_ratio must be in [0, 1], got -5"),
    ("min-lr-ratio-above-1", "distill", [*D, "min_lr_ratio=1.5", "output_dir={missing}"], 2,
     "min_lr_ratio must be in [0, 1], got 1.5"),
    ("beta-above-1", "distill", [*D, "beta=2", "output_dir={missing}"], 2, "beta must be in [0, 1], got 2"),
    ("focal-gamma-negative", "distill", [*D, "focal_gamma=-0.5", "output_dir={missing}"], 2,
     "focal_gamma must be >= 0, got -0.5"),
    ("max-grad-norm-negative", "distill", [*D, "max_grad_norm=-1", "output_dir={missing}"], 2,
     "max_grad_norm must be >= 0, got -1"),
    ("max-steps-zero", "distill", [*D, "max_steps=0", "output_dir={missing}"], 2, "max_steps must be >= 1, got 0"),
    ("seed-negative", "distill", [*D, "seed=-1", "output_dir={missing}"], 2, "seed must be in [0, 4294967295], got -1"),
    ("tracker-unknown", "distill", [*D, "tracker=mlflow", "output_dir={missing}"], 2,
     "tracker must be one of none, tensorboard, wandb, got 'mlflow'"),
    ("precision-unknown", "distill", [*D, "mixed_precision=fp8", "output_dir={missing}"], 2,
     "mixed_precision must be one of no, bf16, fp16, auto, got 'fp8'"),
    ("kd-kind-unknown", "distill", [*D, "kd_kind=kl", "output_dir={missing}"], 2, "kd_kind must be one of forward_kl"),
    ("retrofit-lr-nan", "retrofit", [*R, "lr=nan", "output_dir={missing}"], 2, "lr must be a finite number > 0"),
    ("retrofit-dropout-1", "retrofit", [*R, "lora_dropout=1", "output_dir={missing}"], 2,
     "lora_dropout must be in [0, 1), got 1"),
    ("retrofit-eval-len-1", "retrofit", [*R, "eval_seq_lens=[64, 1]", "output_dir={missing}"], 2,
     "eval_seq_lens must be >= 2, got 1 in [64, 1]"),
    ("retrofit-window-0", "retrofit", [*R, "window=0", "output_dir={missing}"], 2, "window must be > 0, got 0"),
    ("cache-topk-0", "cache_teacher", ["topk=0", "output_dir={missing}"], 2, "topk must be >= 1, got 0"),
    ("export-threads-negative", "export", ["source={run}", "output_dir={missing}", "threads=-2"], 2,
     "threads must be >= 0, got -2"),
    ("gate-floor-nan", "gate", [*GATE, "--floor", "nan"], 3, "floor must be a finite number in [-1, 1], got nan"),
    ("gate-max-drop-2", "gate", [*GATE, "--max-drop", "2"], 3, "max_drop must be in [0, 1), got 2"),
    ("gate-confidence", "gate", [*GATE, "--confidence", "0.3"], 3, "confidence must be in [0.5, 1), got 0.3"),
    ("gate-temperature-nan", "gate", [*GATE, "--temperature", "nan"], 3, "temperature must be a finite number > 0"),
    # -- config syntax: already clear before this issue, kept so
    ("unknown-key", "distill", [*D, "max_stepz=3"], 2, "unknown config key 'max_stepz' in the command line "
                                                      "(did you mean max_steps"),
    ("wrong-type", "distill", [*D, "max_steps=abc"], 2, "config key 'max_steps' expects int, got 'abc'"),
    ("int-given-float", "distill", [*D, "max_steps=2.5"], 2, "config key 'max_steps' expects int, got 2.5"),
    ("missing-config", "distill", ["--config", "{missing}/c.yaml"], 2, "does not exist; pass an existing YAML"),
    ("bad-yaml", "distill", ["--config", "{bad}"], 2, "is not valid YAML"),
    ("yaml-not-mapping", "distill", ["--config", "{listyaml}"], 2, "must be a mapping of key: value"),
    ("unknown-key-in-yaml", "distill", ["--config", "{unknown}"], 2, "unknown config key 'learning_rate'"),
    ("positional", "distill", ["oops"], 2, "cannot parse argument 'oops'; use key=value"),
    ("config-without-path", "distill", ["--config"], 2, "--config needs a path"),
    ("contradiction", "distill", [*D, "resume=latest", "overwrite=true", "output_dir={run}"], 2, "contradict"),
    ("cache-bad-yaml", "cache_teacher", ["--config", "{bad}"], 2, "is not valid YAML"),
    ("gate-unknown-flag", "gate", [*GATE, "--florr", "0.5"], 3, "unrecognized arguments: --florr"),
    ("gate-scorer-layer", "gate", [*GATE, "--scorer-layer", "9"], 3, "scorer_layer must be in [1, 6], got 9"),
    ("gate-missing-model", "gate", ["--candidate", "{missing}", "--baseline", "{model}", "--skip-lm-metrics"], 3,
     "missing"),
    ("export-missing-source", "export", ["source={missing}", "output_dir={root}/out"], 2, "does not exist"),
    ("export-int4", "export", ["source={run}", "output_dir={root}/out", "quantize=int4"], 2,
     "quantize=int4 is not available"),
    ("export-quant-gate-backend", "export", ["source={run}", "output_dir={root}/out", "quantize=int8",
                                             "quant_gate_backend=vllm"], 2, "quant_gate_backend"),
    ("export-quant-gate-prompts-missing", "export", ["source={run}", "output_dir={root}/out", "quantize=int8",
                                                     "quant_gate_prompts={missing}"], 2, "quant_gate_prompts:"),
    ("export-quant-gate-teacher-missing", "export", ["source={run}", "output_dir={root}/out", "quantize=int8",
                                                     "quant_gate_teacher={model}"], 2, "quant_gate_teacher:"),
    ("export-bad-dtype", "export", ["source={run}", "output_dir={root}/out", "dtype=fp8"], 2,
     "dtype=fp8 is not supported"),
    ("export-no-final", "export", ["source={run}", "output_dir={root}/out", "checkpoint=final"], 2,
     "has no final/"),
    ("plan-missing-config", "plan", ["--config", "{missing}/c.yaml"], 2, "does not exist"),
    ("plan-bad-gpus", "plan", ["--config", str(ROOT / "recipes/configs/deepseek_17b_to_7b.yaml"), "--gpus", "0"], 2,
     "--gpus must be >= 1"),
    # -- run folders: overwrite deletes only a run of ours; dangerous places are never used
    ("overwrite-notes", "distill", [*D, "output_dir={notes}", "overwrite=true"], 2,
     "has no .hybrid-distill-run marker, so it is not a run folder of ours; nothing was deleted"),
    ("run-into-notes", "distill", [*D, "output_dir={notes}"], 2, "already holds files that are not a run of ours"),
    ("overwrite-cwd", "distill", [*D, "output_dir=.", "overwrite=true"], 2, "is the current folder"),
    ("overwrite-home", "distill", [*D, "output_dir=~/", "overwrite=true"], 2, "is your home folder"),
    ("overwrite-parent-of-cwd", "distill", [*D, "output_dir=..", "overwrite=true"], 2, "contains the current folder"),
    ("checkout-parent", "distill", [*D, f"output_dir={ROOT.parent}"], 2, "contains the hybrid-distill checkout"),
    ("root", "distill", [*D, "output_dir=/"], 2, "is the filesystem root"),
    ("output-is-file", "distill", [*D, "output_dir={afile}"], 2, "is a file; choose a folder path"),
    ("overwrite-old-unmarked-run", "retrofit", [*R, "output_dir={oldrun}", "overwrite=true"], 2,
     "nothing was deleted"),
    ("retrofit-overwrite-notes", "retrofit", [*R, "output_dir={notes}", "overwrite=true"], 2,
     "not a run folder of ours"),
    ("run-exists", "distill", [*D, "max_steps=8", "output_dir={run}"], 2,
     "already holds a run; pass resume=latest to continue it, overwrite=true to replace it"),
    ("cache-overwrite-notes", "cache_teacher", ["output_dir={notes}", "overwrite=true"], 2,
     "is not a teacher cache (no meta.json); nothing was deleted"),
    ("cache-overwrite-cwd", "cache_teacher", ["output_dir=.", "overwrite=true"], 2, "is the current folder"),
    ("export-overwrite-notes", "export", ["source={run}", "output_dir={notes}", "overwrite=true"], 2,
     "is not an export written by recipes/export.py (no export.json); nothing was deleted"),
    # -- resume paths
    ("resume-latest-missing-dir", "distill", [*D, "resume=latest", "output_dir={missing}"], 2,
     "resume=latest but {missing} does not exist"),
]

# Cases that get as far as loading the (tiny) models before they are refused.
LOADING = [
    ("resume-changed-config", "distill", [*D, "max_steps=4", "seed=99", "lr=0.5", "resume=latest",
                                          "output_dir={run}"], 2,
     "resume would change the run's config (max_steps: 8 → 4, lr: 0.001 → 0.5, seed: 0 → 99) "
     "(max_steps may only grow); put the values back"),
    ("resume-bad-path", "distill", [*D, "max_steps=8", "resume={missing}/step-3", "output_dir={run}"], 2,
     "checkpoint {missing}/step-3 does not exist"),
]


def _fill(argv: list[str], w: dict) -> list[str]:
    return [a.format(**{k: str(v) for k, v in w.items()}) for a in argv]


def _check(case, world, capsys, one_line: bool = True) -> None:
    _, cli, argv, code, needle = case
    before = tree(world["root"])
    capsys.readouterr()
    got = CLIS[cli](_fill(argv, world))
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert got == code, err[-2000:]
    assert "Traceback" not in err
    if one_line:
        assert len(lines) == 1, err
    needle = needle.format(**{k: str(v) for k, v in world.items()})
    assert lines[-1].startswith("error: ") and needle in lines[-1], lines[-1]
    assert tree(world["root"]) == before, "the failed command changed files on disk"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the case: these inputs must be refused before one."""
    import distill.sources
    import eval.gate
    import serve.export

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")
    for module, name in [(distill.sources, "load_pair"), (serve.export, "load_student"), (eval.gate, "load_model"),
                         (eval.gate, "generate_outputs")]:
        monkeypatch.setattr(module, name, loaded)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_cleanly(case, world, capsys, no_model_loads):
    _check(case, world, capsys)


@pytest.mark.parametrize("case", LOADING, ids=[c[0] for c in LOADING])
def test_bad_input_after_the_models_load_fails_cleanly(case, world, capsys):
    _check(case, world, capsys, one_line=False)  # library warnings may precede the error line


def test_retrofit_launched_with_deepspeed_fails_before_the_run_folder(world, capsys, no_model_loads, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch --config_file <deepspeed>` sets
    _check(("retrofit-deepspeed", "retrofit", [*R, "output_dir={missing}"], 2,
            "retrofit.py trains small LoRA adapters with DDP, not DeepSpeed: launch it with launch/gpu_ddp.yaml"),
           world, capsys)


def test_the_table_covers_the_classes():
    assert len(CASES) + len(LOADING) >= 30
    assert {c[1] for c in CASES} == set(CLIS)


# --------------------------------------------------------------------------------------------
# End to end, as reported in issue 11
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_overwrite_on_a_folder_of_notes_deletes_nothing(tmp_path):
    """``mkdir notes && echo precious > notes/a.txt && python recipes/distill.py ... output_dir=notes overwrite=true``."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("precious\n")
    before = tree(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "recipes/distill.py"), "--config", TINY, "max_steps=2",
                           "output_dir=notes", "overwrite=true"], cwd=tmp_path, capture_output=True, text=True,
                          env=child_env(), timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: overwrite=true refused: notes has no .hybrid-distill-run marker, so it is not a run folder of ours; "
        "nothing was deleted; delete it yourself or choose another output_dir=")
    assert tree(tmp_path) == before


# --------------------------------------------------------------------------------------------
# Local sources that do not exist and output folders that cannot be made: refused before the run folder is
# claimed and before any model loads (they used to surface after the teacher loaded, or at the first write)
# --------------------------------------------------------------------------------------------

SOURCES = [
    ("output-under-a-file", "distill", [*D, "output_dir={afile}/x"], 2,
     "output_dir {afile}/x lies under {afile}, which is a file; choose another output_dir"),
    ("retrofit-output-under-a-file", "retrofit", [*R, "output_dir={afile}/x"], 2, "lies under {afile}, which is a file"),
    ("student-missing", "distill", [*D, "student={missing}/student", "output_dir={missing}"], 2,
     "student: model path {missing}/student does not exist; check the path"),
    ("student-not-a-model", "distill", [*D, "student={model}", "output_dir={missing}"], 2,
     "student: {model} has no config.json; point to an HF model directory"),
    ("teacher-missing", "distill", [*D, "teacher=./no-teacher", "output_dir={missing}"], 2,
     "teacher: model path ./no-teacher does not exist"),
    ("tokenizer-missing", "distill", [*D, "tokenizer=~/no-tokenizer", "output_dir={missing}"], 2,
     "tokenizer: model path ~/no-tokenizer does not exist"),
    ("dataset-missing", "distill", [*D, "dataset={missing}/train.jsonl", "output_dir={missing}"], 2,
     "dataset {missing}/train.jsonl does not exist; check the path"),
    ("dataset-missing-relative", "distill", [*D, "dataset=train.jsonl", "output_dir={missing}"], 2,
     "dataset train.jsonl does not exist; check the path"),
    ("eval-dataset-missing", "distill", [*D, "eval_dataset=./held-out", "output_dir={missing}"], 2,
     "eval_dataset ./held-out does not exist; check the path"),
    ("mixture-source-missing", "distill", [*D, "datasets=[{{source: builtin:stdlib-docs}}, {{source: ./b.parquet}}]",
                                           "output_dir={missing}"], 2,
     "datasets source ./b.parquet does not exist; check the path"),
    ("retrofit-dataset-missing", "retrofit", [*R, "dataset={missing}/a.txt", "output_dir={missing}"], 2,
     "dataset {missing}/a.txt does not exist; check the path"),
    ("retrofit-eval-dataset-missing", "retrofit", [*R, "eval_dataset=/no/such/dir", "output_dir={missing}"], 2,
     "eval_dataset /no/such/dir does not exist"),
]


@pytest.fixture
def no_recipe_model_loads(monkeypatch, no_model_loads):
    """The recipes hold their own references to the loaders: those fail the case too."""
    import recipes.distill
    import recipes.retrofit

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")
    for module in (recipes.distill, recipes.retrofit):
        monkeypatch.setattr(module, "load_models", loaded)


@pytest.mark.parametrize("case", SOURCES, ids=[c[0] for c in SOURCES])
def test_missing_sources_and_unmakeable_outputs_fail_before_the_run_folder(case, world, capsys,
                                                                          no_recipe_model_loads):
    _check(case, world, capsys)
