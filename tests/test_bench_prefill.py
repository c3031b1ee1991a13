"""bench/prefill.py: it times the prefill the engine runs, which computes logits on the prompt's last chunk only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine

spec = importlib.util.spec_from_file_location("bench_prefill", Path(__file__).resolve().parents[1] / "bench" / "prefill.py")
prefill = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prefill)


def test_only_the_last_chunk_computes_logits_as_in_the_engine():
    engine = Engine(model=tiny_model(), tokenizer=tiny_tokenizer(), max_batch=1, max_seq_len=64, prefix_cache_bytes=0)
    model = engine.model
    real = model.prefill
    calls: list[tuple[int, int, bool]] = []

    def recording(cache, row, ids, start, logits=True, between=None):
        calls.append((start, ids.numel(), logits))
        return real(cache, row, ids, start, logits=logits, between=between)

    model.prefill = recording
    ids = torch.arange(3, 3 + 40)
    ms, last = prefill.prefill_ms_per_token(engine, ids, 16, fused=False)
    # The engine (serve/engine.py) asks for logits only when the chunk ends the prompt: the head is a full
    # read of the vocabulary matrix, and timing it on every chunk would charge small chunks for it repeatedly.
    assert calls == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert ms > 0 and last.shape == (model.config.vocab_size,)
    # The logits are those of a one-piece prefill of the same prompt.
    model.prefill = real
    _, whole = prefill.prefill_ms_per_token(engine, ids, 40, fused=False)
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-4)
