"""Bounded and dense KV caches: cached decoding equals a full recompute with the hybrid mask."""

from __future__ import annotations

import pytest
import torch

from attention.masks import hybrid_mask
from attention.spec import HybridAttentionConfig
from core.tiny import tiny_model
from serve.model import DecoderModel

SPECS = {
    "sink+window+globals": HybridAttentionConfig(sink_tokens=3, window=8, global_every=5, max_globals=4),
    "window only": HybridAttentionConfig(sink_tokens=0, window=6, global_every=0),
    "globals inside sinks": HybridAttentionConfig(sink_tokens=4, window=5, global_every=2, max_globals=6),
    "unbounded globals": HybridAttentionConfig(sink_tokens=2, window=7, global_every=9, max_globals=None),
}


def reference_logits(model, ids: torch.Tensor, spec: HybridAttentionConfig | None) -> torch.Tensor:
    """``[seq, vocab]`` logits of the untouched HF model with a dense additive hybrid (or causal) mask."""
    n = ids.shape[0]
    allowed = torch.ones(n, n, dtype=torch.bool).tril() if spec is None else hybrid_mask(n, spec)
    additive = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        return model(ids[None], attention_mask=additive).logits[0].float()


def cached_logits(dm: DecoderModel, ids: torch.Tensor, prompt: int, chunk: int, *, dense: bool,
                  row: int = 1, rows: int = 3) -> torch.Tensor:
    """Logits for positions ``prompt-1 .. n-2``: chunked prefill, then one token per step (teacher forcing)."""
    n = ids.shape[0]
    cache = dm.new_cache(rows, 96, dense=dense)
    cache.reset_row(row, cache.window_for(n))
    for start in range(0, prompt, chunk):
        last = dm.prefill(cache, row, ids[start:min(start + chunk, prompt)], start)
    out = [last]
    for p in range(prompt, n - 1):
        # Other rows decode junk at other positions: rows must not leak into each other.
        tokens = torch.full((rows,), 7)
        tokens[row] = ids[p]
        pos = torch.tensor([3, p, 11])[:rows]
        pos[row] = p
        out.append(dm.decode_one_token(cache, tokens, pos, cache.used_slots(max(p, 11)))[row])
    return torch.stack(out)


# Decode weights: the HF modules' own (fast=False), or the fused oneDNN-packed copies, stepping 1 row and
# 3 rows (qwen2 adds q/k/v biases to the fused path).
WEIGHTS = {"model": (False, 3), "fast 1 row": (True, 1), "fast 3 rows": (True, 3)}


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bounded_cache_equals_full_recompute_with_hybrid_mask(arch, name, weights):
    spec = SPECS[name]
    fast, rows = WEIGHTS[weights]
    model = tiny_model(arch, seed=1)
    model.config.hybrid_attention = spec.to_dict()
    dm = DecoderModel(model, fast_weights=fast)
    ids = torch.randint(3, 320, (70,), generator=torch.Generator().manual_seed(0))
    ref = reference_logits(model, ids, spec)
    for prompt, chunk in [(13, 5), (30, 64), (1, 1)]:  # chunks shorter / longer than the window
        got = cached_logits(dm, ids, prompt, chunk, dense=False, row=rows - 1, rows=rows)
        torch.testing.assert_close(got, ref[prompt - 1:-1], atol=1e-4, rtol=0)
    # The test can fail: the dense result is measurably different from the hybrid one.
    dense = reference_logits(model, ids, None)
    assert (dense[20:] - ref[20:]).abs().max() > 1e-2


@pytest.mark.parametrize("prefill", ["flash", "masked"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_dense_cache_equals_causal_forward(monkeypatch, weights, prefill):
    import serve.model

    if prefill == "flash" and serve.model.cpu_flash_op() is None:
        pytest.skip("torch lacks the CPU flash op with GQA")
    if prefill == "masked":  # the path without the fused op: one masked SDPA call per chunk
        monkeypatch.setattr(serve.model, "cpu_flash_op", lambda: None)
    fast, rows = WEIGHTS[weights]
    model = tiny_model("mistral", seed=2)
    dm = DecoderModel(model, fast_weights=fast)
    ids = torch.randint(3, 320, (50,), generator=torch.Generator().manual_seed(1))
    got = cached_logits(dm, ids, 17, 6, dense=True, row=rows - 1, rows=rows)
    torch.testing.assert_close(got, reference_logits(model, ids, None)[16:-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "plain"])
def test_fast_weights_are_fused_copies_and_can_be_turned_off(monkeypatch, onednn):
    import serve.model

    if onednn and not serve.model._onednn_linear_available():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(serve.model, "_onednn_linear_available", lambda: onednn)
    model = tiny_model("qwen2", seed=3)
    attn = model.model.layers[0].self_attn
    dm = DecoderModel(model, fast_weights=True)
    qkv = dm._fast[0].qkv
    assert qkv.packed is onednn
    assert qkv.out_features == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    x = torch.randn(3, 1, attn.q_proj.in_features)
    with torch.inference_mode():
        want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        torch.testing.assert_close(qkv(x), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(qkv(x[:1]), want[:1], rtol=0, atol=1e-5)
    torch.testing.assert_close(qkv.bias[-attn.v_proj.out_features:], attn.v_proj.bias, rtol=0, atol=0)
    assert dm._fast[0].o.bias is None
    assert dm.fast_weight_bytes() > 0
    # Prefill goes through the fused copies too (a prompt-sized row count per call), not the modules,
    # and so do its last position's logits (the fused head at one row); same logits as the model's.
    rows_seen = []
    fused_call = serve.model._Fused.__call__
    monkeypatch.setattr(serve.model._Fused, "__call__", lambda self, x: (rows_seen.append(x.shape[-2]),
                                                                         fused_call(self, x))[1])
    ids = torch.arange(3, 13)
    logits = dm.prefill(dm.new_cache(1, 64, dense=True), 0, ids, 0)
    assert rows_seen == [10] * (4 * len(model.model.layers)) + [1]
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids[None]).logits[0, -1].float(), rtol=0, atol=1e-4)
    off = DecoderModel(model, fast_weights=False)
    assert off._fast == [] and off.fast_weight_bytes() == 0


def test_packed_linear_pads_rows_to_few_shapes_and_keeps_every_row():
    """Prefill inputs run at a few padded row counts (one oneDNN primitive each), outputs unchanged."""
    import serve.model
    from serve.model import row_bucket, row_buckets

    assert [row_bucket(r) for r in (1, 8, 9, 16, 17, 97, 256, 257)] == [1, 8, 16, 16, 24, 104, 256, 320]
    assert all(0 <= row_bucket(r) - r < (1 if r <= 8 else 8 if r <= 256 else 64) for r in range(1, 999))
    assert len(row_buckets(160)) == 27 and row_buckets(160)[-1] == 160
    if not serve.model._onednn_linear_available():
        pytest.skip("this torch build has no oneDNN linear")
    model = tiny_model("qwen2", seed=3)
    mlp = model.model.layers[0].mlp
    dm = DecoderModel(model, fast_weights=True)
    gate_up = dm._fast[0].gate_up
    assert gate_up.packed
    seen = []
    real = torch.ops.mkldnn._linear_pointwise
    for rows in (1, 5, 9, 23, 70, 130):
        x = torch.randn(1, rows, mlp.gate_proj.in_features)
        with torch.inference_mode():
            want = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
            torch.ops.mkldnn._linear_pointwise = lambda a, *rest: (seen.append(a.shape[0]), real(a, *rest))[1]
            try:
                got = gate_up(x)
            finally:
                torch.ops.mkldnn._linear_pointwise = real
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert seen == [1, 5, 16, 24, 72, 136]


def test_warm_kernels_runs_every_padded_length_and_decode_batch(monkeypatch):
    import serve.model

    if not serve.model._onednn_linear_available():
        pytest.skip("this torch build has no oneDNN linear")
    dm = DecoderModel(tiny_model("llama", seed=3), fast_weights=True)
    seen = []
    fused_call = serve.model._Fused.__call__
    monkeypatch.setattr(serve.model._Fused, "__call__", lambda self, x: (seen.append(serve.model.row_bucket(
        x.shape[0] * x.shape[1])), fused_call(self, x))[1])
    assert dm.warm_kernels(40, 4) == len(serve.model.row_buckets(40))
    want = set(serve.model.row_buckets(40)) | {1, 2, 3, 4}
    assert set(seen) == want and len(seen) == 4 * len(serve.model.row_buckets(40)) + 4  # + the head at 1..4
    assert DecoderModel(tiny_model("llama", seed=3), fast_weights=False).warm_kernels(40, 4) == 0


def test_bounded_memory_is_constant_in_length():
    spec = HybridAttentionConfig(sink_tokens=128, window=512, global_every=1024, max_globals=16)
    model = tiny_model("llama")
    model.config.hybrid_attention = spec.to_dict()
    dm = DecoderModel(model)
    small = dm.new_cache(1, 32768)
    big = dm.new_cache(1, 65536)
    assert small.nbytes() == big.nbytes()
    assert small.k.shape[3] == 128 + 15 + 512 + 1  # sinks, globals beyond the sinks, ring, trash slot
    dense = dm.new_cache(1, 32768, dense=True)
    assert big.nbytes() * 20 < dense.nbytes()


def test_unbounded_globals_preallocate_for_max_len_and_global_rows_is_refused():
    model = tiny_model("llama")
    model.config.hybrid_attention = HybridAttentionConfig(sink_tokens=2, window=4, global_every=10).to_dict()
    dm = DecoderModel(model)
    assert dm.new_cache(1, 100).n_globals == 10 - 1  # positions 10, 20, ..., 90 (0 is a sink)
    model.config.hybrid_attention = HybridAttentionConfig(global_rows=True, max_globals=2).to_dict()
    with pytest.raises(ValueError, match="global_rows"):
        DecoderModel(model).new_cache(1, 100)


def test_unsupported_architecture_names_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="llama, mistral, qwen2"):
        DecoderModel(model)


MIXED_SPECS = {
    "heads": HybridAttentionConfig(sink_tokens=3, window=8, global_every=5, max_globals=4,
                                   full_heads={0: [1], 1: [0]}),
    "layer + head": HybridAttentionConfig(sink_tokens=2, window=6, global_every=0, full_layers=[1], full_heads={0: [0]}),
}


@pytest.mark.parametrize("weights", ["model", "fast 3 rows"])
@pytest.mark.parametrize("name", list(MIXED_SPECS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_cache_equals_full_recompute_with_per_head_roles(arch, name, weights):
    import copy

    import attention

    spec = MIXED_SPECS[name]
    fast, rows = WEIGHTS[weights]
    model = tiny_model(arch, seed=1)
    ref_model = attention.retrofit(copy.deepcopy(model), spec)
    ids = torch.randint(3, 320, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attention.use_backend("sdpa"):  # the per-head boolean-mask reference
        ref = ref_model(ids[None]).logits[0]
    model.config.hybrid_attention = spec.to_dict()
    dm = DecoderModel(model, fast_weights=fast)
    cache = dm.new_cache(rows, 96)
    kinds = cache.nbytes_by_kind()
    assert kinds["full"] > 0 and kinds["streaming"] > 0 and sum(kinds.values()) == cache.nbytes()
    for prompt, chunk in [(13, 5), (30, 64), (1, 1)]:
        got = cached_logits(dm, ids, prompt, chunk, dense=False, row=rows - 1, rows=rows)
        torch.testing.assert_close(got, ref[prompt - 1:-1], atol=1e-4, rtol=0)
    # The roles matter: all-streaming decoding differs.
    stream = reference_logits(tiny_model(arch, seed=1), ids, spec.streaming())
    assert (stream[20:] - ref[20:]).abs().max() > 1e-2


def test_mixed_cache_memory_full_heads_grow_streaming_heads_do_not():
    spec = HybridAttentionConfig(sink_tokens=128, window=512, global_every=1024, max_globals=16,
                                 full_heads={0: [1]})
    model = tiny_model("llama")  # 2 layers x 2 KV heads: 1 of 4 pairs full
    model.config.hybrid_attention = spec.to_dict()
    dm = DecoderModel(model)
    small, big = dm.new_cache(1, 32768), dm.new_cache(1, 65536)
    assert small.nbytes_by_kind()["streaming"] == big.nbytes_by_kind()["streaming"]
    assert 1.99 < big.nbytes_by_kind()["full"] / small.nbytes_by_kind()["full"] < 2.0  # (one trash slot each)
    dense = dm.new_cache(1, 32768, dense=True)
    assert small.nbytes() < 0.3 * dense.nbytes()
    assert dense.nbytes_by_kind() == {"full": dense.nbytes(), "streaming": 0}


@pytest.mark.parametrize("head", ["fused", "unfusable"])
def test_refreshed_fast_weights_follow_weights_changed_in_place(monkeypatch, head):
    """A trainer changes the weights in place and refreshes the decode copies (distill.on_policy): the prefill
    logits are the changed model's. With a head that cannot be fused (its layers can), the refresh did nothing
    and the layers' copies stayed those of the old weights."""
    import serve.model

    if head == "unfusable":
        fusable = serve.model._Fused.fusable
        monkeypatch.setattr(serve.model._Fused, "fusable", staticmethod(
            lambda linears: fusable(linears) and linears[0].out_features != 320))  # the head: vocab 320 rows
    model = tiny_model("llama", seed=4)
    dm = DecoderModel(model, fast_weights=True)
    assert dm._fast and (dm._fast_head is None) == (head == "unfusable")
    ids = torch.arange(3, 13)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    dm.refresh_fast_weights()
    assert dm._fast and (dm._fast_head is None) == (head == "unfusable")
    logits = dm.prefill(dm.new_cache(1, 64, dense=True), 0, ids, 0)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids[None]).logits[0, -1].float(), rtol=0, atol=1e-4)
