"""distill.losses: what the main loss tests leave unchecked.

A teacher that rules vocabulary entries out (``-inf`` logits) on both KD paths, the fused KD + CE label
check at the vocabulary edge, the sampled estimator's shape check, and the attention-map row sampler
never drawing padding while a row has enough real tokens.
"""

from __future__ import annotations

import pytest
import torch

from distill.losses import (
    chunked_kd_ce_loss,
    chunked_kd_loss,
    kd_loss,
    sample_query_positions,
    sampled_kd_loss,
)


def _kl(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the support of ``p`` only (0 · log 0 = 0), float64."""
    keep = p > 0
    return (p[keep] * (log_p[keep] - log_q[keep])).sum()


def naive_masked_divergence(s: torch.Tensor, t: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """One token: textbook formulas where the teacher may give some entries probability exactly 0."""
    ps, pt = torch.softmax(s, -1), torch.softmax(t, -1)
    log_ps, log_pt = ps.log(), pt.log()  # log_pt is -inf where the teacher ruled a token out
    if kind == "forward_kl":
        return _kl(pt, log_pt, log_ps)
    if kind == "jsd":
        m = beta * pt + (1 - beta) * ps
        return beta * _kl(pt, log_pt, m.log()) + (1 - beta) * _kl(ps, log_ps, m.log())
    if kind == "skew_kl":
        m = beta * pt + (1 - beta) * ps
        return _kl(pt, log_pt, m.log())
    if kind == "skew_reverse_kl":
        m = beta * ps + (1 - beta) * pt
        return _kl(ps, log_ps, m.log())
    assert kind == "tvd"
    return 0.5 * (pt - ps).abs().sum()


# The kinds whose value stays finite when the teacher rules tokens out (reverse KL is infinite there).
FINITE_KINDS = [("forward_kl", 0.5), ("jsd", 0.3), ("skew_kl", 0.1), ("skew_reverse_kl", 0.1), ("tvd", 0.5)]


def _masked_teacher(tokens: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Student logits ``[tokens, vocab]`` and teacher logits with a third of each row set to ``-inf``."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * 2
    t = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * 2
    ruled_out = torch.rand(tokens, vocab, generator=g) < 0.33
    ruled_out[:, 0] = False  # every row keeps some mass
    return s, t.masked_fill(ruled_out, float("-inf"))


@pytest.mark.parametrize("kind,beta", FINITE_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kd_loss_with_a_teacher_that_rules_tokens_out_matches_the_textbook_value(kind, beta, temperature):
    """A teacher with ``-inf`` logits (a masked vocabulary) gives 0 · log 0 = 0, not NaN, in value and gradient."""
    s, t = _masked_teacher(6, 13, seed=0)
    s.requires_grad_()
    out = kd_loss(s, t, kind=kind, beta=beta, temperature=temperature)
    ref = torch.stack([naive_masked_divergence(s[i] / temperature, t[i] / temperature, kind, beta)
                       for i in range(s.shape[0])]).mean() * temperature**2
    assert torch.isfinite(out)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-12)
    (g,) = torch.autograd.grad(out, s)
    (g_ref,) = torch.autograd.grad(ref, s)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, g_ref, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("kind,beta", FINITE_KINDS)
def test_chunked_kd_with_a_teacher_bias_that_rules_tokens_out_equals_the_full_logits_path(kind, beta):
    """The fused path builds teacher logits chunk by chunk; a ``-inf`` teacher bias must not turn them into NaN."""
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(17, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(9, 5, generator=g, dtype=torch.float64)
    wt = torch.randn(17, 5, generator=g, dtype=torch.float64)
    bt = torch.zeros(17, dtype=torch.float64)
    bt[[2, 5, 11]] = float("-inf")
    out = chunked_kd_loss(hs, ws, ht, wt, kind=kind, beta=beta, temperature=1.5, chunk_size=4, teacher_bias=bt)
    assert torch.isfinite(out)
    hs_ref, ws_ref = hs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    ref = torch.stack([naive_masked_divergence((hs_ref[i] @ ws_ref.T) / 1.5, (ht[i] @ wt.T + bt) / 1.5, kind, beta)
                       for i in range(9)]).mean() * 1.5**2
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out, (hs, ws)), torch.autograd.grad(ref, (hs_ref, ws_ref))):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


def test_fused_kd_ce_refuses_a_label_equal_to_the_vocabulary_size():
    """Ids run 0 .. vocab - 1: a label equal to the vocabulary size is out of range and named, not a gather crash."""
    g = torch.Generator().manual_seed(2)
    hs, ws = torch.randn(2, 4, 6, generator=g), torch.randn(10, 6, generator=g)
    ht, wt = torch.randn(2, 4, 3, generator=g), torch.randn(10, 3, generator=g)
    labels = torch.randint(0, 10, (2, 4), generator=g)
    labels[1, 2] = 10
    with pytest.raises(ValueError, match="labels must be token ids"):
        chunked_kd_ce_loss(hs, ws, ht, wt, labels)
    labels[1, 2] = 9  # the last id is fine
    total, _, ce = chunked_kd_ce_loss(hs, ws, ht, wt, labels)
    assert torch.isfinite(total) and ce > 0
    # masked out, an out-of-range label is never read
    labels[1, 2] = 10
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 2] = False
    assert torch.isfinite(chunked_kd_ce_loss(hs, ws, ht, wt, labels, mask)[0])


def test_sampled_kd_loss_refuses_samples_that_do_not_line_up_with_the_logits():
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 4, 3))
    w = torch.full((2, 4, 3), 1 / 3)
    with pytest.raises(ValueError, match="samples per position"):
        sampled_kd_loss(logits, ids, w)
    with pytest.raises(ValueError, match="samples per position"):
        sampled_kd_loss(logits, torch.randint(0, 11, (2, 5, 3)), torch.full((2, 5, 2), 0.5))


def test_query_rows_never_include_padding_while_a_row_has_enough_real_tokens():
    """Padding is drawn only when a row has fewer real tokens than queries: over many draws, never otherwise."""
    seq, nq = 64, 6
    mask = torch.zeros(3, seq, dtype=torch.bool)
    mask[0, :6] = True  # exactly nq real tokens: all of them, every time
    mask[1, 40:50] = True
    mask[2, ::9] = True  # 8 real tokens spread out
    for seed in range(200):
        pos = sample_query_positions(mask, nq, torch.Generator().manual_seed(seed))
        assert pos.shape == (3, nq)
        assert mask.gather(1, pos).all(), f"seed {seed} drew padding: {pos.tolist()}"
        assert (pos.diff(dim=-1) > 0).all()  # sorted, distinct
    assert torch.equal(sample_query_positions(mask, nq)[0], torch.arange(6))
    # every real position of row 2 is drawn sometimes (uniform among real tokens, not a fixed subset)
    seen = {int(p) for s in range(200) for p in sample_query_positions(mask, nq, torch.Generator().manual_seed(s))[2]}
    assert seen == set(range(0, seq, 9))
