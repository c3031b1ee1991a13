"""Teacher-cache memory: a training process's RSS while it reads cached targets, shard reader vs loading whole.

    python bench/teacher_cache_rss.py [--tokens 2e6 --topk 64 --steps 200 --batch 8 --work /tmp/hd-bench-cache]

Writes a synthetic top-k cache (random ids and log-probs, ``--tokens`` positions in shards of 256 blocks
of 256 tokens: 384 bytes a token at top-64, ~770 MB at the default) with the format
``recipes/cache_teacher.py`` writes, then in a fresh process per arm reads ``--steps`` micro-batches of
``--batch`` random blocks' targets and reports how far the process's RSS rose over what it was before the
cache was opened: at its peak while reading (``VmHWM``, its mark reset at that point), and at the end:

* ``reader``: :class:`distill.teacher_cache.TeacherCache` (rows read from the shards on demand);
* ``load``: every shard loaded and concatenated, as the cache did before (its memory grows with the
  cache: this is what a billion-token corpus could not afford).

Both arms check their targets against each other (a digest of the ids and log-probs of the same
lookups). A table for people, the last line JSON (``rss_peak_growth_mb`` and ``rss_growth_mb`` (at the
end) per arm, ``cache_mb``, ``target_met``: the reader's peak grows by no more than 100 MB whatever the
cache size).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.environment import json_line  # noqa: E402

_CHILD = """
import hashlib, json, sys, time
import torch
def rss_mb():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) / 1024
def hwm_mb():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) / 1024
arm, path, steps, batch, blocks, seq = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
from distill.teacher_cache import TeacherCache, CachedTargets
if arm != "reader":
    from safetensors.torch import load_file  # imported before the mark, as the reader's modules are
train = torch.zeros(blocks, seq, dtype=torch.int64)  # the data the synthetic cache was fingerprinted with
# The peak, not only the end: loading shards whole holds them twice while concatenating, and a reader that
# pulled a whole shard per lookup would free it before the end.
try:
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    peak_mb = hwm_mb
except OSError:  # no resettable mark here: the peak is not known, report the end for it
    peak_mb = rss_mb
r0, t0 = rss_mb(), time.time()
if arm == "reader":
    cache = TeacherCache(path, train)
    lookup = lambda idx: cache.lookup(idx, "cpu")
else:
    from pathlib import Path
    parts = [load_file(str(s)) for s in sorted(Path(path).glob("shard-*.safetensors"))]
    index, logp = torch.cat([p["index"] for p in parts]), torch.cat([p["logprobs"] for p in parts])
    del parts
    lookup = lambda idx: CachedTargets(index[idx].long(), logp[idx].float())
h, g = hashlib.sha256(), torch.Generator().manual_seed(0)
for _ in range(steps):
    t = lookup(torch.randint(blocks, (batch,), generator=g))
    h.update(t.ids.numpy().tobytes())
    h.update(t.logprobs.numpy().tobytes())
print(json.dumps({"rss0_mb": r0, "rss_mb": rss_mb(), "peak_mb": peak_mb(), "seconds": time.time() - t0,
                  "digest": h.hexdigest()[:16]}))
"""


def write_cache(path: Path, tokens: float, topk: int, seq: int, shard_blocks: int) -> tuple[int, float]:
    """A synthetic top-k cache of ~``tokens`` positions; returns (blocks, MB on disk)."""
    import torch

    from distill.teacher_cache import META, bytes_per_token, fingerprint, write_shard

    blocks = max(shard_blocks, int(tokens) // seq // shard_blocks * shard_blocks)
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for i in range(blocks // shard_blocks):
        ids = torch.randint(0, 49152, (shard_blocks, seq, topk), generator=g, dtype=torch.int32)
        write_shard(path / f"shard-{i:05d}.safetensors", ids, -torch.rand(shard_blocks, seq, topk, generator=g) * 9)
    meta = {"mode": "topk", "k": topk, "seq_len": seq, "blocks": blocks, "vocab_size": 49152,
            "fingerprint": fingerprint(torch.zeros(blocks, seq, dtype=torch.int64)),
            "bytes_per_token": bytes_per_token("topk", topk)}
    (path / META).write_text(json.dumps(meta))
    return blocks, sum(p.stat().st_size for p in path.iterdir()) / 2**20


def run_arm(arm: str, cache: Path, steps: int, batch: int, blocks: int, seq: int) -> dict:
    """One arm (``reader`` | ``load``) in a fresh process: RSS before, at its peak and at the end (MB), digest."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, arm, str(cache), str(steps), str(batch), str(blocks),
                           str(seq)], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{arm} arm failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=2e6, help="cached positions")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200, help="micro-batches looked up")
    ap.add_argument("--batch", type=int, default=8, help="blocks per micro-batch")
    ap.add_argument("--work", default="/tmp/hd-bench-cache")
    args = ap.parse_args()
    seq = 256
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.time()
    blocks, cache_mb = write_cache(work / "cache", args.tokens, args.topk, seq, 256)
    print(f"synthetic top-{args.topk} cache: {blocks} blocks x {seq} tokens, {cache_mb:.0f} MB on disk "
          f"({time.time() - t0:.0f}s); {args.steps} lookups of {args.batch} random blocks per arm")
    rows = {arm: run_arm(arm, work / "cache", args.steps, args.batch, blocks, seq) for arm in ("reader", "load")}
    shutil.rmtree(work, ignore_errors=True)
    if rows["reader"]["digest"] != rows["load"]["digest"]:
        raise SystemExit("the two arms read different targets")
    print(f"{'arm':<8} {'RSS before MB':>13} {'peak MB':>8} {'after MB':>9} {'peak growth MB':>14} "
          f"{'end growth MB':>13} {'seconds':>8}")
    for arm, r in rows.items():
        print(f"{arm:<8} {r['rss0_mb']:>13.0f} {r['peak_mb']:>8.0f} {r['rss_mb']:>9.0f} "
              f"{r['peak_mb'] - r['rss0_mb']:>14.0f} {r['rss_mb'] - r['rss0_mb']:>13.0f} {r['seconds']:>8.1f}")
    growth = {arm: r["rss_mb"] - r["rss0_mb"] for arm, r in rows.items()}
    peak = {arm: r["peak_mb"] - r["rss0_mb"] for arm, r in rows.items()}
    print(json_line({"cache_mb": cache_mb, "tokens": blocks * seq, "topk": args.topk, "steps": args.steps,
                     "rss_peak_growth_mb": peak, "rss_growth_mb": growth,
                     "seconds": {a: r["seconds"] for a, r in rows.items()}, "target_met": peak["reader"] <= 100}))


if __name__ == "__main__":
    main()
