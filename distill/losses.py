"""Distillation losses: pure functions first, thin modules second.

Conventions shared by every function here:

* Softmax / log-softmax math runs in fp32 whatever the input dtype (bf16 logits are upcast).
* ``mask`` marks the positions that count (True = counts); masked positions never contribute and
  get exactly zero gradient. Means are over counted tokens (a token-level mean, not per sequence).
* A batch with no counted token gives a zero loss that is still connected to the student's graph,
  so ``backward()`` works and yields zero gradients instead of NaN.
* The teacher side is always detached: no gradient ever reaches teacher tensors.

Functions:

* :func:`kd_loss` -- divergence between student and teacher token distributions from logits.
* :func:`chunked_kd_loss` -- the same value and gradients from final hidden states and output heads,
  without ever materializing ``[tokens, vocab]`` logits (see ``distill/_chunked.py``).
* :func:`sampled_kd_loss` -- forward KL estimated from token ids sampled from the teacher (a sampled
  teacher cache): unbiased in value and gradient, unlike a top-k truncation.
* :func:`ce_loss`, :func:`focal_loss` -- the hard-label term (focal reweights rare / hard tokens).
* :func:`hidden_loss` -- intermediate hidden-state matching (MSE or cosine).
* :func:`attention_map_loss` -- attention-probability map matching on sampled query rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill._chunked import KINDS, ChunkedKD

KD_KINDS = KINDS  # the divergences every KD path accepts (one list, defined by the fused kernel)

__all__ = [
    "KINDS",
    "kd_loss",
    "chunked_kd_loss",
    "chunked_kd_ce_loss",
    "sampled_kd_loss",
    "ce_loss",
    "focal_loss",
    "hidden_loss",
    "attention_map_loss",
    "KDLoss",
    "FocalLoss",
    "SampledKDLoss",
]


# --------------------------------------------------------------------------- helpers


def _check_kd_args(kind: str, temperature: float, beta: float) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kd kind {kind!r}; use one of {', '.join(KINDS)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use 1.0 for no softening")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}; 0 = forward KL, 1 = reverse KL")


def _token_mask(mask: Tensor | None, lead_shape: torch.Size, what: str) -> Tensor | None:
    """Flatten ``mask`` (``lead_shape``, e.g. ``[batch, seq]`` or ``[tokens]``) to ``[tokens]`` bool."""
    if mask is None:
        return None
    if tuple(mask.shape) != tuple(lead_shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match {what} {tuple(lead_shape)}; "
                         "pass a [batch, seq] (or [tokens]) mask with True for tokens that count")
    return mask.reshape(-1).to(torch.bool)


def _rows(x: Tensor, mask: Tensor | None) -> Tensor:
    """``[..., last]`` -> ``[counted_tokens, last]``; no copy when every token counts."""
    x = x.reshape(-1, x.shape[-1])
    return x if mask is None else x[mask]


def _fp32(x: Tensor) -> Tensor:
    """Upcast half / bf16 to fp32 for the softmax math; fp32 and fp64 are kept as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _mean(per_token: Tensor) -> Tensor:
    """Mean over counted tokens; an empty selection gives 0 with a graph (sum of nothing)."""
    return per_token.sum() / max(per_token.numel(), 1)


# --------------------------------------------------------------------------- logit distillation


def _divergence(zs: Tensor, zt: Tensor, kind: str, beta: float) -> Tensor:
    """Per-token divergence between softmax(zs) (student) and softmax(zt) (teacher, detached).

    ``zs``, ``zt``: fp32 ``[tokens, vocab]``. Returns ``[tokens]``. Plain autograd formulas; the
    chunked path uses closed-form gradients instead, and the two are tested against each other.
    """
    # Clamp so that a -inf logit (masked vocabulary) on either side gives 0 * log 0 = 0 rather than NaN.
    log_ps = torch.log_softmax(zs, dim=-1).clamp(min=torch.finfo(zs.dtype).min)
    log_pt = torch.log_softmax(zt, dim=-1).clamp(min=torch.finfo(zt.dtype).min)
    if kind == "jsd" and beta == 0.0:
        kind = "forward_kl"
    elif kind == "jsd" and beta == 1.0:
        kind = "reverse_kl"
    if kind == "skew_kl" and beta == 0.0:
        kind = "forward_kl"
    if kind == "skew_reverse_kl" and beta == 0.0:
        kind = "reverse_kl"
    if kind == "forward_kl":
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    if kind in ("skew_kl", "skew_reverse_kl"):
        if beta == 1.0:  # m is the first distribution: the divergence is 0 (log1p(-1) would be -inf)
            return (log_ps * 0.0).sum(-1)
        # KL(a || m), m = beta * a + (1 - beta) * b, in log space; a = p_t for skew_kl, p_s for the reverse.
        log_a, log_b = (log_pt, log_ps) if kind == "skew_kl" else (log_ps, log_pt)
        log_m = torch.logaddexp(log_a + math.log(beta), log_b + math.log1p(-beta))
        return (log_a.exp() * (log_a - log_m)).sum(-1)
    if kind == "reverse_kl":
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    if kind == "jsd":
        # log m with m = beta * p_t + (1 - beta) * p_s, kept in log space for tiny probabilities.
        log_m = torch.logaddexp(log_pt + math.log(beta), log_ps + math.log1p(-beta))
        kl_t = (log_pt.exp() * (log_pt - log_m)).sum(-1)
        kl_s = (log_ps.exp() * (log_ps - log_m)).sum(-1)
        return beta * kl_t + (1.0 - beta) * kl_s
    return 0.5 * (log_pt.exp() - log_ps.exp()).abs().sum(-1)  # tvd


def kd_loss(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None = None, *,
            kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5) -> Tensor:
    """Token-level distillation divergence between student and teacher distributions.

    Args:
        student_logits: ``[batch, seq, vocab]`` or ``[tokens, vocab]``, any float dtype.
        teacher_logits: same shape; detached (the teacher never gets a gradient).
        mask: ``[batch, seq]`` / ``[tokens]`` bool, True = token counts; None = all count.
        kind: with ``p_s = softmax(student / T)`` and ``p_t = softmax(teacher / T)``:

            * ``forward_kl``: KL(p_t || p_s) (mode-covering; classic Hinton KD)
            * ``reverse_kl``: KL(p_s || p_t) (mode-seeking)
            * ``jsd``: the generalized JSD of GKD,
              ``beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)`` with
              ``m = beta * p_t + (1 - beta) * p_s``. The endpoints are defined as in GKD:
              ``beta = 0`` is exactly forward KL and ``beta = 1`` exactly reverse KL. Note the
              formula itself shrinks to 0 at both ends (``JSD_beta / beta -> KL(p_t || p_s)`` as
              beta -> 0 and ``JSD_beta / (1 - beta) -> KL(p_s || p_t)`` as beta -> 1), so the
              endpoints switch to the KL they interpolate towards rather than continue the curve.
            * ``tvd``: total variation ``0.5 * sum |p_t - p_s|``.
            * ``skew_kl``: DistiLLM's skew KL ``KL(p_t || beta * p_t + (1 - beta) * p_s)``; ``beta``
              is the teacher's share of the mixture (DistiLLM uses 0.1); ``beta = 0`` is forward KL.
            * ``skew_reverse_kl``: DistiLLM's skew reverse KL ``KL(p_s || beta * p_s + (1 - beta) * p_t)``;
              ``beta`` is the student's share (0.1 in DistiLLM): the log ratio is bounded by
              ``log(1 / beta)`` where the teacher rules a token out; ``beta = 0`` is reverse KL.
        temperature: T > 0 softens both distributions; the loss is multiplied by T^2 so gradient
            magnitudes stay comparable across temperatures.
        beta: JSD interpolation weight / skew KL's share of the first distribution in [0, 1] (ignored by the
            other kinds).

    Returns:
        fp32 (fp64 for fp64 inputs) scalar: mean over counted tokens of ``T^2 * divergence``; 0 (with a graph) when no
        token counts.
    """
    _check_kd_args(kind, temperature, beta)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} != teacher logits "
                         f"{tuple(teacher_logits.shape)}; both models must share the tokenizer and "
                         "vocabulary (slice a padded head to the real vocab size)")
    m = _token_mask(mask, student_logits.shape[:-1], "logits' leading dims")
    # Select first, then upcast: only counted tokens are ever copied to fp32.
    zs = _fp32(_rows(student_logits, m))
    zt = _fp32(_rows(teacher_logits.detach(), m))
    if temperature != 1.0:
        zs = zs / temperature
        zt = zt / temperature
    return _mean(_divergence(zs, zt, kind, beta)) * (temperature * temperature)


def chunked_kd_loss(student_hidden: Tensor, student_head: Tensor, teacher_hidden: Tensor,
                    teacher_head: Tensor, mask: Tensor | None = None, *, kind: str = "forward_kl",
                    temperature: float = 1.0, beta: float = 0.5, chunk_size: int = 1024,
                    student_bias: Tensor | None = None, teacher_bias: Tensor | None = None) -> Tensor:
    """:func:`kd_loss` computed from final hidden states and output heads, chunk by chunk.

    Equals ``kd_loss(student_hidden @ student_head.T, teacher_hidden @ teacher_head.T, mask, ...)``
    (values and gradients) but never holds full-vocabulary logits: for each chunk of counted tokens
    the forward pass forms both logit chunks, the loss and its gradient w.r.t. the student logits,
    and folds that gradient into ``student_hidden`` / ``student_head`` gradients immediately.
    Backward only rescales what forward saved. Peak extra memory is about
    ``6 * chunk_size * vocab * 4`` bytes plus one fp32 ``[vocab, d_s]`` head gradient.

    Args:
        student_hidden: ``[batch, seq, d_s]`` or ``[tokens, d_s]`` final (post-norm) hidden states.
        student_head: ``[vocab, d_s]`` output-head (lm_head) weight; gets a gradient if it requires one
            (for tied embeddings pass the embedding weight itself).
        teacher_hidden: ``[batch, seq, d_t]`` / ``[tokens, d_t]``; ``d_t`` may differ from ``d_s``.
        teacher_head: ``[vocab, d_t]``. Teacher tensors never get a gradient.
        mask: ``[batch, seq]`` / ``[tokens]`` bool, True = counts; only counted tokens are processed.
        kind, temperature, beta: as in :func:`kd_loss`.
        chunk_size: tokens per chunk; trades peak memory (linear in it) against matmul efficiency.
        student_bias, teacher_bias: optional ``[vocab]`` head biases.

    Works under ``torch.no_grad()`` (evaluation): no gradient is computed then.
    """
    _check_kd_args(kind, temperature, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if student_head.dim() != 2 or teacher_head.dim() != 2:
        raise ValueError("heads must be [vocab, hidden] weight matrices (e.g. model.lm_head.weight)")
    if student_head.shape[0] != teacher_head.shape[0]:
        raise ValueError(f"student vocab {student_head.shape[0]} != teacher vocab {teacher_head.shape[0]}; "
                         "both models must share the tokenizer (slice a padded head to the real vocab size)")
    if student_hidden.shape[-1] != student_head.shape[1]:
        raise ValueError(f"student hidden width {student_hidden.shape[-1]} != student head width "
                         f"{student_head.shape[1]}; pass the final hidden states and lm_head.weight")
    if teacher_hidden.shape[-1] != teacher_head.shape[1]:
        raise ValueError(f"teacher hidden width {teacher_hidden.shape[-1]} != teacher head width "
                         f"{teacher_head.shape[1]}; pass the final hidden states and lm_head.weight")
    if student_hidden.shape[:-1] != teacher_hidden.shape[:-1]:
        raise ValueError(f"student tokens {tuple(student_hidden.shape[:-1])} != teacher tokens "
                         f"{tuple(teacher_hidden.shape[:-1])}; run both models on the same batch")
    m = _token_mask(mask, student_hidden.shape[:-1], "hidden states' leading dims")
    hs = _rows(student_hidden, m)
    ht = _rows(teacher_hidden.detach(), m).to(teacher_head.dtype)
    hs = hs.to(student_head.dtype)
    wt = teacher_head.detach()
    bt = None if teacher_bias is None else teacher_bias.detach()
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hs.requires_grad, grad_on and student_head.requires_grad,
             grad_on and student_bias is not None and student_bias.requires_grad)
    n = hs.shape[0]
    if n == 0:
        # Nothing counts: a zero that is still attached to the student tensors.
        zero = hs.sum() * 0.0 + student_head.sum() * 0.0
        if student_bias is not None:
            zero = zero + student_bias.sum() * 0.0
        return _fp32(zero)
    return ChunkedKD.apply(hs.contiguous(), student_head, student_bias, ht.contiguous(), wt, bt, kind,
                           float(temperature), float(beta), int(chunk_size), n, needs)[0]


def chunked_kd_ce_loss(student_hidden: Tensor, student_head: Tensor, teacher_hidden: Tensor,
                       teacher_head: Tensor, labels: Tensor, mask: Tensor | None = None, *,
                       ce_weight: float = 1.0, kind: str = "forward_kl", temperature: float = 1.0,
                       beta: float = 0.5, chunk_size: int = 1024) -> tuple[Tensor, Tensor, Tensor]:
    """``chunked_kd_loss + ce_weight * ce_loss`` in one pass over the student head.

    The CE term (at T = 1, on ``labels`` ``[batch, seq]`` aligned with the hidden states) reuses each
    chunk's student logits and its gradient joins the KD gradient before the head matmuls, so the
    student head is applied once instead of twice (forward) and three times less in total.

    Returns:
        ``(total, kd, ce)``: the weighted total (differentiable) and both terms, detached.
    """
    _check_kd_args(kind, temperature, beta)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if tuple(labels.shape) != tuple(student_hidden.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} do not match the hidden states' leading dims "
                         f"{tuple(student_hidden.shape[:-1])}; pass labels aligned (already shifted) with them")
    m = _token_mask(mask, student_hidden.shape[:-1], "hidden states' leading dims")
    lab = labels.reshape(-1) if m is None else labels.reshape(-1)[m]
    if (lab < 0).any() or (lab >= student_head.shape[0]).any():
        raise ValueError("labels must be token ids of counted positions; mask out ignored ones (-100)")
    hs = _rows(student_hidden, m).to(student_head.dtype)
    ht = _rows(teacher_hidden.detach(), m).to(teacher_head.dtype)
    n = hs.shape[0]
    if n == 0:
        zero = _fp32(hs.sum() * 0.0 + student_head.sum() * 0.0)
        return zero, zero.detach(), zero.detach()
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hs.requires_grad, grad_on and student_head.requires_grad, False)
    total, ce, kd = ChunkedKD.apply(hs.contiguous(), student_head, None, ht.contiguous(), teacher_head.detach(), None,
                                    kind, float(temperature), float(beta), int(chunk_size), n, needs,
                                    lab.long(), float(ce_weight))
    return total, kd, ce


def sampled_kd_loss(student_logits: Tensor, sample_ids: Tensor, sample_weights: Tensor,
                    mask: Tensor | None = None, *, temperature: float = 1.0,
                    teacher_logprobs: Tensor | None = None) -> Tensor:
    """Forward KL(p_t || p_s) estimated from tokens sampled from the teacher (Sparse Logit Sampling).

    With ``N`` draws ``x_1..x_N ~ p_t`` (at temperature T) stored as distinct ids and weights
    ``w_i = count_i / N``, the empirical distribution ``p_hat`` has ``E[p_hat] = p_t``. Forward KL
    is ``-H(p_t) - <p_t, log p_s>``, linear in ``p_t``, so replacing ``p_t`` by ``p_hat`` gives an
    unbiased estimate of its value (when the teacher log-probs of the sampled ids are given) and of
    its gradient w.r.t. the student logits, ``T * (p_s - p_hat)``. A top-k truncation is biased
    instead: it never pushes mass onto the teacher's tail tokens.

    Args:
        student_logits: ``[batch, seq, vocab]`` or ``[tokens, vocab]``, any float dtype.
        sample_ids: ``[batch, seq, n]`` long, distinct sampled token ids per position (padding
            slots carry weight 0; their id is ignored).
        sample_weights: ``[batch, seq, n]`` float, ``count / N``; each counted row sums to 1.
        mask: ``[batch, seq]`` / ``[tokens]`` bool, True = counts.
        temperature: T the samples were drawn at; the student is softened by the same T and the
            loss scaled by T^2, as in :func:`kd_loss`.
        teacher_logprobs: ``[batch, seq, n]`` log p_t(x_i) at T. Given: the value estimates the KL;
            omitted: the value is the cross-entropy ``-<p_hat, log p_s>`` (KL + teacher entropy),
            with the same gradient.

    Returns:
        fp32 scalar: mean over counted tokens of ``T^2 *`` the per-token estimate; 0 with a graph
        when no token counts.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if sample_ids.shape != sample_weights.shape or sample_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"sample ids {tuple(sample_ids.shape)} / weights {tuple(sample_weights.shape)} do not "
                         f"match logits {tuple(student_logits.shape)}; pass [batch, seq, n] samples per position")
    m = _token_mask(mask, student_logits.shape[:-1], "logits' leading dims")
    zs = _fp32(_rows(student_logits, m))
    ids = _rows(sample_ids, m).long()
    w = _fp32(_rows(sample_weights.detach(), m))
    if temperature != 1.0:
        zs = zs / temperature
    # Clamped like the teacher's below: a padding slot (w = 0) whose id the student rules out (-inf) adds 0, not NaN.
    log_ps = torch.log_softmax(zs, dim=-1).gather(-1, ids).clamp(min=torch.finfo(zs.dtype).min)
    per_token = -(w * log_ps).sum(-1)
    if teacher_logprobs is not None:
        lp = _fp32(_rows(teacher_logprobs.detach(), m))
        # w = 0 on padding slots: clamp keeps 0 * (-inf) out of the sum.
        per_token = per_token + (w * lp.clamp(min=torch.finfo(lp.dtype).min)).sum(-1)
    return _mean(per_token) * (temperature * temperature)


# --------------------------------------------------------------------------- hard labels


def _label_rows(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}; "
                         "labels must be aligned (already shifted) with [batch, seq, vocab] logits")
    labels = labels.reshape(-1)
    keep = labels != ignore_index
    return _fp32(logits.reshape(-1, logits.shape[-1])[keep]), labels[keep]


def ce_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Cross-entropy, fp32, mean over tokens whose label is not ``ignore_index``.

    ``logits``: ``[batch, seq, vocab]`` or ``[tokens, vocab]``; ``labels``: ``[batch, seq]`` /
    ``[tokens]`` already aligned with the logits (callers shift). No counted token -> 0 with a graph.
    """
    z, y = _label_rows(logits, labels, ignore_index)
    return _mean(F.cross_entropy(z, y, reduction="none"))


def focal_loss(logits: Tensor, labels: Tensor, *, alpha: float = 0.25, gamma: float = 2.0,
               ignore_index: int = -100) -> Tensor:
    """Focal loss ``-alpha * (1 - p_y)^gamma * log p_y``, fp32, mean over non-ignored tokens.

    Down-weights tokens the student already predicts well so rare / hard (long-tail) tokens weigh
    more. ``gamma = 0, alpha = 1`` is exactly :func:`ce_loss`. Shapes as in :func:`ce_loss`.
    """
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}; 0 gives (alpha-weighted) cross-entropy")
    z, y = _label_rows(logits, labels, ignore_index)
    log_p = torch.log_softmax(z, dim=-1).gather(-1, y[:, None]).squeeze(-1)
    if gamma == 0:
        # Skip pow: d/dx x^0 evaluates 0 * x^-1, which is NaN at p = 1.
        return _mean(-alpha * log_p)
    # 1 - p computed as -expm1(log p): exact for p close to 1, where the focal weight matters most. Clamped
    # at the smallest normal float, not 0: at p == 1 (a confident token in fp32) pow's gradient for gamma < 1
    # is gamma * 0^(gamma - 1) = inf, and inf * 0 turns the whole step's gradient into NaN.
    weight = (-torch.expm1(log_p)).clamp(min=torch.finfo(log_p.dtype).tiny).pow(gamma)
    return _mean(-alpha * weight * log_p)


# --------------------------------------------------------------------------- intermediate states


def hidden_loss(student_h: Tensor, teacher_h: Tensor, mask: Tensor | None = None, *,
                kind: str = "mse") -> Tensor:
    """Hidden-state matching on counted tokens, in fp32.

    Args:
        student_h: ``[batch, seq, d]`` (or ``[tokens, d]``), already projected to the teacher width.
        teacher_h: same shape; detached.
        mask: ``[batch, seq]`` / ``[tokens]`` bool, True = counts; None = all count.
        kind: ``mse`` = mean over counted tokens of the mean over the ``d`` features of
            ``(s - t)^2`` (i.e. ``F.mse_loss`` restricted to counted tokens, so the scale does not
            grow with width); ``cosine`` = mean over counted tokens of ``1 - cos(s, t)``.
    """
    if kind not in ("mse", "cosine"):
        raise ValueError(f"unknown hidden loss kind {kind!r}; use 'mse' or 'cosine'")
    if student_h.shape[-1] != teacher_h.shape[-1]:
        raise ValueError(f"student width {student_h.shape[-1]} != teacher width {teacher_h.shape[-1]}; "
                         "add a projector (student -> teacher width) before hidden_loss")
    if student_h.shape != teacher_h.shape:
        raise ValueError(f"student hidden {tuple(student_h.shape)} != teacher hidden {tuple(teacher_h.shape)}; "
                         "run both models on the same batch")
    m = _token_mask(mask, student_h.shape[:-1], "hidden states' leading dims")
    s = _fp32(_rows(student_h, m))
    t = _fp32(_rows(teacher_h.detach(), m))
    if kind == "mse":
        return _mean((s - t).pow(2).mean(-1))
    return _mean(1.0 - F.cosine_similarity(s, t, dim=-1, eps=1e-8))


def sample_query_positions(mask: Tensor, num_queries: int, generator: torch.Generator | None = None
                           ) -> Tensor:
    """Query positions for :func:`attention_map_loss`: ``[batch, min(num_queries, seq)]`` long, sorted.

    All positions when ``seq <= num_queries``. Otherwise each row draws uniformly without
    replacement among its counted positions (padding is only drawn when a row has fewer counted
    positions than ``num_queries``; those rows are then skipped by the loss). Deterministic given
    ``generator``.
    """
    batch, seq = mask.shape
    if seq <= num_queries:
        return torch.arange(seq, device=mask.device).expand(batch, seq)
    # Random keys in [0, 1) for counted positions, < 0 for padding: top-k picks counted first.
    keys = torch.rand((batch, seq), generator=generator, device=mask.device)
    keys = torch.where(mask, keys, keys - 2.0)
    return keys.topk(num_queries, dim=-1).indices.sort(dim=-1).values


def _mean_attention_map(q: Tensor, k: Tensor, pos: Tensor, key_mask: Tensor, row_ok: Tensor) -> Tensor:
    """Head-averaged causal attention probabilities for selected query rows.

    q ``[batch, heads, seq, hd]``, k ``[batch, kv_heads, seq, hd]``, pos ``[batch, nq]``,
    key_mask ``[batch, seq]`` bool, row_ok ``[batch, nq]`` bool. Returns fp32 ``[batch, nq, seq]``.
    """
    b, h, _, hd = q.shape
    kv = k.shape[1]
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} kv heads; pass q/k from one attention layer")
    group = h // kv
    nq = pos.shape[1]
    qs = _fp32(q).gather(2, pos[:, None, :, None].expand(b, h, nq, hd))
    # GQA without repeating K: query head j uses kv head j // group (transformers' repeat_kv order),
    # so fold the group into the query axis and matmul against the un-repeated K.
    qs = qs.reshape(b, kv, group * nq, hd)
    scores = torch.matmul(qs, _fp32(k).transpose(-1, -2)).mul_(1.0 / math.sqrt(hd))
    scores = scores.view(b, kv, group, nq, -1)
    keys = torch.arange(k.shape[2], device=q.device)
    allowed = (keys[None, None, :] <= pos[:, :, None]) & key_mask[:, None, :]
    # Rows that are skipped anyway may have no allowed key (left padding): open them to avoid NaN.
    allowed = allowed | ~row_ok[:, :, None]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    return torch.softmax(scores, dim=-1).mean(dim=(1, 2))


def attention_map_loss(student_q: Tensor, student_k: Tensor, teacher_q: Tensor, teacher_k: Tensor,
                       mask: Tensor | None = None, *, num_queries: int = 64,
                       generator: torch.Generator | None = None) -> Tensor:
    """Squared distance between head-averaged attention-probability maps of two layers.

    Args:
        student_q: ``[batch, heads_s, seq, hd_s]`` post-RoPE queries (as the attention layer sees them).
        student_k: ``[batch, kv_heads_s, seq, hd_s]`` post-RoPE keys; GQA is handled by grouping the
            query heads, K is never repeated in memory.
        teacher_q, teacher_k: the teacher layer's, with their own head counts / head_dim; no grad.
        mask: ``[batch, seq]`` bool, True = real token. Padding keys are excluded from the softmax
            and padding query rows from the mean. None = all real.
        num_queries: query rows sampled per batch row (see :func:`sample_query_positions`);
            memory is O(batch * heads * num_queries * seq). All rows when ``seq <= num_queries``.
        generator: makes the sampling reproducible.

    Each map is ``A = mean_heads softmax(Q K^T / sqrt(hd))`` with a causal mask, so head counts
    may differ between student and teacher. Normalization: mean over sampled, counted query rows
    of ``sum_keys (A_s - A_t)^2`` (each row is a probability vector, so a row's term is at most 2).
    No counted row -> 0 with a graph. Softmax in fp32.
    """
    if student_q.dim() != 4 or teacher_q.dim() != 4 or student_k.dim() != 4 or teacher_k.dim() != 4:
        raise ValueError("q/k must be [batch, heads, seq, head_dim]; transpose [batch, seq, heads, hd] first")
    b, _, seq, _ = student_q.shape
    if teacher_q.shape[0] != b or teacher_q.shape[2] != seq:
        raise ValueError(f"student q {tuple(student_q.shape)} and teacher q {tuple(teacher_q.shape)} "
                         "must share batch and seq; run both models on the same batch")
    if mask is None:
        mask = torch.ones(b, seq, dtype=torch.bool, device=student_q.device)
    mask = mask.to(torch.bool)
    if tuple(mask.shape) != (b, seq):
        raise ValueError(f"mask shape {tuple(mask.shape)} != [batch, seq] = {(b, seq)}")
    if num_queries < 1:
        raise ValueError(f"num_queries must be >= 1, got {num_queries}")
    pos = sample_query_positions(mask, num_queries, generator)
    row_ok = mask.gather(1, pos)
    a_s = _mean_attention_map(student_q, student_k, pos, mask, row_ok)
    with torch.no_grad():
        a_t = _mean_attention_map(teacher_q.detach(), teacher_k.detach(), pos, mask, row_ok)
    per_row = (a_s - a_t).pow(2).sum(-1)  # [batch, nq]
    return _mean(per_row[row_ok])


# --------------------------------------------------------------------------- modules


def normalized_mse(student_h: Tensor, teacher_h: Tensor, mask: Tensor) -> Tensor:
    """Mean over counted tokens of ``mean((s - t)²) / mean(t²)`` per token, in fp32.

    Residual streams of real LMs carry a few huge "massive activation" features (hundreds in
    SmolLM2), so raw MSE is in the thousands and swamps every other term; normalizing each token by
    its own teacher state makes it scale-free and keeps the term a plain token mean, so the recipes'
    token-weighted accumulation (:func:`distill.training.token_weights`) stays exact (a batch-level
    normalizer would not). Shapes: ``[batch, seq, d]`` and
    ``mask`` ``[batch, seq]``; no counted token gives 0 with a graph.
    """
    t = teacher_h.detach().float()
    per_token = (student_h.float() - t).pow(2).mean(-1) / t.pow(2).mean(-1).clamp(min=1e-12)
    m = mask.bool()
    return (per_token * m).sum() / m.sum().clamp(min=1)


def topk_kd_loss(student_logits: Tensor, teacher_index: Tensor, teacher_logprobs: Tensor,
                 mask: Tensor | None = None, *, temperature: float = 1.0) -> Tensor:
    """Forward KL over the teacher's top-k tokens plus one tail bucket, × T².

    The teacher's distribution is known only on its top-k tokens (a teacher cache); the rest of
    the vocabulary is one bucket holding the remaining mass, on both sides.

    Args:
        student_logits: ``[batch, seq, vocab]``.
        teacher_index: ``[batch, seq, k]`` token ids of the teacher's top-k.
        teacher_logprobs: ``[batch, seq, k]`` their log-probabilities at T = 1.
        mask: ``[batch, seq]`` bool, True = counts.
    Returns:
        Mean over counted tokens (0 with a graph when none count).
    """
    t = temperature
    logq = F.log_softmax(student_logits.float() / t, dim=-1)
    # Clamped like kd_loss's: a top-k id both models rule out (-inf; a top-k wider than the teacher's support) adds 0.
    q_top = logq.gather(-1, teacher_index).clamp(min=torch.finfo(logq.dtype).min)
    # Student tail: log of the mass outside the teacher's top-k, computed without cancellation. The
    # fill is the most negative finite value, not -inf, so a top-k that covers the whole vocabulary
    # gives a finite (and unused) tail with finite gradients.
    q_tail = logq.scatter(-1, teacher_index, torch.finfo(logq.dtype).min).logsumexp(-1, keepdim=True)
    p_top = teacher_logprobs.detach().float()
    # Teacher tail; a top-k holding all but fp32 rounding of the mass (< 1e-6) has an empty tail.
    top_mass = p_top.exp().sum(-1, keepdim=True)
    p_tail = torch.where(top_mass > 1 - 1e-6, torch.full_like(top_mass, float("-inf")),
                         torch.log1p(-top_mass.clamp(max=1 - 1e-6)))
    logp = torch.cat([p_top, p_tail], -1) / t
    logp = logp - logp.logsumexp(-1, keepdim=True)
    logq_b = torch.cat([q_top, q_tail], -1)
    p = logp.exp()
    logp = torch.where(p > 0, logp, torch.zeros_like(logp))  # 0 · log 0 counts as 0
    kl = (p * (logp - logq_b)).sum(-1) * t * t
    if mask is None:
        return kl.mean()
    m = mask.bool()
    return (kl * m).sum() / m.sum().clamp(min=1)


class KDLoss(nn.Module):
    """:func:`kd_loss` with its settings bound, so a recipe can build it once from config."""

    def __init__(self, kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5) -> None:
        super().__init__()
        _check_kd_args(kind, temperature, beta)
        self.kind, self.temperature, self.beta = kind, temperature, beta

    def forward(self, student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None = None) -> Tensor:
        return kd_loss(student_logits, teacher_logits, mask, kind=self.kind,
                       temperature=self.temperature, beta=self.beta)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, temperature={self.temperature}, beta={self.beta}"


class SampledKDLoss(nn.Module):
    """:func:`sampled_kd_loss` with its temperature bound."""

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature

    def forward(self, student_logits: Tensor, sample_ids: Tensor, sample_weights: Tensor,
                mask: Tensor | None = None, teacher_logprobs: Tensor | None = None) -> Tensor:
        return sampled_kd_loss(student_logits, sample_ids, sample_weights, mask, temperature=self.temperature,
                               teacher_logprobs=teacher_logprobs)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"


class FocalLoss(nn.Module):
    """:func:`focal_loss` with its settings bound."""

    def __init__(self, alpha: float = 0.25, gamma: float = 2.0, ignore_index: int = -100) -> None:
        super().__init__()
        self.alpha, self.gamma, self.ignore_index = alpha, gamma, ignore_index

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        return focal_loss(logits, labels, alpha=self.alpha, gamma=self.gamma, ignore_index=self.ignore_index)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, gamma={self.gamma}, ignore_index={self.ignore_index}"
