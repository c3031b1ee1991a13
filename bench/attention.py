"""Hybrid attention speed: the attention op alone, then whole-model prefill of SmolLM2-135M.

    python bench/attention.py                 # full run (minutes)
    python bench/attention.py --quick         # 2K / 4K op only, no model

    python bench/attention.py --sizes '' --prefill 8192 --repeats 5   # whole-model prefill at 8K only

Op: fp32, batch 1, 9 query heads / 3 KV heads, head dim 64 (SmolLM2-135M's attention), spec
sink 128 / window 512 / global every 1024. Rows: causal SDPA (``is_causal=True``), masked SDPA
with the boolean hybrid mask (skipped where the [n, n] mask is too big), the block-sparse
kernel, and the same call with per-head roles (1 of 3 KV heads full); forward and forward+backward.
Op timings are the best of interleaved repeats, so load from other processes hits every variant
alike. Then whole-model prefill (last-token logits only, as a server does) dense vs hybrid vs mixed
at 4K and 8K, the median of interleaved repeats (the best beside it). Mixed runs the default retrofit's
pattern (recipes/configs/retrofit_smollm2.yaml: its window or ``window_policy``) with its
``full_head_share`` (or ``--full-share``) of (layer, KV head) pairs full, spread evenly over the layers,
or the whole spec a retrofitted model saved (``--roles DIR``; bench/patterns.py). Prints a table, then
one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention  # noqa: E402
from attention import HybridAttentionConfig, hybrid_attention  # noqa: E402
from attention import kernel as kernel_mod  # noqa: E402
from attention.masks import hybrid_mask  # noqa: E402
from bench.patterns import mixed_spec  # noqa: E402
from core.environment import json_line  # noqa: E402

SPEC = HybridAttentionConfig(sink_tokens=128, window=512, global_every=1024)
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# Per-head roles (issue 14): the op row "mixed" keeps 1 of the 3 KV heads full in its layer; the model
# row keeps the retrofit default's share of all (layer, KV head) pairs full, spread evenly over the layers (which heads
# does not change the cost, only how many).
OP_MIXED = HybridAttentionConfig(sink_tokens=128, window=512, global_every=1024, full_heads={0: [1]})


def median_of(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """``(median, best)`` wall time per function, round-robin ``repeats`` times (warm up before)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def best_of(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time per function, running them round-robin ``repeats`` times after one warm-up."""
    for f in fns.values():
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def op_bench(n: int, repeats: int, masked_max: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, n, HEAD_DIM, generator=g)
    k = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=g)
    v = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=g)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    mask = hybrid_mask(n, SPEC) if n <= masked_max else None

    def causal(x, y, z):
        return F.scaled_dot_product_attention(x, y, z, is_causal=True, enable_gqa=True)

    def masked(x, y, z):
        return F.scaled_dot_product_attention(x, y, z, attn_mask=mask, enable_gqa=True)

    def kernel(x, y, z):
        return hybrid_attention(x, y, z, SPEC, backend="blocksparse")

    def mixed(x, y, z):
        return hybrid_attention(x, y, z, OP_MIXED, backend="blocksparse", layer=0)

    variants = {"causal_sdpa": causal, "kernel": kernel, "mixed": mixed}
    if mask is not None:
        variants["masked_sdpa"] = masked
    fns: dict[str, Callable[[], object]] = {}
    for name, f in variants.items():
        fns[f"{name}/fwd"] = lambda f=f: _no_grad(f, q, k, v)
        fns[f"{name}/fwd+bwd"] = lambda f=f: _fwd_bwd(f, qg, kg, vg)
    return best_of(fns, repeats)


def _no_grad(f, q, k, v):
    with torch.no_grad():
        return f(q, k, v)


def _fwd_bwd(f, q, k, v):
    q.grad = k.grad = v.grad = None
    f(q, k, v).sum().backward()


def prefill_bench(lengths: list[int], repeats: int, mixed_sp: HybridAttentionConfig
                  ) -> dict[int, dict[str, tuple[float, float]]]:
    from transformers import AutoModelForCausalLM

    from core.models import smollm2_dir

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    dense = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    mixed = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32).eval()
    attention.retrofit(model, SPEC)
    attention.retrofit(mixed, mixed_sp)
    out = {}
    warm = torch.randint(100, 40000, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # a short warm-up of each model (a full-length one would double the cost at 8K)
        for m in (dense, model, mixed):
            m(warm, use_cache=False, logits_to_keep=1)
    for n in lengths:
        ids = torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(n))

        def run(m, ids=ids):
            with torch.no_grad():
                return m(ids, use_cache=False, logits_to_keep=1).logits

        out[n] = median_of({"dense": lambda: run(dense), "hybrid": lambda: run(model), "mixed": lambda: run(mixed)},
                           repeats)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2048,4096,8192,16384", help="comma-separated op sequence lengths")
    p.add_argument("--prefill", default="4096,8192", help="comma-separated prefill lengths ('' to skip)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per measurement (best kept)")
    p.add_argument("--masked-max", type=int, default=8192, help="largest n for masked SDPA ([n, n] mask)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--block", type=int, help="kernel query block size, both paths (default: the kernel's)")
    p.add_argument("--quick", action="store_true", help="2K and 4K op only, no model")
    p.add_argument("--full-share", type=float, default=None, help="mixed prefill: share of (layer, KV head) pairs "
                   "full (default: the retrofit config's full_head_share)")
    p.add_argument("--roles", default=None, help="mixed prefill: take the full heads from this model's config")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.block:
        kernel_mod.DEFAULT_BLOCK = kernel_mod.INFERENCE_BLOCK = a.block
    sizes = [2048, 4096] if a.quick else [int(s) for s in a.sizes.split(",") if s]
    prefill = [] if a.quick else [int(s) for s in a.prefill.split(",") if s]

    print(f"hybrid attention: sink {SPEC.sink_tokens} / window {SPEC.window} / global every {SPEC.global_every}; "
          f"fp32, batch 1, {HEADS} q heads / {KV_HEADS} kv heads, head dim {HEAD_DIM}, {a.threads} threads")
    print(f"{'n':>6} {'pass':>8} {'causal SDPA':>12} {'masked SDPA':>12} {'kernel':>10} {'vs causal':>10} "
          f"{'mixed 1/3':>10} {'vs causal':>10}")
    ops = {}
    for n in sizes:
        r = op_bench(n, a.repeats, a.masked_max)
        ops[n] = r
        for pas in ("fwd", "fwd+bwd"):
            c, m, kt = r[f"causal_sdpa/{pas}"], r.get(f"masked_sdpa/{pas}"), r[f"kernel/{pas}"]
            mx = r[f"mixed/{pas}"]
            ms = f"{m * 1e3:10.1f}ms" if m is not None else f"{'skipped':>12}"
            print(f"{n:>6} {pas:>8} {c * 1e3:10.1f}ms {ms} {kt * 1e3:8.1f}ms {c / kt:9.2f}x {mx * 1e3:8.1f}ms "
                  f"{c / mx:9.2f}x", flush=True)

    mixed_sp = mixed_spec(30, KV_HEADS, a.full_share, a.roles)  # SmolLM2-135M: 30 layers
    full = mixed_sp.full_head_count(30, KV_HEADS)
    pre_t = prefill_bench(prefill, max(2, a.repeats - 1), mixed_sp) if prefill else {}
    pre = {n: {k: v[0] for k, v in r.items()} for n, r in pre_t.items()}  # medians
    if pre:
        print(f"\nSmolLM2-135M prefill (last-token logits), fp32 batch 1, median (best) of {max(2, a.repeats - 1)} "
              f"interleaved; mixed = {full} of 90 KV heads full{' (' + a.roles + ')' if a.roles else ''}\n"
              f"{'n':>6} {'dense':>16} {'hybrid':>16} {'speedup':>8} {'mixed':>16} {'speedup':>8}")
        for n, r in pre_t.items():
            cell = {k: f"{v[0]:7.2f}s ({v[1]:5.2f})" for k, v in r.items()}
            print(f"{n:>6} {cell['dense']:>16} {cell['hybrid']:>16} {r['dense'][0] / r['hybrid'][0]:7.2f}x "
                  f"{cell['mixed']:>16} {r['dense'][0] / r['mixed'][0]:7.2f}x", flush=True)

    def speedup(n, pas="fwd"):
        return round(ops[n][f"causal_sdpa/{pas}"] / ops[n][f"kernel/{pas}"], 3) if n in ops else None

    kernel_fwd = {n: ops[n]["kernel/fwd"] for n in ops}
    ns = sorted(kernel_fwd)
    summary = {
        "speedup_4k": speedup(4096),
        "speedup_16k": speedup(16384),
        "prefill_speedup_8k": round(pre[8192]["dense"] / pre[8192]["hybrid"], 3) if 8192 in pre else None,
        "prefill_speedup_4k": round(pre[4096]["dense"] / pre[4096]["hybrid"], 3) if 4096 in pre else None,
        "mixed_prefill_speedup": {str(n): round(r["dense"] / r["mixed"], 3) for n, r in pre.items()},
        "mixed_fwd_speedup": {str(n): round(ops[n]["causal_sdpa/fwd"] / ops[n]["mixed/fwd"], 3) for n in ops},
        "mixed_fwd_bwd_speedup": {str(n): round(ops[n]["causal_sdpa/fwd+bwd"] / ops[n]["mixed/fwd+bwd"], 3)
                                  for n in ops},
        "fwd_bwd_speedup": {str(n): speedup(n, "fwd+bwd") for n in ns},
        "kernel_fwd_ms": {str(n): round(kernel_fwd[n] * 1e3, 2) for n in ns},
        "causal_fwd_ms": {str(n): round(ops[n]["causal_sdpa/fwd"] * 1e3, 2) for n in ns},
        # Cost per token relative to the smallest size: ~1.0 everywhere means linear in n.
        "kernel_per_token_growth": round((kernel_fwd[ns[-1]] / ns[-1]) / (kernel_fwd[ns[0]] / ns[0]), 3) if ns else None,
        "mixed_full_heads": full,
        "prefill_s_median": {str(n): {k: round(v, 3) for k, v in r.items()} for n, r in pre.items()},
        "threads": a.threads,
        "targets": {"speedup_4k": 2.5, "speedup_16k": 6.0, "prefill_speedup_8k": 1.6, "mixed_prefill_speedup_8k": 1.0},
    }
    print(json_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
