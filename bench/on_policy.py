"""On-policy distillation on the demo pair: equal wall-clock against off-policy, and the step cost.

    python bench/on_policy.py --student DIR [--budget 300 --fraction 0.2 --on-kind reverse_kl --seed 0]
    # or the two arms as parallel processes, then their verdict:
    python bench/on_policy.py --student DIR --arms off --seed 0 > off.log
    python bench/on_policy.py --student DIR --arms mix --seed 0 > mix.log
    python bench/on_policy.py --compare off.log mix.log
    # several settings or seeds at once (pairs), their trade-off drawn against the target region:
    python bench/on_policy.py --compare off0.log mix0.log off1.log mix1.log --plot trade_off.png

SmolLM2-135M-Instruct teacher; the student is ``--student`` (an HF folder, e.g. the demo's pruned
student) or, without it, the teacher's layers 0-3 and 24-29. Built-in data packed into ``prompt + gen``
token blocks. Two arms start from the same student and see the same block order, each for ``--budget``
seconds of training (forward, rollouts, backward, optimizer), AdamW at a constant lr 3e-4 (``--schedule
cosine`` gives the recipe's warmup + cosine decay over the budget):

* **off-policy**: every micro-batch is data blocks (KD + CE, the recipe's default terms; ``--ce-weight`` sets
  CE's weight in both arms, 0 for KD alone);
* **on-policy mix**: a share ``--fraction`` of micro-batches are the student's own continuations
  of the blocks' first ``--prompt`` tokens (``--gen`` new tokens, through
  :class:`distill.on_policy.OnPolicy`, i.e. serve's engine over the live weights; divergence only,
  ``--on-kind``), optionally after a warm start of ``--on-start`` of the budget off-policy. ``--gen-rows``
  rolls out fewer rows than the micro-batch, ``--rollout-rows`` decodes several micro-batches' rows at once
  and queues them (the recipe's gen_batch_size and gen_rollout_rows). ``--project data`` (or ``momentum``)
  removes from a rollout gradient its component against the last data step's gradient (or AdamW's first
  moment) when the two conflict (PCGrad's projection); every arm logs the mean cosine of the rollout gradients
  with that direction (``rollout_cos``) and how many conflicted. ``--on-end`` ends the mix early (the rest of the
  budget on data), ``--on-opt separate`` gives rollout steps an AdamW state of their own, ``--on-params blocks``
  lets them move only the decoder layers. ``--on-seq W`` adds to the rollouts' reverse KL the part of its
  sequence-level gradient the token-level loss leaves out (how each sampled token steers the later positions:
  a policy-gradient term with a running baseline, :class:`SequenceRKL`), at weight ``W`` against it.
  ``--on-teacher-temp T`` teaches the rollouts the teacher's distribution at temperature T (the student's at 1),
  ``--on-prompt-grad S`` scales the rollout gradient's path through the prompt's keys and values (0: the prompt
  runs without autograd, a slightly cheaper rollout step). ``--on-joint`` adds each rollout's gradient to a data
  step's instead of giving it a step of its own (each clipped first, one update). ``--on-correct K`` has the
  teacher vet the rollouts before the loss (speculative KD's interleaving, in one pass): a generated token outside
  the teacher's top K at its position is replaced by a draw from the teacher there (:func:`teacher_corrected`).

``--device cuda`` runs models, training and eval on a GPU (fp32, like the CPU arms).

Measured after each arm, on held-out data the training never saw:

* held-out perplexity (``--eval-blocks`` packed held-out blocks);
* reverse KL to the teacher on the student's *own* continuations: the student continues
  ``--eval-prompts`` held-out prompts (``--eval-samples`` times each, sampling at T = 1 with the same
  request seeds in every arm), then ``sum over generated tokens of KL(p_student || p_teacher)`` / their
  number — the exposure-bias gap on-policy training targets — with its standard error over
  continuations. At 32 prompts that error is ~4 % of the value (~6 % on an arm-to-arm change, as large
  as the effect); the default 128 prompts make it ~2 % (~3 % on the change).

Clock: ``--clock cpu`` (default) counts the budget and the step times in this process's CPU seconds.
With ``--threads 1`` that is the wall-clock of an unloaded machine, and it stays fair when the machine
is shared: a wall-clock budget would give more training to whichever arm ran in a quieter moment.
(CPU seconds per step still grow somewhat with contention: run the arms of one comparison side by side,
``--arms off`` / ``--arms mix``, so they see the same load.) ``--clock wall`` counts wall seconds (use it
on a machine of your own). Both are recorded. ``--clock steps`` counts the budget in off-policy steps and
charges each on-policy step ``--on-cost`` of one (the mean step-cost ratio a ``cpu`` run measured): the
number of steps and the lr schedule no longer depend on the machine's load, so an arm rerun with the same
seed gives the same numbers, and arms need not run side by side. The step times are still measured (CPU
seconds), and the verdict says whether the charged cost covered the measured one.

Step cost: inside the on-policy arm (off- and on-policy steps interleaved), the median time of
on-policy steps over that of off-policy steps (same micro-batch size, same sequence length), in CPU
and in wall seconds. JSON last line.
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

from core.environment import differences, environment, json_line  # noqa: E402
from core.models import cache_kwargs, returned_cache  # noqa: E402


def eval_windows(blocks: torch.Tensor, prompt: int, count: int) -> list[list[int]]:
    """``count`` held-out prompts of ``prompt`` tokens: consecutive windows of each held-out block, block by block.

    A block of ``prompt + gen`` tokens yields ``(prompt + gen) // prompt`` windows (two at the defaults), so the
    reverse-KL eval can use more prompts than there are held-out blocks; every window is held-out text.
    """
    per_block = blocks.shape[1] // prompt
    out = [blocks[b, w * prompt: (w + 1) * prompt].tolist() for w in range(per_block) for b in range(blocks.shape[0])]
    if count > len(out):
        raise SystemExit(f"--eval-prompts {count} exceeds the {len(out)} held-out windows of {prompt} tokens; lower it")
    return out[:count]


@torch.no_grad()
def own_continuation_rkl(student, teacher, tokenizer, prompts: list[list[int]], gen: int, seed: int,
                         samples: int = 1, batch: int = 8) -> dict[str, float]:
    """Reverse KL(student || teacher) per generated token on the student's own continuations of ``prompts``.

    Each prompt is continued ``samples`` times (T = 1, request seeds ``seed + i``: both arms draw with the same
    seeds). Returns ``rkl`` (summed KL over all generated tokens / their number) and ``se`` (its standard error,
    the ratio estimator's over continuations, which are independent given the student).
    """
    from distill.on_policy import Rollouts, rollout_batch
    from serve.sampling import SamplingParams

    todo = [p for p in prompts for _ in range(samples)]
    rollouts = Rollouts(student, tokenizer, max_batch=min(len(todo), 32), max_seq_len=len(prompts[0]) + gen)
    sums, counts = [], []
    was = student.training
    dev = next(student.parameters()).device
    for lo in range(0, len(todo), 32):  # engine batches of 32 rows
        chunk = todo[lo: lo + 32]
        params = [SamplingParams(max_new_tokens=gen, temperature=1.0, seed=seed + lo + i) for i in range(len(chunk))]
        # the generated tokens only, as every logged arm measured them (training rollouts keep the stop token)
        rb = rollout_batch(chunk, rollouts.generate(chunk, params, with_stop=False), tokenizer.pad_token_id or 0)
        student.eval()
        for r in range(0, len(chunk), batch):  # [batch, seq, vocab] fp32 logits of two models stay small
            ids, mask = rb["input_ids"][r: r + batch].to(dev), rb["attention_mask"][r: r + batch].to(dev)
            valid = rb["labels"][r: r + batch, 1:].to(dev) != -100  # position t predicts token t + 1
            log_q = student(input_ids=ids, attention_mask=mask).logits[:, :-1][valid].float().log_softmax(-1)
            log_p = teacher(input_ids=ids, attention_mask=mask).logits[:, :-1][valid].float().log_softmax(-1)
            kl = (log_q.exp() * (log_q - log_p)).sum(-1)  # [valid tokens]
            rows = torch.arange(ids.shape[0], device=dev).unsqueeze(1).expand_as(valid)[valid]
            sums += torch.zeros(ids.shape[0], dtype=torch.float64, device=dev).index_add_(0, rows, kl.double()).tolist()
            counts += valid.sum(1).tolist()
    student.train(was)
    s, c = torch.tensor(sums, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)
    rkl = float(s.sum() / c.sum().clamp(min=1))
    n = len(sums)
    se = float(((s - rkl * c) ** 2).sum().div(max(n - 1, 1) * n).sqrt() / c.mean().clamp(min=1e-9))
    return {"rkl": rkl, "se": se}


@torch.no_grad()
def perplexity(student, blocks: torch.Tensor, batch: int) -> float:
    from distill.data import eval_batches
    from eval.metrics import evaluate_lm

    was = student.training
    student.eval()
    ppl = evaluate_lm(student, eval_batches(blocks, batch), device=next(student.parameters()).device)[0].perplexity
    student.train(was)
    return ppl


def lr_multiplier(args, step: int, progress: float) -> float:
    """The recipe's warmup + cosine (``distill.training.warmup_cosine``) with the budget share as its progress.

    Linear warmup over ``--warmup`` steps, then cosine decay to ``--min-lr-ratio`` at the end of the budget
    (the number of steps a budget buys is not known in advance); ``--schedule constant``: 1.
    """
    if args.schedule == "constant":
        return 1.0
    if step < args.warmup:
        return (step + 1) / (args.warmup + 1)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _clock(kind: str):
    """What step times are measured in: wall seconds for ``--clock wall``, else CPU seconds."""
    return time.perf_counter if kind == "wall" else time.process_time


def _clock_name(args) -> str:
    return "wall" if args.clock == "wall" else "cpu"


def _budget_text(args) -> str:
    if args.clock == "steps":
        charge = f"on-policy steps charged {args.on_cost:g}" if args.on_cost else "no on-policy charge"
        return f"{args.budget:.0f} off-policy steps ({charge})"
    return f"{args.budget:.0f}s ({args.clock})"


class Budget:
    """What an arm has spent of ``--budget``: CPU or wall seconds, or off-policy steps (``--clock steps``).

    In steps, an off-policy step costs 1 and an on-policy step ``on_cost``: the arm's length and its lr
    schedule are then a function of the settings alone, not of the machine's load.
    """

    def __init__(self, kind: str, total: float, on_cost: float | None = None):
        self.kind, self.total, self.on_cost = kind, total, on_cost
        self._clock, self.units = _clock(kind), 0.0
        self.t0 = self._clock()

    def spent(self) -> float:
        return self.units if self.kind == "steps" else self._clock() - self.t0

    def left(self) -> bool:
        return self.spent() < self.total

    def progress(self) -> float:
        """Share of the budget spent, the cosine schedule's clock."""
        return self.spent() / self.total

    def charge(self, on: bool) -> None:
        """One step done (counted only by ``--clock steps``; time runs by itself)."""
        if on and self.kind == "steps" and self.on_cost is None:
            raise ValueError("--clock steps charges an on-policy step --on-cost; none was given")
        self.units += self.on_cost if on else 1.0


def project_conflict(params: list[torch.Tensor], reference: list[torch.Tensor | None], apply: bool = True) -> float:
    """Remove from ``params``' gradients their component along ``reference`` when the two point apart.

    The rollout gradient ``g`` and the data direction ``r`` (flattened over all parameters): if ``g . r < 0``,
    ``g <- g - (g . r / |r|^2) r`` (PCGrad's projection), so the update made on rollouts does not undo, to first
    order, what the data steps are doing. Returns the cosine of ``g`` and ``r`` before the projection (nan when
    there is no reference yet); ``apply=False`` only measures it.
    """
    pairs = [(q.grad, r) for q, r in zip(params, reference) if q.grad is not None and r is not None]
    if not pairs:
        return math.nan
    # fp32 dot products per tensor, summed in Python floats: no float64 copies of the gradients
    dot = sum(float(torch.dot(g.reshape(-1), r.reshape(-1))) for g, r in pairs)
    rr = sum(float(torch.dot(r.reshape(-1), r.reshape(-1))) for _, r in pairs)
    gg = sum(float(torch.dot(g.reshape(-1), g.reshape(-1))) for g, _ in pairs)
    cos = dot / math.sqrt(max(rr * gg, 1e-30))
    if apply and dot < 0 and rr > 0:
        for g, r in pairs:
            g.sub_(r.to(g.dtype), alpha=dot / rr)
    return cos


class SequenceRKL:
    """Reverse KL on rollouts with the sequence-level (policy-gradient) term of its gradient (``--on-seq``).

    What the eval measures is the sequence-level reverse KL ``J = E_{y ~ q} [sum_t KL_t(y_<t)]`` with
    ``KL_t = KL(q(.|y_<t) || p(.|y_<t))``. The token-level rollout loss (the recipe's) differentiates only each
    ``KL_t`` at its sampled prefix; ``J``'s gradient has a second part, the effect of each sampled token on the
    prefixes that follow it: ``E[sum_t grad log q(y_t|y_<t) * R_t]`` with ``R_t = sum_{s>t} gamma^(s-t) KL_s``
    (``gamma`` = 1 is exact; below 1 trades bias for variance). The loss is

        mean_t KL_t + weight * mean_t log q(y_t|y_<t) * (R_t - b_j) / sigma

    with ``R_t`` detached, ``b_j`` a running mean of ``R`` at generated index ``j`` (a baseline independent of
    the sample, so the term stays unbiased) and ``sigma`` a running RMS of ``R - b`` (so ``weight`` is the
    term's size against the token-level one, whatever the scale of the returns).

    ``max_entropy`` (``--on-max-entropy``) drops the generated positions where the teacher's entropy is at least
    that many nats from both parts: the rollout loss then teaches only where the teacher is sure of the next token.
    ``teacher_temp`` (``--on-teacher-temp``) divides the teacher's logits before its log-softmax (the student's stay
    at T = 1): below 1 the rollouts are taught a sharper target than the teacher's own. ``prompt_grad``
    (``--on-prompt-grad``) scales the part of the gradient that flows through the prompt's keys and values (the
    prompt: all but its last token, whose logit predicts the first generated one); the loss is the same. At 0 the
    prompt runs without autograd and the rest on top of its key/value cache, so the backward covers only the
    generated half; other scales go through forward hooks on the ``k_proj`` / ``v_proj`` outputs.
    """

    def __init__(self, weight: float, gamma: float, gen: int, decay: float = 0.9, max_entropy: float | None = None,
                 teacher_temp: float = 1.0, prompt_grad: float = 1.0):
        self.weight, self.gamma, self.decay = weight, gamma, decay
        self.max_entropy = max_entropy  # positions where the teacher's entropy is at least this carry no loss
        self.teacher_temp, self.prompt_grad = teacher_temp, prompt_grad
        self._kv_proj: list | None = None  # the student's k_proj / v_proj modules (prompt_grad other than 0 and 1)
        self._cache_key: str | None = None  # the forward's K/V cache keyword (prompt_grad 0)
        self.baseline: torch.Tensor | None = None  # [gen] running mean return per generated index
        self.rms: float | None = None
        self.gen = gen

    def _scale_prompt_kv(self, student, start: int) -> list:
        """Forward hooks that keep every ``k_proj`` / ``v_proj`` output's value and scale the gradient through its
        first ``start`` positions by ``prompt_grad``: ``[rows, seq, dim]`` -> the same."""
        scale = self.prompt_grad

        def hook(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
            head = out[:, :start]
            return torch.cat([head * scale + head.detach() * (1 - scale), out[:, start:]], 1)

        if self._kv_proj is None:  # found once: the student is the same module on every step
            self._kv_proj = [m for name, m in student.named_modules()
                             if name.endswith(("self_attn.k_proj", "self_attn.v_proj"))]
        if not self._kv_proj:
            raise SystemExit("--on-prompt-grad: the student has no self_attn.k_proj / v_proj modules to scale; use 0 or 1")
        return [m.register_forward_hook(hook) for m in self._kv_proj]

    @staticmethod
    def returns(kl: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
        """``[rows, n]`` per-position KL (0 where not ``valid``) -> ``[rows, n]`` discounted sums over later positions."""
        out = torch.zeros_like(kl)
        acc = torch.zeros_like(kl[:, 0])
        for t in range(kl.shape[1] - 1, -1, -1):
            out[:, t] = acc * valid[:, t]
            acc = gamma * (acc + kl[:, t] * valid[:, t])
        return out

    def loss(self, student, teacher, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """``batch``: :func:`distill.on_policy.rollout_batch` rows with one prompt length. Returns (loss, terms)."""
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        valid = labels[:, 1:] != -100  # [rows, seq - 1]: position t predicts token t + 1
        start = int(valid.float().argmax(1).min())  # first position that predicts a generated token
        valid = valid[:, start:]
        if self.prompt_grad != 0 or start == 0:
            hooks = [] if self.prompt_grad == 1 else self._scale_prompt_kv(student, start)
            try:
                log_q = student(input_ids=ids, attention_mask=mask).logits[:, start:-1].float().log_softmax(-1)
            finally:
                for h in hooks:
                    h.remove()
        else:  # the prompt's first start tokens are constants: their K/V cache, then the rest with autograd
            if self._cache_key is None:  # read off the forward's signature once
                self._cache_key = next(iter(cache_kwargs(student, None)))
            with torch.no_grad():
                past = returned_cache(student(input_ids=ids[:, :start], attention_mask=mask[:, :start], use_cache=True))
            log_q = student(input_ids=ids[:, start:], attention_mask=mask, use_cache=False,
                            **{self._cache_key: past}).logits[:, :-1].float().log_softmax(-1)
        with torch.no_grad():
            log_p = (teacher(input_ids=ids, attention_mask=mask).logits[:, start:-1].float()
                     / self.teacher_temp).log_softmax(-1)
            if self.max_entropy is not None:
                valid = valid & (-(log_p.exp() * log_p).sum(-1) < self.max_entropy)
        kl = (log_q.exp() * (log_q - log_p)).sum(-1) * valid  # [rows, n]
        n = valid.sum().clamp(min=1)
        direct = kl.sum() / n
        if self.weight == 0:
            return direct, {"direct": float(direct.detach())}
        ret = self.returns(kl.detach(), valid, self.gamma)  # [rows, n]
        mean = (ret * valid).sum(0) / valid.sum(0).clamp(min=1)  # [n] this batch's mean return per index
        if self.baseline is None:
            self.baseline = mean.clone()
        base = self.baseline[: ret.shape[1]]
        adv = (ret - base) * valid
        rms = float((adv.square().sum() / n).sqrt())
        # (the first batch sets the baseline, so its advantages are 0: the scale starts at the next one)
        self.rms = rms if not self.rms else self.decay * self.rms + (1 - self.decay) * rms
        adv = adv / max(self.rms, 1e-6)
        # the running statistics move after use: this sample's returns never enter its own baseline
        self.baseline[: ret.shape[1]] = self.decay * base + (1 - self.decay) * mean
        logq_y = log_q.gather(-1, labels[:, start + 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [rows, n]
        pg = (logq_y * adv).sum() / n
        return direct + self.weight * pg, {"direct": float(direct.detach()), "pg": float(pg.detach())}


@torch.no_grad()
def teacher_corrected(batch: dict[str, torch.Tensor], teacher, k: int, generator: torch.Generator
                      ) -> tuple[dict[str, torch.Tensor], int]:
    """Rollout rows with every generated token the teacher does not rank in its top ``k`` replaced by a draw from
    the teacher's distribution at that position (T = 1). Returns (the new rows, how many tokens were replaced).

    ``batch``: :func:`distill.on_policy.rollout_batch` rows (``input_ids`` / ``labels`` ``[rows, seq]``, labels
    -100 off the continuation). One teacher forward over the student's rollout decides every position at once,
    so a token after a replaced one was sampled after the student's token, not the teacher's (speculative KD
    interleaves token by token; this is its one-pass form, costing one teacher forward per rollout).
    """
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    device = next(teacher.parameters()).device
    logits = teacher(input_ids=ids.to(device), attention_mask=batch["attention_mask"].to(device)).logits[:, :-1]
    logits = logits.float().cpu()  # [rows, seq - 1]: position t predicts token t + 1
    gen = labels[:, 1:] != -100
    inside = (logits.topk(min(k, logits.shape[-1]), -1).indices == ids[:, 1:, None]).any(-1)
    reject = gen & ~inside  # [rows, seq - 1]
    if reject.any():
        draws = torch.multinomial(logits[reject].softmax(-1), 1, generator=generator).squeeze(-1)
        ids[:, 1:][reject] = draws
        labels[:, 1:][reject] = draws
    return {**batch, "input_ids": ids, "labels": labels}, int(reject.sum())


def run_arm(name: str, fraction: float, args, teacher, student0, tokenizer, data, eval_prompts) -> dict:
    from distill.model import DistillModel, LossConfig
    from distill.on_policy import OnPolicy, OnPolicySettings

    torch.manual_seed(args.seed)
    student = copy.deepcopy(student0).train()
    loss_cfg = LossConfig(kd_weight=1.0, kd_kind=args.kind, temperature=1.0, beta=args.beta, kd_chunk_size=1024,
                          ce_weight=args.ce_weight, focal_weight=0.0, focal_alpha=0.25, focal_gamma=2.0, hidden_weight=0.0,
                          hidden_layers=[], hidden_kind="nmse", attn_weight=0.0, attn_layers=[], attn_num_queries=0)
    model = DistillModel(student, teacher, loss_cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95))
    # --on-opt separate: rollout steps keep their own AdamW moments, so no rollout gradient rides on in the data
    # steps' first moment (and the data steps' momentum is not applied on rollout steps)
    on_opt = (torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95))
              if args.on_opt == "separate" else opt)
    rollout_len = args.on_gen or args.gen
    settings = OnPolicySettings(fraction=fraction, max_new_tokens=rollout_len, temperature=args.gen_temperature,
                                prompt_tokens=args.prompt, seed=args.seed, kd_kind=args.on_kind, rows=args.gen_rows,
                                rollout_rows=args.rollout_rows)
    policy = OnPolicy(settings, model, model, tokenizer, args.batch)
    corrected = [0, 0]  # --on-correct: generated tokens replaced by the teacher's, generated tokens seen
    if args.on_correct:
        rollouts, draws = policy.generate, torch.Generator().manual_seed(args.seed)

        def vetted(blocks: torch.Tensor, step: int, micro: int) -> dict[str, torch.Tensor]:
            batch, n = teacher_corrected(rollouts(blocks, step, micro), teacher, args.on_correct, draws)
            corrected[0] += n
            corrected[1] += int((batch["labels"] != -100).sum())
            return batch

        policy.generate = vetted  # what policy.forward rolls out through
    device = next(student.parameters()).device
    params = [q for q in student.parameters() if q.requires_grad]
    last_data: list[torch.Tensor | None] = [None] * len(params)  # --project data: the last data step's gradient
    cosines: list[float] = []  # rollout gradient vs the data direction, at every on-policy step
    seq = (SequenceRKL(args.on_seq, args.on_seq_gamma, rollout_len, max_entropy=args.on_max_entropy,
                       teacher_temp=args.on_teacher_temp, prompt_grad=args.on_prompt_grad)
           if args.on_seq > 0 or args.on_max_entropy is not None or args.on_teacher_temp != 1
           or args.on_prompt_grad != 1 else None)
    order = torch.randperm(data.train.shape[0], generator=torch.Generator().manual_seed(args.seed))
    clock = _clock(args.clock)
    times = {"on": [], "off": []}
    walls = {"on": [], "off": []}
    budget = Budget(args.clock, args.budget, args.on_cost)
    unit = "steps" if args.clock == "steps" else "s"
    # --ema: an exponential moving average of the weights, updated after every step; the arm is scored on it
    ema = [q.detach().clone() for q in params] if args.ema else None
    t_start, w_start, step = clock(), time.perf_counter(), 0
    first_on = None  # the step at which the warm start (--on-start) ended and the mix began
    while budget.left():
        pick = order[(step * args.batch) % len(order):][: args.batch]
        if len(pick) < args.batch:
            pick = order[: args.batch]
        blocks = data.train[pick].to(device)
        t0, w0 = clock(), time.perf_counter()
        if first_on is None and budget.progress() >= args.on_start:
            first_on = step
        # --on-end: the last share of the budget is off-policy only, so data steps repair what rollouts cost
        on = first_on is not None and budget.progress() < args.on_end and policy.wants(step - first_on, 0, 1)
        step_opt = on_opt if on else opt
        for group in step_opt.param_groups:
            group["lr"] = args.lr * lr_multiplier(args, step, budget.progress()) * (args.on_lr if on else 1)
        data_g = None
        if on and args.on_joint:  # the step's data micro-batch first: its gradient clipped to 1 and set aside
            model(input_ids=blocks).loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            data_g = [q.grad for q in params]
            for q in params:
                q.grad = None
            times["off"].append(clock() - t0)
            walls["off"].append(time.perf_counter() - w0)
            budget.charge(False)
            t0, w0 = clock(), time.perf_counter()
        if on and seq is not None:  # --on-seq, --on-max-entropy, --on-teacher-temp, --on-prompt-grad: computed here
            loss = seq.loss(student, teacher, {k: v.to(device) for k, v in policy.generate(blocks, step, 0).items()})[0]
        else:
            loss = (policy.forward(blocks, step, 0, device) if on else model(input_ids=blocks)).loss
        loss.backward()
        if on:  # --project none still measures how the rollout gradient sits against AdamW's momentum
            ref = (data_g if data_g is not None else last_data) if args.project == "data" else \
                [opt.state[q].get("exp_avg") for q in params]
            cosines.append(project_conflict(params, ref, apply=args.project != "none"))
        elif args.project == "data":  # copied into buffers kept from the first data step on (no new allocations)
            if last_data[0] is None:
                last_data = [None if q.grad is None else q.grad.detach().clone() for q in params]
            else:
                torch._foreach_copy_(last_data, [q.grad for q in params])
        # Every step's gradient norm is far above 1 here, so the clip sets each step's size: --on-clip scales a
        # rollout step's gradient against a data step's (a loss weight would not, it is clipped away).
        if on and args.on_params != "all":  # blocks: only the decoder layers move; head: only what they leave out
            for name_, q in student.named_parameters():
                if (".layers." in name_) == (args.on_params == "head"):
                    q.grad = None
        torch.nn.utils.clip_grad_norm_(student.parameters(), args.on_clip if on else 1.0)
        if data_g is not None:  # --on-joint: one update from the two clipped gradients
            for q, g in zip(params, data_g):
                if g is not None:
                    q.grad = g if q.grad is None else q.grad.add_(g)
        step_opt.step()
        step_opt.zero_grad(set_to_none=True)
        if ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(ema, [q.detach() for q in params], 1 - args.ema)
        times["on" if on else "off"].append(clock() - t0)
        walls["on" if on else "off"].append(time.perf_counter() - w0)
        budget.charge(on)
        step += 1
        kind_ = "data + rollout" if data_g is not None else ("on-policy" if on else "off-policy")
        print(f"    {name} step {step}: {kind_}, {times['on' if on else 'off'][-1]:.1f}s "
              f"({_clock_name(args)}), {budget.spent():.0f}/{args.budget:.0f}{unit}", flush=True)
    elapsed, wall = clock() - t_start, time.perf_counter() - w_start
    measured = [c for c in cosines if not math.isnan(c)]
    model.remove_hooks()
    if ema is not None:  # score (and save) the averaged weights
        with torch.no_grad():
            torch._foreach_copy_([q.data for q in params], ema)
    if args.save:  # the trained weights, to evaluate again later with other eval settings
        Path(args.save).mkdir(parents=True, exist_ok=True)
        torch.save(student.state_dict(), Path(args.save) / f"seed{args.seed}_{'off' if fraction == 0 else 'mix'}.pt")
    ppl = perplexity(student, data.eval[: args.eval_blocks], args.batch)
    ev = own_continuation_rkl(student, teacher, tokenizer, eval_prompts, args.gen, args.eval_seed, args.eval_samples)
    rkl = ev["rkl"]
    stats = policy.stats(wall)  # rollout seconds are wall seconds
    med = {k: statistics.median(v) if v else math.nan for k, v in times.items()}
    wmed = {k: statistics.median(v) if v else math.nan for k, v in walls.items()}
    mean = {k: statistics.fmean(v) if v else math.nan for k, v in times.items()}
    row = {"arm": name, "fraction": fraction, "steps": step, "seconds": elapsed, "wall_seconds": wall,
           "ppl": ppl, "own_rkl": rkl, "own_rkl_se": ev["se"], "on_steps": len(times["on"]), "off_steps": len(times["off"]),
           "on_step_s": med["on"], "off_step_s": med["off"], "on_step_wall_s": wmed["on"],
           "off_step_wall_s": wmed["off"], "on_step_mean_s": mean["on"], "off_step_mean_s": mean["off"],
           "rollout_tok_s": stats["rollout_tok_s"],
           "gen_time_share": stats["gen_time_share"], "decode_copy_syncs": policy.rollouts.syncs,
           "rollout_cos": statistics.fmean(measured) if measured else math.nan,
           "rollout_conflicts": sum(1 for c in measured if c < 0),
           "corrected_share": corrected[0] / corrected[1] if corrected[1] else math.nan, "environment": environment()}
    print(f"  {name}: {step} steps in {elapsed:.0f}s ({_clock_name(args)}; {wall:.0f}s wall), ppl {ppl:.2f}, "
          f"reverse KL on own continuations {rkl:.4f} (SE {ev['se']:.4f})", flush=True)
    return row


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--student", default=None, help="student HF folder (default: teacher layers 0-3,24-29)")
    ap.add_argument("--budget", type=float, default=300.0, help="training budget per arm: seconds, or off-policy "
                    "steps with --clock steps")
    ap.add_argument("--clock", choices=("cpu", "wall", "steps"), default="cpu",
                    help="budget in process CPU seconds (fair on a shared machine), wall seconds, or off-policy "
                    "steps with on-policy steps charged --on-cost (reproducible: independent of the load)")
    ap.add_argument("--on-cost", type=float, default=None, help="--clock steps: what one on-policy step costs, in "
                    "off-policy steps (the mean step-cost ratio a --clock cpu run of the same settings measured)")
    ap.add_argument("--fraction", type=float, default=0.5, help="on-policy share of micro-batches in the mix")
    ap.add_argument("--kind", default="forward_kl", help="divergence for both arms (forward_kl, reverse_kl, jsd, ...)")
    ap.add_argument("--ce-weight", type=float, default=1.0, help="weight of CE on the data micro-batches of both "
                    "arms (the recipe's ce_weight; 0: KD alone)")
    ap.add_argument("--on-kind", default=None, help="divergence on on-policy micro-batches only (the recipe's gen_kd_kind; default: --kind)")
    ap.add_argument("--beta", type=float, default=0.5, help="JSD / skew KL beta")
    ap.add_argument("--on-start", type=float, default=0.0, help="warm start: share of the budget trained "
                    "off-policy before the mix (with --fraction of on-policy micro-batches) begins")
    ap.add_argument("--on-end", type=float, default=1.0, help="share of the budget after which every step is "
                    "off-policy (a cool-down on data; 1: the mix runs to the end)")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per on-policy prompt")
    ap.add_argument("--on-gen", type=int, default=None,
                    help="tokens generated per training rollout, if not --gen (the eval's continuations keep --gen): "
                         "shorter rollouts make an on-policy step cheaper, so the mix keeps more data steps")
    ap.add_argument("--gen-rows", type=int, default=0, help="prompts rolled out per on-policy micro-batch (the "
                    "recipe's gen_batch_size; 0: --batch)")
    ap.add_argument("--rollout-rows", type=int, default=0, help="rows decoded per engine call, the surplus queued for "
                    "the next on-policy micro-batches (the recipe's gen_rollout_rows; 0: --gen-rows)")
    ap.add_argument("--on-lr", type=float, default=1.0, help="lr multiplier of the on-policy steps (exploration; "
                    "AdamW's first moment applies most of a rollout gradient in the later, mostly data, steps, so "
                    "this scales only about 1 - beta1 of it)")
    ap.add_argument("--project", choices=("none", "momentum", "data"), default="none",
                    help="on-policy steps: remove from the rollout gradient its component along the data direction "
                    "when the two conflict (PCGrad): AdamW's first moment, or the last data step's gradient")
    ap.add_argument("--on-clip", type=float, default=1.0, help="gradient-norm clip of the on-policy steps (data steps "
                    "clip at 1; the gradients' norms are 5-17, so this sets a rollout step's size against a data step's)")
    ap.add_argument("--on-opt", choices=("shared", "separate"), default="shared",
                    help="AdamW state of the on-policy steps: the data steps' (shared) or their own (separate)")
    ap.add_argument("--on-params", choices=("all", "blocks", "head"), default="all",
                    help="what the on-policy steps update: every parameter, only the decoder layers (blocks), or only what "
                    "lies outside them: embeddings, final norm and head (head)")
    ap.add_argument("--on-seq", type=float, default=0.0, help="weight of the sequence-level (policy-gradient) "
                    "term of the reverse KL on rollouts (SequenceRKL; 0: the token-level loss only). Needs "
                    "--on-kind reverse_kl")
    ap.add_argument("--on-seq-gamma", type=float, default=1.0, help="discount of the later positions' KL in "
                    "--on-seq's returns (1: the exact gradient)")
    ap.add_argument("--on-max-entropy", type=float, default=None, help="rollout positions where the teacher's "
                    "entropy (nats) is at least this carry no loss: the student is not taught to be flat on its own "
                    "degenerate text")
    ap.add_argument("--on-teacher-temp", type=float, default=1.0, help="the rollout loss's teacher logits are "
                    "divided by this (the student's are not): below 1 a sharper target on the student's own text")
    ap.add_argument("--on-prompt-grad", type=float, default=1.0, help="scale of the rollout gradient's path "
                    "through the prompt's keys and values (0: the prompt runs without autograd, a K/V cache the "
                    "generated half attends to: a slightly cheaper on-policy step)")
    ap.add_argument("--on-joint", action="store_true", help="a rollout rides on a data step: the step's data "
                    "gradient (clipped to 1) plus the rollout's (clipped to --on-clip), one update; charged 1 + "
                    "--on-cost")
    ap.add_argument("--on-correct", type=int, default=0, help="the teacher replaces each generated token outside "
                    "its top K by a draw of its own before the rollout loss (speculative KD, one pass; 0: off)")
    ap.add_argument("--ema", type=float, default=0.0, help="score each arm on an exponential moving average of its "
                    "weights with this decay per step (0: the last weights; pass it to both arms)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (models, training and eval)")
    ap.add_argument("--gen-temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (prefix of each block)")
    ap.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW (peak) learning rate; 3e-4, not the recipe's 1e-3: "
                    "with 1e-3 + cosine both arms end far worse here (off-policy held-out ppl 85-91 vs ~60)")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                    help="constant: --lr throughout; cosine: the recipe's warmup + cosine decay, over the budget")
    ap.add_argument("--warmup", type=int, default=4, help="warmup steps of the cosine schedule (the demo's)")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr of the cosine schedule")
    ap.add_argument("--eval-blocks", type=int, default=64, help="held-out blocks for perplexity (all of them if fewer)")
    ap.add_argument("--eval-prompts", type=int, default=128, help="held-out prompts for the reverse KL (consecutive "
                    "--prompt-token windows of the held-out blocks)")
    ap.add_argument("--eval-samples", type=int, default=1, help="continuations per held-out prompt")
    ap.add_argument("--eval-seed", type=int, default=10_000, help="sampling seed of the eval continuations (the "
                    "same for every arm)")
    ap.add_argument("--arms", choices=("both", "off", "mix"), default="both",
                    help="off: only the off-policy arm (its JSON can feed --off-json); mix: only the mix arm "
                    "(needs --off-json); both: one after the other")
    ap.add_argument("--off-json", default=None, help="reuse the off-policy arm of an earlier run's log (same "
                    "student, data, seed, budget, clock, lr, eval settings): only the mix arm runs")
    ap.add_argument("--compare", nargs="+", metavar="LOG", default=None,
                    help="only compare (no training): an --arms off log and an --arms mix log, or several such "
                    "pairs in a row (OFF MIX OFF MIX ...)")
    ap.add_argument("--plot", default=None, help="with --compare: draw each pair's reverse-KL change against its "
                    "perplexity change, with the target region, into this PNG")
    ap.add_argument("--skip-init", action="store_true", help="do not evaluate the untrained student (it does not "
                    "depend on the seed: one run of a seed sweep is enough)")
    ap.add_argument("--save", default=None, help="folder to save each arm's trained student state dict in")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.on_clip > 0:
        ap.error(f"--on-clip is a positive gradient norm, got {args.on_clip}")
    if not 0 <= args.on_start < 1:
        ap.error(f"--on-start is a share of the budget in [0, 1), got {args.on_start}")
    if not args.on_start < args.on_end <= 1:
        ap.error(f"--on-end is a share of the budget in (--on-start, 1], got {args.on_end}")
    if args.compare and len(args.compare) % 2:
        ap.error(f"--compare takes logs in pairs (OFF MIX OFF MIX ...), got {len(args.compare)}")
    if args.plot and not args.compare:
        ap.error("--plot draws the pairs of --compare; pass their logs")
    if args.off_json and args.arms == "off":
        ap.error("--off-json replaces the off-policy arm; drop it or use --arms mix")
    if args.clock == "steps" and args.on_cost is None and args.arms != "off" and not args.compare:
        ap.error("--clock steps charges each on-policy step --on-cost off-policy steps; pass it (e.g. the mean "
                 "step-cost ratio of a --clock cpu run)")
    if not args.ce_weight >= 0:
        ap.error(f"--ce-weight is a loss weight >= 0, got {args.ce_weight}")
    if args.on_gen is not None and args.on_gen < 1:
        ap.error(f"--on-gen is a number of generated tokens >= 1, got {args.on_gen}")
    if args.on_seq < 0 or not 0 < args.on_seq_gamma <= 1:
        ap.error("--on-seq is a weight >= 0 and --on-seq-gamma a discount in (0, 1]")
    if args.on_seq > 0 and (args.on_kind or args.kind) != "reverse_kl":
        ap.error("--on-seq adds the sequence-level term of the reverse KL; pass --on-kind reverse_kl")
    if args.on_max_entropy is not None and not args.on_max_entropy > 0:
        ap.error(f"--on-max-entropy is a teacher entropy in nats (> 0), got {args.on_max_entropy}")
    if args.on_max_entropy is not None and (args.on_kind or args.kind) != "reverse_kl":
        ap.error("--on-max-entropy masks the rollout reverse KL; pass --on-kind reverse_kl")
    if not args.on_teacher_temp > 0:
        ap.error(f"--on-teacher-temp is a positive temperature, got {args.on_teacher_temp}")
    if not args.on_prompt_grad >= 0:
        ap.error(f"--on-prompt-grad is a gradient scale >= 0, got {args.on_prompt_grad}")
    if (args.on_teacher_temp != 1 or args.on_prompt_grad != 1) and (args.on_kind or args.kind) != "reverse_kl":
        ap.error("--on-teacher-temp and --on-prompt-grad apply to the rollout reverse KL; pass --on-kind reverse_kl")
    if args.on_joint and (args.on_opt != "shared" or args.on_lr != 1):
        ap.error("--on-joint makes one update of the data and rollout gradients; drop --on-opt separate and --on-lr")
    if args.on_correct < 0:
        ap.error(f"--on-correct is a teacher top-K size >= 1 (0: off), got {args.on_correct}")
    if args.on_correct and (args.on_seq > 0 or args.on_max_entropy is not None or args.on_teacher_temp != 1
                            or args.on_prompt_grad != 1):
        ap.error("--on-correct vets the rollouts of the recipe's rollout loss; drop the --on-seq / --on-max-entropy / "
                 "--on-teacher-temp / --on-prompt-grad options")
    if not 0 <= args.ema < 1:
        ap.error(f"--ema is a decay per step in [0, 1), got {args.ema}")
    if args.on_cost is not None and not args.on_cost > 0:
        ap.error(f"--on-cost is a positive share of an off-policy step, got {args.on_cost}")
    return args


def main() -> None:
    args = parse_args()
    if args.compare:
        pairs = list(zip(args.compare[::2], args.compare[1::2]))
        if len(pairs) == 1 and not args.plot:
            compare(*pairs[0])
        else:
            compare_many(pairs, args.plot)
        return
    from core.models import load_causal_lm, load_tokenizer, smollm2_dir
    from distill.data import BUILTIN, build_data
    from distill.student import derive_student

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = str(smollm2_dir())
    teacher = load_causal_lm(path).eval().requires_grad_(False).to(args.device)
    tokenizer = load_tokenizer(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    student0 = (load_causal_lm(args.student) if args.student else derive_student(teacher, "0-3,24-29")).to(args.device)
    seq = args.prompt + args.gen
    data = build_data(tokenizer, dataset=BUILTIN, seq_len=seq, eval_blocks=max(args.eval_blocks, args.eval_prompts))
    eval_prompts = eval_windows(data.eval, args.prompt, args.eval_prompts)
    n_params = sum(p.numel() for p in student0.parameters()) / 1e6
    print(f"demo pair: student {args.student or 'teacher layers 0-3,24-29'} ({n_params:.0f}M), blocks of {seq} "
          f"tokens ({data.train.shape[0]} train / {min(args.eval_blocks, data.eval.shape[0])} held-out for ppl, "
          f"{len(eval_prompts)} held-out prompts x {args.eval_samples} continuations for the reverse KL), "
          f"micro-batch {args.batch} ({args.gen_rows or args.batch} rolled out, decoded "
          f"{args.rollout_rows or args.gen_rows or args.batch} at a time), lr {args.lr:g} ({args.schedule}), "
          f"{_budget_text(args)} per arm, kd_kind={args.kind} "
          f"(on-policy: {args.on_kind or args.kind}), threads={args.threads}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    loads = [os.getloadavg()[0]]
    init = off = mix = None
    if args.off_json:  # the off-policy arm of an earlier run with the same settings
        init, off = last_json(args.off_json)["init"], last_json(args.off_json)["off_policy"]
        print(f"  init and off-policy: from {args.off_json} ({off['steps']} steps)", flush=True)
    elif args.arms != "mix":
        init = None if args.skip_init else measure_init(args, student0, teacher, tokenizer, data, eval_prompts)
        off = run_arm("off-policy", 0.0, args, teacher, student0, tokenizer, data, eval_prompts)
        loads.append(os.getloadavg()[0])
    if args.arms != "off":
        mix = run_arm(f"on-policy {args.fraction:g}", args.fraction, args, teacher, student0, tokenizer, data,
                      eval_prompts)
        loads.append(os.getloadavg()[0])
    report(args, init, off, mix, loads)


def measure_init(args, student0, teacher, tokenizer, data, eval_prompts) -> dict:
    """Held-out perplexity and own-continuation reverse KL of the untrained student (the same for every seed)."""
    ev = own_continuation_rkl(student0, teacher, tokenizer, eval_prompts, args.gen, args.eval_seed, args.eval_samples)
    init = {"ppl": perplexity(student0, data.eval[: args.eval_blocks], args.batch), "own_rkl": ev["rkl"],
            "own_rkl_se": ev["se"]}
    print(f"  init: ppl {init['ppl']:.2f}, reverse KL on own continuations {init['own_rkl']:.4f} "
          f"(SE {init['own_rkl_se']:.4f})", flush=True)
    return init


def last_json(path: str) -> dict:
    """A bench log's result: its JSON last line (one-line errors for a missing log or an unfinished run)."""
    try:
        lines = Path(path).read_text().strip().splitlines()
    except OSError as e:
        raise SystemExit(f"cannot read the bench log {path} ({e.strerror}); pass the log of a finished arm") from None
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"{path} does not end in the bench's JSON line: pass the log of a finished arm") from None


def compare(off_log: str, mix_log: str, emit_json: bool = True) -> dict:
    """``--compare OFF MIX``: the verdict of two arms run as separate processes (``--arms off`` / ``--arms mix``)."""
    off, mix = last_json(off_log), last_json(mix_log)
    keys = ("budget_s", "clock", "student", "seed", "lr", "schedule", "kind", "ce_weight", "gen_tokens", "eval_prompts", "eval_samples",
            "eval_seed", "threads", "ema")
    usual = vars(parse_args([]))  # what a log older than a key ran with: the option's default
    differ = [k for k in keys if off.get(k, usual.get(k)) != mix.get(k, usual.get(k))]
    if differ or off["off_policy"] is None or mix["on_policy"] is None:
        raise SystemExit(f"--compare needs an --arms off log and an --arms mix log of the same settings; "
                         f"{'they differ in ' + ', '.join(differ) if differ else 'an arm is missing'}")
    args = argparse.Namespace(budget=mix["budget_s"], gen=mix["gen_tokens"], **{
        k: mix[k] for k in ("clock", "student", "seed", "lr", "schedule", "fraction", "on_start", "kind", "on_kind", "beta",
                            "gen_temperature", "threads", "eval_prompts", "eval_samples", "eval_seed")},
        **{k: mix.get(k, usual[k]) for k in ("gen_rows", "rollout_rows", "on_lr", "on_cost", "project", "on_end",
                                             "on_clip", "on_opt", "on_params", "on_seq", "on_seq_gamma",
                                             "on_max_entropy", "on_teacher_temp", "on_prompt_grad", "on_joint",
                                             "ce_weight", "on_gen", "on_correct", "ema")})
    return report(args, off["init"], off["off_policy"], mix["on_policy"], off["load_avg"] + mix["load_avg"], emit_json)


# What a mix log's label shows, by JSON key (the bench option's dest) and a short name.
_LABELS = (("fraction", "λ"), ("on_kind", "on-kind "), ("on_clip", "clip "), ("project", "project "),
           ("on_opt", "opt "), ("on_params", "params "), ("on_lr", "lr ×"), ("on_start", "start "),
           ("on_end", "end "), ("gen_temperature", "T "), ("gen_rows", "rows "), ("on_seq", "seq "),
           ("on_max_entropy", "max-H "), ("on_teacher_temp", "teacher T "), ("on_prompt_grad", "prompt grad "),
           ("on_joint", "joint"), ("ce_weight", "ce "), ("on_gen", "rollout tokens "),
           ("on_correct", "teacher top-"), ("ema", "EMA "))


def mix_label(mix: dict) -> str:
    """A mix log's settings, those at the bench's defaults left out, e.g. ``λ0.2 clip 2 project data``.

    The share is always shown; the rollout divergence is left out at reverse KL, the usual choice.
    """
    usual = vars(parse_args([])) | {"fraction": None, "on_kind": "reverse_kl"}
    parts = []
    for key, name in _LABELS:
        default = usual[key]
        value = mix.get(key, default)
        if isinstance(value, bool):  # a switch: its name when on
            parts.extend([name] if value else [])
        elif value is not None and (default is None or value != default):
            parts.append(f"{name}{value:g}" if isinstance(value, float) else f"{name}{value}")
    return " ".join(parts)


def compare_many(pairs: list[tuple[str, str]], plot: str | None) -> list[dict]:
    """``--compare OFF MIX OFF MIX ...``: every pair's verdict, a summary table, the trade-off plot (``--plot``)
    and one JSON last line with every pair."""
    rows = []
    for off_log, mix_log in pairs:
        out = compare(off_log, mix_log, emit_json=False)
        rows.append({"off_log": off_log, "mix_log": mix_log, "label": mix_label(out), "seed": out["seed"],
                     **{k: out[k] for k in ("student", "own_rkl_change", "own_rkl_change_se", "ppl_change",
                                            "target_rkl_met", "target_ppl_met")}})
    if len({r["student"] for r in rows}) > 1:  # pairs from different students: say which, or their points merge
        for r in rows:
            r["label"] += f" ({Path(str(r['student'])).name})"
    width = max(len(r["label"]) for r in rows)
    print(f"\n{'mix':<{width}} {'seed':>4} {'own-cont. rKL':>14} {'held-out ppl':>12}  both targets")
    for r in rows:
        print(f"{r['label']:<{width}} {r['seed']:>4} {r['own_rkl_change']:>+8.1%} ±{r['own_rkl_change_se']:.1%} "
              f"{r['ppl_change']:>+12.1%}  {'met' if r['target_rkl_met'] and r['target_ppl_met'] else 'not met'}")
    slopes = {label: trade_off_slope([r for r in rows if r["label"] == label])
              for label in dict.fromkeys(r["label"] for r in rows)}
    print(f"\nreverse-KL change per +1 % perplexity (least squares through the origin over a setting's seeds whose "
          f"perplexity rose; the targets' corner needs {TARGET_SLOPE:+.2f} or steeper):")
    for label, slope in slopes.items():
        n = sum(r["label"] == label and r["ppl_change"] > 0 for r in rows)
        print(f"  {label:<{width}} {'—' if slope is None else f'{slope:+.2f}'} ({n} pair{'s' * (n != 1)})")
    if plot:
        plot_trade_off(rows, Path(plot))
        print(f"trade-off plot: {plot}")
    print(json_line({"pairs": rows, "plot": plot, "slopes": slopes}))
    return rows


TARGET_SLOPE = -10 / 5  # the line from no change to the targets' corner: -10 % reverse KL at +5 % perplexity


def trade_off_slope(rows: list[dict]) -> float | None:
    """Reverse-KL change per unit of perplexity change over ``rows`` (pairs of one setting), least squares through
    the origin (λ = 0 changes nothing): ``sum(x * y) / sum(x * x)`` over the pairs whose perplexity rose (the others
    cost nothing to trade). Only a setting at or below ``TARGET_SLOPE`` can reach the targets' corner; None when no
    pair's perplexity rose."""
    pts = [(r["ppl_change"], r["own_rkl_change"]) for r in rows if r["ppl_change"] > 0]
    if not pts:
        return None
    return sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)


def plot_trade_off(rows: list[dict], path: Path) -> None:
    """Each pair as a point (perplexity change, reverse-KL change) with the reverse KL's standard error, one
    marker per setting, the region where both targets hold shaded, and the line from the origin through the
    targets' corner (a setting's points must lie on or under it to reach the targets by changing its dose)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    xs = [100 * r["ppl_change"] for r in rows]
    ys = [100 * r["own_rkl_change"] for r in rows]
    lo_x, hi_x = min(xs + [0.0]) - 2, max(xs + [5.0]) + 2
    lo_y, hi_y = min(ys + [-10.0]) - 3, max(ys + [0.0]) + 2
    ax.axvspan(lo_x, 5, ymin=0, ymax=(-10 - lo_y) / (hi_y - lo_y), color="tab:green", alpha=0.12,
               label="targets: rKL ≤ −10 %, ppl ≤ +5 %")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.axvline(0, color="grey", linewidth=0.8)
    markers = "osD^v<>pPX*h"
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for i, label in enumerate(labels):
        mine = [r for r in rows if r["label"] == label]
        ax.errorbar([100 * r["ppl_change"] for r in mine], [100 * r["own_rkl_change"] for r in mine],
                    yerr=[100 * r["own_rkl_change_se"] for r in mine], fmt=markers[i % len(markers)], capsize=3,
                    label=label)
        for r in mine:
            ax.annotate(f"s{r['seed']}", (100 * r["ppl_change"], 100 * r["own_rkl_change"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    ax.plot([0, hi_x], [0, TARGET_SLOPE * hi_x], ":", color="tab:green", linewidth=1.2,
            label=f"{TARGET_SLOPE:+.0f} % rKL per +1 % ppl (through the targets' corner)")
    ax.set_xlim(lo_x, hi_x)
    ax.set_ylim(lo_y, hi_y)
    ax.set_xlabel("held-out perplexity change vs off-policy (%)")
    ax.set_ylabel("reverse KL on own continuations, change (%)")
    ax.set_title("on-policy mix vs off-policy at equal compute")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the points, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args, init: dict, off: dict, mix: dict | None, loads: list[float], emit_json: bool = True) -> dict:
    """The table, the verdict lines and the JSON last line (``emit_json``); returns that JSON's dict."""
    print(f"\n{'arm':<16} {'steps':>5} {'held-out ppl':>12} {'own-cont. rKL':>13} {'rollout tok/s':>13} "
          f"{'gen share':>9}")
    if init is not None:
        print(f"{'init':<16} {'':>5} {init['ppl']:>12.2f} {init['own_rkl']:>13.4f}")
    for r in (x for x in (off, mix) if x is not None):
        print(f"{r['arm']:<16} {r['steps']:>5} {r['ppl']:>12.2f} {r['own_rkl']:>13.4f} "
              f"{r['rollout_tok_s']:>13.1f} {r['gen_time_share']:>9.2f}")
    out = {"budget_s": args.budget, "clock": args.clock, "student": args.student, "seed": args.seed, "lr": args.lr, "schedule": args.schedule,
           "fraction": args.fraction, "on_start": args.on_start, "on_end": args.on_end, "kind": args.kind, "on_kind": args.on_kind or args.kind, "beta": args.beta,
           "gen_tokens": args.gen, "gen_rows": args.gen_rows, "rollout_rows": args.rollout_rows,
           "on_lr": args.on_lr, "on_cost": args.on_cost, "gen_temperature": args.gen_temperature, "project": args.project,
           "on_clip": args.on_clip, "on_opt": args.on_opt, "on_params": args.on_params,
           "on_seq": args.on_seq, "on_seq_gamma": args.on_seq_gamma,
           "on_max_entropy": args.on_max_entropy, "on_teacher_temp": args.on_teacher_temp,
           "on_prompt_grad": args.on_prompt_grad, "on_joint": args.on_joint, "ce_weight": args.ce_weight,
           "on_gen": args.on_gen, "on_correct": args.on_correct, "ema": args.ema,
           "threads": args.threads,
           "eval_prompts": args.eval_prompts, "eval_samples": args.eval_samples, "eval_seed": args.eval_seed,
           "load_avg": loads, "init": init, "off_policy": off, "on_policy": mix}
    if off is not None and mix is not None:
        rkl_change = mix["own_rkl"] / off["own_rkl"] - 1
        ppl_change = mix["ppl"] / off["ppl"] - 1
        # the change's standard error from the two arms' (independent) eval errors, delta method
        rkl_se = (mix["own_rkl"] / off["own_rkl"]) * math.hypot(mix["own_rkl_se"] / mix["own_rkl"],
                                                                off["own_rkl_se"] / off["own_rkl"])
        both = mix["on_steps"] and mix["off_steps"]
        cost = mix["on_step_s"] / mix["off_step_s"] if both else math.nan
        cost_wall = mix["on_step_wall_s"] / mix["off_step_wall_s"] if both else math.nan
        # With queued rollouts (--rollout-rows) most on-policy steps decode nothing: the median hides the
        # rolling steps, the mean does not. Logs of older runs have no means.
        cost_mean = (mix.get("on_step_mean_s", math.nan) / mix.get("off_step_mean_s", math.nan)) if both else math.nan
        changed = differences(off.get("environment"), mix.get("environment"))  # logs of older runs have none
        if changed:
            print(f"\nnote: the arms ran under different environments ({'; '.join(changed)}): the change below "
                  "may be partly theirs")
        out["environment_differences"] = changed
        print(f"\non-policy mix vs off-policy: own-continuation reverse KL {rkl_change:+.1%} (eval SE {rkl_se:.1%}; "
              f"target <= -10%), held-out ppl {ppl_change:+.1%} (target <= +5%)")
        rows = f", {args.gen_rows} rollout rows" if args.gen_rows else ""
        rows += f" (decoded {args.rollout_rows} at a time)" if args.rollout_rows else ""
        print(f"step cost at {args.on_gen or args.gen} generated tokens{rows} (medians, {mix['on_steps']} on / {mix['off_steps']} off "
              f"steps interleaved): on-policy {mix['on_step_s']:.2f}s vs off-policy {mix['off_step_s']:.2f}s = "
              f"{cost:.2f}x {_clock_name(args)} ({cost_wall:.2f}x wall; means {cost_mean:.2f}x {_clock_name(args)}; "
              f"target <= 2x); "
              f"load average {', '.join(f'{x:.1f}' for x in loads)}")
        out.update({"own_rkl_change": rkl_change, "own_rkl_change_se": rkl_se, "ppl_change": ppl_change,
                    "step_cost_ratio": cost, "step_cost_ratio_wall": cost_wall, "step_cost_ratio_mean": cost_mean,
                    "target_rkl_met": rkl_change <= -0.10, "target_ppl_met": ppl_change <= 0.05,
                    "target_cost_met": cost <= 2.0 and not cost_mean > 2.0})
        if args.clock == "steps":
            # Equal compute holds only if the charge covered what an on-policy step really cost (5 % slack for
            # the noise of CPU times on a shared machine).
            covered = cost_mean <= args.on_cost * 1.05
            print(f"equal compute (--clock steps): on-policy steps charged {args.on_cost:.2f}x an off-policy step, "
                  f"measured {cost_mean:.2f}x (cpu mean): {'covered' if covered else 'NOT covered: the mix got more compute'}")
            out["on_cost_covered"] = covered
    if emit_json:
        print(json_line(out))
    return out


if __name__ == "__main__":
    main()
