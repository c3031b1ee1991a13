"""One distillation step: the toolkit's teacher–student module vs a naive pipeline.

    python bench/distill_step.py [--seq 2048 --batch 1 --steps 3 --repeats 3]

Same teacher/student pair (SmolLM2-135M-Instruct → a 10-layer derived student), same batch, same
three terms on (logits KD, hidden-state MSE, attention maps) plus CE on the data:

* **ours** — ``DistillModel``: chunked KD with CE fused into the same head pass (no full-vocab
  logits kept),
  hooks on the mapped layers only, attention maps on 64 sampled query rows, the models' own SDPA.
* **naive** — ``output_hidden_states=True`` and eager attention with ``output_attentions=True`` on
  both models to read one layer each, full logits through plain ``kd_loss``, full attention maps.

Each variant runs in its own subprocess; peak RSS is the high-water mark of the step alone (the
mark is reset with ``/proc/self/clear_refs`` after the models are loaded). ``--repeats`` rounds run
one subprocess of each variant, the order swapping every round (naive, ours / ours, naive / ...), so
load from other processes on a shared machine falls on both alike; each variant's tokens/s and peak
are the medians over its rounds. Prints a table, then one JSON line with ``speedup`` (tokens/s
ratio of the medians), ``speedup_rounds`` (the ratio within each round) and ``rss_ratio`` (peak
ratio, ours / naive). Targets: ≥ 1.3× tokens/s and ≤ 0.6× peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.environment import json_line  # noqa: E402


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def worker(variant: str, seq: int, batch: int, steps: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    from core.models import load_causal_lm, smollm2_dir
    from distill import losses
    from distill.model import DistillModel, LossConfig
    from distill.student import derive_student

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    path = str(smollm2_dir())
    teacher = load_causal_lm(path, attn_implementation="eager" if variant == "naive" else "sdpa")
    teacher.eval().requires_grad_(False)
    student = derive_student(teacher, "0-3,24-29")
    student.config._attn_implementation = teacher.config._attn_implementation
    ids = torch.randint(3, teacher.config.vocab_size, (batch, seq))
    s_layer, t_layer = 9, 29  # the last kept layer ↔ the teacher's last layer
    h_s_layer, h_t_layer = 3, 23  # derived pair for the hidden term
    cfg = LossConfig(kd_weight=1.0, kd_kind="forward_kl", temperature=2.0, beta=0.5, kd_chunk_size=1024,
                     ce_weight=1.0, focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=1.0,
                     hidden_layers=[f"{h_s_layer}:{h_t_layer}"], hidden_kind="mse", attn_weight=1.0,
                     attn_layers=[f"{s_layer}:{t_layer}"], attn_num_queries=64)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5)
    model = DistillModel(student, teacher, cfg) if variant == "ours" else None

    def naive_step():
        out_s = student(ids, output_hidden_states=True, output_attentions=True)
        with torch.no_grad():
            out_t = teacher(ids, output_hidden_states=True, output_attentions=True)
        target = ids[:, 1:]
        kd = losses.kd_loss(out_s.logits[:, :-1], out_t.logits[:, :-1], temperature=2.0)
        ce = losses.ce_loss(out_s.logits[:, :-1], target)
        hid = F.mse_loss(out_s.hidden_states[h_s_layer + 1], out_t.hidden_states[h_t_layer + 1])
        a_s = out_s.attentions[s_layer].float().mean(1)
        a_t = out_t.attentions[t_layer].float().mean(1)
        attn = ((a_s - a_t) ** 2).sum(-1).mean()
        return kd + ce + hid + attn

    def step():
        loss = model(ids).loss if model is not None else naive_step()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    step()  # warm-up (allocator, optimizer state)
    base = _rss_kb("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = _rss_kb("VmHWM:")
    t = sorted(times)[len(times) // 2]
    return {"variant": variant, "tokens_per_s": batch * seq / t, "step_s": t,
            "peak_rss_mb": (peak - base) / 1024}


def run_worker(variant: str, seq: int, batch: int, steps: int, threads: int) -> dict:
    """One variant in a fresh subprocess (its own RSS high-water mark); returns :func:`worker`'s row."""
    proc = subprocess.run([sys.executable, __file__, "--worker", variant, "--seq", str(seq), "--batch",
                           str(batch), "--steps", str(steps), "--threads", str(threads)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def compare(repeats: int, seq: int, batch: int, steps: int, threads: int) -> dict:
    """Both variants, ``repeats`` rounds, the order swapping each round; medians per variant and the ratios.

    A shared machine's load drifts over minutes: two variants run one after the other would each see a
    different machine, so every round runs both, and which goes first alternates.
    """
    runs: dict[str, list[dict]] = {"naive": [], "ours": []}
    for r in range(repeats):
        for variant in (("naive", "ours") if r % 2 == 0 else ("ours", "naive")):
            runs[variant].append(run_worker(variant, seq, batch, steps, threads))
    rows = {v: {"variant": v, "tokens_per_s": median([x["tokens_per_s"] for x in rs]),
                "step_s": median([x["step_s"] for x in rs]), "peak_rss_mb": median([x["peak_rss_mb"] for x in rs]),
                "rounds": rs} for v, rs in runs.items()}
    return {"speedup": rows["ours"]["tokens_per_s"] / rows["naive"]["tokens_per_s"],
            "speedup_rounds": [o["tokens_per_s"] / n["tokens_per_s"] for o, n in zip(runs["ours"], runs["naive"])],
            "rss_ratio": rows["ours"]["peak_rss_mb"] / max(rows["naive"]["peak_rss_mb"], 1e-9),
            "ours": rows["ours"], "naive": rows["naive"], "repeats": repeats}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="rounds of both variants (order swapped each round)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--worker", choices=["ours", "naive"])
    a = p.parse_args(argv)
    if a.worker:
        row = worker(a.worker, a.seq, a.batch, a.steps, a.threads)
        print(json.dumps(row))
        return row
    if a.repeats < 1 or a.steps < 1:
        raise SystemExit("error: --repeats and --steps must be at least 1")
    result = compare(a.repeats, a.seq, a.batch, a.steps, a.threads)
    print(f"distill step, SmolLM2-135M → 10 layers, batch {a.batch} × {a.seq} tokens, {a.threads} threads, "
          f"medians of {a.repeats} interleaved rounds")
    print(f"{'variant':<8} {'tokens/s':>10} {'step s':>8} {'step peak RSS MB':>17}")
    for v in ("naive", "ours"):
        r = result[v]
        print(f"{r['variant']:<8} {r['tokens_per_s']:>10.1f} {r['step_s']:>8.2f} {r['peak_rss_mb']:>17.0f}")
    print(f"speedup {result['speedup']:.2f}x (per round " + ", ".join(f"{x:.2f}" for x in result["speedup_rounds"])
          + f"), peak RSS ratio {result['rss_ratio']:.3f}")
    result |= {"seq": a.seq, "batch": a.batch}
    print(json_line(result))
    return result


if __name__ == "__main__":
    main()
