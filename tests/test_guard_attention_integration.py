"""Retrofit, save, load and revert keep the base model's own sliding-window settings."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, MistralConfig, MistralForCausalLM

import attention
from attention import BASE_KEY, CONFIG_KEY, HybridAttentionConfig
from core.models import cache_kwargs

SPEC = HybridAttentionConfig(sink_tokens=2, window=6, global_every=10)


def mistral(sliding_window: int | None = 16) -> MistralForCausalLM:
    """A 2-layer, width-64 Mistral with GQA and its own sliding window."""
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=sliding_window, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return MistralForCausalLM(cfg).eval()


def ids(seq: int = 40) -> torch.Tensor:
    return torch.randint(3, 320, (2, seq), generator=torch.Generator().manual_seed(1))


def test_mistral_sliding_window_comes_back_after_save_load_revert(tmp_path):
    model = mistral()
    x = ids()
    with torch.no_grad():
        base = model(x).logits  # 40 tokens > window 16: the sliding window really acts
        attention.retrofit(model, SPEC)
        hybrid = model(x).logits
        model.save_pretrained(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        assert saved[CONFIG_KEY] == SPEC.to_dict() and saved[BASE_KEY] == {"sliding_window": 16}

        loaded = attention.load(tmp_path)  # through our registration: the hybrid pattern, not the window
        assert attention.is_hybrid(loaded) and loaded.config.sliding_window is None
        assert torch.equal(loaded(x).logits, hybrid)
        attention.revert(loaded)
        assert loaded.config.sliding_window == 16
        assert not hasattr(loaded.config, BASE_KEY) and not hasattr(loaded.config, CONFIG_KEY)
        assert torch.equal(loaded(x).logits, base)

        plain = AutoModelForCausalLM.from_pretrained(tmp_path)  # no registration: revert still knows the window
        attention.revert(plain)
        assert plain.config.sliding_window == 16 and torch.equal(plain(x).logits, base)


def test_reloaded_hybrid_mistral_decodes_with_a_full_cache(tmp_path):
    """Past the base model's window of 16, a sliding cache would have dropped the sink and global keys."""
    model = attention.retrofit(mistral(), SPEC)
    model.save_pretrained(tmp_path)
    loaded = attention.load(tmp_path)
    x = ids(36)
    with torch.no_grad():
        full = loaded(x).logits
        cache = DynamicCache(config=loaded.config)
        kw = cache_kwargs(loaded, cache)
        steps = [loaded(x[:, :5], use_cache=True, **kw).logits]
        steps += [loaded(x[:, t:t + 1], use_cache=True, **kw).logits for t in range(5, 36)]
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-5


def test_models_without_a_sliding_window_save_no_base_settings(tmp_path):
    model = attention.retrofit(mistral(sliding_window=None), SPEC)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert BASE_KEY not in saved and saved["sliding_window"] is None
    attention.revert(model)
    assert model.config.sliding_window is None and not hasattr(model.config, BASE_KEY)


def qwen2(use_sliding_window: bool) -> torch.nn.Module:
    """2-layer Qwen2 (GQA); with ``use_sliding_window`` its layer 1 is built as a sliding layer of 16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      use_sliding_window=use_sliding_window, sliding_window=16, max_window_layers=1)
    return Qwen2ForCausalLM(cfg).eval()


def test_qwen2_with_sliding_layers_runs_hybrid_and_reverts_bit_for_bit():
    """Qwen2 decides at construction which layers slide and builds their mask from sliding_window on every
    forward: the retrofit must not take that value away (transformers refused the forward)."""
    model, twin = qwen2(True), qwen2(False)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    x = ids(36)
    with torch.no_grad():
        base = model(x).logits
        attention.retrofit(model, SPEC)
        attention.retrofit(twin, SPEC)
        hybrid = model(x).logits
        assert torch.equal(hybrid, twin(x).logits)  # the spec is the pattern in every layer, sliding or not
        cache = DynamicCache(config=model.config)
        kw = cache_kwargs(model, cache)
        steps = [model(x[:, :5], use_cache=True, **kw).logits]
        steps += [model(x[:, t:t + 1], use_cache=True, **kw).logits for t in range(5, 36)]
        assert (torch.cat(steps, 1) - hybrid).abs().max().item() < 1e-5
        attention.revert(model)
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
        assert model.config.use_sliding_window and model.config.sliding_window == 16
        assert torch.equal(model(x).logits, base)


def test_generate_with_a_static_cache_runs_hybrid():
    """generate prepares each step's mask for a static cache through the mask function and hands the result
    back to the model: transformers then read ``.ndim`` of the HybridMask (AttributeError)."""
    from core.tiny import tiny_model

    model = attention.retrofit(tiny_model("llama"), SPEC)
    x = ids(20)
    am = torch.ones_like(x)
    am[1, :5] = 0  # left padding
    with torch.no_grad():
        out = model.generate(x, attention_mask=am, max_new_tokens=8, do_sample=False, cache_implementation="static")
        full = model(out, attention_mask=torch.cat([am, torch.ones(2, 8, dtype=torch.long)], 1)).logits
    assert out.shape == (2, 28)  # past the window of 6 and the global at position 20
    assert torch.equal(full[:, 19:-1].argmax(-1), out[:, 20:])


def test_load_refuses_a_dense_checkpoint_before_its_weights_load(tmp_path):
    """A local config.json without the spec is refused from the config alone (a missing or huge weights
    file is never read): before, this directory failed inside from_pretrained on the missing weights."""
    mistral().config.save_pretrained(tmp_path)  # config only, no weights
    with pytest.raises(attention.HybridAttentionError, match="has no 'hybrid_attention'.*attention.retrofit") as err:
        attention.load(tmp_path)
    assert "\n" not in str(err.value)


def test_load_names_a_broken_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(attention.HybridAttentionError, match="config.json is not valid JSON") as err:
        attention.load(tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("stored, says", [
    ({"sink_tokens": 2, "window": 0, "global_every": 0}, "window must be > 0"),
    ({"full_layers": [7]}, "name layer(s) [7] but the model has 2 layers"),
    ({"windw": 4}, "unknown hybrid attention keys ['windw']"),
    ("sinks+window", "'hybrid_attention' must be an object of hybrid attention keys, got 'sinks+window'"),
    (5, "'hybrid_attention' must be an object of hybrid attention keys, got 5"),
])
@pytest.mark.parametrize("loader", ["attention.load", "core.models.load_causal_lm"])
def test_load_refuses_a_broken_stored_spec_before_its_weights_load(tmp_path, stored, says, loader):
    """A spec config.json holds but no model can run is one line naming the file, from the config alone: it was
    found only after the weights loaded, and a spec that is no object raised a bare ValueError or TypeError. The
    loader the engine, the gate and the recipes use (``core.models.load_causal_lm``) checks it the same way."""
    from core.models import load_causal_lm

    cfg = mistral().config
    setattr(cfg, CONFIG_KEY, stored)
    cfg.save_pretrained(tmp_path)  # config only, no weights: reading them would fail another way
    with pytest.raises(attention.HybridAttentionError) as err:
        (attention.load if loader == "attention.load" else load_causal_lm)(str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and says in msg and str(tmp_path / "config.json") in msg, msg


def test_retrofit_from_a_stored_spec_that_is_no_object_is_one_line():
    model = mistral()
    setattr(model.config, CONFIG_KEY, ["sink", 4])
    with pytest.raises(attention.HybridAttentionError, match="must be an object of hybrid attention keys"):
        attention.retrofit(model)
