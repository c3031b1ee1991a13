"""On-policy distillation on the demo pair: equal wall-clock against off-policy, and the step cost.

    python bench/on_policy.py [--student DIR --budget 300 --fraction 0.5 --kind forward_kl --gen 64 --prompt 64]

SmolLM2-135M-Instruct teacher; the student is ``--student`` (an HF folder, e.g. the demo's pruned
student) or, without it, the teacher's layers 0-3 and 24-29. Built-in data packed into ``prompt + gen``
token blocks. Two arms start from the same student and see the same block order, each for ``--budget``
seconds of training (forward, rollouts, backward, optimizer), one after the other:

* **off-policy**: every micro-batch is data blocks (KD + CE, the recipe's default terms);
* **on-policy mix**: a share ``--fraction`` of micro-batches are the student's own continuations
  of the blocks' first ``--prompt`` tokens (``--gen`` new tokens, through
  :class:`distill.on_policy.OnPolicy`, i.e. serve's engine over the live weights; divergence only).

Measured after each arm, on held-out data the training never saw:

* held-out perplexity (packed held-out blocks);
* reverse KL to the teacher on the student's *own* continuations: the student continues
  ``--eval-prompts`` held-out prefixes (sampling at T = 1, fixed seeds), then
  ``mean over generated tokens of KL(p_student || p_teacher)`` — the exposure-bias gap on-policy
  training targets.

Clock: ``--clock cpu`` (default) counts the budget and the step times in this process's CPU seconds.
With ``--threads 1`` that is the wall-clock of an unloaded machine, and it stays fair when the machine
is shared: a wall-clock budget would give more training to whichever arm ran in a quieter moment.
``--clock wall`` counts wall seconds (use it on a machine of your own). Both are recorded.

Step cost: inside the on-policy arm (``--fraction 0.5`` alternates off- and on-policy steps), the
median time of on-policy steps over that of off-policy steps (same micro-batch size, same sequence
length), in CPU and in wall seconds. JSON last line.
Targets: reverse KL on own continuations −10 % with perplexity no worse than +5 %; step cost ≤ 2×.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


@torch.no_grad()
def own_continuation_rkl(student, teacher, tokenizer, prompts: list[list[int]], gen: int, seed: int) -> float:
    """Mean reverse KL(student || teacher) over the tokens the student generates from ``prompts``."""
    from distill.on_policy import Rollouts, rollout_batch
    from serve.sampling import SamplingParams

    rollouts = Rollouts(student, tokenizer, max_batch=len(prompts), max_seq_len=len(prompts[0]) + gen)
    params = [SamplingParams(max_new_tokens=gen, temperature=1.0, seed=seed + i) for i in range(len(prompts))]
    batch = rollout_batch(prompts, rollouts.generate(prompts, params), tokenizer.pad_token_id or 0)
    was = student.training
    student.eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    total, count = 0.0, 0
    for r in range(ids.shape[0]):  # row by row: [seq, vocab] fp32 logits of two models stay small
        valid = batch["labels"][r, 1:] != -100
        if not valid.any():
            continue
        row = ids[r: r + 1, : int(mask[r].sum())]
        log_q = student(input_ids=row).logits[0, :-1].float().log_softmax(-1)[valid[: row.shape[1] - 1]]
        log_p = teacher(input_ids=row).logits[0, :-1].float().log_softmax(-1)[valid[: row.shape[1] - 1]]
        total += float((log_q.exp() * (log_q - log_p)).sum())
        count += int(valid.sum())
    student.train(was)
    return total / max(count, 1)


@torch.no_grad()
def perplexity(student, blocks: torch.Tensor, batch: int) -> float:
    from distill.data import eval_batches
    from eval.metrics import evaluate_lm

    was = student.training
    student.eval()
    ppl = evaluate_lm(student, eval_batches(blocks, batch))[0].perplexity
    student.train(was)
    return ppl


def _clock(kind: str):
    return time.process_time if kind == "cpu" else time.perf_counter


def run_arm(name: str, fraction: float, args, teacher, student0, tokenizer, data, eval_prompts) -> dict:
    from distill.model import DistillModel, LossConfig
    from distill.on_policy import OnPolicy, OnPolicySettings

    torch.manual_seed(args.seed)
    student = copy.deepcopy(student0).train()
    loss_cfg = LossConfig(kd_weight=1.0, kd_kind=args.kind, temperature=1.0, beta=args.beta, kd_chunk_size=1024,
                          ce_weight=1.0, focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0,
                          hidden_layers=[], hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=0)
    model = DistillModel(student, teacher, loss_cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95))
    settings = OnPolicySettings(fraction=fraction, max_new_tokens=args.gen, temperature=args.gen_temperature,
                                prompt_tokens=args.prompt, seed=args.seed, kd_kind=args.on_kind)
    policy = OnPolicy(settings, model, model, tokenizer, args.batch)
    order = torch.randperm(data.train.shape[0], generator=torch.Generator().manual_seed(args.seed))
    clock = _clock(args.clock)
    times = {"on": [], "off": []}
    walls = {"on": [], "off": []}
    t_start, w_start, step = clock(), time.perf_counter(), 0
    while clock() - t_start < args.budget:
        pick = order[(step * args.batch) % len(order):][: args.batch]
        if len(pick) < args.batch:
            pick = order[: args.batch]
        blocks = data.train[pick]
        t0, w0 = clock(), time.perf_counter()
        on = policy.wants(step, 0, 1)
        out = policy.forward(blocks, step, 0, torch.device("cpu")) if on else model(input_ids=blocks)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times["on" if on else "off"].append(clock() - t0)
        walls["on" if on else "off"].append(time.perf_counter() - w0)
        step += 1
        print(f"    {name} step {step}: {'on' if on else 'off'}-policy, {times['on' if on else 'off'][-1]:.1f}s "
              f"({args.clock}), {clock() - t_start:.0f}/{args.budget:.0f}s", flush=True)
    elapsed, wall = clock() - t_start, time.perf_counter() - w_start
    model.remove_hooks()
    ppl = perplexity(student, data.eval, args.batch)
    rkl = own_continuation_rkl(student, teacher, tokenizer, eval_prompts, args.gen, seed=10_000)
    stats = policy.stats(wall)  # rollout seconds are wall seconds
    med = {k: statistics.median(v) if v else math.nan for k, v in times.items()}
    wmed = {k: statistics.median(v) if v else math.nan for k, v in walls.items()}
    row = {"arm": name, "fraction": fraction, "steps": step, "seconds": elapsed, "wall_seconds": wall,
           "ppl": ppl, "own_rkl": rkl, "on_steps": len(times["on"]), "off_steps": len(times["off"]),
           "on_step_s": med["on"], "off_step_s": med["off"], "on_step_wall_s": wmed["on"],
           "off_step_wall_s": wmed["off"], "rollout_tok_s": stats["rollout_tok_s"],
           "gen_time_share": stats["gen_time_share"], "decode_copy_syncs": policy.rollouts.syncs}
    print(f"  {name}: {step} steps in {elapsed:.0f}s ({args.clock}; {wall:.0f}s wall), ppl {ppl:.2f}, "
          f"reverse KL on own continuations {rkl:.4f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--student", default=None, help="student HF folder (default: teacher layers 0-3,24-29)")
    ap.add_argument("--budget", type=float, default=300.0, help="training seconds per arm (see --clock)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="budget and step times in process CPU seconds (fair on a shared machine) or wall seconds")
    ap.add_argument("--fraction", type=float, default=0.5, help="on-policy share of micro-batches in the mix")
    ap.add_argument("--kind", default="forward_kl", help="divergence for both arms (forward_kl, reverse_kl, jsd, ...)")
    ap.add_argument("--on-kind", default=None, help="divergence on on-policy micro-batches only (the recipe's gen_kd_kind; default: --kind)")
    ap.add_argument("--beta", type=float, default=0.5, help="JSD / skew KL beta")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per on-policy prompt")
    ap.add_argument("--gen-temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefix of each block)")
    ap.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (the README's on-policy numbers used 3e-4; the recipe's default is now 1e-3)")
    ap.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks for perplexity")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the reverse KL")
    ap.add_argument("--off-json", default=None, help="reuse the off-policy arm of an earlier run's log (same "
                    "student, data, seed, budget, clock): only the mix arm runs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from core.models import load_causal_lm, load_tokenizer, smollm2_dir
    from distill.data import BUILTIN, build_data
    from distill.student import derive_student

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = str(smollm2_dir())
    teacher = load_causal_lm(path).eval().requires_grad_(False)
    tokenizer = load_tokenizer(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    student0 = load_causal_lm(args.student) if args.student else derive_student(teacher, "0-3,24-29")
    seq = args.prompt + args.gen
    data = build_data(tokenizer, dataset=BUILTIN, seq_len=seq, eval_blocks=args.eval_blocks)
    eval_prompts = [row[: args.prompt].tolist() for row in data.eval[: args.eval_prompts]]
    n_params = sum(p.numel() for p in student0.parameters()) / 1e6
    print(f"demo pair: student {args.student or 'teacher layers 0-3,24-29'} ({n_params:.0f}M), blocks of {seq} "
          f"tokens ({data.train.shape[0]} train / {data.eval.shape[0]} held-out), micro-batch {args.batch}, "
          f"{args.budget:.0f}s ({args.clock}) per arm, kd_kind={args.kind} (on-policy: {args.on_kind or args.kind}), threads={args.threads}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    init = {"ppl": perplexity(student0, data.eval, args.batch),
            "own_rkl": own_continuation_rkl(student0, teacher, tokenizer, eval_prompts, args.gen, seed=10_000)}
    print(f"  init: ppl {init['ppl']:.2f}, reverse KL on own continuations {init['own_rkl']:.4f}", flush=True)
    loads = [os.getloadavg()[0]]
    if args.off_json:  # the off-policy arm of an earlier run with the same settings (it is deterministic)
        off = json.loads(Path(args.off_json).read_text().strip().splitlines()[-1])["off_policy"]
        print(f"  off-policy: from {args.off_json} ({off['steps']} steps)", flush=True)
    else:
        off = run_arm("off-policy", 0.0, args, teacher, student0, tokenizer, data, eval_prompts)
    loads.append(os.getloadavg()[0])
    mix = run_arm(f"on-policy {args.fraction:g}", args.fraction, args, teacher, student0, tokenizer, data,
                  eval_prompts)
    loads.append(os.getloadavg()[0])

    print(f"\n{'arm':<16} {'steps':>5} {'held-out ppl':>12} {'own-cont. rKL':>13} {'rollout tok/s':>13} "
          f"{'gen share':>9}")
    print(f"{'init':<16} {'':>5} {init['ppl']:>12.2f} {init['own_rkl']:>13.4f}")
    for r in (off, mix):
        print(f"{r['arm']:<16} {r['steps']:>5} {r['ppl']:>12.2f} {r['own_rkl']:>13.4f} "
              f"{r['rollout_tok_s']:>13.1f} {r['gen_time_share']:>9.2f}")
    rkl_change = mix["own_rkl"] / off["own_rkl"] - 1
    ppl_change = mix["ppl"] / off["ppl"] - 1
    both = mix["on_steps"] and mix["off_steps"]
    cost = mix["on_step_s"] / mix["off_step_s"] if both else math.nan
    cost_wall = mix["on_step_wall_s"] / mix["off_step_wall_s"] if both else math.nan
    print(f"\non-policy mix vs off-policy: own-continuation reverse KL {rkl_change:+.1%} (target <= -10%), "
          f"held-out ppl {ppl_change:+.1%} (target <= +5%)")
    print(f"step cost at {args.gen} generated tokens (medians, {mix['on_steps']} on / {mix['off_steps']} off steps "
          f"interleaved): on-policy {mix['on_step_s']:.2f}s vs off-policy {mix['off_step_s']:.2f}s = {cost:.2f}x "
          f"{args.clock} ({cost_wall:.2f}x wall; target <= 2x); load average {', '.join(f'{x:.1f}' for x in loads)}")
    print(json.dumps({"budget_s": args.budget, "clock": args.clock, "student": args.student, "fraction": args.fraction,
                      "kind": args.kind, "on_kind": args.on_kind or args.kind, "gen_tokens": args.gen, "gen_temperature": args.gen_temperature,
                      "threads": args.threads, "load_avg": loads, "init": init, "off_policy": off, "on_policy": mix,
                      "own_rkl_change": rkl_change, "ppl_change": ppl_change, "step_cost_ratio": cost,
                      "step_cost_ratio_wall": cost_wall, "target_rkl_met": rkl_change <= -0.10,
                      "target_ppl_met": ppl_change <= 0.05, "target_cost_met": cost <= 2.0}))


if __name__ == "__main__":
    main()
