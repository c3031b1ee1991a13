"""Naive vs chunked logit distillation: peak memory, time and gradient agreement (CPU, fp32).

    python bench/kd_loss.py                       # 4096 tokens, vocab 49152 and 102400
    python bench/kd_loss.py --vocab 102400 --reps 1 --chunk-size 256

What runs (forward + backward, fp32, kind=forward_kl, T=1, every token counts):

* naive:   ``kd_loss(h_s @ W_s.T, h_t @ W_t.T)`` -- full ``[tokens, vocab]`` logits, autograd.
* chunked: ``chunked_kd_loss(h_s, W_s, h_t, W_t, chunk_size=...)``.

Student width 576 (SmolLM2-135M), teacher width 2048; gradients w.r.t. the student hidden states
and the student head.

How memory is measured: every (variant, rep) runs in its own subprocess. After its tensors exist
(and a tiny warm-up has initialized the thread pools), the worker resets the kernel's RSS
high-water mark (``echo 5 > /proc/self/clear_refs``), runs one step, and reports
``VmHWM - VmRSS_before`` from ``/proc/self/status``: the peak resident memory the step added on top
of its inputs. (Falls back to ``ru_maxrss`` minus the RSS before, which can only over-count, when
``clear_refs`` is unavailable.) Time is the wall time of that same step; the reported time is the
median over reps. The variants alternate (naive, chunked, naive, ...) so that load drift from other
processes affects both alike.

Gradient agreement, three ways (each the max over the two gradients of ``max|g_a - g_b| / max|g_b|``):

* ``max_grad_rel_err``: chunked vs naive, both fp32;
* ``chunked_vs_fp64`` and ``naive_vs_fp64``: each against a float64 reference computed with plain
  autograd through :func:`distill.losses.kd_loss` (no closed-form gradients, no fused code), token chunk
  by token chunk so that it fits in memory -- the loss is a sum over tokens, so the per-chunk
  gradients add up to the exact total.

Two fp32 computations of a 100K-way softmax and of a sum over thousands of tokens each carry rounding
error of order 1e-5 relative; the float64 columns show how much of the chunked-vs-naive difference
is the naive path's own rounding.

The last line is JSON for the largest vocabulary: ``peak_mem_ratio`` and ``time_ratio`` are
chunked / naive.

Chunk size (CPU): a sweep of the chunked step at 1024 tokens, vocab 102400, widths 576/2048 on a
busy 2-core machine gave 128: 56-73 s, 256: 41-46 s, 512: 40 s, 1024: 42 s -- 256 and up are tied
within noise (the matmuls are already large enough), and memory grows linearly with the chunk,
so 256 is the default here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.environment import json_line  # noqa: E402


def _status_kib(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+)", text, re.M).group(1))


def _mem_available_bytes() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"^MemAvailable:\s+(\d+)", text, re.M).group(1)) * 1024


def worker(args: argparse.Namespace) -> None:
    import torch

    from distill.losses import chunked_kd_loss, kd_loss

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n, v, ds, dt = args.tokens, args.vocab_one, args.d_student, args.d_teacher
    # Built in place so that creating inputs leaves no temporary above the final RSS.
    hs = torch.randn(n, ds, generator=g)
    ws = torch.randn(v, ds, generator=g).mul_(3.0 / ds**0.5)
    ht = torch.randn(n, dt, generator=g)
    wt = torch.randn(v, dt, generator=g).mul_(3.0 / dt**0.5)
    hs.requires_grad_()
    ws.requires_grad_()

    if args.variant == "fp64":
        hs64, ws64 = hs.detach().double().requires_grad_(), ws.detach().double().requires_grad_()
        ht64, wt64 = ht.double(), wt.double()
        t0 = time.perf_counter()
        for start in range(0, n, args.chunk_size):
            sl = slice(start, start + args.chunk_size)
            with torch.no_grad():
                zt = ht64[sl] @ wt64.T
            # kd_loss averages over its tokens; scale back to this chunk's share of the n-token mean.
            loss = kd_loss(hs64[sl] @ ws64.T, zt) * (zt.shape[0] / n)
            loss.backward()
            del zt, loss
        torch.save({"hs": hs64.grad, "ws": ws64.grad}, args.grads_out)
        print(json.dumps({"time_s": time.perf_counter() - t0}))  # gradients only: memory is not measured
        return

    def step() -> None:
        if args.variant == "naive":
            zs = hs @ ws.T
            with torch.no_grad():
                zt = ht @ wt.T
            loss = kd_loss(zs, zt)
            del zs, zt
        else:
            loss = chunked_kd_loss(hs, ws, ht, wt, chunk_size=args.chunk_size)
        loss.backward()

    # Warm-up on a slice of the vocabulary: thread pools and kernels, not the measured allocations.
    small = torch.randn(64, ds), torch.randn(512, ds), torch.randn(64, dt), torch.randn(512, dt)
    kd_loss(small[0] @ small[1].T, small[2] @ small[3].T)
    chunked_kd_loss(*small, chunk_size=16)

    rss_before = _status_kib("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        method = "VmHWM"
    except OSError:
        method = "ru_maxrss"
    t0 = time.perf_counter()
    step()
    elapsed = time.perf_counter() - t0
    peak = _status_kib("VmHWM") if method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if args.grads_out:
        torch.save({"hs": hs.grad, "ws": ws.grad}, args.grads_out)
    print(json.dumps({"peak_bytes": (peak - rss_before) * 1024, "time_s": elapsed, "method": method}))


def run_worker(variant: str, vocab: int, args: argparse.Namespace, grads_out: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--vocab-one", str(vocab),
           "--tokens", str(args.tokens), "--d-student", str(args.d_student), "--d-teacher",
           str(args.d_teacher), "--chunk-size", str(args.chunk_size), "--threads", str(args.threads),
           "--grads-out", grads_out]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def max_rel_err(a_path: str, b_path: str) -> float:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max()).item()
               for k in ("hs", "ws"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 102400])
    p.add_argument("--d-student", type=int, default=576)
    p.add_argument("--d-teacher", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-fp64", action="store_true", help="skip the float64 reference (saves a few minutes)")
    p.add_argument("--worker", choices=["naive", "chunked", "fp64"], help=argparse.SUPPRESS)
    p.add_argument("--vocab-one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--grads-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.variant = args.worker
        worker(args)
        return

    print(f"tokens={args.tokens} d_student={args.d_student} d_teacher={args.d_teacher} fp32 forward_kl "
          f"chunk_size={args.chunk_size} threads={args.threads} reps={args.reps}")
    header = (f"{'vocab':>7} {'variant':>8} {'peak MiB':>9} {'time s':>8} {'mem ratio':>9} {'time ratio':>10} "
              f"{'vs naive':>9} {'vs fp64':>9}")
    print(header)
    print("-" * len(header))
    summary = {}
    with tempfile.TemporaryDirectory(prefix="kd-bench-") as tmp:
        for vocab in args.vocab:
            # The naive step peaks at about seven [tokens, vocab] fp32 tensors (two logits, two
            # log-probs, p_t, difference, product) on top of the heads; refuse to push a shared
            # machine into the OOM killer.
            need = 4 * (7 * args.tokens * vocab + vocab * (args.d_student + args.d_teacher)) + 2**30
            if _mem_available_bytes() < need:
                print(f"{vocab:>7} skipped: needs ~{need / 2**30:.1f} GiB free, "
                      f"{_mem_available_bytes() / 2**30:.1f} GiB available")
                continue
            res: dict[str, list[dict]] = {"naive": [], "chunked": []}
            for rep in range(args.reps):
                for variant in ("naive", "chunked"):
                    grads = os.path.join(tmp, f"{variant}.pt") if rep == 0 else ""
                    res[variant].append(run_worker(variant, vocab, args, grads))
            err = max_rel_err(os.path.join(tmp, "chunked.pt"), os.path.join(tmp, "naive.pt"))
            err64 = {"naive": float("nan"), "chunked": float("nan")}
            if not args.no_fp64:
                ref = os.path.join(tmp, "fp64.pt")
                run_worker("fp64", vocab, args, ref)
                err64 = {k: max_rel_err(os.path.join(tmp, f"{k}.pt"), ref) for k in err64}
            peak = {k: max(r["peak_bytes"] for r in v) for k, v in res.items()}
            t = {k: statistics.median(r["time_s"] for r in v) for k, v in res.items()}
            mem_ratio, time_ratio = peak["chunked"] / peak["naive"], t["chunked"] / t["naive"]
            print(f"{vocab:>7} {'naive':>8} {peak['naive'] / 2**20:>9.0f} {t['naive']:>8.2f} {'':>9} {'':>10} "
                  f"{'':>9} {err64['naive']:>9.2e}")
            print(f"{vocab:>7} {'chunked':>8} {peak['chunked'] / 2**20:>9.0f} {t['chunked']:>8.2f} "
                  f"{mem_ratio:>9.3f} {time_ratio:>10.3f} {err:>9.2e} {err64['chunked']:>9.2e}")
            summary = {"vocab": vocab, "tokens": args.tokens, "d_student": args.d_student,
                       "d_teacher": args.d_teacher, "chunk_size": args.chunk_size,
                       "peak_mem_ratio": round(mem_ratio, 4), "time_ratio": round(time_ratio, 4),
                       "max_grad_rel_err": float(f"{err:.3e}"),
                       "chunked_vs_fp64": float(f"{err64['chunked']:.3e}"),
                       "naive_vs_fp64": float(f"{err64['naive']:.3e}"),
                       "naive_peak_mib": round(peak["naive"] / 2**20), "chunked_peak_mib": round(peak["chunked"] / 2**20),
                       "naive_time_s": round(t["naive"], 3), "chunked_time_s": round(t["chunked"], 3),
                       "mem_method": res["naive"][0]["method"]}
    print(json_line(summary))


if __name__ == "__main__":
    main()
