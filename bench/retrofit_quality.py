"""Long-context perplexity of a hybrid retrofit: dense vs hybrid before vs hybrid after fine-tuning.

    python bench/retrofit_quality.py --model runs/retrofit-smollm2/final
    python bench/retrofit_quality.py --base smollm2-135m-instruct --sink 128 --window 512 --global-every 1024

Held-out text (``--text``), cut into sequences of the longest length (8K by default); every shorter
length scores the same tokens in shorter blocks, so the columns differ only in context length and
attention:

* ``docstrings`` (default): the built-in corpus's held-out docstrings (files never trained on),
  joined with EOS and packed;
* ``topics``: long single documents, the pages of the Python language reference that ship with the
  interpreter (``pydoc_data.topics``; not docstrings, so never trained on). Each page is cut on its
  own, no sequence crosses two pages; pages shorter than the longest length are skipped.

* dense: the base model (``--base``), untouched;
* hybrid before: the base model retrofitted with the spec of ``--model`` (or ``--sink/--window/
  --global-every`` without one), no fine-tune;
* hybrid after: ``--model`` loaded with ``attention.load``.

Prints a table, then one JSON line (``gap`` = hybrid / dense - 1; the retrofit target is a gap
of at most ``--target`` at 4K).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.environment import json_line  # noqa: E402


def heldout_sequences(tokenizer, length: int, max_sequences: int | None, text: str = "docstrings") -> torch.Tensor:
    """``[n, length]`` tokens of the held-out text (module docstring)."""
    if text == "topics":
        from pydoc_data.topics import topics

        blocks = []
        for page in topics.values():
            ids = tokenizer(page)["input_ids"]
            n = len(ids) // length * length
            if n:
                blocks.append(torch.tensor(ids[:n]).view(-1, length))
        seqs = torch.cat(blocks) if blocks else torch.empty(0, length, dtype=torch.long)
    else:
        from distill.data import pack, stdlib_docs

        seqs = pack(stdlib_docs("eval"), tokenizer, length)
    return seqs[:max_sequences] if max_sequences else seqs


def perplexity(model, tokens: torch.Tensor, length: int) -> tuple[float, float]:
    """Perplexity over ``tokens`` ``[n, longest]`` cut into ``[*, length]`` blocks; returns (ppl, seconds)."""
    from eval.metrics import evaluate_lm

    blocks = tokens.reshape(-1, length)
    t0 = time.time()
    stats, _ = evaluate_lm(model, ({"input_ids": blocks[i:i + 1]} for i in range(blocks.shape[0])))
    return stats.perplexity, time.time() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="retrofitted HF dir (recipes/retrofit.py's final/); omit to skip 'after'")
    p.add_argument("--base", default="smollm2-135m-instruct", help="the dense model the retrofit started from")
    p.add_argument("--lengths", default="2048,4096,8192", help="comma-separated context lengths")
    p.add_argument("--text", choices=("docstrings", "topics"), default="docstrings",
                   help="held-out text: packed docstrings, or long single pages of the language reference")
    p.add_argument("--max-sequences", type=int, default=None, help="score at most N sequences of the longest length")
    p.add_argument("--sink", type=int, default=128, help="spec without --model: sink tokens")
    p.add_argument("--window", type=int, default=512, help="spec without --model: window")
    p.add_argument("--global-every", type=int, default=1024, help="spec without --model: global_every")
    p.add_argument("--target", type=float, default=0.03, help="acceptable perplexity gap at 4K")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--reuse", help="file whose last line is this bench's JSON from a run with the same base, spec "
                   "and tokens (and these lengths): take dense / hybrid-before from it and score only --model")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import attention
    from core.models import load_causal_lm, load_tokenizer

    lengths = sorted(int(x) for x in args.lengths.split(","))
    if args.model:
        spec_dict = json.loads((Path(args.model) / "config.json").read_text()).get(attention.CONFIG_KEY)
        if spec_dict is None:
            raise SystemExit(f"error: {args.model} has no {attention.CONFIG_KEY!r}; pass a retrofitted model dir")
        spec = attention.HybridAttentionConfig.from_dict(spec_dict)
    else:
        spec = attention.HybridAttentionConfig(sink_tokens=args.sink, window=args.window,
                                               global_every=args.global_every)
    prev = json.loads(Path(args.reuse).read_text().strip().splitlines()[-1]) if args.reuse else None
    # Reused numbers were scored on sequences of their longest length: pack the same ones.
    pack_len = max(lengths + ([int(n) for n in prev["perplexity"]] if prev else []))
    tokenizer = load_tokenizer(args.base)
    tokens = heldout_sequences(tokenizer, pack_len, args.max_sequences, args.text)
    if tokens.shape[0] == 0:
        raise SystemExit(f"error: the held-out text is shorter than {pack_len} tokens; lower --lengths")
    if any(pack_len % n for n in lengths):
        raise SystemExit("error: every length must divide the longest one (e.g. 2048,4096,8192)")

    rows: dict[int, dict[str, float]] = {n: {} for n in lengths}
    seconds: dict[str, float] = {}
    runs = [("dense", False), ("hybrid_before", True)]
    if prev is not None:
        if (prev["base"], prev["spec"], prev["tokens_per_length"], prev.get("text", "docstrings")) \
                != (args.base, spec.to_dict(), tokens.numel(), args.text) \
                or not set(map(str, lengths)) <= set(prev["perplexity"]):
            raise SystemExit(f"error: {args.reuse} was measured with another base, spec, lengths or tokens; "
                             "rerun without --reuse")
        for n in lengths:
            rows[n] = {k: prev["perplexity"][str(n)][k] for k in ("dense", "hybrid_before")}
        seconds = {k: v for k, v in prev["seconds"].items() if k != "hybrid_after"}
        runs = []
    base = load_causal_lm(args.base) if runs else None
    for name, hybrid in runs:
        model = base
        if hybrid:
            attention.retrofit(model, spec)
        seconds[name] = 0.0
        for n in lengths:
            rows[n][name], s = perplexity(model, tokens, n)
            seconds[name] += s
            print(f"  {name:<14} {n:>6}: {rows[n][name]:.3f} ({s:.0f}s)", file=sys.stderr, flush=True)
    del base
    if args.model:
        after = attention.load(args.model)
        seconds["hybrid_after"] = 0.0
        for n in lengths:
            rows[n]["hybrid_after"], s = perplexity(after, tokens, n)
            seconds["hybrid_after"] += s
            print(f"  {'hybrid_after':<14} {n:>6}: {rows[n]['hybrid_after']:.3f} ({s:.0f}s)", file=sys.stderr,
                  flush=True)

    for row in rows.values():
        for name in ("hybrid_before", "hybrid_after"):
            if name in row:
                row[f"gap_{name.split('_')[1]}"] = row[name] / row["dense"] - 1

    print(f"held-out perplexity ({args.text}), {tokens.numel():,} tokens per length ({tokens.shape[0]} x {pack_len}); "
          f"spec: sink {spec.sink_tokens}, window {spec.window}, global_every {spec.global_every}")
    print(f"{'length':>7} {'dense':>9} {'hybrid before':>14} {'gap':>7} {'hybrid after':>13} {'gap':>7}")
    for n, row in rows.items():
        after_cols = (f"{row['hybrid_after']:>13.3f} {row['gap_after']:>+7.1%}" if "hybrid_after" in row
                      else f"{'-':>13} {'-':>7}")
        print(f"{n:>7} {row['dense']:>9.3f} {row['hybrid_before']:>14.3f} {row['gap_before']:>+7.1%} {after_cols}")
    target_len = 4096 if 4096 in rows else lengths[-1]
    gap = rows[target_len].get("gap_after", rows[target_len]["gap_before"])
    result = {
        "bench": "retrofit_quality", "model": args.model, "base": args.base, "spec": spec.to_dict(),
        "text": args.text,
        "tokens_per_length": tokens.numel(), "perplexity": {str(n): r for n, r in rows.items()},
        "target": {"length": target_len, "max_gap": args.target, "gap": gap, "met": gap <= args.target,
                   "measured_on": "hybrid_after" if args.model else "hybrid_before"},
        "seconds": seconds, "threads": args.threads,
    }
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
