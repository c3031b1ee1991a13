"""On-policy distillation on the demo pair: equal wall-clock against off-policy, and the step cost.

    python bench/on_policy.py [--budget 150 --fraction 0.5 --kind forward_kl --gen 64 --prompt 64]

SmolLM2-135M-Instruct teacher, the recipe's derived 10-layer student, built-in data packed into
``prompt + gen`` token blocks. Two arms start from the same student and see the same block order,
each for ``--budget`` seconds of training (forward, rollouts, backward, optimizer):

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

Step cost: inside the on-policy arm, the mean wall time of on-policy steps over that of off-policy
steps (same micro-batch size, same sequence length), measured side by side. JSON last line.
Targets: reverse KL on own continuations −10 % with perplexity no worse than +5 %; step cost ≤ 2×.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
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
    ppl = evaluate_lm(student, eval_batches(blocks, batch)).perplexity
    student.train(was)
    return ppl


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
    settings = OnPolicySettings(fraction=fraction, max_new_tokens=args.gen, temperature=1.0,
                                prompt_tokens=args.prompt, seed=args.seed)
    policy = OnPolicy(settings, model, model, tokenizer, args.batch)
    order = torch.randperm(data.train.shape[0], generator=torch.Generator().manual_seed(args.seed))
    times = {"on": [], "off": []}
    t_start, step = time.perf_counter(), 0
    while time.perf_counter() - t_start < args.budget:
        pick = order[(step * args.batch) % len(order):][: args.batch]
        if len(pick) < args.batch:
            pick = order[: args.batch]
        blocks = data.train[pick]
        t0 = time.perf_counter()
        on = policy.wants(step, 0, 1)
        out = policy.forward(blocks, step, 0, torch.device("cpu")) if on else model(input_ids=blocks)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times["on" if on else "off"].append(time.perf_counter() - t0)
        step += 1
    elapsed = time.perf_counter() - t_start
    model.remove_hooks()
    ppl = perplexity(student, data.eval, args.batch)
    rkl = own_continuation_rkl(student, teacher, tokenizer, eval_prompts, args.gen, seed=10_000)
    stats = policy.stats(elapsed)
    row = {"arm": name, "fraction": fraction, "steps": step, "seconds": elapsed, "ppl": ppl, "own_rkl": rkl,
           "on_steps": len(times["on"]), "off_steps": len(times["off"]),
           "on_step_s": sum(times["on"]) / max(len(times["on"]), 1),
           "off_step_s": sum(times["off"]) / max(len(times["off"]), 1),
           "rollout_tok_s": stats["rollout_tok_s"], "gen_time_share": stats["gen_time_share"]}
    print(f"  {name}: {step} steps in {elapsed:.0f}s, ppl {ppl:.2f}, reverse KL on own continuations {rkl:.4f}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=150.0, help="training seconds per arm")
    ap.add_argument("--fraction", type=float, default=0.5, help="on-policy share of micro-batches in the mix")
    ap.add_argument("--kind", default="forward_kl", help="divergence for both arms (forward_kl, reverse_kl, jsd, ...)")
    ap.add_argument("--beta", type=float, default=0.5, help="JSD / skew KL beta")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per on-policy prompt")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefix of each block)")
    ap.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (the recipe default)")
    ap.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks for perplexity")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the reverse KL")
    ap.add_argument("--threads", type=int, default=2)
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
    student0 = derive_student(teacher, "0-3,24-29")
    seq = args.prompt + args.gen
    data = build_data(tokenizer, dataset=BUILTIN, seq_len=seq, eval_blocks=args.eval_blocks)
    eval_prompts = [row[: args.prompt].tolist() for row in data.eval[: args.eval_prompts]]
    print(f"demo pair, blocks of {seq} tokens ({data.train.shape[0]} train / {data.eval.shape[0]} held-out), "
          f"micro-batch {args.batch}, {args.budget:.0f}s per arm, kd_kind={args.kind}", flush=True)
    init = {"ppl": perplexity(student0, data.eval, args.batch),
            "own_rkl": own_continuation_rkl(student0, teacher, tokenizer, eval_prompts, args.gen, seed=10_000)}
    print(f"  init: ppl {init['ppl']:.2f}, reverse KL on own continuations {init['own_rkl']:.4f}", flush=True)
    off = run_arm("off-policy", 0.0, args, teacher, student0, tokenizer, data, eval_prompts)
    mix = run_arm(f"on-policy {args.fraction:g}", args.fraction, args, teacher, student0, tokenizer, data,
                  eval_prompts)

    print(f"\n{'arm':<16} {'steps':>5} {'held-out ppl':>12} {'own-cont. rKL':>13} {'rollout tok/s':>13} "
          f"{'gen share':>9}")
    print(f"{'init':<16} {'':>5} {init['ppl']:>12.2f} {init['own_rkl']:>13.4f}")
    for r in (off, mix):
        print(f"{r['arm']:<16} {r['steps']:>5} {r['ppl']:>12.2f} {r['own_rkl']:>13.4f} "
              f"{r['rollout_tok_s']:>13.0f} {r['gen_time_share']:>9.2f}")
    rkl_change = mix["own_rkl"] / off["own_rkl"] - 1
    ppl_change = mix["ppl"] / off["ppl"] - 1
    cost = mix["on_step_s"] / mix["off_step_s"] if mix["on_steps"] and mix["off_steps"] else math.nan
    print(f"\non-policy mix vs off-policy: own-continuation reverse KL {rkl_change:+.1%} (target <= -10%), "
          f"held-out ppl {ppl_change:+.1%} (target <= +5%)")
    print(f"step cost at {args.gen} generated tokens: on-policy {mix['on_step_s']:.2f}s vs off-policy "
          f"{mix['off_step_s']:.2f}s = {cost:.2f}x (target <= 2x)")
    print(json.dumps({"budget_s": args.budget, "fraction": args.fraction, "kind": args.kind, "gen_tokens": args.gen,
                      "init": init, "off_policy": off, "on_policy": mix, "own_rkl_change": rkl_change,
                      "ppl_change": ppl_change, "step_cost_ratio": cost,
                      "target_rkl_met": rkl_change <= -0.10, "target_ppl_met": ppl_change <= 0.05,
                      "target_cost_met": cost <= 2.0}))


if __name__ == "__main__":
    main()
