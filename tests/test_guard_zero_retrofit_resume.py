"""The retrofit on two real DDP processes (gloo), killed after a checkpoint and resumed, against one process that
was never stopped: the same per-step losses, the same head roles read back from the checkpoint, and a ``final/``
whose merged weights and hybrid spec are the uninterrupted run's.

One process with ``grad_accum=2`` trains on the same global batch of 4 blocks per step as two processes with
``grad_accum=1`` (the data order splits each step's blocks by rank), so the two runs match to rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, child_env
from tests.test_distributed import _accelerate_bin, _launch_env

RETROFIT = ROOT / "recipes" / "retrofit.py"
SETTINGS = ["--config", str(ROOT / "recipes" / "configs" / "retrofit_tiny.yaml"), "max_steps=4", "save_every=2",
            "eval_every=0", "eval_blocks=2", "eval_seq_lens=[]", "longctx_lengths=[]", "threads=1"]


def _history(run: Path) -> list[dict]:
    return json.loads((run / "checkpoints" / "step-4" / "trainer_state.json").read_text())["history"]


def _ddp(*args: str) -> subprocess.CompletedProcess:
    cmd = [*_accelerate_bin(), "--config_file", str(ROOT / "launch" / "cpu_ddp_2proc.yaml"), "--main_process_port",
           "0", str(RETROFIT), *SETTINGS, *args]
    return subprocess.run(cmd, cwd=ROOT, env=_launch_env(cpu_ddp=True), capture_output=True, text=True, timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_retrofit_killed_and_resumed_matches_one_uninterrupted_process(tmp_path: Path) -> None:
    data = f"data_cache={tmp_path / 'data'}"
    one = subprocess.run([sys.executable, str(RETROFIT), *SETTINGS, f"output_dir={tmp_path / 'one'}", data,
                          "grad_accum=2"], cwd=ROOT, env=child_env(OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    run = tmp_path / "ddp"
    killed = _ddp(f"output_dir={run}", data, "debug_exit_at_step=3")
    assert killed.returncode != 0 and not (run / "final").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    resumed = _ddp(f"output_dir={run}", data, "resume=latest")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "resumed from" in resumed.stdout and "choosing them again" not in resumed.stdout + resumed.stderr

    assert json.loads((run / "summary.json").read_text())["num_processes"] == 2
    a, b = _history(tmp_path / "one"), _history(run)
    assert [h["step"] for h in b] == [1, 2, 3, 4]
    for key in ("loss", "kd", "ce"):
        assert [h[key] for h in b] == pytest.approx([h[key] for h in a], rel=1e-5, abs=1e-7), key
    spec = [json.loads((r / "final" / "config.json").read_text())["hybrid_attention"] for r in (tmp_path / "one", run)]
    assert spec[0] == spec[1] and spec[0]["full_heads"]  # the roles chosen before LoRA, read back on resume
    merged = [load_file(str(r / "final" / "model.safetensors")) for r in (tmp_path / "one", run)]
    assert sorted(merged[0]) == sorted(merged[1]) and not any(".lora_" in k for k in merged[1])
    for key, value in merged[0].items():
        torch.testing.assert_close(merged[1][key], value, rtol=1e-5, atol=1e-6, msg=key)
