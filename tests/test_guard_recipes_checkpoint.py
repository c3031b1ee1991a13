"""A checkpoint is never written from NaN/inf weights: the run stops on the last good one, which stays."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core import checkpoint as ckpt
from core.checkpoint import COMPLETE, NonFiniteWeights, TrainingDiverged, nonfinite_weights, refuse_nonfinite

ROOT = Path(__file__).resolve().parents[1]

# Runs a recipe whose optimizer step number POISON_AT (1-based, counted in this process) leaves +inf in the first
# trained tensor, as an overflowing update would, while that step's loss stays finite.
POISONING = """import os, runpy, sys
import torch
import distill.training as training
real, calls = training.train_step, [0]
def poisoned(accelerator, model, optimizer, scheduler, params, *args, **kwargs):
    terms = real(accelerator, model, optimizer, scheduler, params, *args, **kwargs)
    calls[0] += 1
    if calls[0] == int(os.environ["POISON_AT"]):
        with torch.no_grad():
            params[0].view(-1)[0] = float("inf")
    return terms
training.train_step = poisoned
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_poisoned(recipe: str, args: list[str], at: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", POISONING, recipe, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "POISON_AT": str(at)}, timeout=600)


def _naive_bad(tensors: list[torch.Tensor]) -> int:
    return sum(not bool(torch.isfinite(t.float()).all()) for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_count_matches_a_per_element_check(dtype):
    g = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    tensors = [torch.randn(7, 5, generator=g).to(dtype) for _ in range(6)]
    tensors.append(torch.full((1000,), big, dtype=dtype))  # finite, but its sum overflows the dtype itself
    tensors[1].view(-1)[3] = float("nan")
    tensors[4].view(-1)[0] = float("-inf")
    tensors[5].view(-1)[0], tensors[5].view(-1)[1] = float("inf"), float("-inf")  # sums to NaN, not to 0
    named = [(f"w{i}", t) for i, t in enumerate(tensors)]
    count, first = nonfinite_weights(named)
    assert count == _naive_bad(tensors) == 3 and first == "w1"
    assert nonfinite_weights([("a", tensors[0]), ("big", tensors[-1])]) == (0, None)


def test_zero3_placeholders_are_checked_through_their_local_shard():
    """Under ZeRO-3 a parameter is an empty placeholder; this process's part lives in ``ds_tensor``."""
    placeholder = torch.nn.Parameter(torch.empty(0))
    placeholder.ds_tensor = torch.tensor([1.0, float("nan")])
    assert nonfinite_weights([("p", placeholder)]) == (1, "p")
    placeholder.ds_tensor = torch.ones(3)
    assert nonfinite_weights([("p", placeholder), ("empty", torch.empty(0))]) == (0, None)


def test_a_gathered_zero3_parameter_is_checked_through_its_partition_not_its_stale_full_copy():
    """A ZeRO-3 parameter still gathered after the step (full data, numel > 0) holds the weights from before the
    update, which went into its partition: the partition is what the checkpoint saves, so it is what counts."""
    gathered = torch.nn.Parameter(torch.ones(4))
    gathered.ds_tensor = torch.tensor([1.0, float("inf")])
    assert nonfinite_weights([("g", gathered)]) == (1, "g")
    gathered.ds_tensor = torch.ones(2)
    gathered.data[0] = float("nan")  # a stale full copy is not what is saved
    assert nonfinite_weights([("g", gathered)]) == (0, None)


def _complete(root: Path, step: int) -> Path:
    folder = root / "checkpoints" / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (folder / COMPLETE).write_text("")
    return folder


def test_refusal_names_the_last_good_checkpoint_before_the_step_and_touches_nothing(tmp_path):
    _complete(tmp_path, 2)
    _complete(tmp_path, 4)
    _complete(tmp_path, 8)  # a rewound run's checkpoint past the step: not the one to resume from
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    w = torch.nn.Parameter(torch.tensor([1.0, float("inf")]))
    seen = []

    def reduce(t):
        seen.append(t.clone())
        return t

    with pytest.raises(NonFiniteWeights) as err:
        refuse_nonfinite([("student.w", w)], tmp_path, 6, reduce=reduce)
    msg = str(err.value)
    assert isinstance(err.value, TrainingDiverged) and err.value.exit_code == 3 and "\n" not in msg
    assert f"last good checkpoint is {tmp_path / 'checkpoints' / 'step-4'}" in msg and "student.w" in msg
    assert f"resume={tmp_path / 'checkpoints' / 'step-4'}" in msg  # resume=latest would take step-8
    assert seen and float(seen[0]) == 1.0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    # Another process's bad shard stops this one too (the reduced count), with no name of its own.
    with pytest.raises(NonFiniteWeights, match=r"in 1 trained weight tensor\(s\) while"):
        refuse_nonfinite([("ok", torch.ones(2))], tmp_path, 3, reduce=lambda t: t + 1)
    refuse_nonfinite([("ok", torch.ones(2))], tmp_path, 3, reduce=lambda t: t)  # all finite everywhere: passes


@pytest.mark.slow
def test_distill_refuses_a_poisoned_checkpoint_and_keeps_the_good_one(tmp_path):
    """Step 3 leaves inf in the weights with a finite loss. Before, step-3 was written (and, keep_checkpoints=1,
    step-2 pruned): the only checkpoint left was poisoned, and step 4's NaN named it as the last good one."""
    out = tmp_path / "run"
    proc = run_poisoned("recipes/distill.py", ["--config", "recipes/configs/tiny.yaml", f"output_dir={out}",
                                               "max_steps=4", "save_every=1", "keep_checkpoints=1", "eval_every=0"],
                        at=3)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = re.findall(r"error: .*", proc.stderr)  # one line, which the progress bar may share
    assert len(errors) == 1, proc.stderr[-3000:]
    last = errors[0]
    good = out / "checkpoints" / "step-2"
    assert last.startswith("error: step 3 left NaN/inf") and f"last good checkpoint is {good}" in last, last
    assert "resume=latest" in last and "Traceback" not in proc.stderr
    assert ckpt.complete_checkpoints(out) == [good] and (good / "model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    assert not (out / "final").exists()


@pytest.mark.slow
def test_retrofit_refuses_a_poisoned_checkpoint_and_keeps_the_good_one(tmp_path):
    out = tmp_path / "run"
    proc = run_poisoned("recipes/retrofit.py", ["--config", "recipes/configs/retrofit_tiny.yaml", f"output_dir={out}",
                                                "max_steps=3", "save_every=1", "keep_checkpoints=1", "eval_every=0",
                                                "longctx_lengths=[]", "eval_seq_lens=[]", "full_head_share=0"], at=2)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = re.findall(r"error: .*", proc.stderr)
    good = out / "checkpoints" / "step-1"
    assert len(errors) == 1 and errors[0].startswith("error: step 2 left NaN/inf") and "lora_" in errors[0]
    assert f"last good checkpoint is {good}" in errors[0]
    assert ckpt.complete_checkpoints(out) == [good]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"] and not (out / "final").exists()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("launch", ["cpu_ddp_2proc.yaml", "deepspeed_zero3.yaml"])
def test_a_bad_shard_on_one_rank_stops_every_rank_before_the_save(tmp_path, launch):
    """Two processes (gloo, CPU); only rank 1's weights go bad at step 3. Every rank learns it through the
    summed count and stops: rank 0 neither writes step-3 nor waits forever at the save for the rank that left.
    Under ZeRO-3 (DeepSpeed on the CPU) the inf goes into rank 1's own shard of a real partitioned parameter
    (``ds_tensor``; the parameter itself is an empty placeholder there), which is what the check reads."""
    from tests.test_distributed import LAUNCH, _accelerate_bin, _launch_env

    harness = tmp_path / "poisoning.py"
    harness.write_text(POISONING.replace('if calls[0] == int(os.environ["POISON_AT"]):',
                                         'if calls[0] == int(os.environ["POISON_AT"]) and os.environ["RANK"] == "1":')
                       .replace("params[0].view(-1)[0]", "getattr(params[0], 'ds_tensor', params[0]).view(-1)[0]"))
    out = tmp_path / "run"
    zero3 = launch.startswith("deepspeed")
    extra = ["--num_processes", "2", "--mixed_precision", "no"] if zero3 else []
    cmd = [*_accelerate_bin(), "--config_file", str(LAUNCH / launch), "--main_process_port", "0", *extra,
           str(harness), "recipes/distill.py", "--config", "recipes/configs/tiny.yaml", f"output_dir={out}",
           "max_steps=4", "save_every=1", "keep_checkpoints=1", "eval_every=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**_launch_env(cpu_ddp=not zero3), "POISON_AT": "3"}, capture_output=True,
                          text=True, timeout=420)
    assert proc.returncode != 0
    # Each rank's line ends at the next "error: " too: two ranks' lines can land on one line (a progress bar holds it).
    errors = re.findall(r"error: step 3 left NaN/inf in 1 trained weight tensor\(s\)(?:(?!error: ).)*",
                        proc.stdout + proc.stderr)
    # Rank 0's own weights are finite: only the summed count can stop it, and its line names no tensor (rank 1's
    # line, naming it, may be cut off when the launcher ends the group after the first rank exits).
    assert any("(first: " not in e for e in errors), (proc.stdout + proc.stderr)[-4000:]
    assert all(f"last good checkpoint is {out / 'checkpoints' / 'step-2'}" in e for e in errors)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
