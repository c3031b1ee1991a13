"""bench/vs_trl.py: a clean exit without TRL, and the same losses as TRL's GKD trainer with it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_exits_cleanly_and_says_how_to_install_without_trl():
    code = ("import runpy, sys; sys.modules['trl'] = None; sys.argv = ['bench/vs_trl.py']; "
            "runpy.run_path('bench/vs_trl.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pip install" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] == "trl not installed"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs the optional trl package")
def test_recipe_and_trl_train_the_same_student():
    """Same pair, blocks, order, optimizer and schedule: the per-step losses agree (the random tiny pair)."""
    proc = subprocess.run([sys.executable, "bench/vs_trl.py", "--shapes", "tiny", "--demo-steps", "3",
                           "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["loss_diff"] < 1e-4
    assert result["speedup_tiny"] > 0 and result["rss_ratio_tiny"] > 0
    assert "losses per step" in proc.stderr
