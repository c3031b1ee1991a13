"""Resume after a kill equals the uninterrupted run, for the settings the other resume tests leave out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT, write_text_corpus


def _distill(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml", *args],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ), timeout=600)


@pytest.mark.slow
def test_distill_resume_with_grad_accum_on_policy_rows_and_a_streamed_dataset(tmp_path):
    """grad_accum=2, a streamed corpus, and on-policy micro-batches 3 and 7 (fraction 1/4) served by one rollout
    of two rows: the checkpoint after step 2 holds the row step 4 trains on, and the stream is re-read up to
    step 2's blocks. The resumed run ends on the same weights and the same per-step losses."""
    corpus = write_text_corpus(tmp_path / "corpus.txt")
    common = ["max_steps=4", "save_every=2", "eval_every=0", "grad_accum=2", "streaming=true", f"dataset={corpus}",
              "on_policy_fraction=0.25", "gen_batch_size=1", "gen_rollout_rows=2", "gen_max_new_tokens=8",
              "gen_prompt_tokens=8"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = _distill([*common, f"output_dir={full}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _distill([*common, f"output_dir={killed}", "debug_exit_at_step=3"]).returncode == 137
    queued = json.loads((killed / "checkpoints" / "step-2" / "rank0_state.json").read_text())["queue"]
    assert len(queued) == 1  # the rollout's second row, rolled out at step 2, trained on at step 4
    proc = _distill([*common, f"output_dir={killed}", "resume=latest"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [[json.loads(line)["loss"] for line in (p / "metrics.jsonl").read_text().splitlines()]
              for p in (full, killed)]
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-6, abs=1e-7)
    wa, wb = (load_file(str(p / "final" / "model.safetensors")) for p in (full, killed))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
