"""Our distill recipe against TRL's GKD trainer (supervised mode, forward KL) on the same work.

    pip install "trl>=1.16"      # optional: only this bench needs it
    python bench/vs_trl.py [--shapes demo,long] [--demo-steps 8] [--long-steps 4] [--threads N] [--repeats N]

Both sides get the same teacher and student weights, the same packed token blocks in the same
order (the recipe's ``BlockOrder``), AdamW (betas 0.9/0.95, no weight decay), the same warmup-cosine
schedule and clipping at 1.0, fp32 on CPU (no GPU visible to either side), the same thread count,
and the same objective: forward KL(teacher ‖ student) at T = 1, averaged over predicted tokens (the
recipe with every other term at weight 0; ``GKDTrainer`` with ``lmbda=0`` (no on-policy samples),
``beta=0`` (forward KL), ``seq_kd=False``).

* **ours** — ``recipes/distill.py`` itself, through its CLI (chunked KD from hidden states: no
  ``[tokens, vocab]`` logits are kept); numbers from its ``summary.json``.
* **trl** — ``trl.experimental.gkd.GKDTrainer`` fed the same blocks by a sequential sampler.

Shapes (``--shapes``): **demo** — SmolLM2-135M-Instruct → the recipe's derived 10-layer student, 4 × 256 tokens,
vocab 49,152; **long** — a tiny Llama built here with DeepSeek's vocabulary size (102,400; 4
layers, width 256, untied head) → its derived 2-layer student, 1 × 2048 tokens; **tiny** — the
test suite's random model, for checking agreement in seconds (its speed means nothing).

Each run is its own subprocess, so each peak RSS is that run's alone. Per shape, ``--repeats`` rounds
run both sides, the order swapping every round (ours, TRL / TRL, ours / ...), so load from other
processes on a shared machine falls on both alike; tokens/s, loop seconds and RSS are each side's
medians over the rounds, and ``speedup_rounds_<shape>`` lists the ratio within each round.
Throughput is loop tokens/s: tokens over the seconds spent inside training steps (all steps,
evaluation and saving excluded on both sides). Peak RSS is reported for the training steps and for
the whole process. ``loss_diff`` is the largest relative difference of the final-step loss.
Prints a table, then one JSON line: ``speedup_demo``, ``speedup_long``, ``rss_ratio_long`` (whole
process, ours / TRL), ``loss_diff``. Targets: ≥ 1.15×, ≥ 1.3×, ≤ 0.6×, ≤ 1e-3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.environment import json_line  # noqa: E402

INSTALL = 'pip install "trl>=1.16"'
#: Recipe overrides shared by both sides: forward KL only, nothing else that TRL would not do.
OBJECTIVE = dict(kd_weight=1.0, kd_kind="forward_kl", temperature=1.0, ce_weight=0.0, focal_weight=0.0,
                 hidden_weight=0.0, attn_weight=0.0, lr=3e-4, min_lr_ratio=0.1, warmup_steps=1, weight_decay=0.0,
                 max_grad_norm=1.0, grad_accum=1, seed=0, mixed_precision="no")  # fp32, as TRL's side runs


def cpu_env() -> dict[str, str]:
    """Both sides' subprocess environment: the repo importable and no GPU visible.

    TRL's side runs on the CPU (``use_cpu=True``); the recipe would take a GPU (and bf16) wherever one
    exists, so on a GPU machine the two sides would no longer run the same work.
    """
    return {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
LONG_MODEL = dict(vocab_size=102_400, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False)


SHAPES = ("demo", "long", "tiny")


def shape_overrides(shape: str, steps: int, workdir: Path) -> dict:
    if shape == "tiny":  # the test suite's random 4-layer model: checks agreement in seconds, not speed
        return dict(teacher="tiny-random", student_init="keep_layers", keep_layers="2", seq_len=64, micro_batch_size=2, max_steps=steps,
                    **OBJECTIVE)
    if shape == "demo":
        return dict(teacher="smollm2-135m-instruct", student_init="keep_layers", keep_layers="0-3,24-29", seq_len=256, micro_batch_size=4,
                    max_steps=steps, **OBJECTIVE)
    return dict(teacher=str(long_teacher(workdir)), student_init="keep_layers", keep_layers="2", seq_len=2048, micro_batch_size=1,
                max_steps=steps, **OBJECTIVE)


def long_teacher(workdir: Path) -> Path:
    """A tiny random Llama with DeepSeek's vocabulary size, saved with the demo's tokenizer (ids < 49,152)."""
    path = workdir / "tiny-llama-102k"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from core.models import load_tokenizer, smollm2_dir

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LONG_MODEL))
    tok = load_tokenizer(str(smollm2_dir()))
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


# ---- ours: the recipe's own CLI --------------------------------------------------------------

def run_ours(over: dict, threads: int, out: Path) -> dict:
    args = [f"{k}={v}" for k, v in over.items()] + [
        f"output_dir={out}", "overwrite=true", "compare_ce_only=false", "eval_every=0", "eval_blocks=1",
        "save_every=0", f"threads={threads}"]
    proc = subprocess.run([sys.executable, "recipes/distill.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env=cpu_env())
    if proc.returncode != 0:
        raise SystemExit(f"recipe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"tokens_per_s": s["tokens_per_s"], "loop_s": s["loop_s"], "final_loss": s["final_loss"],
            "losses": [h["loss"] for h in json.loads((out / "checkpoints" / f"step-{over['max_steps']}" /
                                                     "trainer_state.json").read_text())["history"]],
            "rss_train_gb": s["peak_rss_gb"]["train"], "rss_whole_gb": s["peak_rss_gb"]["whole"],
            "threads": s["threads"]}


# ---- TRL: GKDTrainer on the same blocks --------------------------------------------------------

def trl_worker(over: dict, threads: int, out: Path) -> dict:
    import torch
    from accelerate.utils import set_seed
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from distill.config import DistillConfig
    from distill.data import BlockOrder, build_data
    from distill.sources import load_pair
    from distill.threads import PeakRSS
    from distill.training import warmup_cosine

    rss = PeakRSS()
    torch.set_num_threads(threads)
    cfg = DistillConfig(**over, output_dir=str(out))
    set_seed(cfg.seed)  # as the recipe does before loading
    teacher, student, tokenizer = load_pair(cfg)
    student.config.use_cache = False
    data = build_data(tokenizer, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset, seq_len=cfg.seq_len,
                      eval_blocks=cfg.eval_blocks, text_field=cfg.text_field, min_train_blocks=cfg.micro_batch_size,
                      max_train_blocks=cfg.max_train_blocks)
    order = BlockOrder(data.train.shape[0], cfg.micro_batch_size, cfg.seed)
    rows = [b for step in range(cfg.max_steps)
            for _, blocks in order.micro_batches(data.train, step, 0, 1, cfg.micro_batch_size) for b in blocks]
    dataset = Dataset.from_dict({"input_ids": [r.tolist() for r in rows]})

    def collate(batch: list[dict]) -> dict:
        ids = torch.tensor([b["input_ids"] for b in batch])
        labels = ids.clone()
        labels[:, 0] = -100  # never a target: the valid-token count is seq - 1, whichever way it is counted
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))

    class Timing(TrainerCallback):
        loop_s, losses, t0 = 0.0, [], 0.0

        def on_train_begin(self, *a, **k):
            rss.mark("setup")

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.loop_s += time.perf_counter() - self.t0
            rss.mark("train")

    timing = Timing()

    class Sequential(GKDTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)  # the recipe's block order, not a reshuffle

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            timing.losses.append(float((loss[0] if return_outputs else loss).detach()))
            return loss

    args = GKDConfig(output_dir=str(out), per_device_train_batch_size=cfg.micro_batch_size,
                     gradient_accumulation_steps=1, max_steps=cfg.max_steps, lmbda=0.0, beta=0.0, seq_kd=False,
                     max_grad_norm=cfg.max_grad_norm, logging_steps=1, save_strategy="no", report_to=[],
                     use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, seed=cfg.seed,
                     max_length=cfg.seq_len, disable_dropout=True, gradient_checkpointing=False)
    trainer = Sequential(model=student, teacher_model=teacher, args=args, train_dataset=dataset,
                         data_collator=collate, processing_class=tokenizer, optimizers=(optimizer, scheduler),
                         callbacks=[timing])
    trainer.train()
    rss.mark("after")
    tokens = cfg.max_steps * cfg.micro_batch_size * cfg.seq_len
    return {"tokens_per_s": tokens / timing.loop_s, "loop_s": timing.loop_s, "final_loss": timing.losses[-1],
            "losses": timing.losses,
            "rss_train_gb": rss.phases["train"], "rss_whole_gb": rss.whole, "threads": torch.get_num_threads(),
            "steps_seen": len(timing.losses)}


def run_trl(over: dict, threads: int, out: Path) -> dict:
    spec = json.dumps({"over": over, "threads": threads, "out": str(out)})
    proc = subprocess.run([sys.executable, __file__, "--worker", spec], cwd=ROOT, capture_output=True, text=True,
                          env=cpu_env())
    if proc.returncode != 0:
        raise SystemExit(f"TRL worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def compare(shape: str, over: dict, threads: int, work: Path, repeats: int) -> dict[str, dict]:
    """Both sides on one shape, ``repeats`` rounds with the order swapped each round; medians per side.

    A shared machine's load drifts over minutes, so neither side may always run first. Losses come from the
    first round (the same seed gives the same steps in every round).
    """
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    for r in range(repeats):
        for side in (("ours", "trl") if r % 2 == 0 else ("trl", "ours")):
            run = run_ours if side == "ours" else run_trl
            runs[side].append(run(over, threads, work / f"{side}-{shape}-{r}"))
            if runs[side][-1]["threads"] != threads:  # a side that picked its own count measures something else
                raise SystemExit(f"{side} ran on {runs[side][-1]['threads']} threads, not the {threads} asked for; "
                                 "the speedup would compare thread counts, not pipelines (pass --threads N)")
    out = {}
    for side, rs in runs.items():
        out[side] = {**rs[0], **{k: median([x[k] for x in rs])
                                 for k in ("tokens_per_s", "loop_s", "rss_train_gb", "rss_whole_gb")},
                     "tokens_per_s_rounds": [x["tokens_per_s"] for x in rs]}
    out["speedup_rounds"] = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(runs["ours"], runs["trl"])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="demo,long")
    parser.add_argument("--demo-steps", type=int, default=8)
    parser.add_argument("--long-steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads for both sides (0: every core)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of both sides per shape (order swapped each "
                        "round; medians reported)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        spec = json.loads(a.worker)
        print(json.dumps(trl_worker(spec["over"], spec["threads"], Path(spec["out"]))))
        return
    try:
        import trl  # noqa: F401
    except ImportError:
        print(f"bench/vs_trl.py compares against TRL, which is not installed; install it with: {INSTALL}")
        print(json.dumps({"skipped": "trl not installed", "install": INSTALL}))
        return
    from distill.threads import available_cores

    threads = a.threads or available_cores()
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        raise SystemExit(f"unknown shape(s) {bad}; use --shapes demo,long")
    if a.repeats < 1:
        raise SystemExit("error: --repeats must be at least 1")
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        work = Path(tmp)
        for shape in shapes:
            over = shape_overrides(shape, a.long_steps if shape == "long" else a.demo_steps, work)
            results[shape] = compare(shape, over, threads, work, a.repeats)
            print(f"{shape}: losses per step, ours {results[shape]['ours']['losses']}, "
                  f"trl {results[shape]['trl']['losses']}", file=sys.stderr, flush=True)

    print(f"\nours = recipes/distill.py (chunked KD); trl = GKDTrainer (lmbda=0, beta=0); {threads} threads, fp32")
    print(f"{'shape':<6} {'side':<5} {'tokens/s':>9} {'loop s':>7} {'RSS train GB':>13} {'RSS whole GB':>13} "
          f"{'final loss':>11}")
    out: dict[str, float | int | list[float] | None] = {}
    diffs = []
    for shape, r in results.items():
        for side in ("ours", "trl"):
            x = r[side]
            print(f"{shape:<6} {side:<5} {x['tokens_per_s']:>9.1f} {x['loop_s']:>7.1f} {x['rss_train_gb']:>13.2f} "
                  f"{x['rss_whole_gb']:>13.2f} {x['final_loss']:>11.6f}")
        diff = abs(r["ours"]["final_loss"] - r["trl"]["final_loss"]) / abs(r["trl"]["final_loss"])
        diffs.append(diff)
        out[f"speedup_{shape}"] = r["ours"]["tokens_per_s"] / r["trl"]["tokens_per_s"]
        out[f"speedup_rounds_{shape}"] = [round(x, 6) for x in r["speedup_rounds"]]
        out[f"rss_ratio_{shape}"] = r["ours"]["rss_whole_gb"] / r["trl"]["rss_whole_gb"]
        out[f"rss_train_ratio_{shape}"] = r["ours"]["rss_train_gb"] / r["trl"]["rss_train_gb"]
        out[f"loss_diff_{shape}"] = diff
    out["loss_diff"] = max(diffs) if diffs else None
    out["threads"] = threads
    out["repeats"] = a.repeats
    print(json_line({k: (round(v, 6) if isinstance(v, float) and not k.startswith("loss_diff") else v)
                     for k, v in out.items()}))


if __name__ == "__main__":
    main()
