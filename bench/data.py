"""Data at scale: prepare throughput, cached start, training-process memory, mixture proportions.

    python bench/data.py                                   # ~10M and ~200M token corpora, SmolLM2 tokenizer
    python bench/data.py --only throughput --repeats 3     # the prepare-throughput target alone (~3-4 min)
    python bench/data.py --clean                           # and delete the corpora and caches afterwards

Builds two synthetic corpora offline (paragraphs of the standard library's docstrings, shuffled and
recombined into documents of ~1-4K characters, as .jsonl), then measures, each in a fresh process:

* prepare throughput on the small corpus, four arms interleaved (the order rotates each repeat),
  each run in a fresh process with its own empty caches, medians over ``--repeats``:
  today's single-process path (``texts_from`` + ``pack``: one process, one tokenizer thread), the
  same with the tokenizer's own thread pool (what that code gets by default), ``prepare_source``
  with one process, and ``prepare_source`` with ``--num-proc`` processes (target: ≥ 1.6× the first);
* cached start, from the prepared cache, in a fresh process that does what a training process does
  for its data (no model): import torch + transformers + distill.data, load the tokenizer, map the
  data, build the order and read the first micro-batch. Reported twice, labelled: the data stage
  alone (``build_data`` → first batch), and process start (interpreter launch, read from
  ``/proc/self/stat``) → first batch (target ≤ 5 s at either size);
* training-process RSS after mapping the data and reading ``--steps`` steps of blocks, small vs
  large corpus (target: grows ≤ 100 MB); today's path's RSS on the small corpus for reference;
* mixture proportions over ≥ 10K blocks of a three-source mixture (target within ±1 %).

A table for people, the last line JSON for machines. Corpora and caches live under ``--work``
and are reused by later runs (``--clean`` deletes them at the end). Speed is reported as ratios of
arms run side by side; on a shared machine wall time is mostly waiting for a core, so the table
also shows CPU seconds and cores used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.environment import json_line  # noqa: E402

CHARS_PER_TOKEN = 3.9  # SmolLM2 on English docstrings (measured on the built-in corpus)


def make_corpus(path: Path, tokens: float, seed: int) -> Path:
    """Write ~``tokens`` tokens of recombined docstring paragraphs as .jsonl (reused when present)."""
    if path.exists():
        return path
    import numpy as np

    from distill.data import stdlib_docs

    paras = [p.strip() for d in stdlib_docs("train") + stdlib_docs("eval") for p in d.split("\n\n") if len(p) > 80]
    rng = np.random.default_rng(seed)
    target = int(tokens * CHARS_PER_TOKEN)
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w") as f:
        while written < target:
            picks = rng.integers(0, len(paras), size=(64, int(rng.integers(2, 8))))
            lines = [json.dumps({"text": "\n\n".join(paras[i] for i in row)}) for row in picks]
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block)
    os.replace(tmp, path)
    return path


def run_child(code: str, env: dict | None = None, timeout: float = 3600) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last."""
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"error: a benchmark child failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = time.time() - t0
    return out


_RSS = """
def rss_mb():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) / 1024
def rss_parts_mb():
    out = {}
    for line in open('/proc/self/status'):
        if line.startswith(('RssAnon', 'RssFile')):
            out[line.split(':')[0]] = int(line.split()[1]) / 1024
    return out
def cpu_s():
    import resource
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
def hwm_mb():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) / 1024
"""


def baseline(corpus: Path, tokenizer: str, seq_len: int, work: Path, threads: bool) -> dict:
    """Today's path in one process: every document into a list, tokenized, packed into one tensor.

    ``threads``: let the Rust tokenizer use its own thread pool inside ``tokenizer(texts)`` (what
    today's code gets by default); without, one core (single-process tokenization proper).
    """
    return run_child(_RSS + f"""
import json, time
from core.models import load_tokenizer
from distill.data import texts_from, pack
import datasets  # imported before the clock in both children: the clock measures the work
tok = load_tokenizer({tokenizer!r})
r0 = rss_mb()
t, c = time.time(), cpu_s()
blocks = pack(texts_from({str(corpus)!r}, tok), tok, {seq_len})
print(json.dumps({{"seconds": time.time() - t, "cpu_s": cpu_s() - c, "tokens": blocks.numel(), "rss_mb": rss_mb(),
                  "rss0_mb": r0, "hwm_mb": hwm_mb()}}))
""", env={"HF_DATASETS_CACHE": str(work / f"hfds-base-{time.time_ns()}"),
          "TOKENIZERS_PARALLELISM": "true" if threads else "false"})


def prepare(corpus: Path, tokenizer: str, seq_len: int, cache: Path, num_proc: int, work: Path) -> dict:
    return run_child(_RSS + f"""
import json, time
from core.models import load_tokenizer
from distill.data import SourceSpec, PackSettings, prepare_source
import datasets
tok = load_tokenizer({tokenizer!r})
t, c = time.time(), cpu_s()
p = prepare_source(SourceSpec({str(corpus)!r}), tok, PackSettings({seq_len}), data_cache={str(cache)!r},
                   num_proc={num_proc}, progress=False)
m = p.meta
print(json.dumps({{"seconds": time.time() - t, "cpu_s": cpu_s() - c, "tokens": m["train_blocks"] * {seq_len},
                  "stages": m.get("stage_seconds"), "prepared_in_s": m["seconds"],
                  "raw_tokens": m["train_tokens"] + m["eval_tokens"], "bytes": m["bytes"],
                  "blocks": m["train_blocks"], "num_proc": m["num_proc"], "path": str(p.path)}}))
""", env={"HF_DATASETS_CACHE": str(work / f"hfds-prep-{time.time_ns()}")})


def cached_start(datasets: list, tokenizer: str, seq_len: int, cache: Path, steps: int, batch: int) -> dict:
    """A fresh data-only training process: imports, tokenizer, map the prepared data, order, first micro-batch.

    Clocks: ``since_launch_s`` counts from the kernel's start time of this process (so the interpreter's
    own start-up is in it); ``data_s`` is ``build_data`` + order + first micro-batch, the data layer's share.
    """
    return run_child(_RSS + f"""
import os, sys, time
def since_launch():  # seconds since this process was created (field 22 of /proc/self/stat, clock ticks)
    start = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]) / os.sysconf('SC_CLK_TCK')
    return float(open('/proc/uptime').read().split()[0]) - start
t_entry = since_launch()
import json
import torch
from core.models import load_tokenizer
from distill.data import build_data
t_imports = since_launch()
tok = load_tokenizer({tokenizer!r})
t_tok = since_launch()
r0 = rss_mb()
t = time.time()
data = build_data(tok, datasets={datasets!r}, seq_len={seq_len}, eval_blocks=16, data_cache={str(cache)!r},
                  progress=False, min_train_blocks={batch})
order = data.order({batch}, seed=0)
index, first = next(order.micro_batches(data.train, 0, 0, 1, 8))
mask = data.train.loss_mask(index)
data_s, t_first = time.time() - t, since_launch()
heavy = sorted(m for m in ("datasets", "pyarrow", "pandas") if m in sys.modules)
t = time.time()
for step in range({steps}):
    for index, blocks in order.micro_batches(data.train, step, 0, 1, 8):
        mask = data.train.loss_mask(index)
print(json.dumps({{"data_s": data_s, "since_launch_s": t_first, "interpreter_s": t_entry,
                  "imports_s": t_imports - t_entry, "tokenizer_s": t_tok - t_imports, "unneeded_imports": heavy,
                  "rss_mb": rss_mb(), "rss0_mb": r0, "anon_mb": rss_parts_mb()["RssAnon"],
                  "file_mb": rss_parts_mb()["RssFile"], "hwm_mb": hwm_mb(), "train_blocks": data.train.shape[0],
                  "read_s": time.time() - t}}))
""")


def mixture(datasets: list, tokenizer: str, seq_len: int, cache: Path, blocks: int, batch: int) -> dict:
    return run_child(f"""
import json
import numpy as np
from core.models import load_tokenizer
from distill.data import build_data
tok = load_tokenizer({tokenizer!r})
data = build_data(tok, datasets={datasets!r}, seq_len={seq_len}, eval_blocks=16, data_cache={str(cache)!r},
                  progress=False)
order = data.order({batch}, seed=0)
steps = -(-{blocks} // {batch})
idx = np.concatenate([order.step_indices(t).numpy() for t in range(steps)])
got = np.bincount(order.source_of(idx), minlength=len(data.weights)) / idx.size
want = np.asarray(data.weights) / sum(data.weights)
print(json.dumps({{"blocks": int(idx.size), "got": got.tolist(), "want": want.tolist(),
                  "max_abs_dev": float(np.abs(got - want).max()), "epochs": order.epochs(steps)}}))
""")


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def throughput(small: Path, args, work: Path, cache: Path) -> dict:
    """The four arms on the small corpus, interleaved (rotating order), ``args.repeats`` times each."""
    arms = {
        "today": lambda: baseline(small, args.tokenizer, args.seq_len, work, threads=False),
        "today_threads": lambda: baseline(small, args.tokenizer, args.seq_len, work, threads=True),
        "prepare_1": lambda: prepare(small, args.tokenizer, args.seq_len, work / f"c-{time.time_ns()}", 1, work),
        "prepare_n": lambda: prepare(small, args.tokenizer, args.seq_len, work / f"c-{time.time_ns()}",
                                     args.num_proc, work),
    }
    runs: dict[str, list[dict]] = {k: [] for k in arms}
    names = list(arms)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            out = arms[name]()
            runs[name].append(out)
            print(f"  repeat {r + 1}/{args.repeats} {name:<14} {out['seconds']:6.1f} s wall  {out['cpu_s']:6.1f} s CPU"
                  f"  load {os.getloadavg()[0]:.1f}", flush=True)
            if name.startswith("prepare"):  # keep one prepared copy in the shared cache, drop the rest
                shared = cache / Path(out["path"]).name
                if not shared.exists():
                    cache.mkdir(parents=True, exist_ok=True)
                    os.rename(out["path"], shared)
                shutil.rmtree(Path(out["path"]).parent, ignore_errors=True)
    for d in work.glob("hfds-*"):
        shutil.rmtree(d, ignore_errors=True)
    med = {k: {"seconds": median([o["seconds"] for o in v]), "cpu_s": median([o["cpu_s"] for o in v])}
           for k, v in runs.items()}
    rounds = [t["seconds"] / p["seconds"] for t, p in zip(runs["today"], runs["prepare_n"])]
    return {"median": med, "raw_tokens": runs["prepare_n"][0]["raw_tokens"], "num_proc": runs["prepare_n"][0]["num_proc"],
            "speedup": med["today"]["seconds"] / med["prepare_n"]["seconds"], "speedup_rounds": rounds,
            "speedup_vs_threads": med["today_threads"]["seconds"] / med["prepare_n"]["seconds"],
            "scaling_vs_prepare_1": med["prepare_1"]["seconds"] / med["prepare_n"]["seconds"],
            "baseline_rss_mb": median([o["rss_mb"] for o in runs["today"]]),
            "baseline_rss0_mb": median([o["rss0_mb"] for o in runs["today"]])}


def throughput_rows(tp: dict) -> list[tuple[str, str, str]]:
    m, raw = tp["median"], tp["raw_tokens"]
    label = {"today": "prepare small, one process, one thread (today)", "today_threads": "  same, tokenizer's own threads on",
             "prepare_1": "prepare small, prepare_source, 1 process",
             "prepare_n": f"prepare small, prepare_source, {tp['num_proc']} processes"}
    rows = []
    for k, name in label.items():
        note = f"{raw / m[k]['seconds'] / 1e3:.0f}K tok/s; CPU {m[k]['cpu_s']:.1f} s, cores used {m[k]['cpu_s'] / m[k]['seconds']:.2f}"
        rows.append((name, f"{m[k]['seconds']:.1f} s", note))
    rows.append(("prepare speedup vs today (medians)", f"{tp['speedup']:.2f}x",
                 "target >= 1.6x; per repeat " + ", ".join(f"{x:.2f}" for x in tp["speedup_rounds"])
                 + f"; vs tokenizer threads {tp['speedup_vs_threads']:.2f}x; vs prepare 1 proc {tp['scaling_vs_prepare_1']:.2f}x"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-tokens", type=float, default=10e6)
    ap.add_argument("--large-tokens", type=float, default=200e6)
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each throughput arm (medians are reported)")
    ap.add_argument("--only", choices=["all", "throughput", "scale"], default="all",
                    help="throughput: the prepare arms on the small corpus; scale: large prepare, cached start, RSS, mixture")
    ap.add_argument("--steps", type=int, default=200, help="training steps read in the RSS measurement")
    ap.add_argument("--batch", type=int, default=32, help="global batch (blocks) of the order")
    ap.add_argument("--work", default="/tmp/hd-bench-data")
    ap.add_argument("--clean", action="store_true", help="delete --work (corpora and caches) at the end")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    t0 = time.time()
    small = make_corpus(work / f"small-{args.small_tokens:.0e}.jsonl", args.small_tokens, 0)
    large = None if args.only == "throughput" else make_corpus(work / f"large-{args.large_tokens:.0e}.jsonl",
                                                                args.large_tokens, 1)
    print(f"corpora: {small} ({small.stat().st_size / 1e6:.0f} MB)"
          + (f", {large} ({large.stat().st_size / 1e6:.0f} MB)" if large else "") + f" in {time.time() - t0:.0f}s",
          flush=True)
    load0 = os.getloadavg()[0]
    rows, result, tp = [], {}, None
    if args.only != "scale":
        tp = throughput(small, args, work, cache)
        rows = throughput_rows(tp)
        result = {"small_tokens": tp["raw_tokens"], "num_proc": tp["num_proc"], "repeats": args.repeats,
                  "prepare_speedup": tp["speedup"], "prepare_speedup_rounds": tp["speedup_rounds"],
                  "speedup_vs_threaded_baseline": tp["speedup_vs_threads"],
                  "prepare_scaling_vs_1_proc": tp["scaling_vs_prepare_1"],
                  **{f"{k}_s": v["seconds"] for k, v in tp["median"].items()},
                  **{f"{k}_cpu_s": v["cpu_s"] for k, v in tp["median"].items()}}
    if large is not None:
        rows_scale, res_scale = scale(small, large, args, work, cache, tp)
        rows += rows_scale
        result |= res_scale
    load1 = os.getloadavg()[0]
    print(f"\ncorpora: small {result['small_tokens'] / 1e6:.1f}M tokens"
          + (f", large {result['large_tokens'] / 1e6:.1f}M tokens" if large else "")
          + f" ({args.tokenizer}, seq_len {args.seq_len}); {os.cpu_count()} cores, load {load0:.1f} at start, "
          f"{load1:.1f} at end")
    w = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{w}}  {value:>10}  {note}")
    if args.clean:
        shutil.rmtree(work, ignore_errors=True)
    print(json_line({**result, "load_avg_start": load0, "load_avg_end": load1}))


def scale(small: Path, large: Path, args, work: Path, cache: Path, tp: dict | None) -> tuple[list, dict]:
    """Large prepare, cached start at both sizes, RSS small vs large, mixture proportions."""
    prep_small = prepare(small, args.tokenizer, args.seq_len, cache, args.num_proc, work)  # cached after throughput
    prep_large = prepare(large, args.tokenizer, args.seq_len, cache, args.num_proc, work)
    print(f"prepare large ({prep_large['num_proc']} proc, cached if ~0 s): {prep_large['seconds']:.1f}s", flush=True)
    start_small = cached_start([str(small)], args.tokenizer, args.seq_len, cache, args.steps, args.batch)
    start_large = cached_start([str(large)], args.tokenizer, args.seq_len, cache, args.steps, args.batch)
    mix_sources = [{"source": str(small), "weight": 0.5}, {"source": str(large), "weight": 0.3},
                   {"source": "builtin:stdlib-docs", "weight": 0.2}]
    mix = mixture(mix_sources, args.tokenizer, args.seq_len, cache, 10_000, args.batch)
    growth = start_large["rss_mb"] - start_small["rss_mb"]
    anon_growth = start_large["anon_mb"] - start_small["anon_mb"]
    rows = [
        (f"prepare large, {prep_large['num_proc']} processes", f"{prep_large['prepared_in_s']:.1f} s",
         f"{prep_large['raw_tokens'] / prep_large['prepared_in_s'] / 1e3:.0f}K tok/s, {prep_large['bytes'] / 1e6:.0f} MB"
         + (" (prepared by an earlier run; this run mapped it)" if prep_large["seconds"] < 0.5 * prep_large["prepared_in_s"]
            else "")),
    ]
    for name, st in (("small", start_small), ("large", start_large)):
        rows.append((f"cached start {name}: data stage", f"{st['data_s']:.2f} s",
                     "build_data + order + first micro-batch (target <= 5 s)"))
        rows.append((f"cached start {name}: launch -> 1st batch", f"{st['since_launch_s']:.1f} s",
                     f"interpreter {st['interpreter_s']:.1f} + imports (torch, transformers) {st['imports_s']:.1f} + "
                     f"tokenizer {st['tokenizer_s']:.1f} + data {st['data_s']:.2f}; datasets/pyarrow imported: "
                     f"{st['unneeded_imports'] or 'no'}"))
    rows += [
        ("training RSS small", f"{start_small['rss_mb']:.0f} MB",
         f"{start_small['train_blocks']:,} blocks; anon {start_small['anon_mb']:.0f} + file {start_small['file_mb']:.0f}"),
        ("training RSS large", f"{start_large['rss_mb']:.0f} MB",
         f"{start_large['train_blocks']:,} blocks; anon {start_large['anon_mb']:.0f} + file {start_large['file_mb']:.0f}; "
         f"growth {growth:+.1f} MB (anon {anon_growth:+.1f}; target <= 100)"),
    ]
    if tp is not None:
        rows.append(("today's path RSS small", f"{tp['baseline_rss_mb']:.0f} MB",
                     f"+{tp['baseline_rss_mb'] - tp['baseline_rss0_mb']:.0f} MB over the tokenizer-loaded process"))
    rows += [
        ("mixture over >= 10K blocks", f"{mix['max_abs_dev'] * 100:.3f} %",
         "got " + ", ".join(f"{g:.4f}" for g in mix["got"]) + " want " + ", ".join(f"{w:.2f}" for w in mix["want"])),
    ]
    res = {"small_tokens": prep_small["raw_tokens"], "large_tokens": prep_large["raw_tokens"], "prepare_large_s": prep_large["prepared_in_s"],
           "prepare_large_bytes": prep_large["bytes"],
           "cached_start_small_data_s": start_small["data_s"], "cached_start_large_data_s": start_large["data_s"],
           "cached_start_small_launch_to_batch_s": start_small["since_launch_s"],
           "cached_start_large_launch_to_batch_s": start_large["since_launch_s"],
           "cached_start_large_imports_s": start_large["imports_s"], "cached_start_large_tokenizer_s": start_large["tokenizer_s"],
           "cached_start_unneeded_imports": start_large["unneeded_imports"],
           "rss_small_mb": start_small["rss_mb"], "rss_large_mb": start_large["rss_mb"], "rss_growth_mb": growth,
           "rss_anon_growth_mb": anon_growth, "baseline_rss_small_mb": tp["baseline_rss_mb"] if tp else None,
           "mixture_max_abs_dev": mix["max_abs_dev"], "mixture_blocks": mix["blocks"], "mixture_epochs": mix["epochs"]}
    return rows, res


if __name__ == "__main__":
    main()
