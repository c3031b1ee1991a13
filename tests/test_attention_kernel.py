"""Block-sparse / flex / SDPA hybrid attention against a naive boolean-mask reference."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from attention import (
    HybridAttentionConfig,
    HybridAttentionError,
    hybrid_attention,
    resolve_window,
    use_backend,
    use_window,
)
from attention import kernel as kernel_mod
from attention.flex import flex_hybrid_attention
from attention.masks import hybrid_mask, padded_hybrid_mask, query_key_mask


def naive(q, k, v, mask, scale=None):
    """Plain float64 softmax attention with a boolean ``[b|1, 1, q, k]`` mask (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = q.double() @ k.transpose(-1, -2) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def qkv(b, heads, kv_heads, q_len, k_len, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(heads, q_len), mk(kv_heads, k_len), mk(kv_heads, k_len)


def check(out, ref, inputs, atol=1e-5, seed=1):
    """Outputs and input gradients of ``out`` (fp32) match the float64 reference."""
    assert (out.double() - ref).abs().max().item() < atol
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    got = torch.autograd.grad(out, inputs, go.to(out.dtype))
    want = torch.autograd.grad(ref, inputs, go.double())
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max().item() < atol


SPECS = [
    HybridAttentionConfig(sink_tokens=4, window=8, global_every=16),
    HybridAttentionConfig(sink_tokens=0, window=5, global_every=0),
    HybridAttentionConfig(sink_tokens=3, window=20, global_every=7, max_globals=3),
    HybridAttentionConfig(sink_tokens=2, window=1, global_every=9),
    HybridAttentionConfig(sink_tokens=5, window=6, global_every=11, global_rows=True),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"s{s.sink_tokens}-w{s.window}-g{s.global_every}"
                         f"{'-rows' if s.global_rows else ''}")
def test_blocksparse_matches_reference_random_lengths(spec):
    rng = random.Random(0)
    for trial in range(4):
        n = rng.choice([1, 3, 17, spec.sink_tokens + spec.window, 64, 131, 200])
        q, k, v = qkv(2, 6, 2, n, n, seed=trial)
        out = hybrid_attention(q, k, v, spec, backend="blocksparse")
        ref = naive(q, k, v, hybrid_mask(n, spec))
        check(out, ref, (q, k, v))
        with torch.no_grad():  # inference takes the fused path (no log-sum-exp kept)
            assert (hybrid_attention(q, k, v, spec, backend="blocksparse").double() - ref).abs().max() < 1e-5



def test_reference_masks_take_the_policys_window_as_the_attention_does():
    """Without a window argument the reference masks used ``spec.window``, which a spec with a window_policy
    never serves: hybrid_attention picks the policy's window for the length, and the two disagreed."""
    spec = HybridAttentionConfig(sink_tokens=1, window=4, global_every=0, window_policy=[[16, 3], [None, 8]])
    for n in (12, 20):  # one length per policy entry, neither with the spec's own window
        q, k, v = qkv(1, 2, 1, n, n)
        out = hybrid_attention(q, k, v, spec)
        am = torch.ones(1, n, dtype=torch.long)
        for mask in (hybrid_mask(n, spec), padded_hybrid_mask(am, spec), query_key_mask(n, n, spec)):
            assert (out.double() - naive(q, k, v, mask)).abs().max().item() < 1e-5
        q4 = q[:, :, -4:]  # cached decoding: the window follows the key slots up to the last query
        assert (hybrid_attention(q4, k, v, spec).double() - naive(q4, k, v, query_key_mask(4, n, spec))
                ).abs().max().item() < 1e-5

@pytest.mark.parametrize("block", [4, 16, 32])
def test_ragged_blocks_and_window_not_multiple_of_block(block):
    spec = HybridAttentionConfig(sink_tokens=3, window=13, global_every=10)
    q, k, v = qkv(1, 4, 1, 77, 77)  # 4 query heads share one KV head
    out = kernel_mod.blocksparse_attention(q, k, v, spec, spec.window, block=block)
    check(out, naive(q, k, v, hybrid_mask(77, spec)), (q, k, v))


def test_short_sequences_are_exactly_dense_causal():
    spec = HybridAttentionConfig(sink_tokens=8, window=16, global_every=64)
    n = spec.sink_tokens + spec.window
    assert hybrid_mask(n, spec).equal(torch.ones(n, n, dtype=torch.bool).tril())
    q, k, v = qkv(2, 4, 2, n, n)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for backend in ("blocksparse", "sdpa", "auto"):
        assert torch.allclose(hybrid_attention(q, k, v, spec, backend=backend), dense, atol=1e-6)
    # One more token and the pattern is no longer dense.
    assert not hybrid_mask(n + 1, spec).equal(torch.ones(n + 1, n + 1, dtype=torch.bool).tril())


@pytest.mark.parametrize("backend", ["blocksparse", "sdpa", "auto"])
def test_left_padded_batch_counts_real_tokens_only(backend):
    spec = HybridAttentionConfig(sink_tokens=3, window=6, global_every=8)
    n = 45
    am = torch.ones(4, n, dtype=torch.long)
    am[0, :10] = 0  # left padding
    am[1, :n - 2] = 0  # almost all padding
    am[2, 30:] = 0  # right padding
    q, k, v = qkv(4, 4, 2, n, n)
    out = hybrid_attention(q, k, v, spec, attention_mask=am, backend=backend)
    check(out, naive(q, k, v, padded_hybrid_mask(am, spec)), (q, k, v))
    # A left-padded row computes exactly what the unpadded sequence computes.
    alone = hybrid_attention(q[:1, :, 10:], k[:1, :, 10:], v[:1, :, 10:], spec, backend=backend)
    assert torch.allclose(out[:1, :, 10:], alone, atol=1e-6)


def test_padding_with_holes_falls_back_exactly():
    spec = HybridAttentionConfig(sink_tokens=2, window=5, global_every=6)
    am = torch.ones(2, 30, dtype=torch.long)
    am[0, 7:9] = 0
    q, k, v = qkv(2, 2, 2, 30, 30)
    out = hybrid_attention(q, k, v, spec, attention_mask=am, backend="blocksparse")
    check(out, naive(q, k, v, padded_hybrid_mask(am, spec)), (q, k, v))


@pytest.mark.parametrize("backend", ["blocksparse", "sdpa", "auto"])
@pytest.mark.parametrize("q_len", [1, 5, 40])
def test_queries_shorter_than_keys_as_in_cached_decoding(backend, q_len):
    spec = HybridAttentionConfig(sink_tokens=4, window=7, global_every=12, global_rows=True, max_globals=4)
    k_len = 90
    am = torch.ones(2, k_len, dtype=torch.long)
    am[1, :13] = 0
    q, k, v = qkv(2, 6, 3, q_len, k_len)
    for mask in (None, am):
        out = hybrid_attention(q, k, v, spec, attention_mask=mask, backend=backend)
        ref = naive(q, k, v, query_key_mask(q_len, k_len, spec, attention_mask=mask))
        check(out, ref, (q, k, v))


def test_query_start_ignores_empty_cache_slots():
    spec = HybridAttentionConfig(sink_tokens=2, window=4, global_every=5)
    q, k, v = qkv(1, 2, 1, 3, 50)
    out = hybrid_attention(q, k, v, spec, query_start=20, backend="blocksparse")
    ref = hybrid_attention(q, k[:, :, :23], v[:, :, :23], spec, backend="sdpa")
    assert torch.allclose(out, ref, atol=1e-6)
    check(out, naive(q, k, v, query_key_mask(3, 50, spec, query_start=20)), (q, k, v))


def test_bf16_close_to_fp32_reference():
    spec = HybridAttentionConfig(sink_tokens=4, window=16, global_every=20)
    q, k, v = qkv(1, 4, 2, 100, 100, dtype=torch.bfloat16)
    out = hybrid_attention(q, k, v, spec, backend="blocksparse")
    assert out.dtype == torch.bfloat16
    ref = naive(q, k, v, hybrid_mask(100, spec))
    assert (out.double() - ref).abs().max().item() < 3e-2
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all()
               for t in (q, k, v))


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_flex_mask_mod_matches_reference_in_eager_mode():
    # Eager FlexAttention (unfused) runs on CPU: enough to check the mask_mod and block-mask wiring.
    spec = HybridAttentionConfig(sink_tokens=3, window=9, global_every=10, global_rows=True)
    q, k, v = (t.detach() for t in qkv(2, 4, 2, 70, 70))
    am = torch.ones(2, 70, dtype=torch.bool)
    am[1, :15] = False
    with torch.no_grad():
        out = flex_hybrid_attention(q, k, v, spec, spec.window, padding=am, compiled=False)
        assert (out.double() - naive(q, k, v, padded_hybrid_mask(am, spec))).abs().max() < 1e-5
        out = flex_hybrid_attention(q[:, :, -4:], k, v, spec, spec.window, compiled=False)
        assert (out.double() - naive(q[:, :, -4:], k, v, query_key_mask(4, 70, spec))).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_backend_on_cuda(dtype):
    spec = HybridAttentionConfig(sink_tokens=16, window=64, global_every=128)
    q, k, v = (t.detach().cuda().requires_grad_() for t in qkv(1, 6, 2, 1000, 1000, d=64, dtype=dtype))
    out = hybrid_attention(q, k, v, spec, backend="flex")
    ref = hybrid_attention(q, k, v, spec, backend="blocksparse")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (out - ref).abs().max().item() < tol
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        assert (a - b).abs().max().item() < tol * 10


def test_window_resolution_order():
    spec = HybridAttentionConfig(sink_tokens=1, window=4, global_every=0,
                                 window_policy=[[16, 2], [64, 6], [None, 10]])
    assert resolve_window(spec, 10) == 2 and resolve_window(spec, 50) == 6 and resolve_window(spec, 500) == 10
    with use_window(3):
        assert resolve_window(spec, 500) == 3
        assert resolve_window(spec, 500, window=5) == 5
    q, k, v = qkv(1, 2, 2, 40, 40)
    with use_window(3):
        a = hybrid_attention(q, k, v, spec, backend="blocksparse")
    b = hybrid_attention(q, k, v, spec, window=3, backend="sdpa")
    c = hybrid_attention(q, k, v, spec, backend="blocksparse")  # policy: 40 tokens -> window 6
    assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(c, hybrid_attention(q, k, v, spec, window=6, backend="sdpa"), atol=1e-6)
    assert not torch.allclose(a, c, atol=1e-3)


def test_backend_context_forces_dispatch():
    spec = HybridAttentionConfig(sink_tokens=1, window=2, global_every=0)
    q, k, v = qkv(1, 2, 2, 8, 8)
    with use_backend("flex"), pytest.raises(HybridAttentionError, match="CUDA"):
        hybrid_attention(q, k, v, spec)


def test_errors_are_one_line_value_errors():
    for bad in (dict(window=0), dict(sink_tokens=-1), dict(global_every=-2), dict(window_policy=[[8, 0]])):
        with pytest.raises(ValueError) as e:
            HybridAttentionConfig(**bad)
        assert isinstance(e.value, HybridAttentionError) and "\n" not in str(e.value)
    assert HybridAttentionConfig(sink_tokens=0).sink_tokens == 0  # no sinks is a legitimate pattern
    spec = HybridAttentionConfig()
    q, k, v = qkv(1, 3, 2, 4, 4)
    with pytest.raises(HybridAttentionError, match="multiple"):
        hybrid_attention(q, k, v, spec)
    q, k, v = qkv(1, 2, 2, 4, 4)
    with pytest.raises(HybridAttentionError, match="backend"):
        hybrid_attention(q, k, v, spec, backend="magic")
    with pytest.raises(HybridAttentionError, match="window"):
        hybrid_attention(q, k, v, spec, window=0)


def test_work_per_query_does_not_grow_with_length():
    # Key columns per query block: |sinks + globals| + local span; never the full length.
    cols = {}
    for n in (4096, 16384):
        plan = kernel_mod._plan(n, 0, 128, 1024, None, 512, 128, 9 * 128, torch.device("cpu"))
        cols[n] = plan.global_idx.numel() + plan.band_bias.shape[1]
    assert cols[4096] == 128 + 3 + 640 and cols[16384] == 128 + 15 + 640


@pytest.mark.skipif(kernel_mod.cpu_flash_op() is None, reason="torch lacks the CPU flash op with GQA (torch < 2.9)")
@pytest.mark.parametrize("window", [24, 32])  # block 16 / 32: early rows masked (m*B > window) / plain causal
@pytest.mark.parametrize("one_call", [True, False])
def test_inference_flash_path_offsets_ragged_and_global_segments(monkeypatch, window, one_call):
    # Shrink the thresholds so that short sequences take both global-key layouts: one masked call, and
    # mask-free row segments with the sink ramp merged into a masked one.
    monkeypatch.setattr(kernel_mod, "GLOBAL_MASK_ELEMENTS", 1 << 30 if one_call else 0)
    monkeypatch.setattr(kernel_mod, "MIN_GLOBAL_ROWS", 16)
    kernel_mod._plan.cache_clear()
    spec = HybridAttentionConfig(sink_tokens=20, window=window, global_every=40)
    block, k_len = (16 if window == 24 else 32), 203
    seen = set()
    try:
        for q_len in (203, 190, 160, 17):  # offset 0 / inside the early rows / past them; ragged blocks
            q, k, v = (t.detach() for t in qkv(2, 6, 2, q_len, k_len, seed=q_len))
            with torch.no_grad():
                out = kernel_mod.blocksparse_attention(q, k, v, spec, window, block=block)
            assert (out.double() - naive(q, k, v, query_key_mask(q_len, k_len, spec))).abs().max().item() < 1e-5
            plan = kernel_mod._plan(q_len, k_len - q_len, 20, 40, None, window, block, 6 * 2 * block, q.device)
            segments = plan.global_segments
            seen.add("one call" if len(segments) == 1 else "segments")
            if len(segments) > 1:
                seen.update("masked" if mask is not None else "mask-free" for *_, mask in segments)
            if plan.early_rows:
                seen.add("causal early" if plan.early_mask is None else "masked early")
    finally:
        kernel_mod._plan.cache_clear()
    want = {"one call"} if one_call else {"one call", "segments", "masked", "mask-free"}
    assert seen == want | {"masked early"} | ({"causal early"} if window == 32 else set())


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("q_len", [208, 160, 150])  # blocks of 16 aligned with / without offset, ragged
def test_inference_with_transformers_layout(batch, q_len):
    # Models hand over q/k/v as [b, seq, heads, d] transposed: batch and heads do not merge for b > 1.
    spec = HybridAttentionConfig(sink_tokens=4, window=16, global_every=32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, n, h, 16, generator=g).transpose(1, 2) for n, h in ((q_len, 4), (208, 2), (208, 2)))
    with torch.no_grad():
        out = hybrid_attention(q, k, v, spec, backend="blocksparse")
    assert (out.double() - naive(q, k, v, query_key_mask(q_len, 208, spec))).abs().max().item() < 1e-5


def test_inference_without_the_flash_op_takes_the_chunked_path(monkeypatch):
    monkeypatch.setattr(kernel_mod, "cpu_flash_op", lambda: None)
    spec = HybridAttentionConfig(sink_tokens=4, window=8, global_every=16)
    q, k, v = (t.detach() for t in qkv(2, 6, 2, 131, 131))
    with torch.no_grad():
        out = hybrid_attention(q, k, v, spec, backend="blocksparse")
    assert (out.double() - naive(q, k, v, hybrid_mask(131, spec))).abs().max().item() < 1e-5
