"""distill.prune against naive references: models cut by hand, scores computed unit by unit, search termination."""

from __future__ import annotations

import torch

from core.tiny import VOCAB, tiny_model
from distill.prune import SearchSettings, arch_of, count_params, search


def _blocks(n: int = 4, seq: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n, seq), generator=g)


def test_iterative_rounds_with_a_small_round_cut_always_shrink(monkeypatch):
    """max_round_cut below the tolerance puts the unpruned shape in a round's window; it (KL 0) won every round and
    the search never ended. Every intermediate round must cut something."""
    import distill.prune as prune

    teacher = tiny_model("llama", layers=4).requires_grad_(False)
    blocks = _blocks(6, 32)
    s = SearchSettings(target_ratio=0.9, top_k=1, finalists=2, max_candidates=4, search_steps=0, batch_size=2,
                       iterative=True, max_round_cut=0.05)
    sizes: list[tuple[int, int]] = []  # (a round's starting size, its winner's)
    real_round = prune.search_round

    def recording_round(model, *a, **k):
        assert len(sizes) < 12, f"no end to the rounds: {sizes}"
        out = real_round(model, *a, **k)
        sizes.append((count_params(model)[0], count_params(out[0])[0]))
        return out

    monkeypatch.setattr(prune, "search_round", recording_round)
    result = search(teacher, blocks[:4], blocks[4:], blocks[:4], s, log=lambda _msg: None)
    assert all(end < start for start, end in sizes[:-1]), sizes
    assert arch_of(result.model) != arch_of(teacher)
    assert abs(count_params(result.model)[0] - result.target) <= 0.03 * result.target
