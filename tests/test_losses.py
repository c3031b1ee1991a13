"""distill.losses against naive float64 references (plain loops / textbook formulas)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from distill import losses
from distill.losses import (
    KINDS,
    FocalLoss,
    KDLoss,
    attention_map_loss,
    ce_loss,
    chunked_kd_loss,
    focal_loss,
    hidden_loss,
    kd_loss,
    normalized_mse,
    sample_query_positions,
    topk_kd_loss,
)
from tests.helpers import naive_divergence

# --------------------------------------------------------------------------- naive references


def naive_kd(student, teacher, mask, kind, temperature, beta):
    """Loop over tokens of [batch, seq, vocab] logits; teacher detached; mean over counted tokens."""
    s = student.reshape(-1, student.shape[-1]).double()
    t = teacher.detach().reshape(-1, teacher.shape[-1]).double()
    m = torch.ones(s.shape[0], dtype=torch.bool) if mask is None else mask.reshape(-1)
    total, count = s.new_zeros(()), 0
    for i in range(s.shape[0]):
        if m[i]:
            total = total + naive_divergence(s[i] / temperature, t[i] / temperature, kind, beta)
            count += 1
    return total * temperature**2 / max(count, 1)


def grads_of(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def assert_rel(actual, expected, tol):
    """Max-abs error relative to the reference's max magnitude (elementwise rtol is meaningless at 0)."""
    scale = expected.abs().max().clamp(min=1e-30)
    err = ((actual.double() - expected.double()).abs().max() / scale).item()
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


def make_logits(batch=2, seq=5, vocab=11, seed=0, dtype=torch.float64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(batch, seq, vocab, generator=g) * scale).to(dtype)
    t = (torch.randn(batch, seq, vocab, generator=g) * scale).to(dtype)
    mask = torch.rand(batch, seq, generator=g) > 0.35
    mask[0, 0] = True
    return s, t, mask


KIND_BETAS = ([(k, 0.5) for k in ("forward_kl", "reverse_kl", "tvd")] + [("jsd", b) for b in (0.0, 0.1, 0.5, 0.9, 1.0)]
              + [("skew_kl", b) for b in (0.0, 0.1, 0.5, 1.0)] + [("skew_reverse_kl", b) for b in (0.0, 0.1, 0.5, 1.0)])


# --------------------------------------------------------------------------- kd_loss


@pytest.mark.parametrize("kind,beta", KIND_BETAS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_kd_loss_matches_naive(kind, beta, masked, temperature):
    s, t, mask = make_logits(seed=KIND_BETAS.index((kind, beta)))
    mask = mask if masked else None
    s = s.requires_grad_()
    ref = naive_kd(s, t, mask, kind, temperature, beta)
    out = kd_loss(s, t, mask, kind=kind, temperature=temperature, beta=beta)
    assert out.dtype == torch.float64  # fp64 stays fp64; only half / bf16 get upcast
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    (ref_grad,) = grads_of(ref, s)
    assert_rel(grads_of(out, s)[0], ref_grad, 1e-9)

    # fp32 inputs: fp32 math, same answer within fp32 precision. The bound is looser than the
    # chunked-vs-full 1e-5 because this compares with exact math: rounding the logits to fp32
    # alone moves gradients by a few 1e-6 once divided by T = 0.5.
    s32 = s.detach().float().requires_grad_()
    out32 = kd_loss(s32, t.float(), mask, kind=kind, temperature=temperature, beta=beta)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert_rel(grads_of(out32, s32)[0], ref_grad, 3e-5)


def test_kd_loss_flat_tokens_and_masked_grads_are_zero():
    s, t, mask = make_logits()
    s = s.requires_grad_()
    full = kd_loss(s, t, mask, kind="reverse_kl")
    flat = kd_loss(s.reshape(-1, 11), t.reshape(-1, 11), mask.reshape(-1), kind="reverse_kl")
    torch.testing.assert_close(full, flat)
    g = grads_of(full, s)[0]
    assert g[~mask].abs().max() == 0
    assert g[mask].abs().max() > 0
    # Masked positions may hold garbage (even NaN): they must not leak into the loss.
    s_bad = s.detach().clone()
    s_bad[~mask] = float("nan")
    torch.testing.assert_close(kd_loss(s_bad, t, mask, kind="reverse_kl"), full.detach())


def test_jsd_endpoints_and_limits():
    s, t, mask = make_logits(seed=3)
    fwd = kd_loss(s, t, mask, kind="forward_kl", temperature=2.0)
    rev = kd_loss(s, t, mask, kind="reverse_kl", temperature=2.0)
    assert not torch.allclose(fwd, rev)
    torch.testing.assert_close(kd_loss(s, t, mask, kind="jsd", beta=0.0, temperature=2.0), fwd, rtol=0, atol=0)
    torch.testing.assert_close(kd_loss(s, t, mask, kind="jsd", beta=1.0, temperature=2.0), rev, rtol=0, atol=0)
    # The GKD formula tends to its endpoint KL after dividing out the vanishing weight.
    eps = 1e-6
    near0 = kd_loss(s, t, mask, kind="jsd", beta=eps, temperature=2.0) / eps
    near1 = kd_loss(s, t, mask, kind="jsd", beta=1 - eps, temperature=2.0) / eps
    torch.testing.assert_close(near0, fwd, rtol=1e-4, atol=0)
    torch.testing.assert_close(near1, rev, rtol=1e-4, atol=0)


@pytest.mark.parametrize("kind,beta", KIND_BETAS)
def test_identical_inputs_give_zero(kind, beta):
    s, _, mask = make_logits()
    s = s.requires_grad_()
    out = kd_loss(s, s, mask, kind=kind, beta=beta, temperature=1.5)
    assert abs(out.item()) < 1e-12
    assert grads_of(out, s)[0].abs().max() < 1e-12


def test_bf16_inputs_use_fp32_math():
    s, t, mask = make_logits(vocab=64, dtype=torch.bfloat16)
    s = s.requires_grad_()
    out = kd_loss(s, t, mask, kind="jsd", temperature=2.0)
    assert out.dtype == torch.float32
    ref = naive_kd(s.detach().double(), t.double(), mask, "jsd", 2.0, 0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-7)
    (g,) = grads_of(out, s)
    assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()


@pytest.mark.parametrize("kind", KINDS)
def test_empty_mask_gives_zero_and_zero_grads(kind):
    s, t, _ = make_logits()
    s = s.requires_grad_()
    empty = torch.zeros(2, 5, dtype=torch.bool)
    out = kd_loss(s, t, empty, kind=kind, temperature=2.0)
    assert out.item() == 0.0
    (g,) = grads_of(out, s)
    assert torch.isfinite(g).all() and g.abs().max() == 0


def test_teacher_gets_no_grad():
    s, t, mask = make_logits()
    s.requires_grad_()
    t.requires_grad_()
    for kind in KINDS:
        kd_loss(s, t, mask, kind=kind).backward()
    assert t.grad is None and s.grad is not None


def test_kd_argument_errors():
    s, t, _ = make_logits()
    with pytest.raises(ValueError, match="use one of"):
        kd_loss(s, t, kind="kl")
    with pytest.raises(ValueError, match="temperature"):
        kd_loss(s, t, temperature=0.0)
    with pytest.raises(ValueError, match="beta"):
        kd_loss(s, t, kind="jsd", beta=1.5)
    with pytest.raises(ValueError, match="tokenizer"):
        kd_loss(s, t[..., :-1])
    with pytest.raises(ValueError, match="mask shape"):
        kd_loss(s, t, torch.ones(2, 4, dtype=torch.bool))


def test_kd_module_wrapper():
    s, t, mask = make_logits()
    mod = KDLoss(kind="tvd", temperature=2.0)
    torch.testing.assert_close(mod(s, t, mask), kd_loss(s, t, mask, kind="tvd", temperature=2.0))
    assert "tvd" in repr(mod)


# --------------------------------------------------------------------------- chunked_kd_loss


def make_hidden(batch=3, seq=7, vocab=53, d_s=16, d_t=24, seed=0, dtype=torch.float32, bias=False):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(batch, seq, d_s, generator=g)
    ws = torch.randn(vocab, d_s, generator=g) / math.sqrt(d_s) * 3
    ht = torch.randn(batch, seq, d_t, generator=g)
    wt = torch.randn(vocab, d_t, generator=g) / math.sqrt(d_t) * 3
    bs = torch.randn(vocab, generator=g) if bias else None
    bt = torch.randn(vocab, generator=g) if bias else None
    mask = torch.rand(batch, seq, generator=g) > 0.3
    conv = [x.to(dtype) if x is not None else None for x in (hs, ws, ht, wt, bs, bt)]
    return (*conv, mask)


def full_and_chunked(kind, beta, temperature, masked, chunk_size, dtype=torch.float32, bias=False, **kw):
    hs, ws, ht, wt, bs, bt, mask = make_hidden(dtype=dtype, bias=bias, **kw)
    mask = mask if masked else None
    leaves = [hs, ws] + ([bs] if bias else [])
    a = [x.clone().requires_grad_() for x in leaves]
    b = [x.clone().requires_grad_() for x in leaves]
    zs = a[0] @ a[1].T + (a[2] if bias else 0)
    zt = ht @ wt.T + (bt if bias else 0)
    full = kd_loss(zs, zt, mask, kind=kind, temperature=temperature, beta=beta)
    chunked = chunked_kd_loss(b[0], b[1], ht, wt, mask, kind=kind, temperature=temperature, beta=beta,
                              chunk_size=chunk_size, student_bias=b[2] if bias else None,
                              teacher_bias=bt)
    return full, chunked, grads_of(full, *a), grads_of(chunked, *b)


@pytest.mark.parametrize("kind,beta", KIND_BETAS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_equals_full_fp32(kind, beta, masked, temperature):
    # 21 tokens (or fewer when masked) in chunks of 4: the last chunk is partial.
    full, chunked, g_full, g_chunk = full_and_chunked(kind, beta, temperature, masked, chunk_size=4)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-7)
    for gc, gf in zip(g_chunk, g_full):
        assert_rel(gc, gf, 1e-5)


@pytest.mark.parametrize("kind,beta", KIND_BETAS)
@pytest.mark.parametrize("chunk_size", [1, 5, 1000])
def test_chunked_equals_full_fp64_with_bias(kind, beta, chunk_size):
    full, chunked, g_full, g_chunk = full_and_chunked(kind, beta, 1.5, True, chunk_size,
                                                      dtype=torch.float64, bias=True, d_s=8, d_t=40)
    torch.testing.assert_close(chunked, full, rtol=1e-12, atol=1e-14)
    assert len(g_chunk) == 3  # hidden, head, bias
    for gc, gf in zip(g_chunk, g_full):
        assert_rel(gc, gf, 1e-11)


def test_chunked_matches_naive_reference():
    hs, ws, ht, wt, _, _, mask = make_hidden(dtype=torch.float64)
    hs.requires_grad_()
    out = chunked_kd_loss(hs, ws, ht, wt, mask, kind="jsd", beta=0.3, temperature=2.0, chunk_size=3)
    ref = naive_kd(hs @ ws.T, ht @ wt.T, mask, "jsd", 2.0, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert_rel(grads_of(out, hs)[0], grads_of(ref, hs)[0], 1e-9)


def test_chunked_flat_tokens_no_grad_and_teacher_frozen():
    hs, ws, ht, wt, _, _, mask = make_hidden()
    ht.requires_grad_()
    wt.requires_grad_()
    hs.requires_grad_()
    ws.requires_grad_()
    out = chunked_kd_loss(hs, ws, ht, wt, mask, kind="reverse_kl", chunk_size=4)
    flat = chunked_kd_loss(hs.reshape(-1, 16), ws, ht.reshape(-1, 24), wt, mask.reshape(-1),
                           kind="reverse_kl", chunk_size=6)
    torch.testing.assert_close(flat, out)
    out.backward()
    assert ht.grad is None and wt.grad is None
    assert hs.grad[~mask].abs().max() == 0 and hs.grad[mask].abs().max() > 0
    with torch.no_grad():
        ev = chunked_kd_loss(hs, ws, ht, wt, mask, kind="reverse_kl", chunk_size=4)
    assert not ev.requires_grad
    torch.testing.assert_close(ev, out.detach())


def test_chunked_only_head_trainable_and_grad_scaling():
    hs, ws, ht, wt, _, _, mask = make_hidden()
    ws.requires_grad_()
    (chunked_kd_loss(hs, ws, ht, wt, mask, kind="tvd", chunk_size=4) * 3.0).backward()
    ref = ws.detach().clone().requires_grad_()
    (kd_loss(hs @ ref.T, ht @ wt.T, mask, kind="tvd") * 3.0).backward()
    assert_rel(ws.grad, ref.grad, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_empty_mask(kind):
    hs, ws, ht, wt, bs, _, _ = make_hidden(bias=True)
    for x in (hs, ws, bs):
        x.requires_grad_()
    out = chunked_kd_loss(hs, ws, ht, wt, torch.zeros(3, 7, dtype=torch.bool), kind=kind, student_bias=bs)
    assert out.item() == 0.0
    out.backward()
    for g in (hs.grad, ws.grad, bs.grad):
        assert torch.isfinite(g).all() and g.abs().max() == 0


def test_chunked_bf16_close_to_fp32():
    hs, ws, ht, wt, _, _, mask = make_hidden(dtype=torch.bfloat16)
    hs.requires_grad_()
    ws.requires_grad_()
    out = chunked_kd_loss(hs, ws, ht, wt, mask, chunk_size=4)
    assert out.dtype == torch.float32
    out.backward()
    assert hs.grad.dtype == torch.bfloat16 and ws.grad.dtype == torch.bfloat16
    ref = kd_loss(hs.detach() @ ws.detach().T, ht @ wt.T, mask)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-4)


def test_chunked_errors():
    hs, ws, ht, wt, _, _, _ = make_hidden()
    with pytest.raises(ValueError, match="vocab"):
        chunked_kd_loss(hs, ws, ht, wt[:-1])
    with pytest.raises(ValueError, match="lm_head"):
        chunked_kd_loss(hs, ws[:, :-1], ht, wt)
    with pytest.raises(ValueError, match="same batch"):
        chunked_kd_loss(hs, ws, ht[:, :-1], wt)


# --------------------------------------------------------------------------- ce / focal


def make_labels(batch=2, seq=6, vocab=13, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :2] = -100
    labels[1, -1] = -100
    return logits, labels


def naive_focal(logits, labels, alpha, gamma, ignore_index=-100):
    z = logits.reshape(-1, logits.shape[-1]).double()
    y = labels.reshape(-1)
    total, count = z.new_zeros(()), 0
    for i in range(z.shape[0]):
        if y[i] == ignore_index:
            continue
        p = torch.softmax(z[i], -1)[y[i]]
        total = total - alpha * (1 - p) ** gamma * torch.log(p)
        count += 1
    return total / max(count, 1)


@pytest.mark.parametrize("alpha,gamma", [(0.25, 2.0), (1.0, 0.5), (0.5, 0.0), (1.0, 3.0)])
def test_focal_matches_naive(alpha, gamma):
    logits, labels = make_labels()
    logits.requires_grad_()
    out = focal_loss(logits, labels, alpha=alpha, gamma=gamma)
    ref = naive_focal(logits, labels, alpha, gamma)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert_rel(grads_of(out, logits)[0], grads_of(ref, logits)[0], 1e-9)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_focal_gradient_stays_finite_on_a_token_the_student_is_sure_of(gamma):
    """At a logit margin of 30, p_y is exactly 1 in fp32: the focal weight's gradient must not become NaN."""
    logits = torch.tensor([[30.0, 0.0, 0.0], [0.0, 1.0, 2.0]], requires_grad=True)
    labels = torch.tensor([0, 2])
    out = focal_loss(logits, labels, alpha=1.0, gamma=gamma)
    (g,) = grads_of(out, logits)
    assert torch.isfinite(g).all()
    ref = logits.detach().double().requires_grad_()
    (g_ref,) = grads_of(naive_focal(ref, labels, 1.0, gamma), ref)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-5, atol=1e-7)


def test_focal_gamma0_alpha1_is_ce_and_ce_matches_torch():
    logits, labels = make_labels(dtype=torch.float32)
    logits.requires_grad_()
    ce = ce_loss(logits, labels)
    torch.testing.assert_close(focal_loss(logits, labels, alpha=1.0, gamma=0.0), ce)
    ref = F.cross_entropy(logits.detach().double().reshape(-1, 13), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(ce.double(), ref, rtol=1e-6, atol=1e-7)
    (g,) = grads_of(ce, logits)
    assert g[labels == -100].abs().max() == 0
    # A different ignore_index is honored.
    other = labels.clone()
    other[other == -100] = 7
    torch.testing.assert_close(ce_loss(logits, other, ignore_index=7),
                               ce_loss(logits, labels.masked_fill(labels == 7, -100)))
    assert FocalLoss(alpha=1.0, gamma=0.0)(logits, labels).item() == pytest.approx(ce.item())


def test_focal_bf16_and_empty():
    logits, labels = make_labels(dtype=torch.bfloat16)
    out = focal_loss(logits, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_focal(logits.double(), labels, 0.25, 2.0), rtol=1e-5, atol=1e-7)
    logits = logits.float().requires_grad_()
    none = torch.full_like(labels, -100)
    for fn in (focal_loss, ce_loss):
        out = fn(logits, none)
        assert out.item() == 0.0
        (g,) = grads_of(out, logits)
        assert torch.isfinite(g).all() and g.abs().max() == 0


# --------------------------------------------------------------------------- hidden states


def naive_hidden(s, t, mask, kind):
    total, count = s.new_zeros((), dtype=torch.float64), 0
    for b in range(s.shape[0]):
        for i in range(s.shape[1]):
            if not mask[b, i]:
                continue
            x, y = s[b, i].double(), t[b, i].double()
            if kind == "mse":
                total = total + sum((x[j] - y[j]) ** 2 for j in range(x.shape[0])) / x.shape[0]
            else:
                total = total + 1 - (x @ y) / (x.norm() * y.norm())
            count += 1
    return total / max(count, 1)


@pytest.mark.parametrize("kind", ["mse", "cosine"])
def test_hidden_loss_matches_naive(kind):
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    out = hidden_loss(s, t, mask, kind=kind)
    ref = naive_hidden(s, t.detach(), mask, kind)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert_rel(grads_of(out, s)[0], grads_of(ref, s)[0], 1e-9)
    hidden_loss(s, t, mask, kind=kind).backward()
    assert t.grad is None and s.grad is not None
    assert hidden_loss(s, s.detach(), mask, kind=kind).abs().item() < 1e-12
    empty = hidden_loss(s, t, torch.zeros_like(mask), kind=kind)
    assert empty.item() == 0.0
    assert torch.isfinite(grads_of(empty, s)[0]).all()


def test_hidden_loss_width_mismatch_names_projector():
    with pytest.raises(ValueError, match="add a projector"):
        hidden_loss(torch.zeros(1, 2, 4), torch.zeros(1, 2, 8), None)
    with pytest.raises(ValueError, match="'mse' or 'cosine'"):
        hidden_loss(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), None, kind="l1")


# --------------------------------------------------------------------------- attention maps


def naive_attention_loss(sq, sk, tq, tk, mask, rows=None):
    """Per batch / query / head loops with explicit per-head K selection (kv head = h // group)."""

    def head_mean_row(q, k, b, i):
        heads, kv, hd = q.shape[1], k.shape[1], q.shape[-1]
        acc = 0
        for h in range(heads):
            keys = [j for j in range(i + 1) if mask[b, j]]
            sc = torch.stack([q[b, h, i] @ k[b, h // (heads // kv), j] for j in keys]) / math.sqrt(hd)
            row = torch.zeros(q.shape[2], dtype=torch.float64)
            row[keys] = torch.softmax(sc.double(), -1)
            acc = acc + row
        return acc / heads

    total, count = 0, 0
    for b in range(sq.shape[0]):
        for i in range(sq.shape[2]) if rows is None else rows[b].tolist():
            if not mask[b, i]:
                continue
            d = head_mean_row(sq, sk, b, i) - head_mean_row(tq.detach(), tk.detach(), b, i)
            total = total + (d**2).sum()
            count += 1
    return total / max(count, 1)


def make_qk(batch, heads, kv, seq, hd, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, seq, hd, generator=g).to(dtype) * 1.5,
            torch.randn(batch, kv, seq, hd, generator=g).to(dtype) * 1.5)


PAD_MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]],
                        dtype=torch.bool)


def test_attention_map_loss_matches_naive_with_padding_and_different_heads():
    sq, sk = make_qk(3, 4, 2, 8, 8, seed=0)  # student: 4 heads, GQA 2 kv heads, head_dim 8
    tq, tk = make_qk(3, 6, 3, 8, 16, seed=1)  # teacher: 6 heads, 3 kv heads, head_dim 16
    sq.requires_grad_()
    sk.requires_grad_()
    tq.requires_grad_()
    out = attention_map_loss(sq, sk, tq, tk, PAD_MASK, num_queries=8)
    ref = naive_attention_loss(sq, sk, tq, tk, PAD_MASK)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_of(out, sq, sk), grads_of(ref, sq, sk)):
        assert_rel(a, b, 1e-9)
    attention_map_loss(sq, sk, tq, tk, PAD_MASK, num_queries=8).backward()
    assert tq.grad is None and sq.grad is not None
    assert attention_map_loss(sq, sk, sq, sk, PAD_MASK).abs().item() < 1e-14


def test_attention_gqa_equals_repeated_kv():
    sq, sk = make_qk(2, 6, 2, 8, 4, seed=2)
    tq, tk = make_qk(2, 3, 1, 8, 4, seed=3)
    mask = PAD_MASK[:2]
    grouped = attention_map_loss(sq, sk, tq, tk, mask)
    # transformers' repeat_kv order: kv head i serves query heads i*group .. i*group+group-1.
    repeated = attention_map_loss(sq, sk.repeat_interleave(3, dim=1), tq, tk.repeat_interleave(3, dim=1), mask)
    torch.testing.assert_close(grouped, repeated, rtol=1e-12, atol=1e-14)


def test_attention_subsampling_is_deterministic_and_exact_on_sampled_rows():
    sq, sk = make_qk(3, 2, 1, 8, 4, seed=4)
    tq, tk = make_qk(3, 4, 2, 8, 4, seed=5)
    a = attention_map_loss(sq, sk, tq, tk, PAD_MASK, num_queries=3, generator=torch.Generator().manual_seed(7))
    b = attention_map_loss(sq, sk, tq, tk, PAD_MASK, num_queries=3, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    rows = sample_query_positions(PAD_MASK, 3, torch.Generator().manual_seed(7))
    assert rows.shape == (3, 3) and PAD_MASK.gather(1, rows).all()  # only real tokens are drawn
    torch.testing.assert_close(a, naive_attention_loss(sq, sk, tq, tk, PAD_MASK, rows), rtol=1e-10, atol=1e-12)
    others = {round(attention_map_loss(sq, sk, tq, tk, PAD_MASK, num_queries=3,
                                       generator=torch.Generator().manual_seed(s)).item(), 12) for s in range(6)}
    assert len(others) > 1  # the sample really changes with the seed


def test_attention_gradcheck_and_empty_and_fp32():
    sq, sk = make_qk(1, 2, 1, 4, 3, seed=6)
    tq, tk = make_qk(1, 2, 2, 4, 3, seed=7)
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    sq.requires_grad_()
    sk.requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k: attention_map_loss(q, k, tq, tk, mask), (sq, sk))
    empty = attention_map_loss(sq, sk, tq, tk, torch.zeros_like(mask))
    assert empty.item() == 0.0
    assert all(torch.isfinite(g).all() and g.abs().max() == 0 for g in grads_of(empty, sq, sk))
    out16 = attention_map_loss(sq.detach().bfloat16(), sk.detach().bfloat16(), tq.bfloat16(), tk.bfloat16(), mask)
    assert out16.dtype == torch.float32
    with pytest.raises(ValueError, match="multiple"):
        attention_map_loss(sq, sk, tq[:, :1].expand(1, 3, 4, 3), tk, mask)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_fused_kd_ce_equals_separate_terms(kind, temperature):
    from distill.losses import chunked_kd_ce_loss

    g = torch.Generator().manual_seed(7)
    hs = torch.randn(2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(2, 9, 24, generator=g, dtype=torch.float64)
    wt = torch.randn(40, 24, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 40, (2, 9), generator=g)
    mask = torch.rand(2, 9, generator=g) > 0.3
    total, kd, ce = chunked_kd_ce_loss(hs, ws, ht, wt, labels, mask, ce_weight=0.7, kind=kind,
                                       temperature=temperature, chunk_size=4)
    gh, gw = torch.autograd.grad(total, (hs, ws))
    logits = hs @ ws.T
    ref_kd = kd_loss(logits, ht @ wt.T, mask, kind=kind, temperature=temperature)
    ref_ce = torch.nn.functional.cross_entropy(logits[mask], labels[mask])
    ref = ref_kd + 0.7 * ref_ce
    rh, rw = torch.autograd.grad(ref, (hs, ws))
    torch.testing.assert_close(total, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kd, ref_kd.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ce, ref_ce.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- top-k cache KD, normalized MSE


def naive_topk_kd(z: torch.Tensor, idx: list[int], teacher_logp: list[float], t: float) -> torch.Tensor:
    """One token: both sides collapsed to the teacher's top-k tokens + one tail bucket, KL(p‖q) × T²."""
    p = [math.exp(v) for v in teacher_logp]
    p_bucket = torch.tensor(p + [1.0 - sum(p)], dtype=torch.float64)
    p_t = torch.softmax(p_bucket.log() / t, -1)  # the teacher's bucket distribution at temperature t
    q = torch.softmax(z / t, -1)
    q_top = torch.stack([q[i] for i in idx])
    q_bucket = torch.cat([q_top, (1.0 - q_top.sum()).reshape(1)])
    return (p_t * (p_t.log() - q_bucket.log())).sum() * t * t


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_kd_matches_naive_values_and_grads(temperature):
    g = torch.Generator().manual_seed(0)
    b, n, v, k = 2, 3, 11, 4
    z = torch.randn(b, n, v, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(b, n, v, generator=g, dtype=torch.float64) * 2, -1)
    logp, idx = teacher.topk(k, -1)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    got = topk_kd_loss(z, idx, logp, mask, temperature=temperature)
    z_ref = z.detach().clone().requires_grad_(True)
    rows = [naive_topk_kd(z_ref[i, j], idx[i, j].tolist(), logp[i, j].tolist(), temperature)
            for i in range(b) for j in range(n) if mask[i, j]]
    want = torch.stack(rows).mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    got.backward()
    want.backward()
    assert torch.allclose(z.grad.double(), z_ref.grad, atol=1e-6)
    assert z.grad[0, 2].abs().max() == 0  # masked tokens get no gradient


def test_topk_kd_with_the_whole_vocabulary_is_full_kd():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    t_logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    logp, idx = torch.log_softmax(t_logits, -1).topk(7, -1)
    full = kd_loss(z, t_logits, kind="forward_kl", temperature=1.0)
    assert topk_kd_loss(z, idx, logp).item() == pytest.approx(full.item(), abs=1e-4)
    empty = topk_kd_loss(z.requires_grad_(True), idx, logp, torch.zeros(2, 5, dtype=torch.bool))
    assert empty.item() == 0.0 and empty.requires_grad


def test_normalized_mse_matches_naive_and_is_scale_free():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 4, 6, generator=g, dtype=torch.float64) * 50
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    rows = [((s[i, j] - t[i, j]) ** 2).mean() / (t[i, j] ** 2).mean()
            for i in range(2) for j in range(4) if mask[i, j]]
    want = torch.stack(rows).mean()
    got = normalized_mse(s, t, mask)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    (g1,) = torch.autograd.grad(got, s)
    (g2,) = torch.autograd.grad(want, s)
    assert torch.allclose(g1.double(), g2, atol=1e-9)
    assert normalized_mse(s * 10, t * 10, mask).item() == pytest.approx(got.item(), rel=1e-6)


def test_fused_kd_ce_refuses_labels_not_aligned_with_the_hidden_states():
    """Unshifted labels ([batch, seq] against [batch, seq - 1] states) used to be read flat, chunk by chunk: with a
    chunk size dividing the token count, every row after the first got the previous row's labels, silently."""
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    ws = torch.randn(9, 4, generator=g)
    ht, wt = torch.randn(2, 5, 3, generator=g), torch.randn(9, 3, generator=g)
    labels = torch.randint(0, 9, (2, 6), generator=g)
    with pytest.raises(ValueError, match="labels"):
        losses.chunked_kd_ce_loss(hs, ws, ht, wt, labels, chunk_size=5)
    # aligned labels: the fused CE is the plain CE on the student logits, value and gradient
    aligned = labels[:, 1:]
    total, _, ce = losses.chunked_kd_ce_loss(hs, ws, ht, wt, aligned, chunk_size=5)
    ref_ce = F.cross_entropy((hs @ ws.T).reshape(-1, 9), aligned.reshape(-1))
    torch.testing.assert_close(ce, ref_ce.detach())
    kd = losses.kd_loss(hs @ ws.T, ht @ wt.T)
    g_fused = torch.autograd.grad(total, hs)[0]
    g_ref = torch.autograd.grad(kd + ref_ce, hs)[0]
    torch.testing.assert_close(g_fused, g_ref, rtol=1e-5, atol=1e-6)


def test_fused_kd_ce_refuses_a_chunk_size_below_one():
    """A negative chunk size used to skip every chunk: a silent zero loss with zero gradients."""
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    ws, ht, wt = torch.randn(9, 4, generator=g), torch.randn(2, 5, 3, generator=g), torch.randn(9, 3, generator=g)
    labels = torch.randint(0, 9, (2, 5), generator=g)
    for bad in (0, -4):
        with pytest.raises(ValueError, match="chunk_size"):
            losses.chunked_kd_ce_loss(hs, ws, ht, wt, labels, chunk_size=bad)
    total, kd, ce = losses.chunked_kd_ce_loss(hs, ws, ht, wt, labels, chunk_size=3)
    assert kd > 0 and ce > 0
    assert torch.autograd.grad(total, hs)[0].abs().sum() > 0


def test_fused_kd_ce_reports_kd_exactly_when_ce_dominates():
    """The fused path reported kd as (kd + w * ce) - w * ce in fp32: with a small KD (a student close to its
    teacher) or a large ce/kd weight ratio, the logged kd term lost most of its digits (0 at w = 1000)."""
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(64, 32, generator=g, requires_grad=True)
    ws = torch.randn(500, 32, generator=g) * 0.3
    ht = hs.detach() + 0.01 * torch.randn(64, 32, generator=g)
    labels = torch.randint(0, 500, (64,), generator=g)
    kd_alone = losses.chunked_kd_loss(hs, ws, ht, ws, chunk_size=16)
    for w in (1.0, 100.0, 1000.0):
        total, kd, ce = losses.chunked_kd_ce_loss(hs, ws, ht, ws, labels, ce_weight=w, chunk_size=16)
        torch.testing.assert_close(kd, kd_alone.detach(), rtol=1e-5, atol=0)
        # the gradient is still that of kd + w * ce
        ref_ce = F.cross_entropy(hs @ ws.T, labels)
        g_fused = torch.autograd.grad(total, hs)[0]
        g_ref = torch.autograd.grad(losses.kd_loss(hs @ ws.T, ht @ ws.T) + w * ref_ce, hs)[0]
        torch.testing.assert_close(g_fused, g_ref, rtol=1e-4, atol=1e-6)
