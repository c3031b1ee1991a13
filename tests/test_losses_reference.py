"""distill.losses on edge cases, against textbook float64 references written here (full vocab, plain loops)."""

from __future__ import annotations

import pytest
import torch

from distill.losses import chunked_kd_loss, kd_loss

KIND_BETAS = ([(k, 0.5) for k in ("forward_kl", "reverse_kl", "tvd")] + [("jsd", b) for b in (0.0, 0.3, 1.0)]
              + [(k, b) for k in ("skew_kl", "skew_reverse_kl") for b in (0.0, 0.1, 1.0)])


def textbook(s: torch.Tensor, t: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """One token's divergence from ``[vocab]`` float64 logits, on probabilities."""
    ps, pt = torch.softmax(s, -1), torch.softmax(t, -1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum()

    if kind == "forward_kl" or (kind == "jsd" and beta == 0):
        return kl(pt, ps)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1):
        return kl(ps, pt)
    if kind == "jsd":
        m = beta * pt + (1 - beta) * ps
        return beta * kl(pt, m) + (1 - beta) * kl(ps, m)
    if kind == "skew_kl":
        return kl(pt, beta * pt + (1 - beta) * ps)
    if kind == "skew_reverse_kl":
        return kl(ps, beta * ps + (1 - beta) * pt)
    return 0.5 * (pt - ps).abs().sum()


@pytest.mark.parametrize("kind,beta", KIND_BETAS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_a_vocabulary_masked_with_minus_inf_on_both_sides_is_the_unmasked_vocabulary(kind, beta, temperature):
    """Student and teacher logits masked to -inf on the same rows (a vocabulary cut to the tokenizer's tokens):
    those rows are 0 * log 0 = 0, so value and gradients are the textbook ones on the other rows, on the full-logits
    and the chunked path (a -inf head bias there), and the masked rows get no gradient. A student's -inf gave NaN."""
    g = torch.Generator().manual_seed(0)
    tokens, vocab, real, d = 5, 9, 7, 4
    hs = torch.randn(tokens, d, generator=g, dtype=torch.float64)
    ws = torch.randn(vocab, d, generator=g, dtype=torch.float64)
    zt_finite = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * 2
    bias = torch.zeros(vocab, dtype=torch.float64)
    bias[real:] = float("-inf")
    zt = zt_finite + bias

    ref_h = hs.clone().requires_grad_()
    zs = ref_h @ ws[:real].T
    ref = sum(textbook(zs[i] / temperature, zt[i, :real] / temperature, kind, beta) for i in range(tokens))
    ref = ref * temperature**2 / tokens
    (ref_grad,) = torch.autograd.grad(ref, ref_h)

    full_h = hs.clone().requires_grad_()
    logits = full_h @ ws.T + bias
    logits.retain_grad()
    full = kd_loss(logits, zt, kind=kind, temperature=temperature, beta=beta)
    full.backward()
    chunk_h = hs.clone().requires_grad_()
    chunked = chunked_kd_loss(chunk_h, ws, zt_finite, torch.eye(vocab, dtype=torch.float64), kind=kind,
                              temperature=temperature, beta=beta, chunk_size=2, student_bias=bias, teacher_bias=bias)
    chunked.backward()
    for out, grad in ((full, full_h.grad), (chunked, chunk_h.grad)):
        torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert (logits.grad[:, real:] == 0).all()
