"""Data at scale: prepare throughput, cached start, training-process memory, mixture proportions.

    python bench/data.py                                  # ~10M and ~50M token corpora, SmolLM2 tokenizer
    python bench/data.py --small-tokens 10e6 --large-tokens 200e6 --num-proc 2

Builds two synthetic corpora offline (paragraphs of the standard library's docstrings, shuffled and
recombined into documents of ~1-4K characters, as .jsonl), then measures, each in a fresh process:

* prepare throughput: ``prepare_source`` with ``--num-proc`` workers against today's single-process
  path (``texts_from`` + ``pack``: tokenize in one process into a Python list, one int64 tensor),
  on the small corpus, each with its own empty ``datasets`` cache (target ≥ 1.6×);
* cached start: a new process building the run's data from the prepared cache (target ≤ 5 s;
  reported with and without the interpreter's imports);
* training-process RSS after mapping the data and reading 200 steps of blocks, small vs large corpus
  (target: grows ≤ 100 MB); today's path's RSS on the small corpus for reference;
* mixture proportions over ≥ 10K blocks of a three-source mixture (target within ±1 %).

A table for people, the last line JSON for machines. Corpora and caches live under ``--work``
and are reused by later runs (delete the folder to start over).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
    """A fresh training process: map the prepared data, build the order, read ``steps`` steps of blocks."""
    return run_child("import time\nT0 = time.time()\n" + _RSS + f"""
import json
from core.models import load_tokenizer
from distill.data import build_data
tok = load_tokenizer({tokenizer!r})
r0 = rss_mb()
t = time.time()
data = build_data(tok, datasets={datasets!r}, seq_len={seq_len}, eval_blocks=16, data_cache={str(cache)!r},
                  progress=False, min_train_blocks={batch})
order = data.order({batch}, seed=0)
start_s, start_total = time.time() - t, time.time() - T0
for step in range({steps}):
    for index, blocks in order.micro_batches(data.train, step, 0, 1, 8):
        mask = data.train.loss_mask(index)
print(json.dumps({{"start_s": start_s, "start_with_imports_s": start_total, "rss_mb": rss_mb(), "rss0_mb": r0,
                  "anon_mb": rss_parts_mb()["RssAnon"], "file_mb": rss_parts_mb()["RssFile"],
                  "hwm_mb": hwm_mb(), "train_blocks": data.train.shape[0], "read_s": time.time() - t - start_s}}))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-tokens", type=float, default=10e6)
    ap.add_argument("--large-tokens", type=float, default=50e6)
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="training steps read in the RSS measurement")
    ap.add_argument("--batch", type=int, default=32, help="global batch (blocks) of the order")
    ap.add_argument("--work", default="/tmp/hd-bench-data")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    t0 = time.time()
    small = make_corpus(work / f"small-{args.small_tokens:.0e}.jsonl", args.small_tokens, 0)
    large = make_corpus(work / f"large-{args.large_tokens:.0e}.jsonl", args.large_tokens, 1)
    print(f"corpora: {small} ({small.stat().st_size / 1e6:.0f} MB), {large} ({large.stat().st_size / 1e6:.0f} MB) "
          f"in {time.time() - t0:.0f}s", flush=True)

    # Throughput: side by side on the small corpus, each in a fresh process with an empty datasets cache.
    base = baseline(small, args.tokenizer, args.seq_len, work, threads=False)
    print(f"baseline (one process, one thread): {base['seconds']:.1f}s", flush=True)
    base_mt = baseline(small, args.tokenizer, args.seq_len, work, threads=True)
    print(f"baseline (one process, tokenizer threads): {base_mt['seconds']:.1f}s", flush=True)
    fresh = work / f"cache-fresh-{time.time_ns()}"
    prep_small = prepare(small, args.tokenizer, args.seq_len, fresh, args.num_proc, work)
    print(f"prepare small ({prep_small['num_proc']} proc): {prep_small['seconds']:.1f}s", flush=True)
    # The timed folder joins the shared cache (same key, same content) instead of a second prepare.
    cache.mkdir(parents=True, exist_ok=True)
    shared = cache / Path(prep_small["path"]).name
    if not shared.exists():
        os.rename(prep_small["path"], shared)
    prep_large = prepare(large, args.tokenizer, args.seq_len, cache, args.num_proc, work)
    print(f"prepare large ({prep_large['num_proc']} proc, cached if ~0 s): {prep_large['seconds']:.1f}s", flush=True)
    start_small = cached_start([str(small)], args.tokenizer, args.seq_len, cache, args.steps, args.batch)
    start_large = cached_start([str(large)], args.tokenizer, args.seq_len, cache, args.steps, args.batch)
    mix_sources = [{"source": str(small), "weight": 0.5}, {"source": str(large), "weight": 0.3},
                   {"source": "builtin:stdlib-docs", "weight": 0.2}]
    mix = mixture(mix_sources, args.tokenizer, args.seq_len, cache, 10_000, args.batch)

    raw = prep_small["raw_tokens"]
    speedup = base["seconds"] / prep_small["seconds"]
    growth = start_large["rss_mb"] - start_small["rss_mb"]
    anon_growth = start_large["anon_mb"] - start_small["anon_mb"]
    rows = [
        ("prepare small, one process (today)", f"{base['seconds']:.1f} s", f"{raw / base['seconds'] / 1e3:.0f}K tok/s"),
        ("  same, tokenizer's own threads on", f"{base_mt['seconds']:.1f} s",
         f"{raw / base_mt['seconds'] / 1e3:.0f}K tok/s (prepare is {base_mt['seconds'] / prep_small['seconds']:.2f}x)"),
        (f"prepare small, {prep_small['num_proc']} processes", f"{prep_small['seconds']:.1f} s",
         f"{raw / prep_small['seconds'] / 1e3:.0f}K tok/s  ({speedup:.2f}x, target >= 1.6x)"),
        ("  CPU seconds: today / prepare", f"{base['cpu_s']:.0f} / {prep_small['cpu_s']:.0f}",
         f"cores used: today {base['cpu_s'] / base['seconds']:.2f}, threads {base_mt['cpu_s'] / base_mt['seconds']:.2f}, "
         f"prepare {prep_small['cpu_s'] / prep_small['seconds']:.2f}"),
        (f"prepare large, {prep_large['num_proc']} processes", f"{prep_large['prepared_in_s']:.1f} s",
         f"{prep_large['raw_tokens'] / prep_large['prepared_in_s'] / 1e3:.0f}K tok/s"
         + (" (prepared by an earlier run; this run mapped it)" if prep_large["seconds"] < 0.5 * prep_large["prepared_in_s"]
            else "")),
        ("cached start small (build_data)", f"{start_small['start_s']:.2f} s",
         f"{start_small['start_with_imports_s']:.1f} s with imports (target <= 5 s)"),
        ("cached start large (build_data)", f"{start_large['start_s']:.2f} s",
         f"{start_large['start_with_imports_s']:.1f} s with imports"),
        ("training RSS small", f"{start_small['rss_mb']:.0f} MB",
         f"{start_small['train_blocks']:,} blocks; anon {start_small['anon_mb']:.0f} + file {start_small['file_mb']:.0f}"),
        ("training RSS large", f"{start_large['rss_mb']:.0f} MB",
         f"{start_large['train_blocks']:,} blocks; anon {start_large['anon_mb']:.0f} + file {start_large['file_mb']:.0f}; "
         f"growth {growth:+.1f} MB (anon {anon_growth:+.1f}; target <= 100)"),
        ("today's path RSS small", f"{base['rss_mb']:.0f} MB", f"+{base['rss_mb'] - base['rss0_mb']:.0f} MB over "
         "the tokenizer-loaded process"),
        ("mixture over >= 10K blocks", f"{mix['max_abs_dev'] * 100:.2f} %",
         "got " + ", ".join(f"{g:.4f}" for g in mix["got"]) + " want " + ", ".join(f"{w:.2f}" for w in mix["want"])),
    ]
    print("note: on a shared machine wall time is mostly waiting for a core ('cores used' = CPU s / wall s); "
          "the ratios move with the load from run to run.")
    print(f"\ncorpora: small {raw / 1e6:.1f}M tokens, large {prep_large['raw_tokens'] / 1e6:.1f}M tokens "
          f"({args.tokenizer}, seq_len {args.seq_len}); {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    w = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{w}}  {value:>10}  {note}")
    print(json.dumps({
        "small_tokens": raw, "large_tokens": prep_large["raw_tokens"], "num_proc": prep_small["num_proc"],
        "baseline_s": base["seconds"], "baseline_threads_s": base_mt["seconds"],
        "speedup_vs_threaded_baseline": base_mt["seconds"] / prep_small["seconds"],
        "baseline_cpu_s": base["cpu_s"], "prepare_cpu_s": prep_small["cpu_s"],
        "prepare_cores_used": prep_small["cpu_s"] / prep_small["seconds"], "prepare_s": prep_small["seconds"], "prepare_speedup": speedup,
        "prepare_large_s": prep_large["prepared_in_s"], "prepare_large_bytes": prep_large["bytes"],
        "cached_start_small_s": start_small["start_s"], "cached_start_large_s": start_large["start_s"],
        "cached_start_small_with_imports_s": start_small["start_with_imports_s"],
        "cached_start_large_with_imports_s": start_large["start_with_imports_s"],
        "rss_small_mb": start_small["rss_mb"], "rss_large_mb": start_large["rss_mb"], "rss_growth_mb": growth,
        "rss_anon_growth_mb": anon_growth,
        "baseline_rss_small_mb": base["rss_mb"], "mixture_max_abs_dev": mix["max_abs_dev"],
        "mixture_blocks": mix["blocks"], "mixture_epochs": mix["epochs"], "load_avg": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
