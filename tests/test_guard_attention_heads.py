"""The sample length that head scoring's error suggests is one that a rerun really fits."""

from __future__ import annotations

import re

import pytest
import torch

from attention import HybridAttentionConfig, HybridAttentionError
from core.tiny import tiny_model


class CharTokenizer:
    """One token per character: the needle and the question cost about 120 tokens, more than 64."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 300 for c in text]}


def hay() -> torch.Tensor:
    return torch.randint(3, 300, (4, 400), generator=torch.Generator().manual_seed(0))


def suggested(err: pytest.ExceptionInfo) -> int:
    msg = str(err.value)
    assert "\n" not in msg
    return int(re.search(r"pick a length of at least (\d+)", msg).group(1))


def test_needle_samples_suggest_a_length_that_fits():
    from attention.heads import needle_samples

    kw = dict(count=3, min_distance=100, min_start=20, seed=1)
    with pytest.raises(HybridAttentionError, match="pick a length") as err:
        needle_samples(CharTokenizer(), hay(), length=150, **kw)
    n = suggested(err)
    for length in range(n, n + 9):  # that length and every longer one
        assert all(len(s.ids) == length for s in needle_samples(CharTokenizer(), hay(), length=length, **kw))
    with pytest.raises(HybridAttentionError, match="pick a length"):  # and no shorter one
        needle_samples(CharTokenizer(), hay(), length=n - 1, **kw)


def test_head_roles_suggest_a_length_that_fits_under_the_bounds_that_grow_with_it():
    """find_head_roles keeps needles beyond min(sinks, length // 4) and min(window + 16, length // 2): at a
    longer length they lie further back, so "the filler needed now + 64" can fall short again."""
    from attention.heads import find_head_roles

    spec = HybridAttentionConfig(sink_tokens=8, window=40, global_every=0)
    model = tiny_model("llama", max_pos=1024)
    kw = dict(share=0.5, method="retrieval", samples=1, progress=False)
    with pytest.raises(HybridAttentionError, match="pick a length") as err:
        find_head_roles(model, CharTokenizer(), spec, hay(), length=100, **kw)
    n = suggested(err)
    for length in range(n, n + 9):
        out = find_head_roles(model, CharTokenizer(), spec, hay(), length=length, **kw)
        assert out.head_scores["sample_len"] == length and out.full_head_count(2, 2) == 2


@pytest.mark.parametrize("share", [1.5, -0.25])
def test_spread_roles_refuses_a_share_outside_0_1(share):
    """The benchmarks' --full-share: 1.5 made every head full (repeated pairs), -0.25 none, both silently."""
    from attention.heads import spread_roles

    with pytest.raises(HybridAttentionError, match=r"must be in \[0, 1\]") as err:
        spread_roles(HybridAttentionConfig(), 4, 2, share)
    assert "\n" not in str(err.value)
