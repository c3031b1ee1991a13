"""eval.metrics and eval.longctx: which positions count, whose stats come back, where the needle goes."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from core.tiny import tiny_model, tiny_tokenizer
from core.tiny import tiny_teacher_tokenizer as longctx_tokenizer
from eval import longctx
from eval.metrics import LMStats, batch_stats, text_windows, window_stats


def _logits(batch: int, seq: int, vocab: int = 30, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, vocab, generator=g) * 2, torch.randint(0, vocab, (batch, seq), generator=g)


def test_a_left_padded_row_scores_exactly_its_unpadded_tokens():
    """A padding position never predicts the first real token (its own input is not a real token)."""
    logits, ids = _logits(2, 10)
    ref = torch.randn(2, 10, 30, generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0  # row 0: three pads on the left
    padded = batch_stats(logits, ids, mask, ref_logits=ref)
    alone = [batch_stats(logits[0:1, 3:], ids[0:1, 3:], ref_logits=ref[0:1, 3:]),
             batch_stats(logits[1:2], ids[1:2], ref_logits=ref[1:2])]
    total = LMStats().add(alone[0]).add(alone[1])
    assert padded.tokens == padded.ref_tokens == total.tokens == 6 + 9
    assert padded.nll_sum == pytest.approx(total.nll_sum, rel=1e-6)
    assert padded.kl_sum == pytest.approx(total.kl_sum, rel=1e-6) and padded.agree == total.agree


def test_a_position_counts_when_its_label_is_a_target():
    """``loss_mask`` marks target tokens; the prediction of token t + 1 (made at t) counts when t + 1 is one."""
    logits, ids = _logits(2, 9, seed=1)
    loss_mask = torch.zeros(2, 9, dtype=torch.bool)
    loss_mask[0, 4:7] = True  # an assistant turn of three tokens
    loss_mask[1, 1] = True
    loss_mask[1, 8] = True
    st = batch_stats(logits, ids, loss_mask=loss_mask)
    rows = [(b, t) for b in range(2) for t in range(8) if loss_mask[b, t + 1]]
    assert st.tokens == len(rows) == 5
    naive = sum(F.cross_entropy(logits[b, t][None], ids[b, t + 1][None], reduction="sum").item() for b, t in rows)
    assert st.nll_sum == pytest.approx(naive, rel=1e-6)


def test_window_stats_return_the_references_own_stats_beside_the_models():
    """The second list is the reference scored on its own (its loss and perplexity), not the model's again."""
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    tok = tiny_tokenizer()
    text = "the quick brown fox jumps over the lazy dog. héllo wörld ✓ " * 6
    windows, nbytes = text_windows(tok, text, 24)
    own, ref_own = window_stats(model, windows, nbytes, reference=other, batch_size=3)
    alone, _ = window_stats(other, windows, nbytes, batch_size=3)
    mine, _ = window_stats(model, windows, nbytes, batch_size=3)
    assert len(ref_own) == len(alone) == len(windows)
    for r, a, m in zip(ref_own, alone, mine):
        assert r.tokens == a.tokens and r.bytes == a.bytes
        assert r.nll_sum == pytest.approx(a.nll_sum, rel=1e-5)
        assert r.nll_sum != pytest.approx(m.nll_sum, rel=1e-3)  # two different models
    assert [o.nll_sum for o in own] == pytest.approx([m.nll_sum for m in mine], rel=1e-5)


def test_with_bos_the_bytes_cover_the_whole_text_even_where_the_first_token_starts_later():
    """BOS predicts the text from byte 0: leading whitespace a tokenizer strips still counts for bits per byte."""
    from tokenizers import normalizers

    tok = tiny_tokenizer()
    tok.backend_tokenizer.normalizer = normalizers.Strip()
    text = "  \n the quick brown fox jumps over the lazy dog. " * 3
    first = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][0][0]
    assert first > 0  # the case at hand: the first token starts past byte 0
    for seq_len in (8, 1000):
        _, nbytes = text_windows(tok, text, seq_len)
        assert sum(nbytes) == len(text.encode())


class _SlowTokenizer:
    """A tokenizer without offsets (``is_fast`` False): one id per character, optionally a BOS."""

    is_fast = False

    def __init__(self, bos: int | None):
        self.bos_token_id = bos

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict:
        return {"input_ids": [3 + ord(c) % 40 for c in text]}


@pytest.mark.parametrize("bos", [None, 1])
@pytest.mark.parametrize("seq_len", [2, 3, 4, 7, 512])
def test_without_offsets_the_window_bytes_still_add_up_to_the_text(bos, seq_len):
    """A slow tokenizer's windows share the text's bytes by predicted tokens. Rounded window by window, the
    shares missed the text's size (25 of 26 bytes, 1000 of 1001), and bits per byte was off by as much."""
    for text in ("ab cd ef gh ij kl mn op qr", "héllo wörld ✓ naïve café", "x" * 1001):
        windows, nbytes = text_windows(_SlowTokenizer(bos), text, seq_len)
        assert sum(nbytes) == len(text.encode())
        predicted = [len(w) - 1 for w in windows]
        assert sum(predicted) == len(text) - (bos is None)
        # each window's share stays within one byte of its exact share
        total, pred = len(text.encode()), sum(predicted)
        assert all(abs(b - total * p / pred) <= 1 for b, p in zip(nbytes, predicted))


@pytest.fixture(scope="module")
def tok():
    return longctx_tokenizer()


@pytest.mark.parametrize("kind", longctx.KINDS)
def test_the_needle_sits_at_the_sentence_boundary_nearest_its_depth(tok, kind):
    """Before the needle lie ``depth × sentences`` filler sentences, to the nearest whole sentence."""
    fillers = [longctx._enc(tok, " " + s) for s in longctx.FILLER]

    def sentences(ids: list[int]) -> int:
        """Filler sentences in ``ids`` (they are laid whole, back to back)."""
        n, i = 0, 0
        while i < len(ids):
            hit = next((f for f in fillers if ids[i:i + len(f)] == f), None)
            i += len(hit) if hit else 1
            n += hit is not None
        return n

    for depth in (0.1, 0.3, 0.45, 0.5, 0.7, 0.9):
        for trial in range(3):
            s = longctx.build_sample(tok, kind, 600, depth, random.Random(f"{depth}-{trial}"), trial)
            total = sentences(s.ids)
            before = sentences(s.ids[:s.needle_pos])
            assert total > 20
            assert abs(before - depth * total) <= 0.5, (depth, trial, before, total)
