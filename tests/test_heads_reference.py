"""attention.heads.head_scores against a naive per-head count over eager attention probabilities: biased projections
(Qwen2), four query heads per KV head and one, three layers, single- and multi-key samples."""

from __future__ import annotations

import pytest
import torch

from core.tiny import tiny_model


class CharTokenizer:
    """One token per character (ids 3..): digits tokenize the same in and out of context."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 300 for c in text]}


@pytest.mark.parametrize("arch,heads,kv_heads", [("qwen2", 8, 2), ("mistral", 4, 4)])
def test_head_scores_match_a_naive_eager_count(arch, heads, kv_heads):
    from attention.heads import head_scores, needle_samples

    shape = dict(layers=3, heads=heads, kv_heads=kv_heads)
    model = tiny_model(arch, seed=3, **shape)
    hay = torch.randint(3, 300, (2, 300), generator=torch.Generator().manual_seed(0))
    samples = needle_samples(CharTokenizer(), hay, count=2, length=240, min_distance=40, seed=2)
    samples += needle_samples(CharTokenizer(), hay, count=1, length=300, min_distance=40, seed=3, keys=2)
    got = head_scores(model, samples, progress=False)
    eager = tiny_model(arch, seed=3, attn_implementation="eager", **shape)
    hit, mass, total = torch.zeros(3, heads), torch.zeros(3, heads), 0
    for s in samples:
        with torch.no_grad():
            probs = eager(torch.tensor([s.ids[:-1]]), output_attentions=True).attentions  # layers x [1, heads, q, k]
        for layer, a in enumerate(probs):
            for h in range(heads):
                for r, (pos, token) in enumerate(zip(s.key_positions, s.ids[s.answer_start:])):
                    row = a[0, h, s.answer_start - 1 + r]  # the query that predicts answer token r
                    assert s.ids[pos] == token
                    hit[layer, h] += float(int(row.argmax()) == pos)
                    mass[layer, h] += float(row[pos])
        total += len(s.ids) - s.answer_start
    group = heads // kv_heads  # query head h reads KV head h // group: a KV head scores its group's best
    for name, ref in (("retrieval", hit), ("mass", mass)):
        want = torch.stack([(ref[:, k * group:(k + 1) * group] / total).amax(-1) for k in range(kv_heads)], -1)
        torch.testing.assert_close(got[name], want, atol=1e-6, rtol=0)
    assert got["mass"].shape == (3, kv_heads) and got["mass"].max() > 0
