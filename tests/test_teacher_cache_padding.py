"""Teacher caches of a teacher whose head is padded beyond the tokenizer (e.g. a 152,064-row teacher for a
151,936-row student of one tokenizer): used, and holding only tokenizer tokens."""

from __future__ import annotations

import json
from types import SimpleNamespace

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
    tokenizer_fingerprint,
    write_shard,
)


def _cache(path, blocks, tok, vocab: int):
    """A sampled cache of ``blocks`` written as by a teacher whose head has ``vocab`` rows (ids < len(tok))."""
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*blocks.shape, vocab, generator=g)
    logits[..., len(tok):] = -1e4  # padding rows: never drawn
    ids, counts, lp = sample_teacher(logits, 6, 1.0, g)
    write_shard(path / "shard-00000.safetensors", ids, lp, counts)
    meta = {"mode": "sampled", "k": 6, "seq_len": blocks.shape[1], "blocks": blocks.shape[0],
            "fingerprint": fingerprint(blocks), "vocab_size": vocab, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "bytes_per_token": bytes_per_token("sampled", 6), "temperature": 1.0, "samples": 6}
    (path / META).write_text(json.dumps(meta))
    return ids


def test_a_cache_from_a_teacher_whose_vocab_differs_only_in_padding_rows_is_used(tmp_path):
    """The live teacher path accepts a teacher / student whose vocab sizes differ only in padding rows beyond
    the shared tokenizer (distill.model.check_pair: e.g. a Qwen2.5-7B teacher, 152064 rows, and a 0.5B
    student, 151936, one 151665-token tokenizer). The cache of that same teacher was refused as written
    'for a vocabulary of ...; cache with the student's tokenizer', although it was."""
    tok = tiny_tokenizer()  # 320 tokens
    blocks = torch.randint(0, 320, (3, 8), generator=torch.Generator().manual_seed(1))
    ids = _cache(tmp_path / "padded", blocks, tok, vocab=336)
    cache = TeacherCache(tmp_path / "padded", blocks, vocab_size=320, tokenizer=tok, temperature=1.0)
    assert torch.equal(cache.lookup(torch.tensor([2, 0]), "cpu").ids, ids[[2, 0]].long())
    # A student padded beyond the teacher, the same tokenizer: accepted too.
    _cache(tmp_path / "plain", blocks, tok, vocab=320)
    TeacherCache(tmp_path / "plain", blocks, vocab_size=384, tokenizer=tok, temperature=1.0)
    # Still refused: sizes that differ where no tokenizer shows they are padding, or a tokenizer longer
    # than a vocabulary (its ids would name rows the model does not have).
    with pytest.raises(TeacherCacheError, match="vocabulary of 336"):
        TeacherCache(tmp_path / "padded", blocks, vocab_size=320, temperature=1.0)
    with pytest.raises(TeacherCacheError, match="vocabulary of 336"):
        TeacherCache(tmp_path / "padded", blocks, vocab_size=320, tokenizer=_Sized(tok, 330), temperature=1.0)


class _Sized:
    """``tok`` whose ``len`` is ``n`` (the same token table)."""

    def __init__(self, tok, n: int):
        self.tok, self.n = tok, n

    def get_vocab(self):
        return self.tok.get_vocab()

    def __len__(self) -> int:
        return self.n


class _PaddedTeacher(torch.nn.Module):
    """A teacher whose head has padding rows beyond the tokenizer that still get real probability (an
    untrained padded head): logits ``[rows, seq, vocab]`` from a fixed table per input token."""

    def __init__(self, vocab: int, real: int):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        table = torch.randn(real, vocab, generator=g)
        table[:, real:] += 2.0  # the padding rows are likely
        self.table = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[input_ids])


@pytest.mark.parametrize("mode", ["sampled", "topk"])
def test_cached_targets_name_only_tokenizer_tokens_of_a_padded_teacher(mode):
    """A padded teacher head's extra rows are no tokens: cached ids there would be refused by the student's
    lookup mid-training (ids beyond its vocabulary) or train it towards rows no text has. The cache keeps the
    teacher's distribution over the tokenizer's tokens (renormalized, as check_pair's sliced live logits)."""
    from recipes.cache_teacher import CacheTeacherConfig, cache_shard

    real, vocab = 40, 48
    teacher = _PaddedTeacher(vocab, real)
    blocks = torch.randint(0, real, (3, 5), generator=torch.Generator().manual_seed(4))
    cfg = CacheTeacherConfig(teacher="tiny-random", seq_len=5, mode=mode, topk=6, samples=24, batch_size=2)
    bar = SimpleNamespace(update=lambda n: None)
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "shard-00000.safetensors"
        cache_shard(cfg, teacher, blocks, 0, path, bar, vocab=real)
        got = load_file(str(path))
    ids, lp = got["index"].long(), got["logprobs"].float()
    used = got["counts"] > 0 if mode == "sampled" else torch.ones_like(ids, dtype=torch.bool)
    assert int(ids[used].max()) < real
    naive = torch.log_softmax(teacher.table[blocks][..., :real].float(), -1)  # over the tokenizer's tokens
    assert torch.allclose(lp[used], naive.gather(-1, ids)[used], atol=2e-3)
    if mode == "topk":
        assert torch.equal(ids, naive.topk(6, -1).indices)
