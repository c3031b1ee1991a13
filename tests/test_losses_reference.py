"""distill.losses on edge cases, against textbook float64 references written here (full vocab, plain loops)."""

from __future__ import annotations

import pytest
import torch

from distill.losses import chunked_kd_loss, kd_loss
from tests.helpers import naive_divergence

KIND_BETAS = ([(k, 0.5) for k in ("forward_kl", "reverse_kl", "tvd")] + [("jsd", b) for b in (0.0, 0.3, 1.0)]
              + [(k, b) for k in ("skew_kl", "skew_reverse_kl") for b in (0.0, 0.1, 1.0)])


def masked_batch():
    """``[3, 9]`` ids, attention mask (row 2 right-padded) and completion mask (row 1 without targets), and the
    generator that drew them (for what the test draws next)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, 290, (3, 9), generator=g)
    am = torch.ones_like(x)
    am[2, 6:] = 0
    loss_mask = torch.rand(3, 9, generator=g) > 0.4
    loss_mask[1] = False
    return x, am, loss_mask, g


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
    ref = sum(naive_divergence(zs[i] / temperature, zt[i, :real] / temperature, kind, beta) for i in range(tokens))
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


@pytest.mark.parametrize("chunk", [None, 4])
def test_distill_model_gradients_equal_a_plain_full_logits_reference_under_every_mask(chunk):
    """KD (JSD, T != 1) + CE + focal (gamma = 0) through DistillModel, on the full-logits and the chunked+CE
    paths, with right padding, an ignored label, a completion mask that leaves one row without a target and a
    teacher head padded past the student's: loss terms and student gradients equal a plain reference built
    from the models' full logits."""
    import warnings

    import torch.nn.functional as F

    from core.tiny import tiny_model
    from distill.model import DistillModel, LossConfig

    teacher = tiny_model(layers=2, seed=0, vocab_size=320).double()
    student = tiny_model(layers=2, seed=1, vocab_size=300).double()
    x, am, loss_mask, g = masked_batch()
    labels = x.masked_fill(am == 0, -100)
    labels[0, 2] = -100
    cfg = LossConfig(kd_weight=1.0, kd_kind="jsd", temperature=1.7, beta=0.3, kd_chunk_size=chunk, ce_weight=0.7,
                     focal_weight=0.3, focal_alpha=0.25, focal_gamma=0.0, hidden_weight=0.0, hidden_layers=[],
                     hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the padded teacher head's warning
        m = DistillModel(student, teacher, cfg, tokenizer_size=290)
    assert m.kd_path == ("full" if chunk is None else "chunked+ce")
    out = m(x, attention_mask=am, labels=labels, loss_mask=loss_mask)
    params = [p for p in student.parameters() if p.requires_grad]
    got = torch.autograd.grad(out.loss, params, allow_unused=True)
    m.remove_hooks()

    s = student(x, attention_mask=am).logits[:, :-1]
    with torch.no_grad():
        t = teacher(x, attention_mask=am).logits[:, :-1, :300]
    target = labels[:, 1:]
    valid = (target != -100) & am[:, :-1].bool() & loss_mask[:, 1:]
    counted = [(b, i) for b in range(3) for i in range(8) if valid[b, i]]
    kd = sum(naive_divergence(s[b, i] / 1.7, t[b, i] / 1.7, "jsd", 0.3) for b, i in counted) * 1.7**2 / len(counted)
    ce = sum(-F.log_softmax(s[b, i], -1)[target[b, i]] for b, i in counted) / len(counted)
    total = kd + 0.7 * ce + 0.3 * 0.25 * ce  # focal with gamma = 0 is alpha * CE
    want = torch.autograd.grad(total, params, allow_unused=True)
    assert out.tokens == len(counted)
    for name, value in (("kd", kd), ("ce", ce), ("focal", 0.25 * ce), ("loss", total)):
        torch.testing.assert_close(getattr(out, name).detach(), value.detach(), rtol=1e-10, atol=1e-12, msg=name)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("mode", ["topk", "sampled"])
def test_distill_model_cached_targets_equal_a_per_token_reference_under_masks(mode):
    """DistillModel from cached teacher targets (T != 1), with padding and a completion mask: position t's student
    logits meet position t's cached targets (the teacher's next-token view), and the term and its gradients equal
    textbook per-token values: top-k + tail-bucket KL, or the sampled estimate sum w (log p - log q)."""
    import math

    from core.tiny import tiny_model
    from distill.model import DistillModel, LossConfig
    from distill.teacher_cache import CachedTargets, sample_teacher, topk_logprobs

    student = tiny_model(layers=2, seed=1).double()
    teacher = tiny_model(layers=2, seed=0).double()
    x, am, loss_mask, g = masked_batch()
    T = 1.6
    with torch.no_grad():
        t_logits = teacher(x).logits
    if mode == "topk":
        ids, lp = topk_logprobs(t_logits, 5)
        targets = CachedTargets(ids.long(), lp.double())
    else:
        ids, counts, lp = sample_teacher(t_logits, 7, T, g)
        targets = CachedTargets(ids.long(), lp.double(), counts.double() / 7)
    cfg = LossConfig(kd_weight=1.0, kd_kind="forward_kl", temperature=T, beta=0.5, kd_chunk_size=4, ce_weight=0.0,
                     focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0, hidden_layers=[],
                     hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=64)
    m = DistillModel(student, None, cfg, cached_teacher=True)
    out = m(x, attention_mask=am, loss_mask=loss_mask, teacher_topk=targets)
    params = list(student.parameters())
    got = torch.autograd.grad(out.loss, params, allow_unused=True)

    s = student(x, attention_mask=am).logits
    valid = am[:, :-1].bool() & am[:, 1:].bool() & loss_mask[:, 1:]
    rows = []
    for b, i in ((b, i) for b in range(3) for i in range(8) if valid[b, i]):
        q = torch.softmax(s[b, i] / T, -1)
        if mode == "topk":
            p = [math.exp(v) for v in targets.logprobs[b, i].tolist()]
            p_t = torch.softmax(torch.tensor(p + [1 - sum(p)], dtype=torch.float64).log() / T, -1)
            q_top = q[targets.ids[b, i]]
            q_b = torch.cat([q_top, (1 - q_top.sum()).reshape(1)])
            rows.append((p_t * (p_t.log() - q_b.log())).sum() * T * T)
        else:
            w, used = targets.weights[b, i], targets.weights[b, i] > 0
            rows.append((w[used] * (targets.logprobs[b, i][used] - q[targets.ids[b, i][used]].log())).sum() * T * T)
    ref = torch.stack(rows).mean()
    want = torch.autograd.grad(ref, params, allow_unused=True)
    assert out.tokens == len(rows)
    tol = 1e-5 if mode == "topk" else 1e-10  # topk_kd_loss runs in fp32
    torch.testing.assert_close(out.kd.detach().double(), ref.detach(), rtol=tol, atol=tol)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampled_padding_slots_count_for_nothing_when_the_student_rules_their_id_out(temperature):
    """A sampled cache pads each position's slots with id 0 and weight 0. With token 0 masked to -inf on both sides
    (never drawn), those slots gave 0 * log 0 = NaN: the value is the textbook sum over the drawn ids alone."""
    from distill.losses import sampled_kd_loss
    from distill.teacher_cache import sample_teacher

    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    s = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    t[..., 0] = s[..., 0] = float("-inf")
    ids, counts, lp = sample_teacher(t, 6, temperature, g)
    assert (counts == 0).any()  # some padding slots
    w = counts.double() / 6
    mask = torch.tensor([[True, False, True], [True, True, True]])
    got_s = s.clone().requires_grad_()
    got = sampled_kd_loss(got_s, ids, w, mask, temperature=temperature, teacher_logprobs=lp.double())
    ref_s = s.clone().requires_grad_()
    log_q = torch.log_softmax(ref_s / temperature, -1)
    rows = [sum(w[b, i, j] * (lp[b, i, j].double() - log_q[b, i, ids[b, i, j]]) for j in range(6) if counts[b, i, j])
            for b in range(2) for i in range(3) if mask[b, i]]
    ref = torch.stack(rows).mean() * temperature**2
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(got, got_s)[0], torch.autograd.grad(ref, ref_s)[0],
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("k", [7, 9])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_wider_than_the_teachers_support_is_full_kd_when_both_rule_tokens_out(k, temperature):
    """Tokens masked to -inf on both sides: a top-k holding the teacher's whole support is exact forward KL, and one
    wider than it (ids of probability 0 in the top-k, where the student's log-prob is -inf too) must stay so (NaN)."""
    from distill.losses import topk_kd_loss
    from distill.teacher_cache import topk_logprobs

    g = torch.Generator().manual_seed(0)
    t = torch.randn(2, 3, 9, generator=g)
    s = torch.randn(2, 3, 9, generator=g)
    t[..., :2] = s[..., :2] = float("-inf")
    idx, lp = topk_logprobs(t, k)
    got_s, ref_s = s.clone().requires_grad_(), s.clone().requires_grad_()
    got = topk_kd_loss(got_s, idx.long(), lp, temperature=temperature)
    ref = kd_loss(ref_s, t, temperature=temperature)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(got, got_s)[0], torch.autograd.grad(ref, ref_s)[0],
                               rtol=1e-5, atol=1e-6)


def test_normalized_mse_and_topk_kd_never_reach_the_teacher():
    """The module's convention (the teacher side is detached), for the two terms that did not detach: a teacher
    tensor that requires grad (e.g. a teacher-side projector) got a gradient from them."""
    from distill.losses import normalized_mse, topk_kd_loss

    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    t = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    lp, idx = torch.log_softmax(t, -1).topk(3, -1)
    for loss in (normalized_mse(s, t, mask), topk_kd_loss(s, idx, lp, mask, temperature=2.0)):
        grad_s, grad_t = torch.autograd.grad(loss, (s, t), allow_unused=True)
        assert grad_t is None and grad_s.abs().sum() > 0


def test_a_cached_targets_student_with_padding_rows_compares_over_the_cache_s_vocabulary():
    """A student whose vocabulary has padding rows past the cache's (which check_vocabulary accepts) took those rows
    into its softmax on the cached path, not on the live one: the term equals the student cut to the cache's
    vocabulary, in value and gradient."""
    from core.tiny import VOCAB, tiny_model
    from distill.model import DistillModel, LossConfig
    from distill.teacher_cache import CachedTargets, topk_logprobs

    padded = tiny_model(layers=1, seed=1, vocab=VOCAB + 64).double()
    with torch.no_grad():
        padded.lm_head.weight[VOCAB:] *= 40  # padding rows with real mass, as untrained rows may have
    cut = tiny_model(layers=1, seed=1, vocab=VOCAB).double()
    cut.load_state_dict({k: v[:VOCAB] if v.shape[:1] == (VOCAB + 64,) else v for k, v in padded.state_dict().items()})
    x = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids, lp = topk_logprobs(tiny_model(layers=1, seed=0).double()(x).logits, 5)
    targets = CachedTargets(ids.long(), lp.double())
    cfg = LossConfig(kd_weight=1.0, kd_kind="forward_kl", temperature=1.0, beta=0.5, kd_chunk_size=None,
                     ce_weight=0.0, focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0,
                     hidden_layers=[], hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=64)
    got = DistillModel(padded, None, cfg, cached_teacher=True, cached_vocab=VOCAB)(x, teacher_topk=targets)
    want = DistillModel(cut, None, cfg, cached_teacher=True, cached_vocab=VOCAB)(x, teacher_topk=targets)
    torch.testing.assert_close(got.kd.double(), want.kd.double(), rtol=1e-6, atol=1e-6)
    g_got = torch.autograd.grad(got.loss, padded.model.layers[0].mlp.down_proj.weight)[0]
    g_want = torch.autograd.grad(want.loss, cut.model.layers[0].mlp.down_proj.weight)[0]
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-8)
