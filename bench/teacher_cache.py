"""Teacher caches: bytes per token and KD-gradient error against full logits, top-k vs sampled.

    python bench/teacher_cache.py [--blocks 4 --seq 256 --topk 16 64 --temperature 1.0 --seeds 3]

The demo pair (SmolLM2-135M-Instruct teacher, the recipe's derived 10-layer student) on packed
training blocks of the built-in data. For each top-k size ``k`` the sampled cache gets the most
samples that fit in no more bytes per token (top-k: 6 bytes a slot, int32 id + fp16 log-prob;
sampled: 7, one more uint8 count). Both targets go through the functions the recipe uses
(:func:`distill.teacher_cache.topk_kd_loss`, :func:`distill.losses.sampled_kd_loss`) on the
fp16-rounded values a cache stores, and are compared with full-logit forward KD
(:func:`distill.losses.kd_loss`) at the same temperature:

* ``param grad err``: ``||g - g_full|| / ||g_full||`` of the gradient w.r.t. every student
  parameter over the whole batch (what the optimizer sees);
* ``logit grad err``: the same over the per-position gradients w.r.t. the student logits (one
  draw's noise at each position, before it averages out across positions).

Sampled numbers are the mean over ``--seeds`` independent draws. JSON last line (the ``--topk``
size closest to 64): ``bytes_per_token`` {topk, sampled}, ``grad_err_topk``, ``grad_err_sampled``,
``ratio`` and ``target_met`` (sampled at no more bytes than top-k 64 has ≤ 1/3 of its error).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.environment import json_line  # noqa: E402


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(y.double().pow(2).sum()) for y in b)
    return (num / den) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4, help="packed blocks in the batch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per block")
    ap.add_argument("--topk", type=int, nargs="+", default=[16, 64], help="top-k sizes to compare")
    ap.add_argument("--temperature", type=float, default=1.0, help="KD temperature")
    ap.add_argument("--seeds", type=int, default=3, help="independent sampled draws averaged")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from core.models import load_causal_lm, load_tokenizer, smollm2_dir
    from distill.data import BUILTIN, build_data
    from distill.losses import kd_loss, sampled_kd_loss
    from distill.student import derive_student
    from distill.teacher_cache import (
        bytes_per_token,
        sample_teacher,
        slots_for_bytes,
        tail_mass,
        topk_kd_loss,
        topk_logprobs,
    )

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    path = str(smollm2_dir())
    teacher = load_causal_lm(path).eval().requires_grad_(False)
    tokenizer = load_tokenizer(path)
    student = derive_student(teacher, "0-3,24-29").train()
    data = build_data(tokenizer, dataset=BUILTIN, seq_len=args.seq, eval_blocks=1)
    ids = data.train[: args.blocks]
    temp = args.temperature
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits[:, :-1].float()
    params = [p for p in student.parameters() if p.requires_grad]
    s_logits = student(input_ids=ids).logits[:, :-1]

    def grads(loss: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        *g, g_logits = torch.autograd.grad(loss, [*params, s_logits], retain_graph=True)
        return g, g_logits

    full_p, full_l = grads(kd_loss(s_logits, t_logits, kind="forward_kl", temperature=temp))
    rows = []
    for k in args.topk:
        idx, lp = topk_logprobs(t_logits, k)
        lp16 = lp.half().float()  # what the cache stores
        g_p, g_l = grads(topk_kd_loss(s_logits, idx.long(), lp16, temperature=temp))
        rows.append({"cache": f"top-{k}", "bytes_per_token": bytes_per_token("topk", k),
                     "tail_mass": float(tail_mass(lp).mean()), "param_grad_err": _rel(g_p, full_p),
                     "logit_grad_err": _rel([g_l], [full_l])})
        n = slots_for_bytes("sampled", bytes_per_token("topk", k))
        errs_p, errs_l = [], []
        for seed in range(args.seeds):
            sid, counts, slp = sample_teacher(t_logits, n, temp, torch.Generator().manual_seed(seed))
            w = counts.float() / n
            g_p, g_l = grads(sampled_kd_loss(s_logits, sid.long(), w, temperature=temp,
                                             teacher_logprobs=slp.half().float()))
            errs_p.append(_rel(g_p, full_p))
            errs_l.append(_rel([g_l], [full_l]))
        rows.append({"cache": f"sampled-{n}", "bytes_per_token": bytes_per_token("sampled", n), "tail_mass": None,
                     "param_grad_err": sum(errs_p) / len(errs_p), "logit_grad_err": sum(errs_l) / len(errs_l)})

    tokens = ids.shape[0] * (ids.shape[1] - 1)
    print(f"demo pair, {tokens} positions, T={temp}, sampled errors mean of {args.seeds} draws "
          f"({time.time() - t0:.0f}s)")
    print(f"{'cache':<12} {'bytes/token':>11} {'tail mass':>9} {'param grad err':>14} {'logit grad err':>14}")
    for r in rows:
        tail = "" if r["tail_mass"] is None else f"{r['tail_mass']:.3f}"
        print(f"{r['cache']:<12} {r['bytes_per_token']:>11} {tail:>9} {r['param_grad_err']:>14.4f} "
              f"{r['logit_grad_err']:>14.4f}")
    k = min(args.topk, key=lambda x: abs(x - 64))
    i = args.topk.index(k)
    top, smp = rows[2 * i], rows[2 * i + 1]
    ratio = smp["param_grad_err"] / top["param_grad_err"]
    print(f"\n{smp['cache']} vs {top['cache']}: param-gradient error ratio {ratio:.3f} (target <= 0.333)")
    print(json_line({"bytes_per_token": {"topk": top["bytes_per_token"], "sampled": smp["bytes_per_token"]},
                     "k": k, "samples": int(smp["cache"].split("-")[1]), "temperature": temp,
                     "grad_err_topk": top["param_grad_err"], "grad_err_sampled": smp["param_grad_err"],
                     "logit_grad_err_topk": top["logit_grad_err"], "logit_grad_err_sampled": smp["logit_grad_err"],
                     "tail_mass_topk": top["tail_mass"], "ratio": ratio, "target_met": ratio <= 1 / 3}))


if __name__ == "__main__":
    main()
