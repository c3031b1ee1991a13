"""Windowed perplexity / bits per byte against one full forward pass, and agreement/KL limits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from core.tiny import VOCAB, tiny_model, tiny_tokenizer
from eval.metrics import LMStats, batch_stats, evaluate_text, text_windows, window_stats

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


# ---- bounded chunks -------------------------------------------------------------------------

def _pair(vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 9), generator=g)
    logits = torch.randn(3, 9, vocab, generator=g) * 2
    ref = torch.randn(3, 9, vocab + 8, generator=g) * 3  # a padded reference vocabulary is sliced
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding: its positions never count
    return logits, ref, ids, mask


def test_chunked_rows_give_the_same_stats(monkeypatch):
    import eval.metrics as metrics

    logits, ref, ids, mask = _pair()
    whole = batch_stats(logits, ids, mask, ref_logits=ref)
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 3 * 40)  # 3 positions per chunk
    small = batch_stats(logits, ids, mask, ref_logits=ref)
    assert whole.tokens == small.tokens == whole.ref_tokens == 8 * 3 - 3
    assert whole.agree == small.agree
    assert whole.nll_sum == pytest.approx(small.nll_sum, rel=1e-6) and whole.kl_sum == pytest.approx(small.kl_sum, rel=1e-6)
    # naive references over the scored positions
    v = (mask[:, 1:] & mask[:, :-1]).bool()
    lg, rf, lab = logits[:, :-1][v], ref[:, :-1][v][:, :40], ids[:, 1:][v]
    assert small.nll_sum == pytest.approx(F.cross_entropy(lg, lab, reduction="sum").item(), rel=1e-6)
    p = torch.softmax(rf.double(), -1)
    naive_kl = (p * (p.log() - torch.log_softmax(lg.double(), -1))).sum().item()
    assert small.kl_sum == pytest.approx(naive_kl, rel=1e-5)
    assert small.agree == int((lg.argmax(-1) == rf.argmax(-1)).sum())


def test_evaluate_lm_progress_shows_a_bar_and_changes_nothing(capsys):
    from eval.metrics import evaluate_lm

    model, ref = tiny_model(seed=0), tiny_model(seed=1)
    ids = torch.randint(3, VOCAB, (6, 16), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids[i:i + 2]} for i in range(0, 6, 2)]
    quiet = evaluate_lm(model, batches, ref)
    assert capsys.readouterr().err == ""  # the default stays silent for library callers
    shown = evaluate_lm(model, batches, ref, progress="held-out 16")
    err = capsys.readouterr().err
    assert "held-out 16" in err and "3/3" in err
    assert shown == quiet  # the same sums, field by field


def test_candidate_vocabulary_wider_than_the_reference_is_compared_on_the_shared_ids():
    """A candidate with more logit columns than its reference (same tokenizer, e.g. a differently padded
    embedding matrix) used to crash KL with a shape mismatch; it is compared on the shared ids."""
    logits, ref, ids, mask = _pair(vocab=48)
    ref = ref[..., :40]  # the reference is the narrower one now
    st = batch_stats(logits, ids, mask, ref_logits=ref)
    v = (mask[:, 1:] & mask[:, :-1]).bool()
    lg, rf, lab = logits[:, :-1][v], ref[:, :-1][v], ids[:, 1:][v]
    assert st.nll_sum == pytest.approx(F.cross_entropy(lg, lab, reduction="sum").item(), rel=1e-6)
    lg40 = lg[:, :40].double()
    p = torch.softmax(rf.double(), -1)
    naive_kl = (p * (p.log() - torch.log_softmax(lg40, -1))).sum().item()
    assert st.kl_sum == pytest.approx(naive_kl, rel=1e-5)
    assert st.agree == int((lg40.argmax(-1) == rf.argmax(-1)).sum())
