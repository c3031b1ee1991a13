"""Long-context retrieval: does the model still find a needle (a pass key) hidden in filler text?

Command line::

    python -m eval.longctx --model DIR --lengths 1024,2048,4096,8192 --depths 10 --trials 2 \\
        [--kinds passkey,multikey] [--out runs/longctx] [--dense] [--retrofit default|JSON] \\
        [--scoring exact|first_number]

Each sample is built offline: an instruction, repeated filler sentences up to ``length`` tokens,
the needle at a relative ``depth`` (0 = right after the instruction, 1 = just before the question),
then the question, whose answer is the key. Kinds:

* ``passkey``: one needle, "The pass key is 71432. Remember it. 71432 is the pass key.";
* ``multikey``: four needles with different keys ("The pass key of the red door is ..."); the one
  asked for sits at ``depth``, the others at random depths.

Scoring is exact match of greedy decoding: the answer's tokens are appended to the prompt and the
sample counts as found iff every answer token is the model's argmax at its position. That is the
same as "greedy generation starts with the key" (one forward pass instead of a decode loop), given
the key's tokenization is the one the model would produce; digits are single tokens in the
tokenizers we ship, and ``key_tokens_canonical`` in the JSON says whether that held. ``--scoring
first_number`` instead decodes a few greedy tokens and checks that the first number in them is the
key (exact digits; "The pass key is the 71432" counts, a longer or different number does not).

A model whose config carries a hybrid attention spec loads hybrid (``attention.load``), otherwise
dense; ``--dense`` forces dense and ``--retrofit`` switches a dense model to a spec for a probe.
Outputs: ``<out>/longctx.json`` (every sample), ``<out>/longctx.png`` (accuracy per length × depth,
one panel per kind), a table, and a last line of JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import attention
from core.config import ConfigError, check_output_dir
from core.fsio import atomic_write_text
from core.models import (
    ModelSourceError,
    cache_kwargs,
    load_causal_lm,
    load_tokenizer,
    peek_config,
    resolve_device,
    resolve_model_path,
    returned_cache,
)

KINDS = ("passkey", "multikey")
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it at the end.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
DOORS = ("red", "blue", "green", "white", "black", "yellow", "orange", "purple")
MULTI_NEEDLES = 4
# Needle depths that test retrieval: at depth 0 a needle lies among a hybrid model's sink tokens and at depth 1
# inside its local window, where a model that attends to nothing else still finds it.
INTERIOR_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


class LongCtxError(ValueError):
    """Bad input to the long-context eval; one line naming the fix."""


@dataclass
class Sample:
    kind: str
    length: int  # requested
    depth: float
    trial: int
    ids: list[int]  # prompt + answer tokens
    answer_len: int
    key: str
    needle_pos: int  # token index where the asked-for needle starts
    canonical: bool  # the question + answer tokenized together gives the same answer tokens


def _enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def build_sample(tok, kind: str, length: int, depth: float, rng: random.Random, trial: int = 0) -> Sample:
    """One retrieval prompt of at most ``length`` tokens (answer included), needle at ``depth`` in [0, 1].

    Filler is whole sentences, so the prompt is within one sentence of ``length`` and never longer.
    """
    if kind not in KINDS:
        raise LongCtxError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    if kind == "passkey":
        key = str(rng.randint(10000, 99999))
        needles = [(f" The pass key is {key}. Remember it. {key} is the pass key.", depth)]
        question = " What is the pass key? The pass key is"
    else:
        doors = rng.sample(DOORS, MULTI_NEEDLES)
        keys = [str(rng.randint(10000, 99999)) for _ in doors]
        key, door = keys[0], doors[0]
        needles = [(f" The pass key of the {d} door is {k}. Remember it.", depth if i == 0 else rng.random())
                   for i, (d, k) in enumerate(zip(doors, keys))]
        question = f" What is the pass key of the {door} door? The pass key of the {door} door is"
    head = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + _enc(tok, INTRO)
    q_ids, a_ids = _enc(tok, question), _enc(tok, " " + key)
    needle_ids = [_enc(tok, text) for text, _ in needles]
    filler = [_enc(tok, " " + s) for s in FILLER]
    budget = length - len(head) - len(q_ids) - len(a_ids) - sum(map(len, needle_ids))
    if budget < 0:
        raise LongCtxError(f"length {length} is too short for a {kind} prompt; use lengths >= "
                           f"{length - budget + 16}")
    sentences: list[list[int]] = []
    used, i = 0, rng.randrange(len(filler))
    while used + len(filler[i % len(filler)]) <= budget:
        sentences.append(filler[i % len(filler)])
        used += len(sentences[-1])
        i += 1
    # Needles go between filler sentences at the sentence nearest their depth (ties: asked-for first).
    cuts = [round(d * len(sentences)) for _, d in needles]
    ids, needle_pos = list(head), -1
    for s in range(len(sentences) + 1):
        for n, c in enumerate(cuts):
            if c == s:
                if n == 0:
                    needle_pos = len(ids)
                ids += needle_ids[n]
        if s < len(sentences):
            ids += sentences[s]
    ids += q_ids + a_ids
    canonical = _enc(tok, question + " " + key) == q_ids + a_ids
    return Sample(kind, length, depth, trial, ids, len(a_ids), key, needle_pos, canonical)


SCORINGS = ("exact", "first_number")


@torch.inference_mode()
def score_sample(model, sample: Sample, device: str = "cpu", scoring: str = "exact", tokenizer=None
                 ) -> tuple[bool, str]:
    """``(found, predicted)`` for one sample.

    ``exact``: greedy decoding starts with the key's tokens (teacher-forced argmax check, one forward
    pass). ``first_number``: the first number in the greedy continuation (``answer_len + 3`` tokens,
    decoded with the model's KV cache) is the key — "The pass key is the 71432" counts, "714329" or a
    wrong number does not (the passkey scoring of LongLoRA / Landmark Attention); needs ``tokenizer``.
    """
    n = sample.answer_len
    if scoring == "exact":
        ids = torch.tensor([sample.ids[:-1]], device=device)
        logits = model(input_ids=ids, logits_to_keep=n, use_cache=False).logits[0, -n:]
        pred = logits.argmax(-1).tolist()
        return pred == sample.ids[-n:], json.dumps(pred)
    if scoring != "first_number" or tokenizer is None:
        raise LongCtxError(f"scoring {scoring!r} needs one of {', '.join(SCORINGS)} (first_number: a tokenizer)")
    pred = greedy_continuation(model, sample.ids[:-n], n + 3, device)
    number = re.search(r"\d+", tokenizer.decode(pred))
    return number is not None and number.group() == sample.key, json.dumps(pred)


def greedy_continuation(model, prompt: list[int], new: int, device: str = "cpu") -> list[int]:
    """``new`` greedy tokens after ``prompt`` (prefill once, then one token at a time through the cache)."""
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
    tokens = [int(out.logits[0, -1].argmax())]
    name = next(iter(cache_kwargs(model, None)))  # the keyword's name, read off the forward's signature once
    while len(tokens) < new:
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), use_cache=True,
                    **{name: returned_cache(out)})
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def check_prompt_fits(tok, lengths: list[int], kind: str = "passkey") -> None:
    """:class:`LongCtxError` when a ``kind`` prompt does not fit in one of ``lengths`` (its own size depends on
    the tokenizer): callers check before the work that comes ahead of the probe."""
    for n in lengths:
        build_sample(tok, kind, n, 0.5, random.Random(0))


def depths_for(depths: int | str | list[float]) -> list[float]:
    """Needle depths: a count (evenly spaced from 0 to 1; one depth: the middle) or explicit fractions.

    ``"0.25,0.5"`` (any text with a comma or a point) lists the depths themselves.
    """
    if isinstance(depths, str) and ("," in depths or "." in depths):
        try:
            depths = [float(x) for x in depths.split(",") if x.strip()]
        except ValueError:
            raise LongCtxError(f"--depths needs a count or fractions like 0.25,0.5; got {depths!r}") from None
    if isinstance(depths, list):
        if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
            raise LongCtxError(f"depths must be fractions in [0, 1], got {depths}")
        return depths
    try:
        count = int(depths)
    except ValueError:
        raise LongCtxError(f"--depths needs a count or fractions like 0.25,0.5; got {depths!r}") from None
    if count < 1:
        raise LongCtxError(f"--depths must be >= 1, got {count}")
    return [0.5] if count == 1 else [i / (count - 1) for i in range(count)]


def run_longctx(model, tok, *, lengths: list[int], depths: int | str | list[float], trials: int,
                kinds: list[str] | tuple[str, ...], seed: int = 0, device: str = "cpu", progress: bool = True,
                scoring: str = "exact") -> dict[str, Any]:
    """Accuracy per kind × length × depth over ``trials`` samples per cell (seeded, same prompts every run)."""
    from tqdm.auto import tqdm

    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max(lengths) > limit:
        raise LongCtxError(f"length {max(lengths)} exceeds the model's max_position_embeddings={limit}; "
                           "drop it from --lengths")
    if trials < 1:
        raise LongCtxError(f"--trials must be >= 1, got {trials}")
    if scoring not in SCORINGS:
        raise LongCtxError(f"unknown scoring {scoring!r}; use one of {', '.join(SCORINGS)}")
    grid = depths_for(depths)
    samples = []
    for kind in kinds:
        for length in lengths:
            for di, depth in enumerate(grid):
                for t in range(trials):
                    rng = random.Random(f"{seed}-{kind}-{length}-{di}-{t}")
                    samples.append(build_sample(tok, kind, length, depth, rng, t))
    canonical = all(s.canonical for s in samples)
    rows = []
    bar = tqdm(samples, desc="longctx", disable=not progress, dynamic_ncols=True)
    found_so_far = 0
    t0 = time.perf_counter()
    for i, s in enumerate(bar):
        ok, pred = score_sample(model, s, device, scoring, tok)
        found_so_far += ok
        rows.append({"kind": s.kind, "length": s.length, "tokens": len(s.ids), "depth": s.depth, "trial": s.trial,
                     "key": s.key, "found": ok, "pred_tokens": pred, "needle_pos": s.needle_pos})
        bar.set_postfix(acc=f"{found_so_far / (i + 1):.2f}", len=s.length)
    acc: dict[str, dict[str, float]] = {}
    cells: dict[str, dict[str, dict[str, float]]] = {}
    for kind in kinds:
        acc[kind], cells[kind] = {}, {}
        for length in lengths:
            sel = [r for r in rows if r["kind"] == kind and r["length"] == length]
            acc[kind][str(length)] = sum(r["found"] for r in sel) / len(sel)
            # The share of the cell's own samples: a length or depth given twice puts more than ``trials`` there.
            cells[kind][str(length)] = {f"{d:.3f}": _share([r["found"] for r in sel if r["depth"] == d])
                                        for d in grid}
    return {"accuracy": acc, "cells": cells, "depths": grid, "lengths": lengths, "trials": trials,
            "kinds": list(kinds), "seed": seed, "key_tokens_canonical": canonical, "scoring": scoring,
            "seconds": time.perf_counter() - t0, "samples": rows}


def _share(found: list[bool]) -> float:
    return sum(found) / len(found) if found else float("nan")


def plot_heatmap(result: dict[str, Any], path: Path, title: str) -> None:
    """Accuracy as a depth × length heatmap, one panel per kind, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds, lengths, depths = result["kinds"], result["lengths"], result["depths"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(1.6 + 1.3 * len(lengths) * len(kinds), 1.2 + 0.35 * len(depths)),
                             squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        grid = [[result["cells"][kind][str(n)][f"{d:.3f}"] for n in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        ax.set_title(f"{kind}: " + ", ".join(f"{result['accuracy'][kind][str(n)]:.0%}" for n in lengths), fontsize=9)
        for y, row in enumerate(grid):
            for x, v in enumerate(row):
                ax.text(x, y, f"{v:.0%}" if not math.isnan(v) else "", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="exact match")
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def load_for_eval(model: str, *, dense: bool = False, retrofit: str | None = None):
    """``(model, tokenizer, attention_name)``: as served (hybrid when the config carries a spec) unless
    ``dense`` or ``retrofit`` (``default`` or a JSON spec) says otherwise."""
    try:
        path = resolve_model_path(model)
        tok = load_tokenizer(path)
        lm = load_causal_lm(path, dense=dense or retrofit is not None).eval()
    except (ModelSourceError, OSError) as err:
        raise LongCtxError(str(err).splitlines()[0]) from None
    if attention.is_hybrid(lm):
        return lm, tok, "hybrid"
    if getattr(lm.config, attention.CONFIG_KEY, None) is not None:
        # --dense or --retrofit: the stored spec does not apply; the model it was retrofitted from does (with the
        # sliding window a Mistral's retrofit set aside)
        attention.revert(lm)
    if retrofit is None:
        return lm, tok, "dense"
    attention.retrofit(lm, retrofit_spec(retrofit))
    return lm, tok, "hybrid"


def retrofit_spec(retrofit: str) -> attention.HybridAttentionConfig:
    """The ``--retrofit`` spec: ``default`` or a JSON object of hybrid attention keys (one :class:`LongCtxError`
    line otherwise)."""
    if retrofit == "default":
        return attention.HybridAttentionConfig()
    try:
        raw = json.loads(retrofit)
        if not isinstance(raw, dict):
            raise TypeError(f"got {type(raw).__name__}")
        return attention.HybridAttentionConfig.from_dict(raw)
    except (json.JSONDecodeError, TypeError, attention.HybridAttentionError) as err:
        raise LongCtxError(f"--retrofit needs 'default' or a JSON object of hybrid attention keys "
                           f"({str(err).splitlines()[0]})") from None


def check_model_config(model: str, lengths: list[int], spec: attention.HybridAttentionConfig | None, *,
                       dense: bool = False) -> None:
    """The lengths and the spec the model will run (``--retrofit``'s, else unless ``dense`` the one its config
    carries) against the model's ``config.json``, read without its weights; a model whose config cannot be read
    so is checked once it loads (:func:`run_longctx`)."""
    config = peek_config(model)
    if config is None:
        return
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max(lengths) > limit:
        raise LongCtxError(f"length {max(lengths)} exceeds the model's max_position_embeddings={limit}; "
                           "drop it from --lengths")
    where, stored = "--retrofit", getattr(config, attention.CONFIG_KEY, None)
    try:
        if spec is None and not dense and stored is not None:  # the model loads hybrid: its spec must run
            where = f"{model}/config.json (or pass --dense)"
            if not isinstance(stored, dict):
                raise attention.HybridAttentionError(f"{attention.CONFIG_KEY!r} must be an object of hybrid attention "
                                                     f"keys, got {stored!r}")
            spec = attention.HybridAttentionConfig.from_dict(stored)
        if spec is not None:
            spec.check_model(config.num_hidden_layers,
                             getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    except attention.HybridAttentionError as err:
        raise LongCtxError(f"{where}: {str(err).splitlines()[0]}") from None


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LongCtxError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise LongCtxError(f"expected positive integers, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.longctx", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (hybrid if its config carries a spec) "
                   "or 'smollm2-135m-instruct'")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="comma-separated prompt lengths in tokens")
    p.add_argument("--depths", default="10", help="number of needle depths from 0%% to 100%%, or the depths "
                   "themselves as fractions (0.25,0.5,0.75)")
    p.add_argument("--trials", type=int, default=2, help="samples per length × depth cell (different keys)")
    p.add_argument("--kinds", default="passkey", help=f"comma-separated: {', '.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0, help="seed of keys, filler order and distractor depths")
    p.add_argument("--out", default=None, help="folder for longctx.json and longctx.png; without it, no files")
    p.add_argument("--dense", action="store_true", help="load dense even when the config carries a hybrid spec")
    p.add_argument("--retrofit", default=None, help="switch the model to a hybrid spec first: 'default' or JSON")
    p.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU, else cpu) | cpu | cuda | "
                   "cuda:N")
    p.add_argument("--scoring", default="exact", help="exact: the greedy answer starts with the key (one "
                   "forward pass); first_number: the first number of the greedy continuation is the key")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from attention.errors import HybridAttentionError

        device = resolve_device(args.device)

        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise LongCtxError(f"unknown kind(s) {bad or args.kinds!r}; use {', '.join(KINDS)}")
        lengths = _ints(args.lengths)
        # Everything the command line alone decides is refused here, before the model loads (run_longctx checks
        # the same for callers in code); --out too, so that the results are not lost when they are written.
        depths_for(args.depths)
        if args.trials < 1:
            raise LongCtxError(f"--trials must be >= 1, got {args.trials}")
        if args.scoring not in SCORINGS:
            raise LongCtxError(f"unknown --scoring {args.scoring!r}; use one of {', '.join(SCORINGS)}")
        if args.out:
            check_output_dir(args.out, "--out")
        check_model_config(args.model, lengths, None if args.retrofit is None else retrofit_spec(args.retrofit),
                           dense=args.dense)
        try:
            model, tok, attn = load_for_eval(args.model, dense=args.dense, retrofit=args.retrofit)
        except HybridAttentionError as err:
            raise LongCtxError(str(err).splitlines()[0]) from None
        model.to(device)
        result = run_longctx(model, tok, lengths=lengths, depths=args.depths, trials=args.trials, kinds=kinds,
                             seed=args.seed, device=device, scoring=args.scoring)
    except (LongCtxError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    result["model"], result["attention"] = args.model, attn
    spec = getattr(model.config, "hybrid_attention", None)
    result["hybrid_attention"] = spec if attn == "hybrid" else None
    print(f"\n{args.model} ({attn}), {args.trials} trial(s) x {len(result['depths'])} depth(s) per cell, "
          f"{result['seconds']:.0f}s")
    print("kind        " + "".join(f"{n:>8}" for n in lengths))
    for kind in kinds:
        print(f"{kind:<12}" + "".join(f"{result['accuracy'][kind][str(n)]:>8.0%}" for n in lengths))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "longctx.json", json.dumps(result, indent=1))
        plot_heatmap(result, out / "longctx.png", f"{args.model} ({attn})")
        print(f"wrote {out / 'longctx.json'} and {out / 'longctx.png'}")
    summary = {k: result[k] for k in ("model", "attention", "accuracy", "lengths", "trials", "kinds",
                                      "key_tokens_canonical", "scoring", "seconds")}
    summary["depths"] = len(result["depths"])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
