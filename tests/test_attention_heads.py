"""Per-KV-head roles: full (retrieval) heads next to streaming heads, against a per-head mask reference."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import attention
from attention import CONFIG_KEY, HybridAttentionConfig, HybridAttentionError, hybrid_attention
from attention.masks import head_query_key_mask, query_key_mask
from core.tiny import tiny_model

ARCHS = ["llama", "mistral", "qwen2"]
BASE = dict(sink_tokens=2, window=6, global_every=10)
MIXED = HybridAttentionConfig(**BASE, full_heads={0: [1], 1: [0]})  # tiny models: 2 layers, 2 KV heads


def naive(q, k, v, mask, scale=None):
    """float64 softmax attention with a boolean ``[b|1, heads|1, q, k]`` mask (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = q.double() @ k.transpose(-1, -2) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def qkv(b, heads, kv_heads, q_len, k_len, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).requires_grad_()  # noqa: E731
    return mk(heads, q_len), mk(kv_heads, k_len), mk(kv_heads, k_len)


def grads(out, inputs, seed=1):
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.autograd.grad(out, inputs, go.to(out.dtype))


@pytest.mark.parametrize("backend", ["blocksparse", "sdpa", "auto"])
@pytest.mark.parametrize("full", [(1,), (0, 2), (0, 1, 2), ()], ids=lambda f: "full" + "".join(map(str, f)))
def test_per_head_values_and_grads_match_mask_reference(backend, full):
    spec = HybridAttentionConfig(sink_tokens=3, window=8, global_every=11, full_heads={4: list(full)})
    q, k, v = qkv(2, 6, 3, 70, 70)
    mask = head_query_key_mask(70, 70, spec, 4, 6, 3)
    ref = naive(q, k, v, mask)
    out = hybrid_attention(q, k, v, spec, backend=backend, layer=4)
    assert (out.double() - ref).abs().max().item() < 1e-5
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert (a.double() - b).abs().max().item() < 1e-5
    # The roles matter: a full head differs from its streaming self, a streaming one does not.
    stream = hybrid_attention(q, k, v, spec.streaming(), backend=backend)
    diff = (out - stream).detach().abs().amax((0, 2, 3)).view(3, 2).amax(1)
    for h in range(3):
        assert (diff[h] > 1e-3) if h in full else (diff[h] == 0)


def test_per_head_inference_path_with_offset_and_padding():
    spec = HybridAttentionConfig(sink_tokens=2, window=8, global_every=9, full_heads={0: [0]})
    q, k, v = qkv(2, 4, 2, 40, 100)
    pad = torch.ones(2, 100, dtype=torch.bool)
    pad[1, :13] = False  # left padding
    with torch.no_grad():
        out = hybrid_attention(q, k, v, spec, attention_mask=pad, layer=0)
        mask = head_query_key_mask(40, 100, spec, 0, 4, 2, attention_mask=pad)
        ref = naive(q, k, v, mask)
    real = pad[:, 60:]
    assert (out.double() - ref).permute(0, 2, 1, 3)[real].abs().max().item() < 1e-5
    # The other layer has no full heads: exactly the streaming pattern.
    with torch.no_grad():
        other = hybrid_attention(q, k, v, spec, attention_mask=pad, layer=1)
        stream = hybrid_attention(q, k, v, spec.streaming(), attention_mask=pad)
    assert torch.equal(other, stream)


@pytest.mark.parametrize("arch", ARCHS)
def test_model_mixed_heads_match_masked_reference_values_and_grads(arch):
    ids = torch.randint(3, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 48, dtype=torch.long)
    am[1, :7] = 0
    out, grad = {}, {}
    for backend in ("blocksparse", "sdpa"):
        model = attention.retrofit(tiny_model(arch).train(), MIXED)
        with attention.use_backend(backend):
            loss = model(ids, attention_mask=am, labels=ids).loss
        loss.backward()
        out[backend] = loss.detach()
        grad[backend] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert abs(out["blocksparse"] - out["sdpa"]).item() < 1e-5
    assert (grad["blocksparse"] - grad["sdpa"]).abs().max().item() < 1e-5
    streaming = attention.retrofit(tiny_model(arch), MIXED.streaming())
    with torch.no_grad():
        assert abs(streaming(ids, attention_mask=am, labels=ids).loss - out["sdpa"]).item() > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_all_heads_full_equals_dense_and_no_heads_full_equals_hybrid(arch):
    ids = torch.randint(3, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 40, dtype=torch.long)
    am[0, :5] = 0
    real = am.bool()
    with torch.no_grad():
        dense = tiny_model(arch)(ids, attention_mask=am).logits
        hybrid = attention.retrofit(tiny_model(arch), HybridAttentionConfig(**BASE))(ids, attention_mask=am).logits
        for roles in ({"full_layers": [0, 1]}, {"full_heads": {0: [0, 1], 1: [0, 1]}}):
            all_full = attention.retrofit(tiny_model(arch), HybridAttentionConfig(**BASE, **roles))
            assert (all_full(ids, attention_mask=am).logits - dense)[real].abs().max().item() < 1e-5
        none_full = attention.retrofit(tiny_model(arch), HybridAttentionConfig(**BASE, full_heads={}, full_layers=[]))
        assert torch.equal(none_full(ids, attention_mask=am).logits, hybrid)
    assert (hybrid - dense)[real].abs().max().item() > 1e-2


def test_head_map_naming_missing_layer_or_head_is_one_line_error():
    with pytest.raises(HybridAttentionError, match=r"layer\(s\) \[2\].*2 layers") as e:
        attention.retrofit(tiny_model("llama"), HybridAttentionConfig(**BASE, full_heads={2: [0]}))
    assert "\n" not in str(e.value)
    with pytest.raises(HybridAttentionError, match=r"\(1, 5\).*2 KV heads"):
        attention.retrofit(tiny_model("llama"), HybridAttentionConfig(**BASE, full_heads={1: [5]}))
    with pytest.raises(HybridAttentionError, match="layer"):
        attention.retrofit(tiny_model("llama"), HybridAttentionConfig(**BASE, full_layers=[7]))
    with pytest.raises(HybridAttentionError, match="full_heads"):
        HybridAttentionConfig(full_heads={0: ["x"]})


def test_save_load_keeps_roles_and_scores(tmp_path):
    scores = {"method": "retrieval", "scores": [[0.1, 0.9], [0.5, 0.2]], "full_head_share": 0.5}
    spec = HybridAttentionConfig(**BASE, full_heads={0: [1], 1: [0]}, head_scores=scores)
    model = attention.retrofit(tiny_model("qwen2"), spec)
    ids = torch.randint(3, 320, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids).logits
        model.save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())[CONFIG_KEY]
        assert saved["full_heads"] == {"0": [1], "1": [0]} and saved["head_scores"] == scores
        reloaded = attention.load(tmp_path)
        assert HybridAttentionConfig.from_dict(reloaded.config.hybrid_attention) == spec
        assert torch.equal(reloaded(ids).logits, before)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert not attention.is_hybrid(plain)
        assert torch.equal(plain(ids).logits, tiny_model("qwen2")(ids).logits)


def test_full_heads_make_the_pattern_unbounded():
    bounded = HybridAttentionConfig(**BASE, max_globals=4)
    assert bounded.bounded and not HybridAttentionConfig(**BASE, max_globals=4, full_layers=[0]).bounded
    assert bounded.streaming() == bounded and MIXED.streaming().bounded is False  # max_globals None: unbounded


def test_head_mask_reference_is_pattern_per_head():
    spec = HybridAttentionConfig(sink_tokens=1, window=3, global_every=0, full_layers=[2])
    m = head_query_key_mask(12, 12, spec, 2, 4, 2)
    assert m.shape == (1, 4, 12, 12) and torch.equal(m[0, 0], torch.ones(12, 12, dtype=torch.bool).tril())
    m = head_query_key_mask(12, 12, spec, 1, 4, 2)
    assert torch.equal(m[0, 3], query_key_mask(12, 12, spec)[0, 0])


# ---- head identification (attention.heads) ---------------------------------------------------------------

class CharTokenizer:
    """One token per character (ids 3..): digits tokenize the same in and out of context."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 300 for c in text]}


def test_needle_samples_put_the_key_where_they_say():
    from attention.heads import needle_samples

    hay = torch.randint(3, 300, (3, 400), generator=torch.Generator().manual_seed(0))
    samples = needle_samples(CharTokenizer(), hay, count=5, length=300, min_distance=120, min_start=20, seed=1)
    for s in samples:
        assert len(s.ids) == 300
        answer = s.ids[s.answer_start:]
        assert [s.ids[p] for p in s.key_positions] == answer
        assert s.key_positions[0] >= 20 and s.answer_start - s.key_positions[-1] >= 120
    with pytest.raises(HybridAttentionError, match="length"):
        needle_samples(CharTokenizer(), hay, count=1, length=300, min_distance=290, seed=1)


def test_head_scores_match_eager_attention_reference():
    from attention.heads import head_scores, needle_samples

    model = tiny_model("llama", seed=3, layers=2, heads=4, kv_heads=2)
    hay = torch.randint(3, 300, (2, 300), generator=torch.Generator().manual_seed(0))
    samples = needle_samples(CharTokenizer(), hay, count=3, length=260, min_distance=40, seed=2)
    got = head_scores(model, samples, progress=False)
    assert model.config._attn_implementation != "hybrid_heads_probe"  # restored
    hit, mass, total = torch.zeros(2, 4), torch.zeros(2, 4), 0
    eager = tiny_model("llama", seed=3, layers=2, heads=4, kv_heads=2, attn_implementation="eager")
    for s in samples:
        n = len(s.ids) - s.answer_start
        with torch.no_grad():
            att = eager(torch.tensor([s.ids[:-1]]), output_attentions=True).attentions
        pos = torch.tensor(s.key_positions)
        for li, a in enumerate(att):
            rows = a[0, :, -n:]  # [heads, n, k]
            hit[li] += (rows.argmax(-1) == pos).float().sum(-1)
            mass[li] += rows[:, torch.arange(n), pos].sum(-1)
        total += n
    torch.testing.assert_close(got["retrieval"], (hit / total).view(2, 2, 2).amax(-1))
    torch.testing.assert_close(got["mass"], (mass / total).view(2, 2, 2).amax(-1), atol=1e-5, rtol=0)


def test_choose_roles_takes_the_top_share_with_tiebreak():
    from attention.heads import choose_roles, plot_head_scores

    scores = torch.tensor([[0.0, 0.9], [0.0, 0.0], [0.5, 0.0]])
    tiebreak = torch.tensor([[0.1, 0.5], [0.0, 0.3], [0.4, 0.2]])
    spec = choose_roles(HybridAttentionConfig(**BASE), scores, 0.5, method="retrieval", tiebreak=tiebreak)
    assert spec.full_heads == {0: [1], 1: [1], 2: [0]}  # 0.9, 0.5, then the best tie (0.3)
    assert spec.head_scores["scores"] == [[0.0, 0.9], [0.0, 0.0], [0.5, 0.0]]
    assert spec.streaming() == HybridAttentionConfig(**BASE)
    assert choose_roles(HybridAttentionConfig(**BASE), scores, 0.0, method="mass").full_heads is None
    with pytest.raises(HybridAttentionError, match="full_head_share"):
        choose_roles(HybridAttentionConfig(**BASE), scores, 1.5, method="mass")
    with pytest.raises(HybridAttentionError, match="head scores"):
        plot_head_scores(HybridAttentionConfig(**BASE), "unused.png")


def test_reshare_reranks_the_saved_scores_and_tiebreak():
    """The saved record holds the whole ranking: another share of it needs no new scoring, and it
    survives the config round trip."""
    from attention.heads import choose_roles, reshare

    scores = torch.tensor([[0.0, 0.9], [0.0, 0.0], [0.5, 0.0]])
    tiebreak = torch.tensor([[0.1, 0.5], [0.0, 0.3], [0.4, 0.2]])
    spec = choose_roles(HybridAttentionConfig(**BASE), scores, 0.5, method="gates", tiebreak=tiebreak,
                        extra={"steps": 7})
    saved = HybridAttentionConfig.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert reshare(saved, 0.5).full_heads == spec.full_heads == {0: [1], 1: [1], 2: [0]}
    # two more heads: the next ties by tiebreak (0.2 at (2, 1), then 0.1 at (0, 0))
    wider = reshare(saved, 5 / 6)
    assert wider.full_heads == {0: [0, 1], 1: [1], 2: [0, 1]}
    assert wider.head_scores["steps"] == 7 and wider.head_scores["full_head_share"] == 5 / 6
    assert reshare(saved, 0.0).full_heads is None
    with pytest.raises(HybridAttentionError, match="no saved head scores"):
        reshare(HybridAttentionConfig(**BASE), 0.5)


def test_probe_builds_its_causal_mask_on_the_model_device():
    # head_score=retrieval/mass on a GPU model: the probe's mask must live where the scores do. The meta
    # device checks devices like CUDA does, without a GPU.
    from types import SimpleNamespace

    from attention.heads import _Probe

    probe = _Probe()
    probe.rows = 2
    q, k = torch.empty(1, 4, 7, 8, device="meta"), torch.empty(1, 2, 7, 8, device="meta")
    out, _ = probe(SimpleNamespace(layer_idx=0), q, k, k, None)
    assert out.shape == (1, 7, 4, 8) and probe.attn[0].shape == (4, 2, 7)
