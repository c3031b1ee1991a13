"""BERTScore throughput with the offline MiniLM scorer: 100 pairs of ~30 words, load included.

    python bench/bertscore.py [--pairs 100] [--words 30] [--threads 2]

Pairs are built from the bundled prompt texts: the candidate is a 30-word window, the reference
the same window with every fifth word dropped and a neighbouring window's words appended, so pairs
are related but never identical (identical pairs would short-circuit to 1.0). Prints a table, then
one JSON line. ``functional_s`` times ``bert_score.score`` (which reloads the model per call) on
the same pairs for comparison with the resident scorer the gate uses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/bertscore.py`

from core.environment import json_line  # noqa: E402


def make_pairs(n: int, words: int) -> tuple[list[str], list[str]]:
    from eval.prompt_set import default_prompts_path, load_prompts

    stream = " ".join(p.prompt for p in load_prompts(default_prompts_path())).split()
    cands, refs = [], []
    for i in range(n):
        start = (i * 37) % (len(stream) - 2 * words)
        window = stream[start:start + words]
        cands.append(" ".join(window))
        ref = [w for k, w in enumerate(window) if k % 5 != 4] + stream[start + words:start + words + words // 5]
        refs.append(" ".join(ref))
    return cands, refs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--words", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-functional", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    c0 = time.process_time()  # CPU seconds: comparable across runs on a shared, busy machine
    import torch

    torch.set_num_threads(args.threads)
    from eval.bertscore import BertScore, scorer_model_dir

    t_import = time.perf_counter() - t0
    cands, refs = make_pairs(args.pairs, args.words)
    t1 = time.perf_counter()
    scorer = BertScore(device="cpu")
    t_load = time.perf_counter() - t1
    t2 = time.perf_counter()
    f1 = scorer.f1(cands, refs)
    t_score = time.perf_counter() - t2
    cpu_with_load = time.process_time() - c0
    t3 = time.perf_counter()
    scorer.f1(cands, refs)
    t_score_warm = time.perf_counter() - t3
    total = time.perf_counter() - t0

    functional = None
    if not args.skip_functional:
        from bert_score import score

        t4 = time.perf_counter()
        _, _, f_ref = score(cands, refs, model_type=str(scorer_model_dir()), num_layers=scorer.layer,
                            use_fast_tokenizer=True, device="cpu")
        functional = time.perf_counter() - t4
        assert abs(f_ref.numpy() - f1).max() < 1e-4

    rows = [("import torch+bert_score+transformers", t_import), ("load scorer (MiniLM-L6)", t_load),
            (f"score {args.pairs} pairs (first)", t_score), (f"score {args.pairs} pairs (again)", t_score_warm),
            ("total incl. load (first score)", t_import + t_load + t_score)]
    if functional is not None:
        rows.append(("bert_score.score() same pairs (reloads model)", functional))
    print(f"{'stage':48s} {'seconds':>8s}")
    for name, sec in rows:
        print(f"{name:48s} {sec:8.2f}")
    print(f"process CPU seconds incl. import+load+first score: {cpu_with_load:.2f}")
    print(f"mean F1 {f1.mean():.4f}, pairs/s (warm) {args.pairs / t_score_warm:.0f}, threads {args.threads}")
    print(json_line({"bench": "bertscore", "pairs": args.pairs, "words": args.words, "threads": args.threads,
                     "import_s": round(t_import, 3), "load_s": round(t_load, 3), "score_s": round(t_score, 3),
                     "score_warm_s": round(t_score_warm, 3), "total_with_load_s": round(t_import + t_load + t_score, 3),
                     "wall_s": round(total, 3), "cpu_with_load_s": round(cpu_with_load, 3), "functional_s": None if functional is None else round(functional, 3),
                     "mean_f1": round(float(f1.mean()), 4), "layer": scorer.layer,
                     "settings_hash": scorer.settings_hash()}))


if __name__ == "__main__":
    main()
