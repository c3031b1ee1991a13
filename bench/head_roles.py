"""Which per-KV-head roles keep pass-key retrieval: accuracy per arm (dense, streaming, head choices).

    python bench/head_roles.py                                  # demo model, 2K/4K/8K, 6 depths
    python bench/head_roles.py --arms dense,retrieval:0.5,mass:0.5 --lengths 8192 --depths 0.3,0.7

One model is loaded once (fp32, dense); head scores (``attention.heads``: retrieval hits and
attention mass, on needle samples built from the retrofit's training text, the recipe's defaults)
are computed once on the dense model; then every arm switches the same model in place and scores
the same pass-key prompts (``eval.longctx``: exact match of the greedy answer, every answer token;
``--scoring first_number``: the first number of the greedy continuation is the key).
Arms:

* ``dense``: the untouched model (the reference);
* ``stream``: the hybrid pattern on every head (no roles);
* ``retrieval:S`` / ``mass:S``: the top share ``S`` of (layer, KV head) pairs by that score full;
* ``gates:S``: the top share by DuoAttention-style gates learned on the frozen model
  (``attention.heads.learn_gates``, the retrofit's defaults unless ``--gate-*`` say otherwise;
  ``--gate-spec '{"window": 256}'`` trains them under another pattern, as the retrofit's ``gate_window``;
  ``--gate-context dense --gate-len 8192`` trains them on long samples with only the question and answer
  gated, as the retrofit's ``gate_context``);
* ``layers:S``: whole layers full (Gemma-style), the ``round(S * layers)`` layers whose KV heads
  score highest on average by retrieval hits (ties: attention mass).

Training-free: the arms are the model before the retrofit's LoRA stage. The pattern (sinks, window,
globals) is ``--spec`` (JSON keys of ``HybridAttentionConfig``; default: the retrofit default).
Accuracy is load-independent; the table shows accuracy per length per arm and the ratio to dense.
Last line: JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import attention  # noqa: E402
from attention.gates import CONTEXTS  # noqa: E402
from attention.heads import choose_roles, head_scores, learn_gates, spec_samples  # noqa: E402
from attention.spec import HybridAttentionConfig  # noqa: E402
from core.environment import json_line  # noqa: E402
from eval.longctx import build_sample, depths_for, score_sample  # noqa: E402


def layer_roles(spec: HybridAttentionConfig, scores: dict[str, torch.Tensor], share: float) -> HybridAttentionConfig:
    """``spec`` with the ``round(share * layers)`` best layers (mean retrieval score, then mass) full."""
    layers = scores["retrieval"].shape[0]
    key = scores["retrieval"].mean(-1) * 1e3 + scores["mass"].mean(-1)  # retrieval first, mass breaks ties
    top = sorted(torch.argsort(key, descending=True)[: round(share * layers)].tolist())
    return dataclasses.replace(spec, full_heads=None, full_layers=top or None,
                               head_scores={"method": "layers", "full_layer_share": share})


def arm_spec(arm: str, spec: HybridAttentionConfig, scores: dict[str, torch.Tensor]) -> HybridAttentionConfig | None:
    if arm == "dense":
        return None
    if arm == "stream":
        return spec.streaming()
    kind, _, share = arm.partition(":")
    if kind == "layers":
        return layer_roles(spec, scores, float(share))
    if kind == "gates":
        return choose_roles(spec, scores["gates"], float(share), method=kind, tiebreak=scores["gate_pressure"])
    if kind not in scores:
        raise SystemExit(f"error: unknown arm {arm!r}; use dense, stream, retrieval:S, mass:S, gates:S or layers:S")
    other = scores["mass" if kind == "retrieval" else "retrieval"]
    return choose_roles(spec, scores[kind], float(share), method=kind, tiebreak=other)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--arms", default="dense,stream,retrieval:0.25,retrieval:0.5,gates:0.25,gates:0.5")
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--depths", default="0.1,0.26,0.42,0.58,0.74,0.9", help="needle depths (fractions) or a count")
    p.add_argument("--trials", type=int, default=1, help="samples per length x depth (different keys)")
    p.add_argument("--spec", default="{}", help="JSON of HybridAttentionConfig keys (default: the retrofit default)")
    p.add_argument("--head-samples", type=int, default=12)
    p.add_argument("--head-len", type=int, default=1536)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scoring", default="exact", choices=("exact", "first_number"),
                   help="eval.longctx scoring: the greedy answer starts with the key, or its first number is the key")
    p.add_argument("--out", default=None, help="write every sample's result to this JSON file")
    p.add_argument("--scores", default=None, help="head scores file: read if it exists, else computed and written")
    p.add_argument("--gates", default=None, help="learned gates file: read if it exists, else trained and written")
    p.add_argument("--gate-samples", type=int, default=12)
    p.add_argument("--gate-len", type=int, default=1024)
    p.add_argument("--gate-steps", type=int, default=120)
    p.add_argument("--gate-lr", type=float, default=0.05)
    p.add_argument("--gate-l1", type=float, default=0.05)
    p.add_argument("--gate-context", default="gated", choices=CONTEXTS,
                   help="dense: only the question and answer run gated (long samples cost little)")
    p.add_argument("--gate-spec", default="{}", help="JSON of HybridAttentionConfig keys that differ while the gates "
                   "train (e.g. a smaller window, so more of each sample lies beyond it); the arms use --spec")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from core.models import load_causal_lm, load_tokenizer, resolve_model_path
    from distill.data import build_data

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, dense=True).eval()
    spec = HybridAttentionConfig.from_dict(json.loads(args.spec))
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    scores: dict[str, torch.Tensor] = {}
    data = None
    if args.scores and os.path.exists(args.scores):
        scores = {k: torch.tensor(v) for k, v in json.load(open(args.scores)).items()}
    elif any(a.split(":")[0] in ("retrieval", "mass", "layers") for a in arms):
        # Head scores as the retrofit computes them (recipes/retrofit.py choose_head_roles, its defaults).
        data = build_data(tok, dataset="builtin:stdlib-docs", seq_len=2048, eval_blocks=3, min_train_blocks=1)
        needles = spec_samples(tok, spec, data.train, count=args.head_samples, length=args.head_len, seed=args.seed)
        scores = head_scores(model, needles)
        if args.scores:
            with open(args.scores, "w") as fh:
                json.dump({k: v.tolist() for k, v in scores.items()}, fh)
    gate_info = {}
    if args.gates and os.path.exists(args.gates):
        gate_info = json.load(open(args.gates))
    elif any(a.startswith("gates:") for a in arms):
        data = data or build_data(tok, dataset="builtin:stdlib-docs", seq_len=2048, eval_blocks=3, min_train_blocks=1)
        t0 = time.perf_counter()
        gate_spec = dataclasses.replace(spec, **json.loads(args.gate_spec))
        result = learn_gates(model, tok, gate_spec, data.train, samples=args.gate_samples, length=args.gate_len,
                             seed=args.seed, steps=args.gate_steps, lr=args.gate_lr, l1=args.gate_l1,
                             context=args.gate_context)
        gate_info = {"gates": result.gates.tolist(), "pressure": result.pressure.tolist(),
                     "seconds": time.perf_counter() - t0, "final_mse": result.history[-1]["mse"],
                     "settings": {k: getattr(args, k) for k in ("gate_samples", "gate_len", "gate_steps",
                                                                "gate_lr", "gate_l1", "gate_spec", "gate_context")}}
        print(f"gates learned in {gate_info['seconds']:.0f}s (final relative MSE {gate_info['final_mse']:.5f})")
        if args.gates:
            with open(args.gates, "w") as fh:
                json.dump(gate_info, fh)
    if gate_info:
        scores.update(gates=torch.tensor(gate_info["gates"]), gate_pressure=torch.tensor(gate_info["pressure"]))
    specs = {a: arm_spec(a, spec, scores) for a in arms}
    lengths = [int(x) for x in args.lengths.split(",")]
    grid = depths_for(args.depths)
    rows = []
    for length in lengths:
        samples = [build_sample(tok, "passkey", length, d, random.Random(f"{args.seed}-passkey-{length}-{di}-{t}"), t)
                   for di, d in enumerate(grid) for t in range(args.trials)]
        for arm in arms:
            if specs[arm] is None:
                attention.revert(model)
            else:
                attention.retrofit(model, specs[arm])
            t0 = time.perf_counter()
            found = []
            for s in samples:
                ok, pred = score_sample(model, s, scoring=args.scoring, tokenizer=tok)
                found.append(ok)
                rows.append({"arm": arm, "length": length, "depth": s.depth, "trial": s.trial, "found": ok,
                             "pred": tok.convert_ids_to_tokens(json.loads(pred)), "key": s.key})
            print(f"{arm:<16} {length:>6}: {sum(found)}/{len(found)}  ({time.perf_counter() - t0:.0f}s) "
                  + "".join("x" if f else "." for f in found), flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump({"rows": rows, "specs": {a: s and s.to_dict() for a, s in specs.items()}}, fh)
    acc = {a: {n: sum(r["found"] for r in rows if r["arm"] == a and r["length"] == n) /
               max(1, sum(1 for r in rows if r["arm"] == a and r["length"] == n)) for n in lengths} for a in arms}
    print("\narm             " + "".join(f"{n:>8}" for n in lengths) + "   (accuracy; ratio to dense)")
    for a in arms:
        ratio = "".join(f"{acc[a][n] / acc['dense'][n]:>6.2f}" if acc.get("dense", {}).get(n) else "     -"
                        for n in lengths)
        print(f"{a:<16}" + "".join(f"{acc[a][n]:>8.0%}" for n in lengths) + "   " + ratio)
    print(json_line({"bench": "head_roles", "model": args.model, "scoring": args.scoring, "spec": spec.to_dict(),
                     "depths": grid,
                     "trials": args.trials, "accuracy": acc,
                     "gate_seconds": gate_info.get("seconds"), "gate_settings": gate_info.get("settings"),
                     "full_heads": {a: s and s.full_head_count(model.config.num_hidden_layers,
                                                                model.config.num_key_value_heads)
                                    for a, s in specs.items()}}))


if __name__ == "__main__":
    main()
