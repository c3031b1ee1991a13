"""bench/ scripts against naive references: each JSON key is the quantity its name says."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from core.tiny import save_tiny

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefix_cache_hit_tokens_per_request_counts_the_timed_requests_only(tmp_path, monkeypatch, capsys):
    # Header 64 tokens, suffix 64: a timed request restores the header (two 32-token blocks) and no more; the
    # untimed greedy check repeats whole prompts already seen, which also restore a block of their suffix.
    model = save_tiny(tmp_path / "tiny")
    monkeypatch.setattr(sys, "argv", ["prefix_cache.py", "--model", str(model), "--prefix", "64", "--suffix", "64",
                                      "--reps", "1", "--threads", "1", "--check-tokens", "1"])
    _load("prefix_cache").main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["hit_tokens_per_request"] == 64
