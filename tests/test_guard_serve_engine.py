"""The engine's own messages and limits, in the corners: a bounded window shorter than a prefix block."""

from __future__ import annotations

import logging
import re

import pytest

from attention.spec import HybridAttentionConfig
from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine


@pytest.mark.parametrize("window,chunk,advice", [(8, 7, "no prefill_chunk caches all"),
                                                  (48, 20, "prefill_chunk <= 16 caches all")])
def test_the_prefix_cache_warning_gives_advice_that_can_be_followed(caplog, window, chunk, advice):
    spec = HybridAttentionConfig(sink_tokens=2, window=window, global_every=5, max_globals=2)
    model = tiny_model("llama", seed=8)
    model.config.hybrid_attention = spec.to_dict()
    with caplog.at_level(logging.WARNING, logger="serve.engine"):
        Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=1, max_seq_len=64, prefill_chunk=chunk,
               prefix_cache_bytes=1 << 20, prefix_block=32)
    (warning,) = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert advice in warning
    assert not re.search(r"<= -?0\b|<= -\d", warning)  # never a chunk size below 1
