"""recipes/retrofit.py refuses every length its config and the model's config.json can judge before any weights
load and before the run folder is claimed."""

from __future__ import annotations

import pytest

import core.models
from core.config import ConfigError, parse_config
from core.tiny import save_tiny
from tests.helpers import forbid

TINY = ["--config", "recipes/configs/retrofit_tiny.yaml"]


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight load fails the test: the bad input must be refused first."""
    from recipes import retrofit

    forbid(monkeypatch, "weights were loaded before the bad input was refused", (retrofit, "load_models"),
           (retrofit, "tiny_teacher"), (retrofit, "load_causal_lm"), (core.models, "load_causal_lm"))
    return retrofit


@pytest.mark.parametrize("argv, match", [
    (["seq_len=2048"], "seq_len/eval_seq_lens up to 2048 exceed the model's maximum of 1024 positions; lower them"),
    (["eval_seq_lens=[4096]"], "seq_len/eval_seq_lens up to 4096 exceed the model's maximum of 1024"),
    (["longctx_lengths=[256, 100000]"], "longctx_lengths up to 100000 exceed the model's maximum of 1024"),
    (["longctx_lengths=[100]"], "longctx_lengths: length 100 is too short for a passkey prompt"),
    (["head_score=retrieval", "head_sample_len=24"], "head roles: .*pick a length of at least .*raise head_sample_len"),
    (["gate_sample_len=24"], "head roles: .*pick a length of at least .*raise gate_sample_len"),
    (["seq_len=32", "eval_seq_lens=[]", "longctx_lengths=[]"],
     r"head roles: .*raise seq_len \(it caps gate_sample_len=1024 at 32 tokens\)"),
])
def test_lengths_are_refused_before_any_weights_load(no_weights, tmp_path, argv, match):
    out = tmp_path / "o"
    with pytest.raises(ConfigError, match=match) as err:
        no_weights.main([*TINY, f"output_dir={out}", *argv])
    assert "\n" not in str(err.value)
    assert not out.exists()  # refused before the run folder was claimed


def test_a_local_model_is_judged_from_its_config_json(no_weights, tmp_path):
    model = save_tiny(tmp_path / "model", max_pos=192)
    with pytest.raises(ConfigError, match="up to 256 exceed the model's maximum of 192 positions"):
        no_weights.main([*TINY, f"teacher={model}", f"output_dir={tmp_path / 'o'}"])
    assert core.models.peek_config(str(model)).max_position_embeddings == 192


def test_good_lengths_pass_without_loading_weights(no_weights, tmp_path):
    cfg = parse_config(no_weights.RetrofitConfig, [*TINY, f"output_dir={tmp_path / 'o'}"])
    no_weights.check_before_loading(cfg)  # the shipped tiny config is fine


def test_unreadable_sources_are_left_to_the_loader(tmp_path, monkeypatch):
    """No config.json to read without loading (the demo teacher before its conversion, a hub name offline):
    nothing is decided early, and the loader reports the source in its own words."""
    monkeypatch.setenv("HYBRID_DISTILL_CACHE", str(tmp_path / "cache"))
    assert core.models.peek_config("smollm2-135m-instruct") is None
    assert not (tmp_path / "cache").exists()  # no conversion was started
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert core.models.peek_config("no-such-org/no-such-model") is None
