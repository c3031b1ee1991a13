"""bench/serve_quant.py: one batch's rates, and a prefill column made of measured (not warm-up) runs only."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from core.tiny import save_tiny, tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.sampling import SamplingParams

spec = importlib.util.spec_from_file_location("serve_quant", Path(__file__).resolve().parents[1] / "bench" / "serve_quant.py")
serve_quant = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_quant)


def test_run_batch_gives_decode_and_prefill_rates():
    engine = Engine(model=tiny_model(), tokenizer=tiny_tokenizer(), max_batch=2, max_seq_len=64, prefix_cache_bytes=0)
    rate, prefill = serve_quant.run_batch(engine, [[5] * 16, [6] * 16], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert rate > 0 and prefill > 0


@pytest.mark.parametrize("batch", ["4", "1"])
def test_prefill_column_leaves_out_the_warm_up(tmp_path, monkeypatch, capsys, batch):
    pytest.importorskip("torchao")
    model = save_tiny(tmp_path / "tiny", hidden=128)
    monkeypatch.setattr(sys, "argv", ["serve_quant.py", "--model", str(model), "--batch", batch, "--reps", "1",
                                      "--prompt", "48", "--new-tokens", "4", "--threads", "1", "--defaults-only"])
    serve_quant.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Without batch-1 runs there is no prefill to report (before: the warm-up's, a cold run's, alone).
    assert set(out["prefill_tokens_per_s"]) == (set() if batch == "4" else {"fp32 (fused packed copies)",
                                                                              "int8 (fused, int8pack bf16)"})
