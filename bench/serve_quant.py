"""int8 exports (torchao weight-only ``int8``, W8A8 ``w8a8``) against fp32: weight bytes and engine decode tokens/s.

    python bench/serve_quant.py [--model smollm2-135m-instruct] [--schemes int8 w8a8] [--batch 1 4] \
        [--new-tokens 48] [--reps 3] [--threads 2] [--defaults-only]

The fp32 model is quantized through the export path (:func:`serve.quantize.quantize_dir` into a temp
dir, the same files ``recipes/export.py quantize=int8`` writes) and loaded back as transformers loads
it. The engines decode the same prompts, alternately (so machine noise hits all alike): fp32 with the
fused oneDNN-packed decode copies (the CPU default), fp32 on the model's own weights, and per scheme the
fused int8 copies (the default for that export: ``int8`` through ``torch._weight_int8pack_mm`` with
activations rounded to bf16, ``w8a8`` through oneDNN's int8 GEMM) and, without ``--defaults-only``,
torchao's own linears (``fast_weights=False``). Decode tokens/s = the tokens made after the last row's first token
over the time from it to the last token (``bench/decode.py``'s ``decode_rate``), median over ``--reps``; prefill
tokens/s of one ``--prompt``-token prompt likewise, from the batch-1 runs (none without 1 in ``--batch``; the
warm-up run is not counted). Also:
decoder-layer weight bytes int8 / fp32 (embeddings excluded) and how many greedy tokens int8 shares
with fp32 before the first difference. Targets (issue 16): bytes <= 0.4x; int8 decode tokens/s not lower
than fp32 (the default engines: fused fp32 vs fused int8 / w8a8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.environment import json_line  # noqa: E402


def run_batch(engine, prompts: list[list[int]], sp) -> tuple[float, float]:
    """(decode tokens/s: ``bench/decode.py``'s ``decode_rate``, the first prompt's prefill tokens/s) of one
    batch run to the end."""
    from bench.decode import decode_rate

    stamps: list[list[float]] = [[] for _ in prompts]

    def cb(i):
        def on_event(_d, token, _f):
            if token is not None:
                stamps[i].append(time.perf_counter())
        return on_event

    t0 = time.perf_counter()
    reqs = [engine.submit(p, sp, cb(i)) for i, p in enumerate(prompts)]
    while not all(r.done for r in reqs):
        engine.step()
    return decode_rate(stamps)[1], len(prompts[0]) / (stamps[0][0] - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--schemes", nargs="+", default=["int8"], choices=["int8", "w8a8"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--defaults-only", action="store_true",
                    help="only the two default engines (fused fp32, fused int8): skips the slow reference arms")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.models import resolve_model_path
    from serve.engine import Engine
    from serve.quantize import quantize_dir, weight_bytes
    from serve.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    src = resolve_model_path(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="serve-quant-"))
    for scheme in args.schemes:
        quantize_dir(src, tmp / scheme, scheme)
    sizes = {scheme: weight_bytes(tmp / scheme) for scheme in args.schemes}
    base = weight_bytes(src)
    tok = AutoTokenizer.from_pretrained(src)
    seq = args.prompt + args.new_tokens + 8
    fp32 = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa")
    quant = {scheme: AutoModelForCausalLM.from_pretrained(tmp / scheme, attn_implementation="sdpa")
             for scheme in args.schemes}
    mb = max(args.batch)
    engines = {
        "fp32 (fused packed copies)": Engine(model=fp32, tokenizer=tok, max_batch=mb, max_seq_len=seq,
                                              prefix_cache_bytes=0),
        "fp32 (model weights)": Engine(model=fp32, tokenizer=tok, max_batch=mb, max_seq_len=seq, fast_weights=False,
                                       prefix_cache_bytes=0),
    }
    fused_names = {"int8": "int8 (fused, int8pack bf16)", "w8a8": "w8a8 (fused, oneDNN int8)"}
    for scheme, model in quant.items():
        engines[fused_names[scheme]] = Engine(model=model, tokenizer=tok, max_batch=mb, max_seq_len=seq,
                                              prefix_cache_bytes=0)
        engines[f"{scheme} (torchao linears)"] = Engine(model=model, tokenizer=tok, max_batch=mb, max_seq_len=seq,
                                                        fast_weights=False, prefix_cache_bytes=0)
    fp32_name = "fp32 (fused packed copies)"
    defaults = [fp32_name] + [fused_names[s] for s in args.schemes]
    if args.defaults_only:
        engines = {k: v for k, v in engines.items() if k in defaults}
    g = torch.Generator().manual_seed(0)
    vocab = min(tok.vocab_size, fp32.config.vocab_size)
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    def decode(engine: Engine, batch: int) -> tuple[float, float]:
        return run_batch(engine, torch.randint(100, vocab, (batch, args.prompt), generator=g).tolist(), sp)

    rates: dict[tuple[str, int], list[float]] = {}
    prefill: dict[str, list[float]] = {}
    with torch.inference_mode():
        for e in engines.values():
            decode(e, 1)  # warm-up, not recorded
        for b in args.batch:
            for _ in range(args.reps):
                for name, e in engines.items():
                    rate, pre = decode(e, b)
                    rates.setdefault((name, b), []).append(rate)
                    if b == 1:
                        prefill.setdefault(name, []).append(pre)
        chat = tok.apply_chat_template([{"role": "user", "content": "Explain what a compiler does."}],
                                       add_generation_prompt=True, tokenize=True)
        chat = list(chat["input_ids"]) if hasattr(chat, "keys") else list(chat)  # a BatchEncoding in transformers 5
        greedy = SamplingParams(max_new_tokens=args.new_tokens)
        a = engines[fp32_name].generate([chat], greedy)[0].token_ids
        same = {}
        for scheme in args.schemes:
            b = engines[fused_names[scheme]].generate([chat], greedy)[0].token_ids
            same[scheme] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = {scheme: sizes[scheme]["other"] / base["other"] for scheme in args.schemes}
    for scheme in args.schemes:
        print(f"decoder-layer weight bytes: fp32 {base['other']:,}, {scheme} {sizes[scheme]['other']:,} "
              f"({ratio[scheme]:.3f}x, target <= 0.4); embeddings {base['embeddings']:,} -> "
              f"{sizes[scheme]['embeddings']:,}")
    pre = {name: statistics.median(v) for name, v in prefill.items()}
    print(f"{'engine':<32}" + "".join(f"{f'b{b} tok/s':>12}" for b in args.batch) + f"{'prefill tok/s':>15}")
    for name in engines:
        print(f"{name:<32}" + "".join(f"{med[(name, b)]:>12.1f}" for b in args.batch)
              + (f"{pre[name]:>15.1f}" if name in pre else f"{'-':>15}"))
    for scheme in args.schemes:
        print(f"greedy chat answer: {scheme} equals fp32 for the first {same[scheme]} of {len(a)} tokens")
    vs = {scheme: {f"b{b}": round(med[(fused_names[scheme], b)] / med[(fp32_name, b)], 3) for b in args.batch}
          for scheme in args.schemes}
    out = {"model": str(args.model), "threads": args.threads, "prompt_tokens": args.prompt,
           "new_tokens": args.new_tokens, "reps": args.reps, "layer_bytes_fp32": base["other"],
           "layer_bytes": {s: sizes[s]["other"] for s in args.schemes},
           "layer_bytes_ratio": {s: round(r, 4) for s, r in ratio.items()},
           "embedding_bytes_equal": all(sizes[s]["embeddings"] == base["embeddings"] for s in args.schemes),
           "decode_tokens_per_s": {f"{n} b{b}": round(v, 1) for (n, b), v in med.items()},
           "prefill_tokens_per_s": {n: round(v, 1) for n, v in pre.items()},
           "greedy_prefix_equal_tokens": same, "vs_fp32_fast": vs}
    out["targets"] = {s: {"bytes_le_0.4x": ratio[s] <= 0.4, "decode_not_slower": all(v >= 1.0 for v in vs[s].values())}
                      for s in args.schemes}
    print(json_line(out))


if __name__ == "__main__":
    main()
