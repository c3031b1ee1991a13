"""The distill recipe on a weighted mixture with chat data and a token budget, through its real CLI."""

import json
import math
import subprocess
import sys

from tests.helpers import ROOT, child_env


def test_recipe_trains_a_mixture_with_chat_data_for_a_token_budget(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"the teacher distills {i} " * 20}) for i in range(200)) + "\n")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i} " * 5},
                                                       {"role": "assistant", "content": f"answer {i} " * 8}]})
                              for i in range(200)) + "\n")
    mixture = f"[{{source: {text}, weight: 3}}, {{source: {chat}, weight: 1}}]"
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml", f"output_dir={out}",
         f"datasets={mixture}", "max_tokens=500", "eval_every=0", "save_every=0", "attn_weight=0",
         f"data_cache={tmp_path / 'cache'}"],
        cwd=ROOT, capture_output=True, text=True, env=child_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == math.ceil(500 / (2 * 64)) == 4  # micro 2 x seq 64 per step
    data = summary["data"]
    assert set(data) == {"text.jsonl", "chat.jsonl"} and data["text.jsonl"]["weight"] == 3.0
    assert data["chat.jsonl"]["epochs"] > 0 and math.isfinite(summary["final_loss"])
    assert "data           chat.jsonl: weight 1" in proc.stdout

    bad = subprocess.run(
        [sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml", f"output_dir={tmp_path / 'b'}",
         f"datasets=[{{source: {text}, weight: 0}}]"],
        cwd=ROOT, capture_output=True, text=True, env=child_env(), timeout=600)
    last = bad.stderr.strip().splitlines()[-1]  # (earlier lines: library import warnings, not ours)
    assert bad.returncode == 2 and last.startswith("error: ") and "weights must be > 0" in last
    assert "Traceback" not in bad.stderr
