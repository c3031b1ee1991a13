"""distill.teacher_cache: the numbers and edges the main cache tests do not pin down.

The tail mass a top-k cache reports, the stored bytes per token the planner budgets with, the
vocabulary edge of a lookup, a shard one byte short, and the sampling temperature a run must match.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.tiny import tiny_tokenizer
from distill.teacher_cache import (
    META,
    TeacherCache,
    TeacherCacheError,
    bytes_per_token,
    fingerprint,
    sample_teacher,
    slots_for_bytes,
    tail_mass,
    tokenizer_fingerprint,
    topk_logprobs,
    write_shard,
)

VOCAB = 320


def _cache(path: Path, blocks: torch.Tensor, tok, *, ids: torch.Tensor | None = None, temperature: float = 1.0,
           slots: int = 5) -> Path:
    """A one-shard sampled cache of ``blocks`` ``[n, seq]`` (``ids`` ``[n, seq, slots]`` replace the drawn ids)."""
    path.mkdir()
    logits = torch.randn(*blocks.shape, VOCAB, generator=torch.Generator().manual_seed(0))
    drawn, counts, lp = sample_teacher(logits, slots, temperature, torch.Generator().manual_seed(1))
    write_shard(path / "shard-00000.safetensors", drawn if ids is None else ids, lp, counts)
    meta = {"mode": "sampled", "k": slots, "seq_len": blocks.shape[1], "blocks": blocks.shape[0],
            "fingerprint": fingerprint(blocks), "vocab_size": VOCAB, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "bytes_per_token": bytes_per_token("sampled", slots), "temperature": temperature}
    (path / META).write_text(json.dumps(meta))
    return path


def test_tail_mass_is_the_probability_outside_the_top_k():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 50, generator=g) * 2
    probs = torch.softmax(logits.double(), -1)
    for k in (1, 5, 49, 50):
        _, top = topk_logprobs(logits, k)
        naive = 1.0 - probs.sort(-1, descending=True).values[..., :k].sum(-1)
        torch.testing.assert_close(tail_mass(top).double(), naive.clamp(min=0), rtol=0, atol=1e-5)
    _, all_of_it = topk_logprobs(logits, 50)
    assert tail_mass(all_of_it).abs().max() < 1e-5  # nothing outside a top-k that covers the vocabulary


@pytest.mark.parametrize("mode", ["topk", "sampled"])
def test_bytes_per_token_is_what_a_shard_stores_per_position(tmp_path, mode):
    """The planner's figure equals the tensor bytes a written shard holds per position, counts included."""
    slots, blocks, seq = 7, 3, 5
    logits = torch.randn(blocks, seq, VOCAB)
    if mode == "sampled":
        ids, counts, lp = sample_teacher(logits, slots)
    else:
        (ids, lp), counts = topk_logprobs(logits, slots), None
    shard = tmp_path / "shard-00000.safetensors"
    write_shard(shard, ids, lp, counts)
    with open(shard, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    data = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    assert data == bytes_per_token(mode, slots) * blocks * seq
    # and the inverse: the most slots a byte budget holds
    budget = bytes_per_token(mode, slots)
    assert slots_for_bytes(mode, budget) == slots and slots_for_bytes(mode, budget - 1) == slots - 1


def test_a_lookup_refuses_an_id_equal_to_the_vocabulary_size(tmp_path):
    """Ids run 0 .. vocab - 1: the first id past the end is refused in one line, the last one is read."""
    tok = tiny_tokenizer()
    blocks = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, VOCAB, (2, 6, 5), generator=torch.Generator().manual_seed(5))
    ids[1, 3, 0] = VOCAB - 1
    edge = TeacherCache(_cache(tmp_path / "edge", blocks, tok, ids=ids), blocks, vocab_size=VOCAB, tokenizer=tok,
                        temperature=1.0)
    assert int(edge.lookup(torch.tensor([1]), "cpu").ids.max()) == VOCAB - 1
    ids[1, 3, 0] = VOCAB
    past = TeacherCache(_cache(tmp_path / "past", blocks, tok, ids=ids), blocks, vocab_size=VOCAB, tokenizer=tok,
                        temperature=1.0)
    with pytest.raises(TeacherCacheError, match=f"beyond the student's vocabulary of {VOCAB}") as err:
        past.lookup(torch.tensor([0, 1]), "cpu")
    assert "\n" not in str(err.value)


def test_a_shard_one_byte_short_is_refused_when_the_cache_opens(tmp_path):
    tok = tiny_tokenizer()
    blocks = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6))
    path = _cache(tmp_path / "c", blocks, tok)
    TeacherCache(path, blocks, vocab_size=VOCAB, tokenizer=tok, temperature=1.0)  # whole: opens
    shard = path / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(TeacherCacheError, match="is truncated"):
        TeacherCache(path, blocks, vocab_size=VOCAB, tokenizer=tok, temperature=1.0)


def test_a_sampled_cache_is_refused_at_any_other_temperature(tmp_path):
    """Draws at T are unbiased for T only: a run at a nearby temperature is refused, the same one accepted."""
    tok = tiny_tokenizer()
    blocks = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    path = _cache(tmp_path / "c", blocks, tok, temperature=2.0)
    TeacherCache(path, blocks, vocab_size=VOCAB, tokenizer=tok, temperature=2.0)
    TeacherCache(path, blocks, vocab_size=VOCAB, tokenizer=tok, temperature=2.0 + 1e-12)  # float noise only
    for other in (2.0001, 1.9999, 2.5):
        with pytest.raises(TeacherCacheError, match="set temperature=2.0"):
            TeacherCache(path, blocks, vocab_size=VOCAB, tokenizer=tok, temperature=other)
