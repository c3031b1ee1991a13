"""bench/patterns.py: the benchmarks' mixed arm measures the default retrofit's pattern or a model's own spec."""

from __future__ import annotations

import pytest
import yaml

import attention
from attention import HybridAttentionConfig
from bench.patterns import RETROFIT_CONFIG, mixed_spec, retrofit_default
from core.tiny import tiny_model


def test_default_is_the_retrofit_config_pattern_and_share():
    cfg = yaml.safe_load(RETROFIT_CONFIG.read_text())
    spec, share = retrofit_default()
    assert share == cfg["full_head_share"]
    assert (spec.sink_tokens, spec.window, spec.global_every, spec.max_globals) == (
        cfg["sink_tokens"], cfg["window"], cfg["global_every"], cfg["max_globals"])
    want_policy = None if cfg["window_policy"] is None else [(b, w) for b, w in cfg["window_policy"]]
    assert spec.window_policy == want_policy and not spec.has_head_roles
    mixed = mixed_spec(30, 3)
    assert mixed.full_head_count(30, 3) == round(share * 90)
    assert mixed.window_policy == spec.window_policy and mixed.window == spec.window
    assert mixed_spec(30, 3, 0.5).full_head_count(30, 3) == 45


def test_roles_take_the_whole_saved_spec_window_policy_included(tmp_path):
    spec = HybridAttentionConfig(sink_tokens=2, window=6, global_every=10, window_policy=[[16, 6], [None, 12]],
                                 full_heads={0: [1]}, full_layers=[1])
    attention.retrofit(tiny_model("llama"), spec).save_pretrained(tmp_path)
    got = mixed_spec(2, 2, 0.9, roles=str(tmp_path))
    assert got == spec  # the share is ignored: the model's own heads and pattern


def test_roles_without_a_hybrid_spec_is_a_one_line_error(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="no 'hybrid_attention'.*retrofitted model"):
        mixed_spec(2, 2, roles=str(tmp_path))
    with pytest.raises(SystemExit, match="no config.json"):
        mixed_spec(2, 2, roles=str(tmp_path / "missing"))
