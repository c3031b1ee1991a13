"""distill.prune.select: the kept units are the best ones by total score, ties keep the lower index."""

from __future__ import annotations

import itertools

import torch

from distill.prune import Arch, Scores, select


def _scores(layers=3, kv=3, group=2, inter=10, hidden=8, seed=0) -> Scores:
    g = torch.Generator().manual_seed(seed)
    return Scores(blocks=torch.rand(layers, generator=g), heads=torch.rand(layers, kv, group, generator=g),
                  neurons=torch.rand(layers, inter, generator=g), channels=torch.rand(hidden, generator=g))


def _kept_total(heads: torch.Tensor, q_sel: list[int], group: int) -> float:
    """Total score of the kept query heads ``q_sel`` (numbered ``kv_group * group + head``) of one layer."""
    return float(sum(heads[q // group, q % group] for q in q_sel))


def test_kept_heads_are_the_subset_with_the_largest_total_score():
    """Over every choice of KV groups (each keeping its best query heads), select's choice scores highest."""
    for seed in range(20):
        s = _scores(seed=seed, kv=4, group=3)
        arch = Arch(layers=3, hidden=8, kv_heads=2, group=2, intermediate=10)
        sel = select(s, arch)
        for li, layer in enumerate(sel.layers):
            heads = s.heads[layer]
            best = max(sum(float(heads[g].sort(descending=True).values[:2].sum()) for g in groups)
                       for groups in itertools.combinations(range(4), 2))
            assert len(sel.kv_heads[li]) == 2 and len(sel.q_heads[li]) == 4
            assert all(q // 3 in sel.kv_heads[li] for q in sel.q_heads[li])  # query heads of the kept groups
            assert abs(_kept_total(heads, sel.q_heads[li], 3) - best) < 1e-6


def test_a_group_with_two_good_heads_beats_a_group_with_one_great_head():
    heads = torch.tensor([[[1.0, 1.0], [1.5, 0.1]]])  # group 0 sums to 2.0, group 1 to 1.6
    s = Scores(blocks=torch.ones(1), heads=heads, neurons=torch.ones(1, 4), channels=torch.ones(4))
    sel = select(s, Arch(layers=1, hidden=4, kv_heads=1, group=2, intermediate=4))
    assert sel.kv_heads == [[0]] and sel.q_heads == [[0, 1]]


def test_ties_keep_the_lower_index_and_the_kept_indices_are_sorted():
    s = Scores(blocks=torch.tensor([0.5, 0.9, 0.5, 0.5]),
               heads=torch.tensor([[[0.2, 0.7], [0.7, 0.7]]] * 4),
               neurons=torch.tensor([[0.3, 0.3, 0.3, 0.1, 0.3]] * 4),
               channels=torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0, 0.0]))
    sel = select(s, Arch(layers=2, hidden=3, kv_heads=1, group=1, intermediate=2))
    assert sel.layers == [0, 1]  # 0.9 first, then the lowest of the tied 0.5s
    assert sel.channels == [0, 1, 2]
    assert sel.neurons == [[0, 1], [0, 1]]
    # group 0's best head (0.7) ties group 1's best (0.7): the lower group wins, its best head is kept
    assert sel.kv_heads == [[0], [0]] and sel.q_heads == [[1], [1]]
    # and one wider: group 1 keeps both of its tied heads, lower index first
    sel = select(s, Arch(layers=1, hidden=3, kv_heads=1, group=2, intermediate=2))
    assert sel.kv_heads == [[1]] and sel.q_heads == [[2, 3]]
