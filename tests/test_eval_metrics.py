"""Windowed perplexity / bits per byte against one full forward pass, and agreement/KL limits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eval.metrics import LMStats, batch_stats, compact_reference, evaluate_text, text_windows, window_stats
from tests.tiny import tiny_model, tiny_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. héllo wörld ✓ naïve café. distill the teacher! " * 4


def _naive_nll(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float()
    return F.cross_entropy(logits, x[0, 1:], reduction="sum").item()


@pytest.mark.parametrize("bos", [False, True])
def test_windows_predict_every_token_once_and_bytes_add_up(bos):
    tok = tiny_tokenizer()
    if not bos:
        tok.bos_token = None
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    windows, nbytes = text_windows(tok, TEXT, seq_len=16)
    predicted = sum(len(w) - 1 for w in windows)
    assert predicted == len(ids) - (0 if bos else 1)
    assert all(len(w) <= 16 for w in windows)
    assert windows[1][0] == windows[0][-1]  # one-token overlap
    first = len(TEXT.encode()) if bos else len(TEXT.encode()) - len(tok.decode(ids[:1]).encode())
    assert sum(nbytes) == first


def test_windowed_stats_equal_full_sequence_when_it_fits():
    torch.manual_seed(0)
    model = tiny_model(seed=0)
    tok = tiny_tokenizer()
    full = [tok.bos_token_id] + tok(TEXT, add_special_tokens=False)["input_ids"]
    st = evaluate_text(model, tok, TEXT, seq_len=len(full))
    assert st.tokens == len(full) - 1
    assert st.nll_sum == pytest.approx(_naive_nll(model, full), rel=1e-5)
    assert st.bits_per_byte == pytest.approx(st.nll_sum / math.log(2) / len(TEXT.encode()))
    # short windows lose context (nll may change) but every token is still scored once
    short = evaluate_text(model, tok, TEXT, seq_len=20, batch_size=3)
    assert short.tokens == st.tokens and short.bytes == st.bytes == len(TEXT.encode())
    naive = sum(_naive_nll(model, w) for w in text_windows(tok, TEXT, 20)[0])
    assert short.nll_sum == pytest.approx(naive, rel=1e-5)


def test_agreement_and_kl_limits():
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    tok = tiny_tokenizer()
    windows, nbytes = text_windows(tok, TEXT, 32)
    own, ref_own = window_stats(model, windows, nbytes, reference=model, batch_size=4)
    total = LMStats()
    for s in own:
        total.add(s)
    assert total.top1_agreement == 1.0 and total.kl == pytest.approx(0.0, abs=1e-6)
    assert sum(s.nll_sum for s in ref_own) == pytest.approx(total.nll_sum, rel=1e-6)
    own2, _ = window_stats(model, windows, nbytes, reference=other, batch_size=4)
    t2 = LMStats()
    for s in own2:
        t2.add(s)
    assert t2.kl > 0 and t2.top1_agreement < 1.0


# ---- compact reference (top-k + tail bucket) ------------------------------------------------

def _pair(vocab=40, ref_vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 9), generator=g)
    logits = torch.randn(3, 9, vocab, generator=g) * 2
    ref = torch.randn(3, 9, ref_vocab, generator=g) * 3
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding: its positions never count
    return logits, ref, ids, mask


def _naive_bucket_kl(logits, ref, ids, mask, k):
    """Per position, by hand: teacher top-k tokens plus everything else as one outcome."""
    total = 0.0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if not (mask[b, t] and mask[b, t + 1]):
                continue
            p = torch.softmax(ref[b, t].double(), -1)
            q = torch.softmax(logits[b, t].double(), -1)
            top = p.argsort(descending=True)[:k].tolist()
            rest = [i for i in range(p.numel()) if i not in top]
            total += sum(float(p[i] * (p[i].log() - q[i].log())) for i in top)
            if rest:
                pt, qt = p[rest].sum(), q[rest].sum()
                total += float(pt * (pt.log() - qt.log()))
    return total


@pytest.mark.parametrize("k", [1, 5, 39])
def test_compact_reference_bucket_kl_matches_naive(k):
    logits, ref, ids, mask = _pair()
    compact = compact_reference(ref, ids, mask, k=k)
    st = batch_stats(logits, ids, mask, ref_topk=compact)
    assert st.kl_sum == pytest.approx(_naive_bucket_kl(logits, ref, ids, mask, k), rel=1e-5)
    exact = batch_stats(logits, ids, mask, ref_logits=ref)
    assert 0 < st.kl_sum <= exact.kl_sum + 1e-5  # coarse-graining never increases KL
    assert st.agree == exact.agree and st.ref_tokens == exact.ref_tokens == st.tokens == 8 * 3 - 3
    assert st.nll_sum == exact.nll_sum


def test_compact_reference_is_exact_with_full_k_and_keeps_the_teachers_loss():
    logits, ref, ids, mask = _pair(vocab=40, ref_vocab=48)  # a padded reference vocabulary is sliced
    compact = compact_reference(ref, ids, mask, k=40, vocab=40)
    st, exact = batch_stats(logits, ids, mask, ref_topk=compact), batch_stats(logits, ids, mask, ref_logits=ref)
    assert st.kl_sum == pytest.approx(exact.kl_sum, rel=1e-5) and st.agree == exact.agree
    own = batch_stats(ref[..., :40], ids, mask)
    assert compact.own_stats().nll_sum == pytest.approx(own.nll_sum, rel=1e-6)
    assert compact.own_stats().tokens == own.tokens
    # identical model and reference: zero KL, full agreement, whatever k
    same = batch_stats(ref[..., :40], ids, mask, ref_topk=compact_reference(ref, ids, mask, k=3, vocab=40))
    assert same.kl_sum == pytest.approx(0.0, abs=1e-5) and same.agree == same.ref_tokens
    with pytest.raises(ValueError, match="vocab="):
        batch_stats(logits, ids, mask, ref_topk=compact_reference(ref, ids, mask, k=48))


def test_compact_reference_is_small():
    vocab, k = 49_152, 256
    ref = torch.randn(2, 64, vocab)
    ids = torch.randint(0, vocab, (2, 64))
    compact = compact_reference(ref, ids, k=k)
    assert compact.nbytes() == 2 * 63 * (k * (8 + 4) + 4 + 4)
    assert compact.nbytes() < ref.numel() * 4 / 15


def test_chunked_rows_give_the_same_stats(monkeypatch):
    import eval.metrics as metrics

    logits, ref, ids, mask = _pair()
    whole = batch_stats(logits, ids, mask, ref_logits=ref)
    whole_topk = batch_stats(logits, ids, mask, ref_topk=compact_reference(ref, ids, mask, k=5))
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 3 * 40)  # 3 positions per chunk
    small = batch_stats(logits, ids, mask, ref_logits=ref)
    small_topk = batch_stats(logits, ids, mask, ref_topk=compact_reference(ref, ids, mask, k=5))
    for a, b in ((whole, small), (whole_topk, small_topk)):
        assert a.tokens == b.tokens and a.agree == b.agree and a.ref_tokens == b.ref_tokens
        assert a.nll_sum == pytest.approx(b.nll_sum, rel=1e-6) and a.kl_sum == pytest.approx(b.kl_sum, rel=1e-6)
    # the reference scored under one chunking is read correctly under another
    assert batch_stats(logits, ids, mask, ref_topk=compact_reference(ref, ids, mask, k=5)).kl_sum == \
        pytest.approx(whole_topk.kl_sum, rel=1e-6)
    naive = F.cross_entropy(logits[:, :-1][(mask[:, 1:] & mask[:, :-1]).bool()], ids[:, 1:][(mask[:, 1:] & mask[:, :-1]).bool()],
                            reduction="sum").item()
    assert small.nll_sum == pytest.approx(naive, rel=1e-6)
