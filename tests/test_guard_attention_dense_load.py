"""A dense load of a hybrid checkpoint is the base model again, sliding window and all."""

from __future__ import annotations

import torch

import attention
from attention import BASE_KEY, CONFIG_KEY
from core.models import load_causal_lm
from eval.longctx import load_for_eval
from tests.test_guard_attention_integration import SPEC, ids, mistral


def test_a_dense_load_of_a_hybrid_mistral_gets_its_sliding_window_back(tmp_path):
    model = mistral()
    x = ids()
    with torch.no_grad():
        base = model(x).logits  # 40 tokens > window 16
        attention.retrofit(model, SPEC).save_pretrained(tmp_path)
        dense = load_causal_lm(str(tmp_path), dense=True).eval()
        assert dense.config.sliding_window == 16 and not attention.is_hybrid(dense)
        assert not hasattr(dense.config, CONFIG_KEY) and not hasattr(dense.config, BASE_KEY)
        assert torch.equal(dense(x).logits, base)
        served = load_causal_lm(str(tmp_path)).eval()  # as served: hybrid
        assert attention.is_hybrid(served)


def test_longctx_dense_scores_the_base_mistral(tmp_path):
    model = mistral()
    attention.retrofit(model, SPEC).save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.save_pretrained(tmp_path)
    lm, _, name = load_for_eval(str(tmp_path), dense=True)
    assert name != "hybrid" and lm.config.sliding_window == 16
