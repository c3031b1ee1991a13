"""Hybrid attention plugged into tiny Llama / Mistral / Qwen2 models through AttentionInterface."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import attention
from attention import CONFIG_KEY, HybridAttentionConfig
from core.models import cache_kwargs
from core.tiny import tiny_model

ARCHS = ["llama", "mistral", "qwen2"]
SMALL = HybridAttentionConfig(sink_tokens=2, window=6, global_every=10)


def batch(seq=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 320, (2, seq), generator=g)
    am = torch.ones(2, seq, dtype=torch.long)
    am[1, :9] = 0  # left padding
    return ids, am


@pytest.mark.parametrize("arch", ARCHS)
def test_window_covering_the_sequence_equals_untouched_model(arch):
    model = tiny_model(arch)  # 4 query heads, 2 KV heads
    ids, am = batch()
    with torch.no_grad():
        dense = model(ids, attention_mask=am).logits
        attention.retrofit(model, HybridAttentionConfig(sink_tokens=4, window=64, global_every=16))
        assert attention.is_hybrid(model)
        for backend in ("blocksparse", "sdpa", "auto"):
            with attention.use_backend(backend):
                hybrid = model(ids, attention_mask=am).logits
            real = am.bool()
            assert (hybrid - dense)[real].abs().max().item() < 1e-5
        attention.revert(model)
        assert not attention.is_hybrid(model) and not hasattr(model.config, CONFIG_KEY)
        assert torch.equal(model(ids, attention_mask=am).logits, dense)


@pytest.mark.parametrize("arch", ARCHS)
def test_small_window_backends_agree_and_differ_from_dense(arch):
    model = tiny_model(arch)
    ids, am = batch()
    with torch.no_grad():
        dense = model(ids, attention_mask=am).logits
        attention.retrofit(model, SMALL)
        with attention.use_backend("sdpa"):
            ref = model(ids, attention_mask=am).logits
        with attention.use_backend("blocksparse"):
            got = model(ids, attention_mask=am).logits
    assert (got - ref).abs().max().item() < 1e-5
    assert (ref - dense).abs().max().item() > 1e-2  # the pattern really changes the model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cached_decoding_equals_full_forward(arch):
    model = attention.retrofit(tiny_model(arch), SMALL)
    ids, am = batch(seq=30)
    with torch.no_grad():
        full = model(ids, attention_mask=am).logits
        cache = DynamicCache(config=model.config)
        kw = cache_kwargs(model, cache)  # the keyword's name depends on the transformers release
        steps = [model(ids[:, :18], attention_mask=am[:, :18], use_cache=True, **kw).logits]
        for t in range(18, 30):
            steps.append(model(ids[:, t:t + 1], attention_mask=am[:, :t + 1], use_cache=True, **kw).logits)
    cached = torch.cat(steps, 1)
    assert (cached - full)[am.bool()].abs().max().item() < 1e-5


def test_generate_runs_through_the_interface():
    model = attention.retrofit(tiny_model("mistral"), SMALL)
    ids, am = batch(seq=20)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False)
        full = model(out, attention_mask=torch.cat([am, torch.ones(2, 8, dtype=torch.long)], 1)).logits
    assert torch.equal(full[:, 19:-1].argmax(-1), out[:, 20:])


def test_training_gradients_match_masked_reference():
    ids, am = batch(seq=48)
    grads = {}
    for backend in ("blocksparse", "sdpa"):
        model = attention.retrofit(tiny_model("llama").train(), SMALL)
        with attention.use_backend(backend):
            model(ids, attention_mask=am, labels=ids).loss.backward()
        grads[backend] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (grads["blocksparse"] - grads["sdpa"]).abs().max().item() < 1e-5


def test_use_window_sets_the_window_for_the_next_forward():
    model = tiny_model("llama")
    ids, am = batch()
    with torch.no_grad():
        dense = model(ids, attention_mask=am).logits
        attention.retrofit(model, SMALL)
        with attention.use_window(64):
            wide = model(ids, attention_mask=am).logits
        narrow = model(ids, attention_mask=am).logits
    assert (wide - dense)[am.bool()].abs().max().item() < 1e-5
    assert (narrow - dense).abs().max().item() > 1e-2


def test_save_load_round_trip(tmp_path):
    model = attention.retrofit(tiny_model("qwen2"), SMALL)
    ids, am = batch()
    with torch.no_grad():
        hybrid = model(ids, attention_mask=am).logits
        model.save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        assert saved[CONFIG_KEY] == SMALL.to_dict()
        assert attention.ATTN_IMPLEMENTATION not in json.dumps(saved)  # plain loading must not see it
        reloaded = attention.load(tmp_path)
        assert attention.is_hybrid(reloaded)
        assert torch.equal(reloaded(ids, attention_mask=am).logits, hybrid)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert not attention.is_hybrid(plain)
        dense = tiny_model("qwen2")(ids, attention_mask=am).logits
        assert torch.equal(plain(ids, attention_mask=am).logits, dense)


def test_sliding_window_settings_are_suspended_and_restored():
    model = tiny_model("mistral")
    model.config.sliding_window = 16
    attention.retrofit(model, SMALL)
    assert model.config.sliding_window is None  # a sliding cache would drop sinks and globals
    attention.revert(model)
    assert model.config.sliding_window == 16 and model.config._attn_implementation == "sdpa"


def test_unsupported_architecture_names_the_supported_ones():
    class NotViaInterface(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"model_type": "gpt_custom"})()

    with pytest.raises(attention.UnsupportedArchitectureError, match="llama, mistral, qwen2") as e:
        attention.retrofit(NotViaInterface(), SMALL)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_sequence_beyond_max_positions_is_an_error():
    model = attention.retrofit(tiny_model("llama", max_pos=32), SMALL)
    ids, _ = batch(seq=33)
    with pytest.raises(attention.SequenceTooLongError, match="max_position_embeddings=32") as e:
        model(ids)
    assert "\n" not in str(e.value)
    model(ids[:, :32])
