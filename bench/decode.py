"""Decode throughput: the serving engine vs HF ``generate`` on SmolLM2-135M, side by side in one run.

    python bench/decode.py [--quick] [--new-tokens 128] [--threads 2]
    python bench/decode.py --cases 8k --engines hf,mixed --repeats 3 --new-tokens 64   # the 8K mixed target

Cases: prompt 512 × batch 1, prompt 512 × batch 8, prompt 8K × batch 1. Each runs HF ``generate``
(greedy, its default dynamic cache), the engine with a preallocated dense cache, and the engine on a
hybrid copy of the same weights (spec sink 128 / window 512 / global_every 1024 / max_globals 16 in the
config) with the bounded cache. HF always attends densely: the hybrid copy only changes our engine.

Throughput is *decode* tokens/s: generated tokens after the first, over the time from the first to the
last token (the prompt's prefill is excluded, it is reported separately as time to first token). At batch
8 the engine prefills the rows over several steps and the rows done first decode meanwhile, so its window
starts at the last row's first token and counts only the tokens made after it (:func:`decode_rate`); HF
prefills the batch in one forward (timed by a 1-token run and subtracted). No engine keeps a prefix cache:
every repeat reuses the case's prompt, and each arm's time to first token is a full prefill.

JSON keys:
* ``speedup_512_b1``, ``speedup_512_b8``: engine dense / HF, decode tokens/s (same attention, so this
  is the cache and loop overhead alone).
* ``speedup_8k``: engine hybrid bounded / HF dense at the 8K prompt, the number a user of a hybrid
  export sees; ``speedup_8k_dense`` is engine dense / HF and ``speedup_8k_bounded_vs_dense`` the cache alone.
* ``kv_ratio_32k``: bounded / dense KV-cache bytes at 32K positions (``kv_ratio_8k`` likewise).
* ``mixed_*``: the same for a third engine on the default retrofit's pattern (its window or
  ``window_policy``) with its ``full_head_share`` of the (layer, KV head) pairs full (or ``--full-share``),
  or on the whole spec a retrofitted model saved (``--roles DIR``; bench/patterns.py) (``MixedKVCache``:
  full cache for those, bounded for the rest): ``mixed_speedup_8k`` vs HF, ``mixed_kv_ratio_32k``, the
  bytes per kind and ``mixed_pattern``.

``--repeats N`` runs the arms of each case round-robin N times and reports the median tokens/s per
arm (ratios are of medians); ``--engines`` picks the arms (HF is always the reference).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention.spec import HybridAttentionConfig  # noqa: E402
from bench.patterns import mixed_spec  # noqa: E402
from core.environment import json_line  # noqa: E402
from serve.engine import Engine  # noqa: E402
from serve.sampling import SamplingParams  # noqa: E402

SPEC = HybridAttentionConfig(sink_tokens=128, window=512, global_every=1024, max_globals=16)


def hf_decode(model, prompts: torch.Tensor, new: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s per sequence × batch) of HF greedy ``generate``."""
    from transformers.generation.streamers import BaseStreamer

    stamps: list[float] = []

    class Stamp(BaseStreamer):
        def put(self, value):
            stamps.append(time.perf_counter())

        def end(self):
            pass

    t0 = time.perf_counter()
    # The streamer only works with batch 1; batches time the whole call and subtract a 1-token run.
    if prompts.shape[0] == 1:
        model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=Stamp(),
                       eos_token_id=None, pad_token_id=0)
        # stamps[0] is the prompt, stamps[1] the first generated token.
        return stamps[1] - t0, (new - 1) / (stamps[-1] - stamps[1])
    model.generate(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                   pad_token_id=0)
    total = time.perf_counter() - t1
    return ttft, prompts.shape[0] * (new - 1) / (total - ttft)


def decode_rate(stamps: list[list[float]]) -> tuple[float, float]:
    """(start, decode tokens/s) from each row's token times: the tokens made after ``start``, the last
    row's first token, over the time from it to the last token of any row."""
    # Rows whose prefill ended earlier already decode before start: their tokens then are not counted.
    start = max(s[0] for s in stamps)
    end = max(s[-1] for s in stamps)
    return start, sum(t > start for s in stamps for t in s) / (end - start)


def engine_decode(engine: Engine, prompts: torch.Tensor, new: int) -> tuple[float, float]:
    """(time to first token of the last row, decode tokens/s summed over the batch: :func:`decode_rate`)."""
    stamps: list[list[float]] = [[] for _ in range(len(prompts))]

    def cb(i):
        def on_event(_delta, token, _finish):
            if token is not None:
                stamps[i].append(time.perf_counter())
        return on_event

    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [engine.submit(p.tolist(), sp, cb(i)) for i, p in enumerate(prompts)]
    while not all(r.done for r in reqs):
        engine.step()
    start, rate = decode_rate(stamps)
    return start - t0, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2K instead of 8K prompt, 32 new tokens")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default="512_b1,512_b8,8k", help="comma-separated subset of 512_b1,512_b8,8k")
    ap.add_argument("--engines", default="dense,hybrid,mixed", help="engine arms beside HF (always run, so "
                    "naming it changes nothing): subset of dense,hybrid,mixed")
    ap.add_argument("--repeats", type=int, default=1, help="round-robin repeats per case (medians reported)")
    ap.add_argument("--full-share", type=float, default=None, help="mixed engine: share of (layer, KV head) "
                    "pairs full (default: the retrofit config's full_head_share)")
    ap.add_argument("--roles", default=None, help="mixed engine: take the full heads from this model's config")
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e and e != "hf"]
    unknown = sorted(set(engines) - {"dense", "hybrid", "mixed"})
    if unknown:
        ap.error(f"--engines: unknown arm(s) {', '.join(unknown)}; use a subset of hf,dense,hybrid,mixed")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    new = args.new_tokens or (32 if args.quick else 128)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.models import smollm2_dir

    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    model.config.hybrid_attention = SPEC.to_dict()  # the hybrid copy: same weights, spec in the config
    # The long case fills the model's positions (8,192), prompt and new tokens together: the engines refuse more.
    max_len = 2048 if args.quick else model.config.max_position_embeddings
    long_len = max_len - new
    # No prefix cache: each repeat reuses its case's prompt, and every arm's TTFT is a full prefill.
    dense = Engine(model=model, tokenizer=tok, max_batch=8, max_seq_len=max_len, dense=True, prefix_cache_bytes=0)
    hybrid = Engine(model=model, tokenizer=tok, max_batch=8, max_seq_len=max_len, prefix_cache_bytes=0)
    mixed_sp = mixed_spec(model.config.num_hidden_layers, model.config.num_key_value_heads, args.full_share,
                          args.roles)
    mixed_full = mixed_sp.full_head_count(model.config.num_hidden_layers, model.config.num_key_value_heads)
    model.config.hybrid_attention = mixed_sp.to_dict()  # the engine reads the spec once, at construction
    mixed = Engine(model=model, tokenizer=tok, max_batch=8, max_seq_len=max_len, prefix_cache_bytes=0)
    model.config.hybrid_attention = SPEC.to_dict()
    vocab = model.config.vocab_size

    def prompts(batch: int, n: int) -> torch.Tensor:
        return torch.randint(100, vocab, (batch, n), generator=torch.Generator().manual_seed(n + batch))

    warm = prompts(1, 16)
    hf_decode(model, warm, 4)
    engine_decode(dense, warm, 4)
    engine_decode(hybrid, warm, 4)
    engine_decode(mixed, warm, 4)

    rows, result = [], {}
    nan = (float("nan"), float("nan"))
    arms = {"dense": dense, "hybrid": hybrid, "mixed": mixed}
    cases = [c for c in [("512_b1", 1, 512), ("512_b8", 8, 512), ("8k", 1, long_len)] if c[0] in args.cases.split(",")]
    for name, batch, n in cases:
        p = prompts(batch, n)
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in ["hf", *engines]}
        for _ in range(args.repeats):  # interleaved: load from other processes hits every arm alike
            with torch.inference_mode():
                runs["hf"].append(hf_decode(model, p, new))
            for e in engines:
                runs[e].append(engine_decode(arms[e], p, new))
        med = {k: (statistics.median(t for t, _ in v), statistics.median(s for _, s in v)) for k, v in runs.items()}
        hf, en, hy, mx = (med.get(k, nan) for k in ("hf", "dense", "hybrid", "mixed"))
        rows.append((name, hf, en, hy, mx))
        result[f"hf_tok_s_{name}"] = round(hf[1], 2)
        result[f"engine_dense_tok_s_{name}"] = round(en[1], 2)
        result[f"engine_hybrid_tok_s_{name}"] = round(hy[1], 2)
        result[f"engine_mixed_tok_s_{name}"] = round(mx[1], 2)
        print(f"  {name}: HF {hf[1]:.1f} tok/s, engine dense {en[1]:.1f}, engine hybrid {hy[1]:.1f}, "
              f"engine mixed {mx[1]:.1f}", file=sys.stderr, flush=True)

    def kv_bytes(n: int, bounded: bool) -> int:
        return dense.model.new_cache(1, n, dense=not bounded).nbytes()

    kv = {n: (kv_bytes(n, False), kv_bytes(n, True)) for n in (8192, 32768)}
    mixed_kv = {n: mixed.model.new_cache(1, n).nbytes_by_kind() for n in (8192, 32768)}
    print(f"\nSmolLM2-135M fp32, {torch.get_num_threads()} threads, {new} new tokens, decode tokens/s "
          f"(TTFT in parentheses), median of {args.repeats} interleaved; hybrid = {SPEC.to_json()}; mixed: "
          f"{mixed_full} KV heads full, "
          f"window {mixed_sp.window_policy or mixed_sp.window}")
    print(f"{'case':<14}{'HF generate':>22}{'engine dense':>22}{'engine hybrid':>22}{'engine mixed':>22}")
    for name, hf, en, hy, mx in rows:
        print(f"{name:<14}" + "".join(f"{t:>12.1f} ({f:6.2f}s)" for f, t in (hf, en, hy, mx)))
    print(f"\n{'KV cache bytes':<14}{'dense':>16}{'bounded':>16}{'ratio':>10}{'mixed full':>16}{'mixed stream':>16}"
          f"{'ratio':>10}")
    for n, (d, b) in kv.items():
        mf, ms = mixed_kv[n]["full"], mixed_kv[n]["streaming"]
        print(f"{n:<14}{d:>16,}{b:>16,}{b / d:>10.4f}{mf:>16,}{ms:>16,}{(mf + ms) / d:>10.4f}")
    r = {name: (hf[1], en[1], hy[1], mx[1]) for name, hf, en, hy, mx in rows}

    def ratio(case: str, a: int, b: int) -> float | None:
        if case not in r or r[case][a] != r[case][a] or r[case][b] != r[case][b]:  # not run (NaN)
            return None
        return round(r[case][a] / r[case][b], 3)

    out = {
        "speedup_512_b1": ratio("512_b1", 1, 0),
        "speedup_512_b8": ratio("512_b8", 1, 0),
        "speedup_8k": ratio("8k", 2, 0),
        "speedup_8k_dense": ratio("8k", 1, 0),
        "speedup_8k_bounded_vs_dense": ratio("8k", 2, 1),
        "mixed_speedup_8k": ratio("8k", 3, 0),
        "kv_ratio_8k": round(kv[8192][1] / kv[8192][0], 5),
        "kv_ratio_32k": round(kv[32768][1] / kv[32768][0], 5),
        "mixed_kv_ratio_32k": round(sum(mixed_kv[32768].values()) / kv[32768][0], 5),
        "mixed_kv_bytes_32k": mixed_kv[32768],
        "mixed_full_heads": mixed_full,
        "mixed_pattern": {k: v for k, v in mixed_sp.to_dict().items() if k not in ("full_heads", "head_scores")},
        "repeats": args.repeats,
        "long_prompt": long_len,
        "new_tokens": new,
        **result,
    }
    print(json_line(out))


if __name__ == "__main__":
    main()
