"""Hybrid attention edge cases against a naive dense reference written from the pattern's definition."""

from __future__ import annotations

import math

import torch

from attention import HybridAttentionConfig, hybrid_attention
from attention import kernel as kernel_mod


def allowed(n: int, spec: HybridAttentionConfig, window: int, real: torch.Tensor) -> torch.Tensor:
    """``[b, 1, n, n]`` from the spec's rule, positions counting real tokens; a padded row sees its own key."""
    b = real.shape[0]
    out = torch.zeros(b, 1, n, n, dtype=torch.bool)
    for r in range(b):
        pos = (real[r].long().cumsum(0) - 1).tolist()
        for qi in range(n):
            if not real[r, qi]:
                out[r, 0, qi, qi] = True
                continue
            for kj in range(qi + 1):
                i, j = pos[qi], pos[kj]
                glob = spec.global_every > 0 and j % spec.global_every == 0
                out[r, 0, qi, kj] = bool(real[r, kj]) and (j < spec.sink_tokens or i - j < window or glob)
    return out


def dense(q, k, v, mask):
    """float64 softmax attention under a boolean mask, GQA by repeating the KV heads."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def test_a_window_wider_than_the_keys_stays_within_the_keys(monkeypatch):
    """A window (from a policy or ``use_window``) far beyond the sequence is the dense pattern; the kernel's
    local spans were sized by the window, not the keys: 60x the time and +400 MB for 256 padded tokens."""
    spans = []
    plan = kernel_mod._plan

    def spy(*args):
        p = plan(*args)
        spans.append((p.back + 1) * p.block)
        return p

    monkeypatch.setattr(kernel_mod, "_plan", spy)
    n, window = 40, 1 << 13
    spec = HybridAttentionConfig(sink_tokens=2, window=window, global_every=7)
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, :9] = False  # left padding: "auto" takes the block-sparse kernel, not the dense shortcut
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, n, 12, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, n, 12, generator=g, requires_grad=True) for _ in range(2))
    go = torch.randn(2, 4, n, 12, generator=g)
    ref = dense(q, k, v, allowed(n, spec, window, real))
    want = torch.autograd.grad((ref * go.double()).sum(), (q, k, v))
    out = hybrid_attention(q, k, v, spec, attention_mask=real)
    got = torch.autograd.grad((out * go).sum(), (q, k, v))
    assert (out.double() - ref).abs().max().item() < 1e-5
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and (a.double() - b).abs().max().item() < 1e-5
    with torch.no_grad():  # the inference path
        assert (hybrid_attention(q, k, v, spec, attention_mask=real).double() - ref).abs().max().item() < 1e-5
    assert spans and max(spans) <= 2 * n + kernel_mod.DEFAULT_BLOCK


def test_half_precision_training_path_scores_in_fp32():
    """fp16 / bf16 inputs on the training path: scores rounded to the input dtype before the softmax gave
    ~10x SDPA's output error (bf16: 0.12 against 0.009) and 3-5x its gradient error."""
    n = 200
    spec = HybridAttentionConfig(sink_tokens=2, window=40, global_every=33)
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, :30] = False
    mask = allowed(n, spec, spec.window, real)
    for dtype, out_tol, grad_tol in ((torch.float16, 0.006, 0.0015), (torch.bfloat16, 0.04, 0.012)):
        g = torch.Generator().manual_seed(0)
        q = (3 * torch.randn(2, 4, n, 64, generator=g)).to(dtype)
        k = (3 * torch.randn(2, 2, n, 64, generator=g)).to(dtype)  # scores of ~10: rounding them shows
        v = torch.randn(2, 2, n, 64, generator=g).to(dtype)
        go = torch.randn(2, 4, n, 64, generator=g).to(dtype)
        exact = [t.double().requires_grad_() for t in (q, k, v)]
        ref = dense(*exact, mask)
        want = torch.autograd.grad((ref * go.double()).sum(), exact)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = hybrid_attention(*leaves, spec, attention_mask=real, backend="blocksparse")
        got = torch.autograd.grad((out * go).sum(), leaves)
        assert out.dtype == dtype and all(t.dtype == dtype for t in got)
        assert (out.double() - ref).abs().max().item() < out_tol
        for a, b in zip(got, want):
            assert (a.double() - b).abs().max().item() / b.abs().max().item() < grad_tol


SPECS = [
    HybridAttentionConfig(sink_tokens=2, window=6, global_every=5),
    HybridAttentionConfig(sink_tokens=0, window=1, global_every=1),  # every key global
    HybridAttentionConfig(sink_tokens=50, window=3, global_every=0),  # sinks cover the sequence
]


def test_edge_lengths_padding_gqa_odd_head_dim_every_backend():
    """Lengths 1, window, window + 1 and longer; left padding and an all-padding row (finite, no NaN in
    the backward); 3 query heads per KV head; head dim 5: values and gradients of every CPU backend equal
    the dense reference."""
    for spec in SPECS:
        for n in (1, 6, 7, 40):
            real = torch.ones(3, n, dtype=torch.bool)
            real[1, : n // 2] = False
            real[2] = False
            mask = allowed(n, spec, spec.window, real)
            g = torch.Generator().manual_seed(n)
            q = torch.randn(3, 6, n, 5, generator=g, requires_grad=True)
            k, v = (torch.randn(3, 2, n, 5, generator=g, requires_grad=True) for _ in range(2))
            go = torch.randn(3, 6, n, 5, generator=g)
            ref = dense(q, k, v, mask)
            want = torch.autograd.grad((ref * go.double()).sum(), (q, k, v))
            for backend in ("auto", "blocksparse", "sdpa"):
                out = hybrid_attention(q, k, v, spec, attention_mask=real.long(), backend=backend)
                got = torch.autograd.grad((out * go).sum(), (q, k, v))
                assert (out.double() - ref).abs().max().item() < 1e-5, (spec, n, backend)
                for a, b in zip(got, want):
                    assert torch.isfinite(a).all() and (a.double() - b).abs().max().item() < 1e-5, (spec, n, backend)
                with torch.no_grad():
                    out = hybrid_attention(q, k, v, spec, attention_mask=real.long(), backend=backend)
                assert (out.double() - ref).abs().max().item() < 1e-5, (spec, n, backend, "inference")
