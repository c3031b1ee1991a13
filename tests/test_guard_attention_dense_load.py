"""A dense evaluation of a hybrid checkpoint scores the base model again, sliding window and all; the engine's
dense load keeps the spec it runs with its own kernels."""

from __future__ import annotations

import pytest
import torch

import attention
from attention import BASE_KEY, CONFIG_KEY
from core.models import load_causal_lm
from eval.longctx import load_for_eval
from tests.test_guard_attention_integration import SPEC, ids, mistral


@pytest.fixture
def saved(tmp_path):
    """A hybrid Mistral checkpoint (its own window 16) with a tokenizer, and the base model's logits."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = mistral()
    with torch.no_grad():
        base = model(ids()).logits  # 40 tokens > window 16: the window acts
    attention.retrofit(model, SPEC).save_pretrained(tmp_path)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.save_pretrained(tmp_path)
    return tmp_path, base


def test_longctx_dense_scores_the_base_mistral(saved):
    path, base = saved
    lm, _, name = load_for_eval(str(path), dense=True)
    assert name == "dense" and lm.config.sliding_window == 16
    assert not hasattr(lm.config, CONFIG_KEY) and not hasattr(lm.config, BASE_KEY)
    with torch.no_grad():
        assert torch.equal(lm(ids()).logits, base)


def test_a_dense_load_keeps_the_spec_for_the_engines_own_kernels(saved):
    path, _ = saved
    lm = load_causal_lm(str(path), dense=True)
    assert not attention.is_hybrid(lm) and getattr(lm.config, CONFIG_KEY) == SPEC.to_dict()
