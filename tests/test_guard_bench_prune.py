"""bench/prune.py: the search ranks its candidates on held-out blocks other than those that score every student."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("bench_prune", Path(__file__).resolve().parents[1] / "bench" / "prune.py")
prune_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prune_bench)


class Stop(Exception):
    pass


def test_ranking_blocks_are_not_the_scored_ones(monkeypatch):
    """Run the bench up to its two held-out sets (tiny teacher, real data path) and compare them."""
    import core.models
    import distill.prune
    import distill.student
    from core.tiny import tiny_model, tiny_tokenizer
    from distill.data import BUILTIN, build_data

    tok = tiny_tokenizer()
    seen: list[torch.Tensor] = []

    class RecordingHeldOut:
        def __init__(self, teacher, blocks, batch_size, mask=None):
            seen.append(blocks.clone())
            if len(seen) == 2:
                raise Stop

    monkeypatch.setattr(core.models, "load_tokenizer", lambda *a, **k: tok)
    monkeypatch.setattr(core.models, "load_causal_lm", lambda *a, **k: tiny_model())
    monkeypatch.setattr(distill.student, "derive_student", lambda teacher, layers: tiny_model())
    monkeypatch.setattr(distill.prune, "HeldOut", RecordingHeldOut)
    monkeypatch.setattr(sys, "argv", ["bench/prune.py", "--seq-len", "32", "--eval-blocks", "6", "--rank-blocks", "3",
                                      "--threads", "1"])
    with pytest.raises(Stop):
        prune_bench.main()
    scored, ranked = seen
    assert scored.shape[0] == 6 and ranked.shape[0] == 3
    rows_scored = {tuple(r.tolist()) for r in scored}
    assert not any(tuple(r.tolist()) in rows_scored for r in ranked)
    # The scored blocks are the same first six a plain 6-block split gives: earlier results stay comparable.
    assert torch.equal(scored, build_data(tok, dataset=BUILTIN, seq_len=32, eval_blocks=6).eval)


def test_split_refuses_too_few_blocks():
    blocks = torch.arange(40).view(10, 4)
    scored, ranked = prune_bench.split_heldout(blocks, 7, 3)
    assert torch.equal(scored, blocks[:7]) and torch.equal(ranked, blocks[7:])
    with pytest.raises(SystemExit, match="fewer than --eval-blocks 8 \\+ --rank-blocks 3"):
        prune_bench.split_heldout(blocks, 8, 3)
    with pytest.raises(SystemExit, match="at least 1"):
        prune_bench.split_heldout(blocks, 8, 0)
