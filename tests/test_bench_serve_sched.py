"""bench/serve_sched.py: the arms pin overtaking, so each differs from ``chunk 128`` only in what its name says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine

spec = importlib.util.spec_from_file_location("serve_sched", Path(__file__).resolve().parents[1] / "bench" / "serve_sched.py")
serve_sched = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_sched)


def test_arms_differ_only_in_their_named_setting():
    arms = serve_sched.arms(160, 20)
    assert list(arms) == ["chunk 512", "chunk 128", "chunk 128 overtake 160", "chunk 128 timed 20 ms"]
    base = arms["chunk 128"]
    assert base == {"prefill_chunk": 128, "overtake_tokens": 0}
    diff = {name: {k for k in {*kw, *base} if kw.get(k) != base.get(k)} for name, kw in arms.items()}
    assert diff == {"chunk 512": {"prefill_chunk"}, "chunk 128": set(), "chunk 128 overtake 160": {"overtake_tokens"},
                    "chunk 128 timed 20 ms": {"prefill_step_s"}}
    assert list(serve_sched.arms(0, 0)) == ["chunk 512", "chunk 128"]


def test_engines_take_the_pinned_threshold_and_the_default_arm_is_the_engines_default():
    model, tok = tiny_model(), tiny_tokenizer()

    def engine(**kw) -> Engine:
        return Engine(model=model, tokenizer=tok, max_batch=2, max_seq_len=256, prefix_cache_bytes=0, **kw)

    # Left to its default, a 512-token chunk would overtake prompts of up to 640 tokens.
    assert engine(prefill_chunk=512).overtake_tokens == 640
    for kw in serve_sched.arms(160, 20).values():
        assert engine(**kw).overtake_tokens == kw["overtake_tokens"]
    assert engine(prefill_chunk=128).overtake_tokens == 160  # --overtake's default: the engine's own
