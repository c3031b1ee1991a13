"""student_init=prune in the distill recipe: the search ranks its candidates on held-out blocks that the run's
reported held-out evaluation (its first ``eval_blocks`` blocks of each source) does not score."""

from __future__ import annotations

import json

import pytest
import torch

from core.tiny import tiny_model, tiny_tokenizer
from distill import prune
from distill.config import DistillConfig
from distill.data import build_data
from distill.prune import PruneError
from tests.helpers import write_text_corpus


class Searched(Exception):
    """Raised by the stand-in search with what the recipe gave it: the data is under test, not the search."""


@pytest.fixture
def given(monkeypatch):
    seen: dict = {}

    def fake_search(teacher, calib, held, train, s, log, masks=None):
        seen.update(held=held, masks=masks, train=train)
        raise Searched()

    monkeypatch.setattr(prune, "search", fake_search)
    monkeypatch.setattr(prune, "_recipe_memo", {})
    return seen


def _search_data(cfg: DistillConfig, seen: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    with pytest.raises(Searched):
        prune.prune_for_recipe(tiny_model("llama", layers=2), tiny_tokenizer(), cfg, log=lambda _msg: None)
    return seen["held"], seen["masks"].heldout


def _rows(blocks: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(r.tolist()) for r in blocks}


def _reported(cfg: DistillConfig):
    """The held-out data the recipe reports its perplexity on (recipes/distill.py's build_data call)."""
    return build_data(tiny_tokenizer(), **cfg.data_args(), seq_len=cfg.seq_len, eval_blocks=cfg.eval_blocks,
                      progress=False)


def _words(seed: int, k: int) -> str:
    """``k`` random words: blocks of distinct documents then differ, so a shared row means a shared block."""
    import random

    vocab = "the quick brown fox jumps over a lazy dog and distills teacher into student while tokens flow".split()
    return " ".join(random.Random(seed).choices(vocab, k=k))


def _segments(data) -> list[torch.Tensor]:
    """Each source's held-out blocks, in source order."""
    return list(torch.split(data.eval, [r.eval_blocks for r in data.sources]))


def test_plain_text_ranks_on_the_heldout_blocks_after_the_reported_ones(tmp_path, given):
    text = write_text_corpus(tmp_path / "text.txt", lines=600)
    cfg = DistillConfig(datasets=[text], seq_len=16, eval_blocks=5, prune_eval_blocks=3, prune_calib_blocks=4,
                        data_cache=str(tmp_path / "c"))
    held, mask = _search_data(cfg, given)
    reported = _reported(cfg).eval
    assert reported.shape[0] == 5 and held.shape == (3, 16) and mask is None
    assert not _rows(held) & _rows(reported)
    # The next blocks of the same held-out split: held-out text, not training text.
    every = build_data(tiny_tokenizer(), **cfg.data_args(), seq_len=16, eval_blocks=8, progress=False).eval
    assert torch.equal(every[:5], reported) and torch.equal(held, every[5:8])
    assert not _rows(held) & _rows(given["train"][:])


def test_a_two_source_mixture_keeps_every_sources_reported_blocks_out(tmp_path, given):
    """The run reports on each source's first blocks; a suffix of the concatenated wider held-out set would
    still hold some of the second source's (here: 2 + 2 reported, 3 + 3 built, [4:] = the second's 2nd and 3rd)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"text": _words(i, 30)}) for i in range(400)))
    b.write_text("\n".join(json.dumps({"text": _words(10_000 + i, 30).upper()}) for i in range(400)))
    mix = [{"source": str(a), "weight": 1}, {"source": str(b), "weight": 1}]
    cfg = DistillConfig(datasets=mix, seq_len=16, eval_blocks=4, prune_eval_blocks=2, prune_calib_blocks=4,
                        data_cache=str(tmp_path / "c"))
    held, mask = _search_data(cfg, given)
    run = _reported(cfg)
    assert [r.eval_blocks for r in run.sources] == [2, 2] and held.shape == (2, 16) and mask is None
    assert not _rows(held) & _rows(run.eval)
    # One block past the reported ones from each source, by weight.
    every = _segments(build_data(tiny_tokenizer(), **cfg.data_args(), seq_len=16, eval_blocks=20, progress=False))
    assert all(e.shape[0] >= 3 for e in every)
    assert torch.equal(held, torch.stack([every[0][2], every[1][2]]))


def test_chat_ranking_blocks_and_their_completion_masks_follow_the_same_rows(tmp_path, given):
    rows = [{"messages": [{"role": "user", "content": _words(i, 8)},
                          {"role": "assistant", "content": _words(50_000 + i, 4 + i % 9)}]} for i in range(800)]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = DistillConfig(datasets=[str(chat)], seq_len=32, eval_blocks=4, prune_eval_blocks=3, prune_calib_blocks=4,
                        data_cache=str(tmp_path / "c"))
    held, mask = _search_data(cfg, given)
    run = _reported(cfg)
    assert run.eval_mask is not None and held.shape == (3, 32) and mask is not None and mask.shape == held.shape
    assert not _rows(held) & _rows(run.eval)
    every = build_data(tiny_tokenizer(), **cfg.data_args(), seq_len=32, eval_blocks=7, progress=False)
    assert torch.equal(held, every.eval[4:7]) and torch.equal(mask, every.eval_mask[4:7])
    assert 0 < int(mask.sum()) < mask.numel()  # prompt tokens masked out, targets kept


def test_too_few_heldout_blocks_for_both_is_one_line_naming_the_fix(tmp_path, given):
    text = write_text_corpus(tmp_path / "text.txt", lines=300)
    probe = DistillConfig(datasets=[text], seq_len=16, data_cache=str(tmp_path / "c"))
    have = build_data(tiny_tokenizer(), **probe.data_args(), seq_len=16, eval_blocks=10_000, progress=False)
    n = have.eval.shape[0]
    assert n >= 3
    cfg = DistillConfig(datasets=[text], seq_len=16, eval_blocks=n - 1, prune_eval_blocks=2, prune_calib_blocks=4,
                        data_cache=str(tmp_path / "c"))
    with pytest.raises(PruneError) as err:
        prune.prune_for_recipe(tiny_model("llama", layers=2), tiny_tokenizer(), cfg, log=lambda _msg: None)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and f"has {n} blocks" in msg and "lower prune_eval_blocks" in msg
    assert "held" not in given  # refused before the search touched the teacher
    # Exactly enough: the search runs, on the last two.
    held, _ = _search_data(DistillConfig(datasets=[text], seq_len=16, eval_blocks=n - 2, prune_eval_blocks=2,
                                         prune_calib_blocks=4, data_cache=str(tmp_path / "c")), given)
    assert torch.equal(held, have.eval[n - 2:])


def test_a_search_kept_for_one_eval_blocks_is_not_reused_for_another(tmp_path, monkeypatch):
    """The student searched in a process is kept for the same settings; another eval_blocks moves the ranking
    blocks (a reuse could hand a run a student picked on blocks it reports), so it searches again."""
    import dataclasses

    ranked = []
    real_search = prune.search

    def spy_search(teacher, calib, held, train, s, log, **kw):
        ranked.append(held)
        return real_search(teacher, calib, held, train, s, log, **kw)

    monkeypatch.setattr(prune, "search", spy_search)
    monkeypatch.setattr(prune, "_recipe_memo", {})
    cfg = DistillConfig(seq_len=32, eval_blocks=2, prune_calib_blocks=4, prune_eval_blocks=2, target_ratio=0.5,
                        prune_axes="depth", prune_search_steps=1, prune_top_k=1, prune_max_candidates=2,
                        micro_batch_size=2, max_train_blocks=8, output_dir=str(tmp_path / "run"))
    tok = tiny_tokenizer()
    prune.prune_for_recipe(tiny_model("llama", layers=2), tok, cfg, log=lambda _msg: None)
    prune.prune_for_recipe(tiny_model("llama", layers=2), tok, dataclasses.replace(cfg, output_dir=str(tmp_path / "b")),
                           log=lambda _msg: None)
    assert len(ranked) == 1  # same settings: kept
    wider = dataclasses.replace(cfg, eval_blocks=4, output_dir=str(tmp_path / "c"))
    prune.prune_for_recipe(tiny_model("llama", layers=2), tok, wider, log=lambda _msg: None)
    assert len(ranked) == 2
    reported = _reported(wider).eval
    assert torch.equal(reported[2:4], ranked[0]) and not _rows(ranked[1]) & _rows(reported)


def test_a_separate_eval_dataset_ranks_past_the_blocks_the_run_reports(tmp_path, given):
    train = write_text_corpus(tmp_path / "train.txt", lines=300)
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("\n".join(json.dumps({"text": _words(70_000 + i, 30)}) for i in range(60)))
    cfg = DistillConfig(datasets=[train], eval_dataset=str(heldout), seq_len=16, eval_blocks=6, prune_eval_blocks=3,
                        prune_calib_blocks=4, data_cache=str(tmp_path / "c"))
    held, _ = _search_data(cfg, given)
    reported = _reported(cfg).eval
    every = build_data(tiny_tokenizer(), **cfg.data_args(), seq_len=16, eval_blocks=9, progress=False).eval
    assert reported.shape[0] == 6 and torch.equal(held, every[6:9]) and not _rows(held) & _rows(reported)
