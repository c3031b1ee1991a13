"""Time to first token with and without the prompt-prefix cache, for prompts sharing a long header.

    python bench/prefix_cache.py [--model smollm2-135m-instruct] [--prefix 1024] [--suffix 32] [--reps 5]

Every request is ``header + its own suffix`` (a chat system prompt or a few-shot header in front of a
question). Two engines over the same weights, one with the prefix cache and one without, answer the
same requests alternately (so machine noise hits both alike); TTFT is submit -> first token, measured
with ``max_new_tokens=1`` on an idle engine. The cached engine sees the header once before timing (the
first request of a deployment pays full price; that one is reported too). Also checked: both engines
produce the same greedy tokens. Target (issue 16): cached TTFT >= 3x lower at a 1K-token header.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.environment import json_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="HF model dir or the demo name")
    ap.add_argument("--prefix", type=int, default=1024, help="shared header tokens")
    ap.add_argument("--suffix", type=int, default=32, help="tokens of each request's own part")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared between the engines")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.models import resolve_model_path
    from serve.engine import Engine
    from serve.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(path)
    seq = args.prefix + args.suffix + args.check_tokens + 8
    cached = Engine(model=model, tokenizer=tok, max_batch=1, max_seq_len=seq)
    plain = Engine(model=model, tokenizer=tok, max_batch=1, max_seq_len=seq, prefix_cache_bytes=0)
    g = torch.Generator().manual_seed(0)
    vocab = min(tok.vocab_size, model.config.vocab_size)
    header = torch.randint(100, vocab, (args.prefix,), generator=g).tolist()
    prompts = [header + torch.randint(100, vocab, (args.suffix,), generator=g).tolist() for _ in range(args.reps + 1)]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def ttft(engine: Engine, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        engine.generate([prompt], one)
        return time.perf_counter() - t0

    with torch.inference_mode():
        ttft(plain, prompts[0][-64:])  # warm both engines' code paths on an unrelated short prompt
        ttft(cached, prompts[0][-64:])
        cold = ttft(cached, prompts[0])  # the first request with this header fills the cache
        t_cached, t_plain = [], []
        hits0 = cached.prefix_cache.stats.hit_tokens
        for p in prompts[1:]:
            t_plain.append(ttft(plain, p))
            t_cached.append(ttft(cached, p))
        # The timed requests' own hits: the greedy check below repeats whole prompts, which hit more.
        timed_hits = cached.prefix_cache.stats.hit_tokens - hits0
        check = SamplingParams(max_new_tokens=args.check_tokens, ignore_eos=True)
        same = all(cached.generate([p], check)[0].token_ids == plain.generate([p], check)[0].token_ids
                   for p in prompts[1:3])
    st = cached.prefix_cache.stats
    med_c, med_p = statistics.median(t_cached), statistics.median(t_plain)
    out = {
        "model": str(args.model), "prefix_tokens": args.prefix, "suffix_tokens": args.suffix, "reps": args.reps,
        "threads": args.threads, "ttft_uncached_s": round(med_p, 4), "ttft_cached_s": round(med_c, 4),
        "ttft_first_request_s": round(cold, 4), "speedup": round(med_p / med_c, 2),
        "hit_tokens_per_request": timed_hits // max(1, len(t_cached)),
        "cache_bytes": st.bytes, "greedy_equal": same, "target_met": med_p / med_c >= 3.0 and same,
    }
    print(f"shared header {args.prefix} tokens + {args.suffix} own, {args.threads} threads, median of {args.reps}")
    print(f"{'':<28}{'TTFT (s)':>10}")
    print(f"{'no prefix cache':<28}{med_p:>10.3f}")
    print(f"{'prefix cached':<28}{med_c:>10.3f}")
    print(f"{'first request (fills it)':<28}{cold:>10.3f}")
    print(f"speedup {out['speedup']}x (target >= 3x); cache holds {st.bytes / 2**20:.1f} MiB; "
          f"greedy tokens equal: {same}")
    print(json_line(out))


if __name__ == "__main__":
    main()
