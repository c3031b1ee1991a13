"""Distillation divergence from hidden states without materializing full-vocabulary logits.

:func:`distill.losses.chunked_kd_loss` is the public entry point; this module holds the math.

For a chunk of tokens the student and teacher logits ``[chunk, vocab]`` are formed, the per-token
divergence *and its closed-form gradient w.r.t. the student logits* are computed right away, and
that gradient is pushed through the student head at once (into the hidden-state gradient of the
chunk and into a running head-gradient sum). Nothing vocabulary-sized survives the chunk, so peak
memory is O(chunk * vocab + vocab * d_s) instead of O(tokens * vocab). Backward only scales the
saved gradients by ``grad_output``.

Closed-form gradients w.r.t. the (temperature-scaled) student logits ``z``, with
``p_s = softmax(z)``; every divergence ``D(p_s)`` gets ``dD/dz = p_s * (g - <p_s, g>)`` where
``g = dD/dp_s`` (the softmax Jacobian), which gives:

* forward KL(p_t || p_s):   ``p_s - p_t``
* reverse KL(p_s || p_t):   ``p_s * (log p_s - log p_t - KL)``
* JSD_beta (GKD):           ``(1 - beta) * p_s * (log p_s - log m - KL(p_s || m))``,
  ``m = beta * p_t + (1 - beta) * p_s`` (the ``beta * KL(p_t || m)`` term's derivative through
  ``m`` cancels against the ``p_s / m`` part of the second term)
* skew KL(p_t || m), ``m = beta * p_t + (1 - beta) * p_s`` (DistiLLM): ``g = -(1 - beta) * p_t / m``,
  so ``p_s * (g - <p_s, g>)``
* skew reverse KL(p_s || m), ``m = beta * p_s + (1 - beta) * p_t`` (DistiLLM's SRKL):
  ``g = log(p_s / m) - beta * p_s / m`` (the constant 1 cancels), so ``p_s * (g - <p_s, g>)``; the log
  ratio is at most ``log(1 / beta)``, where reverse KL's is unbounded on tokens the teacher rules out
* TVD 0.5 * sum|p_t - p_s|: ``p_s * (g - <p_s, g>)`` with ``g = 0.5 * sign(p_s - p_t)`` (sign(0) = 0,
  the same subgradient autograd uses for ``abs``)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

KINDS = ("forward_kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl")


def divergence_and_grad(zs: Tensor, zt: Tensor, kind: str, beta: float, need_grad: bool
                        ) -> tuple[Tensor, Tensor | None]:
    """Per-token divergence and its gradient w.r.t. the student logits.

    ``zs``, ``zt``: fp32 ``[tokens, vocab]`` already divided by the temperature; both are
    OVERWRITTEN (their buffers are reused so that only a few ``[tokens, vocab]`` tensors live at
    once). Returns ``loss [tokens]`` and ``grad [tokens, vocab]`` (None without ``need_grad``).
    """
    if kind == "jsd" and beta == 0.0:
        kind = "forward_kl"
    elif kind == "jsd" and beta == 1.0:
        kind = "reverse_kl"
    elif kind == "skew_kl" and beta == 0.0:
        kind = "forward_kl"
    elif kind == "skew_reverse_kl" and beta == 0.0:
        kind = "reverse_kl"
    if kind in ("skew_kl", "skew_reverse_kl") and beta == 1.0:  # m is the first distribution: zero divergence
        loss = zs.new_zeros(zs.shape[0])
        return loss, (zs.zero_() if need_grad else None)
    # In-place log-softmax: the raw logits are not needed again, so their buffers are reused.
    log_pt = zt.sub_(torch.logsumexp(zt, dim=-1, keepdim=True))
    # A teacher may mask out vocabulary entries with -inf; clamping keeps 0 * log 0 at 0, not NaN.
    log_pt.clamp_(min=torch.finfo(log_pt.dtype).min)
    log_ps = zs.sub_(torch.logsumexp(zs, dim=-1, keepdim=True))
    log_ps.clamp_(min=torch.finfo(log_ps.dtype).min)  # the same for the student's -inf logits
    grad: Tensor | None = None

    if kind == "forward_kl":
        pt = log_pt.exp()
        loss = log_pt.sub_(log_ps).mul_(pt).sum(-1)
        if need_grad:
            grad = log_ps.exp_().sub_(pt)
    elif kind == "reverse_kl":
        f = log_ps - log_pt
        ps = log_ps.exp_()
        loss = (ps * f).sum(-1)
        if need_grad:
            grad = f.sub_(loss[:, None]).mul_(ps)
    elif kind == "jsd":
        log_m = log_ps + math.log1p(-beta)
        torch.logaddexp(log_m, log_pt + math.log(beta), out=log_m)
        pt = log_pt.exp()
        kl_t = log_pt.sub_(log_m).mul_(pt).sum(-1)
        del pt
        ps = log_ps.exp()
        f = log_ps.sub_(log_m)
        del log_m
        kl_s = (ps * f).sum(-1)
        loss = kl_t.mul_(beta).add_(kl_s, alpha=1.0 - beta)
        if need_grad:
            grad = f.sub_(kl_s[:, None]).mul_(ps).mul_(1.0 - beta)
    elif kind == "skew_kl":
        log_m = torch.logaddexp(log_pt + math.log(beta), log_ps + math.log1p(-beta))
        pt = log_pt.exp()
        loss = (pt * (log_pt - log_m)).sum(-1)
        if need_grad:
            g = log_pt.sub_(log_m).exp_().mul_(-(1.0 - beta))  # -(1 - beta) * p_t / m
            ps = log_ps.exp_()
            grad = g.sub_((ps * g).sum(-1, keepdim=True)).mul_(ps)
    elif kind == "skew_reverse_kl":
        log_m = torch.logaddexp(log_ps + math.log(beta), log_pt.add_(math.log1p(-beta)))
        f = log_ps.sub(log_m)  # log(p_s / m) <= log(1 / beta)
        ps = log_ps.exp_()
        loss = (ps * f).sum(-1)
        if need_grad:
            g = f.sub_(torch.exp(f).mul_(beta))  # log(p_s / m) - beta * p_s / m
            grad = g.sub_((ps * g).sum(-1, keepdim=True)).mul_(ps)
    elif kind == "tvd":
        ps = log_ps.exp_()
        d = torch.sub(ps, log_pt.exp_(), out=log_pt)
        loss = d.abs().sum(-1).mul_(0.5)
        if need_grad:
            g = d.sign_().mul_(0.5)
            grad = g.sub_((ps * g).sum(-1, keepdim=True)).mul_(ps)
    else:  # pragma: no cover - validated by the caller
        raise ValueError(f"unknown kind {kind!r}")
    return loss, grad


class ChunkedKD(torch.autograd.Function):
    """Loss = T^2 * sum_tokens D(softmax(h_s W_s^T / T), softmax(h_t W_t^T / T)) / n_norm.

    Inputs are already restricted to the tokens that count: ``hs [n, d_s]``, ``ws [vocab, d_s]``,
    ``bs [vocab] | None``, ``ht [n, d_t]``, ``wt [vocab, d_t]``, ``bt [vocab] | None``.
    ``needs`` says which of (hs, ws, bs) need a gradient; it is decided outside because grad mode
    is always off inside ``forward``.
    """

    @staticmethod
    def forward(ctx, hs: Tensor, ws: Tensor, bs: Tensor | None, ht: Tensor, wt: Tensor,
                bt: Tensor | None, kind: str, temperature: float, beta: float, chunk_size: int,
                n_norm: int, needs: tuple[bool, bool, bool], labels: Tensor | None = None,
                ce_weight: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        n = hs.shape[0]
        need_hs, need_ws, need_bs = needs
        need_any = need_hs or need_ws or need_bs
        grad_hs = torch.empty_like(hs) if need_hs else None
        # Head gradients are summed over chunks: accumulate in fp32 whatever the parameter dtype.
        acc = torch.promote_types(ws.dtype, torch.float32)
        grad_ws = torch.zeros(ws.shape, dtype=acc, device=ws.device) if need_ws else None
        grad_bs = torch.zeros(ws.shape[0], dtype=acc, device=ws.device) if need_bs else None
        # d(T^2 * D(z / T) / n_norm) / d logits = T * dD/dz / n_norm
        grad_scale = temperature / n_norm
        total = torch.zeros((), dtype=torch.float64, device=hs.device)
        ce_total = torch.zeros((), dtype=torch.float64, device=hs.device)
        for start in range(0, n, chunk_size):
            hs_c = hs[start:start + chunk_size]
            ht_c = ht[start:start + chunk_size]
            zs = _logits(hs_c, ws, bs, temperature)
            zt = _logits(ht_c, wt, bt, temperature)
            g_ce = None
            if labels is not None:
                # Fused CE on the same student logits (at T = 1): saves a second head matmul pass.
                lab = labels[start:start + chunk_size, None]
                z1 = zs if temperature == 1.0 else zs * temperature
                lse = torch.logsumexp(z1, dim=-1, keepdim=True)
                ce_total += (lse - z1.gather(1, lab)).sum(dtype=torch.float64)
                if need_any:
                    g_ce = z1.sub(lse).exp_()
                    g_ce.scatter_add_(1, lab, torch.full_like(lab, -1.0, dtype=g_ce.dtype))
                    g_ce.mul_(ce_weight / n_norm)
                del z1, lse
            loss, grad = divergence_and_grad(zs, zt, kind, beta, need_any)
            del zs, zt
            total += loss.sum(dtype=torch.float64)
            if grad is None:
                continue
            grad.mul_(grad_scale)
            if g_ce is not None:
                grad.add_(g_ce)
                del g_ce
            if need_hs:
                g = grad.to(ws.dtype)  # no-op for fp32 / fp64 heads
                torch.mm(g, ws, out=grad_hs[start:start + chunk_size])
                del g
            if need_ws:
                grad_ws.addmm_(grad.t(), hs_c.to(acc))
            if need_bs:
                grad_bs += grad.sum(0)
            del grad
        if grad_ws is not None:
            grad_ws = grad_ws.to(ws.dtype)
        if grad_bs is not None:
            grad_bs = grad_bs.to(bs.dtype)
        ctx.save_for_backward(grad_hs, grad_ws, grad_bs)
        ce = ce_total / n_norm
        kd = total * (temperature * temperature / n_norm)
        # kd and ce are also returned on their own (not as total - ce_weight * ce, which cancels digits).
        kd_out, ce_out = kd.to(acc), ce.to(acc)
        ctx.mark_non_differentiable(kd_out, ce_out)
        return (kd + ce_weight * ce).to(acc), ce_out, kd_out

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_ce: Tensor | None = None, _grad_kd: Tensor | None = None):
        grad_hs, grad_ws, grad_bs = ctx.saved_tensors
        out = []
        for g in (grad_hs, grad_ws, grad_bs):
            out.append(None if g is None else g * grad_out.to(g.dtype))
        return (*out, None, None, None, None, None, None, None, None, None, None, None)


def _logits(h: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    """``[chunk, vocab]`` logits / T, at least fp32; the matmul runs in the head's dtype like the model."""
    z = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if temperature != 1.0:
        z.div_(temperature)
    return z
