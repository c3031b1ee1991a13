"""Prefill speed: the engine's fused decode-layout weight copies vs the model's own weights.

    python bench/prefill.py [--model smollm2-135m-instruct] [--threads 1,2] [--chunks 64,128,512] [--repeats 5]

A short request's time to first token is mostly its own prefill (``bench/serve_sched.py``), so the
engine prefills through the same fused, oneDNN-reordered projection copies it decodes with
(:mod:`serve.model`). This measures that choice: one 512-token prompt prefilled into a dense cache row
in chunks of each size, once through the fused copies and once through the model's own ``nn.Linear``
weights (MKL), the two arms alternating inside every repeat so machine noise hits both alike. Reported
per thread count and chunk size: median milliseconds per prompt token of each arm and their ratio
(own / fused: above 1 means the fused copies are faster). Both arms produce the same logits (checked
here to fp32 rounding, and by the serving tests).

JSON keys: ``ms_per_token`` {threads: {chunk: {"fused", "own"}}}, ``speedup`` {threads: {chunk: own / fused}}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from time import perf_counter

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.environment import json_line  # noqa: E402
from serve.engine import Engine  # noqa: E402


def prefill_ms_per_token(engine: Engine, ids: torch.Tensor, chunk: int, fused: bool) -> tuple[float, torch.Tensor]:
    """Prefill ``ids`` into row 0 in ``chunk``-token pieces; milliseconds per token and the last logits.

    As the engine does, only the chunk that ends the prompt computes logits (the head reads the whole
    vocabulary matrix; on every chunk it would be timed once per chunk, which the engine never runs).
    """
    model = engine.model
    model._prefill_fast = fused
    cache = engine._ensure_cache(1)
    n = ids.numel()
    t0 = perf_counter()
    for start in range(0, n, chunk):
        logits = model.prefill(cache, 0, ids[start:start + chunk], start, logits=start + chunk >= n)
    return (perf_counter() - t0) / ids.numel() * 1000, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--chunks", default="64,128,512", help="comma-separated prefill chunk sizes")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]

    engine = Engine(args.model, max_batch=1, prefix_cache_bytes=0)
    if not engine.model.fast_weight_bytes():
        raise SystemExit("this engine has no fused weight copies (not CPU, or fast_weights off): nothing to compare")
    vocab = min(engine.tokenizer.vocab_size, engine.model.config.vocab_size)
    ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0))
    times: dict[int, dict[int, dict[str, list[float]]]] = {t: {c: {"fused": [], "own": []} for c in chunks}
                                                           for t in threads}
    for n in threads:
        torch.set_num_threads(n)
        for c in chunks:  # warm-up, and the two arms must agree
            _, a = prefill_ms_per_token(engine, ids, c, True)
            _, b = prefill_ms_per_token(engine, ids, c, False)
            if not torch.allclose(a, b, rtol=1e-3, atol=1e-3):
                raise SystemExit(f"fused and own-weight prefill disagree at chunk {c}: max diff {(a - b).abs().max()}")
        for rep in range(args.repeats):
            for c in chunks:
                for arm in ("fused", "own") if rep % 2 == 0 else ("own", "fused"):
                    times[n][c][arm].append(prefill_ms_per_token(engine, ids, c, arm == "fused")[0])
    engine.model._prefill_fast = True

    med = {n: {c: {arm: statistics.median(v) for arm, v in by.items()} for c, by in per.items()}
           for n, per in times.items()}
    speed = {n: {c: m["own"] / m["fused"] for c, m in per.items()} for n, per in med.items()}
    print(f"{'threads':>7} {'chunk':>6} {'own ms/tok':>11} {'fused ms/tok':>13} {'own/fused':>10}")
    for n in threads:
        for c in chunks:
            print(f"{n:>7} {c:>6} {med[n][c]['own']:>11.3f} {med[n][c]['fused']:>13.3f} {speed[n][c]:>10.2f}")
    print(json_line({"model": args.model, "tokens": args.tokens, "repeats": args.repeats,
                     "ms_per_token": {n: {c: {k: round(v, 4) for k, v in m.items()} for c, m in per.items()}
                                      for n, per in med.items()},
                     "speedup": {n: {c: round(v, 3) for c, v in per.items()} for n, per in speed.items()}}))


if __name__ == "__main__":
    main()
