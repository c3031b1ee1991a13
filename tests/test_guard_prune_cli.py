"""python -m distill.prune: a model it cannot reach is one line, not a traceback."""

import subprocess
import sys


def test_an_unreachable_model_is_one_line_naming_it(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "distill.prune", "--model", "someorg/nomodel", "--target-ratio", "0.5",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    # (optional packages may log their own import warnings above it)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --model someorg/nomodel:"), proc.stderr
    assert not (tmp_path / "out").exists()
