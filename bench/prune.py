"""How the student is cut: hand-picked layers vs importance pruning (depth, width, searched), same budget and steps.

    python bench/prune.py                      # the demo's setting: its search, 24 steps, 4 × 256 tokens per step
    python bench/prune.py --variants searched,ce_only,manual     # the issue's JSON numbers only (no depth/width)

Teacher: the built-in demo (SmolLM2-135M-Instruct), data: the built-in stdlib docstrings, the
held-out split the recipe uses. Budget: the non-embedding parameter count of today's demo student
(teacher layers ``0-3,24-29``). Every student is trained for ``--steps`` steps with the demo recipe's
terms and schedule (``recipes/distill.py`` defaults: KD T=1 + CE + 0.2 · nmse on derived spans, AdamW
1e-3, warmup 4, cosine to 0.1×, seed 0, same data order) through ``distill.prune.short_distill``, then scored
on the same held-out blocks. The search runs with the recipe's ``prune_*`` defaults, as the demo does,
except that its candidates are ranked on the ``--rank-blocks`` held-out blocks after the
``--eval-blocks`` scored ones: a choice made on the blocks that then score it would flatter the
searched students against the hand-picked one.

* **manual** — the hand-picked layers;
* **depth (BI)** — the best depth-only cut by block influence;
* **width** — the best cut on MLP / heads / hidden only (all layers kept);
* **searched** — the search's winner (all axes; ``--search-steps`` of short distillation for its
  ``--top-k`` finalists decide it). For equal steps its row re-prunes the winning architecture fresh
  from the scores, so it has seen exactly ``--steps`` steps like the others;
* **searched, CE-only** — the same init trained on CE alone for the same steps, lr and schedule
  (``kd_vs_ce``).

Students train in the order searched, CE-only, manual, depth, width; the table and the JSON line are
printed after each (``"complete": false`` until the last), so a run cut short still reports.

Also printed, init only: the issue's probes (20 BI layers + MLP 600; 30 layers + MLP 768).
``prune_search_s`` is the wall time of calibration + the full search. The machine this runs on may
be shared: times are upper bounds, ratios are measured side by side in one process.
Last line: JSON with ``params_student``, ``ppl_manual``, ``ppl_pruned``, ``ratio`` (pruned / manual
after the steps), ``kd_vs_ce`` (pruned KD+terms ppl / CE-only ppl; ≤ 0.9 meets the ≥10 % target).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.environment import json_line  # noqa: E402


def split_heldout(blocks: torch.Tensor, scored: int, ranking: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, seq]`` held-out blocks → (``[scored, seq]`` that score every student, ``[ranking, seq]`` after them).

    Disjoint: the search picks its winner on the second part, so the first still measures it held out.
    """
    if scored < 1 or ranking < 1:
        raise SystemExit("error: --eval-blocks and --rank-blocks must be at least 1")
    if blocks.shape[0] < scored + ranking:
        raise SystemExit(f"error: the held-out text has {blocks.shape[0]} blocks, fewer than --eval-blocks {scored} "
                         f"+ --rank-blocks {ranking}; lower one of them or --seq-len")
    return blocks[:scored], blocks[scored:scored + ranking]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=24, help="distill steps per student (the demo's max_steps)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per block")
    p.add_argument("--batch", type=int, default=4, help="blocks per step")
    p.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks scored (the recipe's eval_blocks)")
    # The search as the demo recipe runs it (prune_* defaults of DistillConfig), so the bench prices what the demo does.
    p.add_argument("--calib-blocks", type=int, default=8, help="calibration blocks (recipe: prune_calib_blocks)")
    p.add_argument("--rank-blocks", type=int, default=4, help="held-out blocks that rank search candidates "
                   "(recipe: prune_eval_blocks), the ones after the --eval-blocks scored ones")
    p.add_argument("--search-steps", type=int, default=4, help="short-distill steps per search finalist "
                   "(recipe: prune_search_steps)")
    p.add_argument("--top-k", type=int, default=2, help="search finalists short-distilled (recipe: prune_top_k)")
    p.add_argument("--finalists", type=int, default=12, help="candidates scored on all rank blocks")
    p.add_argument("--max-candidates", type=int, default=16, help="candidates ranked at init "
                   "(recipe: prune_max_candidates)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--arch", help="skip the search and use this winner, e.g. L30,h448,kv3,g3,mlp512 (short runs)")
    p.add_argument("--skip-probes", action="store_true", help="skip the init-only probes of the issue")
    p.add_argument("--variants", default="manual,depth,width,searched,ce_only",
                   help="students trained (a subset for short runs; skipped ones are null in the JSON)")
    args = p.parse_args()
    if args.eval_blocks < 1 or args.rank_blocks < 1:
        raise SystemExit("error: --eval-blocks and --rank-blocks must be at least 1")
    torch.set_num_threads(args.threads)

    import dataclasses

    from core.models import load_causal_lm, load_tokenizer
    from distill.config import DistillConfig
    from distill.data import BUILTIN, build_data
    from distill.prune import (
        AXES,
        Arch,
        HeldOut,
        SearchSettings,
        arch_of,
        count_params,
        family_of,
        importance,
        prune_to,
        search,
        short_distill,
    )
    from distill.student import derive_student

    recipe = DistillConfig()  # the demo's defaults: terms, lr, warmup, seed, keep_layers
    kd_terms = recipe.losses()
    ce_only = dataclasses.replace(kd_terms, kd_weight=0.0, ce_weight=1.0, focal_weight=0.0, hidden_weight=0.0,
                                  attn_weight=0.0)
    tok = load_tokenizer(recipe.teacher)  # the data first: too few held-out blocks is an error before any model loads
    data = build_data(tok, dataset=BUILTIN, seq_len=args.seq_len, eval_blocks=args.eval_blocks + args.rank_blocks)
    scored, ranking = split_heldout(data.eval, args.eval_blocks, args.rank_blocks)
    teacher = load_causal_lm(recipe.teacher).eval().requires_grad_(False)
    calib, train = data.train[: args.calib_blocks], data.train
    fam, base = family_of(teacher), arch_of(teacher)
    manual = derive_student(teacher, recipe.keep_layers)
    budget, emb = count_params(manual)
    print(f"teacher {base.label()}; budget = demo student ({recipe.keep_layers}): {budget:,} non-embedding "
          f"(+{emb:,} embedding) parameters", flush=True)

    held = HeldOut(teacher, scored, args.batch)
    rank = HeldOut(teacher, ranking, args.batch)
    teacher_ppl = held.stats(teacher).perplexity

    t0 = time.time()
    scores = importance(teacher, calib, args.batch)
    calib_s = time.time() - t0
    print(f"calibration: {calib.numel():,} tokens in {calib_s:.0f}s", flush=True)

    def settings(axes, steps, top_k):
        return SearchSettings(target_params=budget, axes=axes, top_k=top_k, finalists=args.finalists,
                              max_candidates=args.max_candidates, search_steps=steps, lr=recipe.lr,
                              batch_size=args.batch, seed=recipe.seed,
                              calibration={"dataset": BUILTIN, "blocks": int(calib.shape[0]), "seq_len": args.seq_len})

    quiet = lambda _msg: None  # noqa: E731
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    found_arch: dict[str, Arch] = {}

    def best_on(axes: tuple[str, ...]) -> Arch:  # ranked at init only; searched when its student is reached
        if axes not in found_arch:
            found_arch[axes] = search(teacher, calib, None, train, settings(axes, 0, 1), quiet, scores, rank).winner.arch
        return found_arch[axes]
    prune_search_s, n_candidates = None, None
    if args.arch:
        f = dict(part.split("=") for part in args.arch.replace("L", "layers=", 1).replace("h", "hidden=", 1)
                 .replace("kv", "kv_heads=", 1).replace("g", "group=", 1).replace("mlp", "intermediate=", 1)
                 .split(","))
        best = Arch(**{k: int(v) for k, v in f.items()})
        print(f"searched architecture given: {best.label()} (no search run)", flush=True)
    else:
        t0 = time.time()
        found = search(teacher, calib, None, train, settings(AXES, args.search_steps, args.top_k), quiet, scores,
                       rank)
        prune_search_s, n_candidates = calib_s + time.time() - t0, len(found.table)
        best = found.winner.arch
        print(f"search: {len(found.table)} candidates, winner {best.label()} in {prune_search_s:.0f}s "
              f"(calibration included)", flush=True)

    def train_eval(name, student, loss_cfg):
        init = held.stats(student)
        t = time.time()
        short_distill(student, teacher, train, args.steps, loss_config=loss_cfg, lr=recipe.lr, batch_size=args.batch,
                      warmup=recipe.warmup_steps, seed=recipe.seed, progress=name)
        final = held.stats(student)
        row = {"student": name, "arch": arch_of(student).label(), "params": count_params(student)[0],
               "ppl_init": init.perplexity, "ppl_final": final.perplexity, "kl_final": final.kl,
               "top1_final": final.top1_agreement, "train_s": time.time() - t}
        print(f"  {name}: ppl {row['ppl_init']:,.1f} → {row['ppl_final']:,.1f}", flush=True)
        return row

    pruned_best = prune_to(teacher, scores, best)
    # The numbers first (searched KD vs CE-only, then the hand-picked baseline), depth/width last:
    # the table and the JSON line are printed after every student, so a run cut short still reports.
    plan = [("searched", "searched", lambda: copy.deepcopy(pruned_best), kd_terms),
            ("ce_only", "searched, CE-only", lambda: copy.deepcopy(pruned_best), ce_only),
            ("manual", "manual", lambda: manual, kd_terms),
            ("depth", "depth (BI)", lambda: prune_to(teacher, scores, best_on(("depth",))), kd_terms),
            ("width", "width", lambda: prune_to(teacher, scores, best_on(("mlp", "heads", "hidden"))), kd_terms)]
    plan = [item for item in plan if item[0] in variants]
    rows: list[dict] = []
    for _key, name, make, terms in plan:
        rows.append(train_eval(name, make(), terms))
        probes = []
        if len(rows) == len(plan) and not args.skip_probes:
            for a in (Arch(20, base.hidden, base.kv_heads, base.group, 600),
                      Arch(30, base.hidden, base.kv_heads, base.group, 768)):
                st = held.stats(prune_to(teacher, scores, a))
                probes.append({"arch": a.label(), "params": fam.counts(a)[0], "ppl_init": st.perplexity})
        report(args, rows, probes, teacher_ppl, int(scored.shape[0]), budget, emb, best, found_arch,
               prune_search_s, n_candidates, complete=len(rows) == len(plan), terms=recipe)


def report(args, rows, probes, teacher_ppl, eval_blocks, budget, emb, best, found_arch, prune_search_s,
           n_candidates, complete, terms) -> None:
    """The table so far, then one JSON line (``complete`` false until every student has trained)."""
    print(f"\nheld-out perplexity on {eval_blocks} blocks of {args.seq_len} tokens; teacher {teacher_ppl:.2f}; "
          f"{args.steps} steps of batch {args.batch}; terms kd {terms.kd_weight} ce {terms.ce_weight} "
          f"hidden {terms.hidden_weight}, lr {terms.lr:g} (CE-only: ce 1, same lr and schedule)")
    print(f"{'student':20} {'architecture':34} {'non-emb':>12} {'ppl init':>10} {'ppl final':>10} {'KL':>7} "
          f"{'top-1':>6} {'train s':>8}")
    for r in rows:
        print(f"{r['student']:20} {r['arch']:34} {r['params']:>12,} {r['ppl_init']:>10,.1f} {r['ppl_final']:>10,.1f} "
              f"{r['kl_final']:>7.3f} {r['top1_final']:>6.3f} {r['train_s']:>8.0f}")
    for pr in probes:
        print(f"{'probe (init only)':20} {pr['arch']:34} {pr['params']:>12,} {pr['ppl_init']:>10,.1f}")
    by = {r["student"]: r for r in rows}

    def get(name, key):
        return by[name][key] if name in by else None

    def ratio(a, b):
        return a / b if a is not None and b is not None else None
    depth, width = found_arch.get(("depth",)), found_arch.get(("mlp", "heads", "hidden"))
    out = {
        "complete": complete, "students_done": [r["student"] for r in rows],
        "params_student": budget, "params_embedding": emb, "teacher_ppl": teacher_ppl, "steps": args.steps,
        "seq_len": args.seq_len, "batch": args.batch, "eval_blocks": eval_blocks,
        "kd_weight": terms.kd_weight, "ce_weight": terms.ce_weight, "hidden_weight": terms.hidden_weight,
        "lr": terms.lr,
        "ppl_manual": get("manual", "ppl_final"), "ppl_pruned": get("searched", "ppl_final"),
        "ppl_depth": get("depth (BI)", "ppl_final"), "ppl_width": get("width", "ppl_final"),
        "ppl_manual_init": get("manual", "ppl_init"), "ppl_pruned_init": get("searched", "ppl_init"),
        "ppl_depth_init": get("depth (BI)", "ppl_init"), "ppl_width_init": get("width", "ppl_init"),
        "ppl_pruned_ce_only": get("searched, CE-only", "ppl_final"),
        "ratio": ratio(get("searched", "ppl_final"), get("manual", "ppl_final")),
        "kd_vs_ce": ratio(get("searched", "ppl_final"), get("searched, CE-only", "ppl_final")),
        "arch_pruned": best.label(), "arch_depth": depth and depth.label(), "arch_width": width and width.label(),
        "prune_search_s": prune_search_s, "search_steps": args.search_steps, "top_k": args.top_k,
        "candidates": n_candidates, "threads": args.threads, "probes": probes,
    }
    print(json_line(out), flush=True)


if __name__ == "__main__":
    main()
