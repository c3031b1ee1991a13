"""The pieces of a training loop that every recipe shares, so that no two copies drift apart.

A recipe keeps its loop in plain view (config → data → models → loop → save) and calls these for
the parts that must behave the same everywhere:

* :func:`start_run` / :func:`finish_run`: parse the config, claim the run folder, build the
  accelerator; at the end run the release gate and write ``summary.json``.
* :class:`Run`: resume (with the saved config compared to the new one), checkpoints written by
  every rank between barriers and renamed only when whole, the per-step record (history, progress
  bar, trackers, ``metrics.jsonl``, divergence check), ``loss.png`` redrawn as the run goes and the
  summary files.
* :func:`train_step`: one optimizer step over a step's micro-batches (accumulation, clipping,
  the loss terms averaged over processes).
* :func:`evaluate`: the one held-out evaluation loop (perplexity, agreement and KL to a reference).
* :func:`save_hf_dir`: a model as an HF directory, atomically and durably.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedDataParallelKwargs,
    DistributedType,
    InitProcessGroupKwargs,
    is_tensorboard_available,
    is_wandb_available,
)

from core import checkpoint as ckpt
from core import rundir
from core.config import ConfigError, check_resume_config, parse_config, save_config
from core.environment import differences, environment, finite_or_null
from core.fsio import atomic_write_text, is_saved_model, replace_dir, restore_aside
from core.models import resolve_model_path
from core.tiny import TINY, tiny_teacher, tiny_teacher_tokenizer
from distill.data import eval_batches
from distill.distributed import is_deepspeed, is_fsdp, zero_stage
from distill.threads import PeakRSS, setup_threads
from eval.gate import INPUT_ERRORS, GateConfig, input_exit_code, run_gate
from eval.metrics import LMStats, evaluate_lm
from eval.prompt_set import default_prompts_path

TRACKERS = ("none", "tensorboard", "wandb")
TRACKER_AVAILABLE: dict[str, Callable[[], bool]] = {"tensorboard": is_tensorboard_available, "wandb": is_wandb_available}
PRECISIONS = ("no", "bf16", "fp16", "auto")

# How long a rank waits at a barrier or collective before the process group gives up. Some work runs on the
# main process alone while the others wait: preparing a large corpus (main_process_first), the retrofit's
# pass-key check. NCCL's own default (10 minutes) would abort those runs.
DIST_TIMEOUT_ENV = "HYBRID_DISTILL_DIST_TIMEOUT"
DIST_TIMEOUT_S = 3 * 3600


# --------------------------------------------------------------------------------------------
# Run setup and teardown
# --------------------------------------------------------------------------------------------

def launched_with_deepspeed() -> bool:
    """``accelerate launch`` with a DeepSpeed config (it exports this before any ``Accelerator`` exists)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"


def launched_with_fsdp() -> bool:
    """``accelerate launch`` with an FSDP config (exported, like DeepSpeed's flag, before any ``Accelerator``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def dist_timeout() -> timedelta:
    """The process group's timeout: ``$HYBRID_DISTILL_DIST_TIMEOUT`` seconds, by default 3 hours."""
    raw = os.environ.get(DIST_TIMEOUT_ENV, "").strip()
    if not raw:
        return timedelta(seconds=DIST_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{DIST_TIMEOUT_ENV}={raw!r} is not a positive number of seconds; unset it for the "
                          f"default ({DIST_TIMEOUT_S} s)")
    return timedelta(seconds=seconds)


GRAD_ACCUM_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"


def check_launch_grad_accum(grad_accum: int) -> None:
    """Refuse a launch that sets another gradient accumulation than the recipe's ``grad_accum``.

    ``accelerate launch`` exports a launch config's ``gradient_accumulation_steps`` (``accelerate config`` writes
    one into every DeepSpeed config) as ``$ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, and ``Accelerator`` takes it
    over the value it is given. The recipe still runs ``grad_accum`` micro-batches per step, so the optimizer and
    the LR schedule would step every ``N`` micro-batches instead: with ``N`` = 1 and ``grad_accum`` = 16 the
    schedule would end after a sixteenth of the run, and nothing would say so.
    """
    launched = os.environ.get(GRAD_ACCUM_ENV, "").strip()
    if launched.isdigit() and int(launched) != grad_accum:
        raise ConfigError(
            f"the launch sets gradient_accumulation_steps={launched} (${GRAD_ACCUM_ENV}, from the launch config), "
            f"which would override grad_accum={grad_accum}; remove gradient_accumulation_steps from the launch "
            f"config (the recipe's grad_accum sets it) or set grad_accum={launched}")


def leaves_weights_unused(cfg: Any) -> bool:
    """True when no loss term of ``cfg`` reaches the logits (``kd_weight``, ``ce_weight`` and ``focal_weight`` all
    0; a config without them reaches them). The hidden-state and attention-map terms stop at their matched layers,
    so the head, the final norm and the layers past the deepest matched one get no gradient, and DDP stops at the
    second step ("Expected to have finished reduction in the prior iteration") unless it looks for unused
    parameters. DeepSpeed copes without being told."""
    weights = [getattr(cfg, k, None) for k in ("kd_weight", "ce_weight", "focal_weight")]
    return None not in weights and not any(weights)


def make_accelerator(cfg: Any, project_dir: Path) -> Accelerator:
    """An ``Accelerator`` from a recipe config (``mixed_precision``, ``grad_accum``, ``tracker``).

    ``mixed_precision=auto`` is bf16 on GPUs that support it and fp32 on CPU, where bf16 matmuls are
    several times slower. Without GPUs, distributed runs (DDP, DeepSpeed) need the gloo backend, or
    accelerate miscounts processes. The LR schedule is stepped by :func:`train_step`, once per optimizer
    step: accelerate's own stepping advances it ``num_processes`` times per step (it assumes a
    dataloader split across ranks, so a 2-process run would warm up and decay twice as fast). A launch
    that sets its own gradient accumulation is refused (:func:`check_launch_grad_accum`). DDP looks for
    parameters without a gradient only when some must go without (:func:`leaves_weights_unused`).
    Every backend waits :func:`dist_timeout` at a barrier (NCCL's default would be 10 minutes).
    """
    mixed = cfg.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    launched_apart = int(os.environ.get("WORLD_SIZE", "1")) > 1
    distributed = launched_apart or launched_with_deepspeed()
    gloo = distributed and not torch.cuda.is_available()
    handlers = [InitProcessGroupKwargs(backend="gloo", timeout=dist_timeout()) if gloo
                else InitProcessGroupKwargs(timeout=dist_timeout())]  # the backend: accelerate's choice
    if leaves_weights_unused(cfg):
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    check_launch_grad_accum(cfg.grad_accum)
    log_with = None if cfg.tracker == "none" else cfg.tracker
    # accelerate only warns and logs nowhere when a tracker's package is missing: a run that was asked
    # to log must not end "successfully" with no curves anywhere.
    if log_with is not None and not TRACKER_AVAILABLE[log_with]():
        raise ConfigError(f"tracker={log_with} needs its package: pip install -e \".[{log_with}]\" "
                          "(or set tracker=none)")
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mixed, log_with=log_with,
                              project_dir=str(project_dir), kwargs_handlers=handlers,
                              step_scheduler_with_optimizer=False)
    # Started apart, each rank trains its own copy on its share of the data: accelerate counts one process (a
    # multi-GPU launch on CPUs without ACCELERATE_USE_CPU), or counts them all with no backend joining them (an
    # FSDP launch on CPUs).
    if launched_apart and (accelerator.num_processes == 1 or accelerator.distributed_type == DistributedType.NO):
        raise ConfigError("several processes were launched but accelerate runs them apart; on CPU add "
                          "ACCELERATE_USE_CPU=true (see launch/README.md)")
    return accelerator


def start_run(config_cls: type, argv: list[str] | None = None, *, resume_safe: Iterable[str] = (),
              without_deepspeed: str | None = None, without_fsdp: str | None = None,
              check: Callable[[Any], None] | None = None) -> tuple[Any, Accelerator, Path]:
    """``(cfg, accelerator, output_dir)``: the config parsed and checked, the run folder claimed.

    Every process checks the folder before anything loads (:func:`core.rundir.check_output_dir`);
    the main process then claims it: an old run is removed only if ``overwrite`` allows it and the
    folder carries our marker, so a mistyped ``output_dir`` never loses files we did not write. A
    resume is checked here too: a config that differs from the checkpoint's outside ``resume_safe``, another
    global batch, another number of processes where the checkpoint's state is saved per process
    (:func:`check_resume_world`) or another distributed backend (:func:`check_resume_backend`) is refused before any
    model or data loads.
    ``without_deepspeed``: the error for a recipe that does not run under DeepSpeed, raised before the
    folder is touched when a DeepSpeed config launched it;
    ``without_fsdp`` the same for an FSDP config. ``check``: the recipe's own checks of the parsed config
    (e.g. :func:`distill.config.check_sources`), run before the folder is touched.
    """
    cfg = parse_config(config_cls, argv)
    if check is not None:
        check(cfg)
    if without_deepspeed and launched_with_deepspeed():
        raise ConfigError(without_deepspeed)
    if without_fsdp and launched_with_fsdp():
        raise ConfigError(without_fsdp)
    out = rundir.check_output_dir(cfg.output_dir, cfg.overwrite, cfg.resume)
    cfg.output_dir = str(out)  # ~ expanded: every later write (the Run, final/, a resume) goes where it was claimed
    resume = check_resume(cfg, out, resume_safe) if cfg.resume is not None else None
    accelerator = make_accelerator(cfg, out)
    if resume is not None:  # world size and backend are known once the accelerator exists; still before any model loads
        check_resume_world(resume, accelerator.num_processes, global_batch(cfg, accelerator.num_processes),
                           getattr(cfg, "micro_batch_size", None))
        check_resume_backend(resume, checkpoint_backend(accelerator))
    setup_threads(cfg.threads, accelerator.is_main_process)  # every core, even under `accelerate launch`
    if accelerator.is_main_process:
        rundir.claim_output_dir(out, cfg.overwrite, cfg.resume)
    accelerator.wait_for_everyone()
    return cfg, accelerator, out


def check_resume(cfg: Any, out: Path, resume_safe: Iterable[str] = ()) -> Path:
    """The complete checkpoint ``cfg.resume`` names in ``out``, its ``config.yaml`` checked against ``cfg``
    (:func:`core.config.check_resume_config`: keys outside ``resume_safe`` must not change)."""
    path = ckpt.resolve_resume(cfg.resume, out)
    # A token budget sets max_steps at run time, so the saved max_steps is derived: compare max_tokens.
    derived = ("max_steps",) if getattr(cfg, "max_tokens", None) else ()
    check_resume_config(path / "config.yaml", cfg, (*resume_safe, *derived))
    return path


class WorldSizeMismatch(ckpt.CheckpointError):
    """A resume whose global batch differs from the checkpoint's, or on another number of processes where the
    checkpoint's state is saved per process."""


def global_batch(cfg: Any, num_processes: int | None) -> int | None:
    """Blocks per optimizer step: micro_batch_size × grad_accum × processes (None where one is not known)."""
    batch = (getattr(cfg, "micro_batch_size", None), getattr(cfg, "grad_accum", None), num_processes)
    return math.prod(batch) if None not in batch else None


def check_resume_world(path: Path, num_processes: int, global_batch: int | None = None,
                       micro_batch_size: int | None = None) -> None:
    """Refuse to resume checkpoint ``path`` where the rest of the run would not be the one it started.

    The data order starts step t at t × global batch (blocks per step: micro_batch_size × grad_accum × processes)
    and a token budget (``max_tokens``) sets the step count from it, so the global batch must stay what it was:
    otherwise the resumed run would silently train on other data for another number of steps. The number of
    processes may change with it (a node lost, or more GPUs), e.g. 2 processes × grad_accum 1 resumed on 1
    process × grad_accum 2, but only where the checkpoint holds the whole optimizer state (DDP or one process):
    DeepSpeed and FSDP save it in shards, one per process. The ranks' random states then differ from an
    uninterrupted run's and their own states (queued rollout rows) are dropped, so sampled steps differ;
    deterministic ones do not, up to the order of floating-point sums. A checkpoint from before these were
    recorded is accepted unchecked. ``micro_batch_size``: this run's, for the fix the error names.
    """
    state = ckpt.read_state(path)
    saved, saved_batch = state.get("num_processes"), state.get("global_batch")
    if saved is None:
        return
    plural = "es" * (saved != 1)
    if saved != num_processes:
        if state.get("backend") != "plain" or saved_batch is None:
            why = (f"{BACKENDS[state['backend']][0]} saves the optimizer state per process" if state.get("backend")
                   in BACKENDS else "it does not record how its state is laid out")
            raise WorldSizeMismatch(
                f"checkpoint {path} was written by {saved} process{plural} but this run has {num_processes}, and "
                f"{why}: launch with {saved} process{plural} (accelerate launch --num_processes {saved}) to resume it")
    if saved_batch is None or global_batch is None or saved_batch == global_batch:
        return
    raise WorldSizeMismatch(
        f"checkpoint {path} trained on {saved_batch} blocks per step but this run takes {global_batch}; the data "
        f"order and step count depend on it: {_global_batch_fix(saved_batch, num_processes, micro_batch_size)}")


def _global_batch_fix(blocks: int, num_processes: int, micro_batch_size: int | None) -> str:
    """How to take ``blocks`` per step on ``num_processes`` processes (micro_batch_size × grad_accum each)."""
    if blocks % num_processes:
        return (f"launch with a number of processes that divides {blocks}, and set micro_batch_size × grad_accum × "
                f"processes = {blocks}")
    per = blocks // num_processes
    micro = max(d for d in range(1, min(per, micro_batch_size or per) + 1) if per % d == 0)
    return (f"set micro_batch_size={micro} grad_accum={per // micro} (micro_batch_size × grad_accum × {num_processes} "
            f"process{'es' * (num_processes != 1)} = {blocks})")


def finish_run(cfg: Any, accelerator: Accelerator, out: Path, summary: dict[str, Any],
               print_summary: Callable[[dict[str, Any], Path], None]) -> None:
    """Run the release gate when ``cfg.gate`` asks, then write ``summary.json`` and print the summary.

    A gate that does not pass ends the process with exit code 1 (after everything is written), so a CI job
    that trains with ``gate=true`` fails with it; the verdict and the report are in ``summary.json``. A gate that
    cannot run on its input (:data:`eval.gate.INPUT_ERRORS`: a prompt file, a model, the offline scorer) ends it in
    one line with the gate's own code for broken input (3, or 4 for a model that cannot load or a missing scorer),
    ``summary.json`` written all the same (verdict ``error``): the trained run is kept. The ranks meet first: what
    follows is the main process's alone, and the others end without waiting for the gate (a barrier after it would
    hold them for as long as it runs).
    """
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    if cfg.gate:
        try:
            summary["gate"] = gate_against_teacher(cfg, out, summary)
        except INPUT_ERRORS as err:  # after the training: keep what it made, then say why in one line
            summary["gate"] = {"verdict": "error", "exit_code": input_exit_code(err),
                               "error": (str(err).splitlines() or [type(err).__name__])[0], "report": None}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    print_summary(summary, out)
    if cfg.gate and summary["gate"]["verdict"] == "error":
        print(f"error: the release gate could not run: {summary['gate']['error']}; the run's outputs are kept "
              f"(summary.json, final/): fix that and run python -m eval.gate on {out / 'final'}", file=sys.stderr)
        raise SystemExit(summary["gate"]["exit_code"])
    if cfg.gate and summary["gate"]["verdict"] != "pass":
        print(f"error: the release gate says {summary['gate']['verdict'].upper()} (report: "
              f"{summary['gate']['report']}); the run's outputs are kept", file=sys.stderr)
        raise SystemExit(1)


def bundled_prompt_count() -> int:
    """How many prompts the bundled set holds: the most ``gate_prompts`` can take (:func:`gate_against_teacher`)."""
    return sum(1 for line in default_prompts_path().read_text().splitlines() if line.strip())


def check_gate_prompts(gate: bool, gate_prompts: int) -> None:
    """A recipe's ``gate_prompts`` the closing gate can use as asked, in one :class:`ConfigError` line naming the fix:
    at most the bundled set's count (the gate silently ran on fewer) and, with ``gate``, at least the gate's
    ``min_prompts`` (the run trained to the end, then its gate could only say inconclusive)."""
    bundled = bundled_prompt_count()
    if gate_prompts > bundled:
        raise ConfigError(f"gate_prompts={gate_prompts} exceeds the {bundled} prompts of the bundled set; use "
                          f"at most {bundled}")
    least = GateConfig.__dataclass_fields__["min_prompts"].default
    if gate and gate_prompts < least:
        raise ConfigError(f"gate_prompts={gate_prompts} is below the gate's min_prompts={least}: its verdict "
                          f"would be inconclusive whatever the model; use at least {least}")


def check_gate_positions(gate: bool, limit: int | None, role: str = "model") -> None:
    """With ``gate``, the closing gate's language-model windows (``lm_seq_len``) within a model's ``limit`` positions
    (``role``: how the error names it; None: not known), in one :class:`ConfigError` line naming the fix: else the
    gate raised after the whole training, before ``summary.json``."""
    lm_seq_len = GateConfig.__dataclass_fields__["lm_seq_len"].default
    if gate and limit is not None and lm_seq_len > limit:
        raise ConfigError(f"gate=true scores the final model on {lm_seq_len}-token windows, past the {role}'s maximum "
                          f"of {limit} positions; set gate=false and run python -m eval.gate --lm-seq-len {limit} on "
                          "final/")


def teacher_dir(cfg: Any, out: Path) -> Path:
    """An HF directory of the teacher (the demo cache, a local dir, or a saved copy for tiny runs)."""
    if cfg.teacher == TINY:
        path = out / "teacher"
        if not (path / "config.json").is_file():
            tiny_teacher(cfg.seed).save_pretrained(path)
            tiny_teacher_tokenizer().save_pretrained(path)
        return path
    return Path(resolve_model_path(cfg.teacher))


def gate_against_teacher(cfg: Any, out: Path, summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the release gate: the final student against the teacher, on the bundled prompts.

    The bundled prompts are short enough to fit a hybrid model's window, so a retrofit's gate also judges the
    pass-key retrieval its closing check measured (``summary["longctx"]``) at ``longctx_lengths``.
    """
    teacher = teacher_dir(cfg, out)
    prompts = default_prompts_path()
    lines = [line for line in prompts.read_text().splitlines() if line.strip()]
    if cfg.gate_prompts < len(lines):  # a smaller, fixed subset of the bundled set
        prompts = out / "gate_prompts.jsonl"
        prompts.write_text("\n".join(lines[: cfg.gate_prompts]) + "\n")
    retrieval = (summary or {}).get("longctx")
    lengths = getattr(cfg, "longctx_lengths", None)
    measured = None
    if retrieval and lengths:
        measured = {"candidate": {"attention": "hybrid", "accuracy": retrieval["hybrid"]},
                    "baseline": {"attention": "dense", "accuracy": retrieval["dense"]},
                    "depths": retrieval["depths"], "trials": retrieval["trials"],
                    "measured_by": "the retrofit's closing check (summary.json: longctx)"}
    gate_cfg = GateConfig(candidate=str(out / "final"), baseline=str(teacher), out=str(out / "gate"),
                          prompts=str(prompts), longctx=",".join(map(str, lengths)) if measured else None,
                          longctx_trials=retrieval["trials"] if measured else GateConfig.longctx_trials)
    result = run_gate(gate_cfg, longctx=measured)
    return {"verdict": result.verdict, "exit_code": result.exit_code, "report": str(result.report_md)}


# --------------------------------------------------------------------------------------------
# Optimizer step, schedule, evaluation
# --------------------------------------------------------------------------------------------

def warmup_cosine(warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """LR multiplier: linear warmup, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def target_count(loss_mask: torch.Tensor | None, shape: tuple[int, int]) -> int:
    """The targets a data micro-batch's loss averages over: ``loss_mask`` ``[rows, seq]``'s shifted ones, or
    every next token of its ``shape`` ``(rows, seq)`` blocks."""
    return int(loss_mask[:, 1:].sum()) if loss_mask is not None else shape[0] * (shape[1] - 1)


def token_weights(accelerator: Accelerator, counts: list[int | None]) -> list[float]:
    """Loss weights that make a step's gradient a mean over its data tokens, not over its micro-batches.

    Each loss term is a mean over its own micro-batch's targets, so with completion-only chat masks a token
    in a micro-batch of few assistant tokens would weigh more than one in a full micro-batch. ``counts``: the
    targets of each of this rank's micro-batches (:func:`target_count`; None: one outside the data, an
    on-policy micro-batch, weight 1). A counted one gets its count over the mean count of the step's counted
    micro-batches on every rank: equal counts (plain packed text) give exactly 1.
    """
    known = [c for c in counts if c is not None]
    total = torch.tensor([float(sum(known)), float(len(known))], dtype=torch.float64, device=accelerator.device)
    total_sum, total_n = accelerator.reduce(total, reduction="sum").tolist()
    mean = total_sum / total_n if total_sum > 0 else 1.0
    return [1.0 if c is None else c / mean for c in counts]


def train_step(accelerator: Accelerator, model: torch.nn.Module, optimizer, scheduler, params: list,
               micro_batches: Iterable[Any], forward: Callable[[Any], Any], *, grad_accum: int,
               max_grad_norm: float, keep: Iterable[str] | None = None,
               weights: list[float] | None = None) -> dict[str, float]:
    """One optimizer step over ``micro_batches``; the loss terms, averaged over micro-batches and ranks.

    ``forward(micro_batch)`` returns a :class:`distill.model.DistillOutput`; ``keep`` names the terms
    reported (default: every non-zero one) besides ``loss``. ``weights`` (:func:`token_weights`, one per
    micro-batch): each micro-batch's loss is scaled by it, in the gradient and in the reported terms.
    """
    sums: dict[str, float] = {}
    for i, micro in enumerate(micro_batches):
        w = 1.0 if weights is None else weights[i]
        with accelerator.accumulate(model):
            output = forward(micro)
            loss = output.loss
            accelerator.backward(loss if w == 1.0 else loss * w)
            if accelerator.sync_gradients and max_grad_norm > 0:
                accelerator.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            if accelerator.sync_gradients:  # one schedule step per optimizer step, whatever the world size
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        terms = output.terms()
        if keep is not None:
            terms = {k: v for k, v in terms.items() if k in keep}
        terms["loss"] = float(loss.detach())
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + v * w / grad_accum
    reduced = accelerator.reduce(torch.tensor(list(sums.values()), device=accelerator.device), reduction="mean")
    return {k: float(v) for k, v in zip(sums, reduced.tolist())}


def reduce_stats(accelerator: Accelerator, stats: LMStats) -> LMStats:
    """Sum an :class:`eval.metrics.LMStats` over processes (every rank gets the total)."""
    totals = torch.tensor([stats.nll_sum, stats.tokens, stats.agree, stats.kl_sum, stats.ref_tokens],
                          dtype=torch.float64, device=accelerator.device)
    nll, tok, agree, kl, ref_tok = accelerator.reduce(totals, reduction="sum").tolist()
    return LMStats(nll_sum=nll, tokens=int(tok), agree=int(agree), kl_sum=kl, ref_tokens=int(ref_tok))


def evaluate(accelerator: Accelerator, model: torch.nn.Module, blocks: torch.Tensor, batch_size: int,
             reference: torch.nn.Module | None = None, mask: torch.Tensor | None = None,
             progress: str | None = None) -> tuple[LMStats, LMStats | None]:
    """:func:`eval.metrics.evaluate_lm` over this rank's share of ``blocks`` ``[n, seq]``, summed over ranks.

    ``mask`` ``[n, seq]`` bool (``PackedData.eval_mask``): only targets count, as in training
    (completion-only chat data scores the assistant's tokens). None: every token.
    ``progress``: label of a progress bar, shown by the main process only (None: silent).
    """
    # A list (of views, no copies) so that the bar knows its length.
    batches = list(eval_batches(blocks, batch_size, accelerator.process_index, accelerator.num_processes, mask=mask))
    stats, ref_stats = evaluate_lm(model, batches, reference, device=accelerator.device,
                                   progress=progress if accelerator.is_main_process else None)
    return reduce_stats(accelerator, stats), (reduce_stats(accelerator, ref_stats) if ref_stats else None)


def save_hf_dir(accelerator: Accelerator, model: torch.nn.Module, tokenizer, path: Path,
                state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``model`` (+ tokenizer) as an HF directory: into a temp folder, fsynced, then renamed.

    The folder is for inference: its config has the KV cache on, which training turns off (without it a forward
    returns no cache and step-by-step decoding re-runs the whole prefix for every token).
    """
    if accelerator.is_main_process:
        tmp = path.with_name(f".tmp-{path.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        training_cache = getattr(model.config, "use_cache", None)
        model.config.use_cache = True
        try:
            model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        finally:
            model.config.use_cache = training_cache
        tokenizer.save_pretrained(tmp)
        replace_dir(tmp, path)
    accelerator.wait_for_everyone()


# --------------------------------------------------------------------------------------------
# The run: resume, checkpoints, per-step records
# --------------------------------------------------------------------------------------------

class BackendMismatch(ckpt.CheckpointError):
    """A resume under another distributed backend than the checkpoint was written by."""


# What each checkpoint_backend() value is, and a launch config that gives it (launch/README.md).
BACKENDS = {
    "plain": ("DDP or a single process (no DeepSpeed, no FSDP)",
              "launch/gpu_ddp.yaml or launch/cpu_ddp_2proc.yaml (DDP), or no launch config (one process)"),
    "deepspeed zero-0": ("DeepSpeed ZeRO stage 0", "a DeepSpeed config with zero_stage: 0"),
    "deepspeed zero-1/2": ("DeepSpeed ZeRO-1/2", "launch/deepspeed_zero2.yaml"),
    "deepspeed zero-1/2 + optimizer offload": ("DeepSpeed ZeRO-1/2 with the optimizer offloaded",
                                               "a DeepSpeed config with zero_stage: 2 and offload_optimizer_device: cpu"),
    "deepspeed zero-3": ("DeepSpeed ZeRO-3", "launch/deepspeed_zero3.yaml"),
    "deepspeed zero-3 + optimizer offload": ("DeepSpeed ZeRO-3 with the optimizer offloaded",
                                             "launch/deepspeed_zero3_offload.yaml"),
    "fsdp": ("FSDP", "launch/gpu_fsdp.yaml"),
}


def checkpoint_backend(accelerator: Any) -> str | None:
    """Which backend lays out ``accelerator.save_state``'s model and optimizer state (a :data:`BACKENDS` key).

    DeepSpeed writes its own engine files, ZeRO-3 one model-state file per rank and ZeRO-1/2 one for all,
    FSDP its sharded state, everything else ``model.safetensors`` and ``optimizer.bin``. An offloaded optimizer
    is DeepSpeed's CPU Adam (accelerate swaps it in), whose parameter groups carry keys the recipe's AdamW lacks:
    a ZeRO-3 checkpoint resumed with optimizer offload loads, then fails at the first step (``KeyError:
    'bias_correction'``). ZeRO-1 and 2 share a layout; parameter offload changes none. None: not known (a fake
    accelerator in tests).
    """
    if getattr(accelerator, "distributed_type", None) is None:
        return None
    if is_deepspeed(accelerator):
        stage = zero_stage(accelerator)
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        offload = ((config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
                   and config.get("zero_force_ds_cpu_optimizer", True))
        return ("deepspeed zero-1/2" if stage in (1, 2) else f"deepspeed zero-{stage}") + (
            " + optimizer offload" if offload else "")
    return "fsdp" if is_fsdp(accelerator) else "plain"


def check_resume_backend(path: Path, backend: str | None) -> None:
    """Refuse to resume checkpoint ``path`` under another distributed backend than wrote it.

    Each backend reads only its own layout of the model and optimizer files (:func:`checkpoint_backend`), and
    the load fails after the models are built with an error that does not say why (DeepSpeed: a bare
    ``AssertionError``). A checkpoint from before the backend was recorded, or an unknown backend, is accepted
    unchecked.
    """
    saved = ckpt.read_state(path).get("backend")
    if saved is None or backend is None or saved == backend:
        return
    was, launch = BACKENDS.get(saved, (saved, f"the launch config that wrote it ({saved})"))
    now = BACKENDS.get(backend, (backend, ""))[0]
    raise BackendMismatch(
        f"checkpoint {path} was written under {was} but this run is launched under {now}; each backend saves the "
        f"model and optimizer in its own layout: launch with {launch} to resume it")


@dataclasses.dataclass
class TrainerState:
    """What a checkpoint's ``trainer_state.json`` holds besides the accelerate state."""

    step: int = 0
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    init: dict[str, Any] = dataclasses.field(default_factory=dict)
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)  # the writer's (core.environment)
    # The world size and global batch (blocks per step) that wrote it: a resume must match them
    # (check_resume_world). None: not known (a fake accelerator in tests).
    num_processes: int | None = None
    global_batch: int | None = None
    # The backend whose file layout the accelerate state has (checkpoint_backend; check_resume_backend).
    backend: str | None = None


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one strict-JSON line: a float that is not finite becomes null."""
    return json.dumps(finite_or_null(record), allow_nan=False) + "\n"


class Run:
    """One run's folder on every rank: resume, checkpoints, the step record and the summary files.

    ``tracker_project`` names the tracker project; ``progress`` the progress bar.

    While it runs, the main process keeps two records a user can watch and that a crash leaves behind:
    ``metrics.jsonl``, one JSON line per optimizer step appended (and flushed) as each step is recorded
    (:meth:`record`), and ``loss.png``, redrawn at each held-out evaluation, each checkpoint and before a
    :class:`core.checkpoint.TrainingDiverged` is raised (:meth:`plot`).
    """

    METRICS = "metrics.jsonl"

    def __init__(self, cfg: Any, accelerator: Accelerator, *, tracker_project: str, progress: str) -> None:
        self.cfg, self.accelerator = cfg, accelerator
        self.out = Path(cfg.output_dir).expanduser()
        self.main = accelerator.is_main_process
        world = getattr(accelerator, "num_processes", None)
        self.state = TrainerState(environment=environment(), num_processes=world,
                                  global_batch=global_batch(cfg, world), backend=checkpoint_backend(accelerator))
        self.tracker_project, self.progress = tracker_project, progress
        self.bar = None
        self._t_step = 0.0
        self.loop_seconds = 0.0  # inside training steps only (no evaluation, no checkpoint)
        self._t_wall = time.perf_counter()
        self.rss = PeakRSS()  # peak memory per phase: setup, train, eval_save, after
        self.loop_tokens = 0
        self.resumed_from: Path | None = None
        self.resharded = False  # resumed on another number of processes than the checkpoint's (check_resume_world)
        self._plotted_evals = 0  # len(state.evals) at the last plot: a new evaluation redraws loss.png
        self._plot_failed = False

    @property
    def metrics_path(self) -> Path:
        return self.out / self.METRICS

    # ---- start -----------------------------------------------------------------------------
    def resume(self) -> TrainerState:
        """Load ``cfg.resume`` into the prepared objects (no-op without it); returns the trainer state."""
        if self.cfg.resume is None:
            return self.state
        path = ckpt.resolve_resume(self.cfg.resume, self.out)  # its config was checked by start_run
        if self.state.num_processes is not None:  # start_run checked the run's own; an ablation's is checked here
            check_resume_world(path, self.state.num_processes, self.state.global_batch,
                               getattr(self.cfg, "micro_batch_size", None))
        check_resume_backend(path, self.state.backend)
        saved = ckpt.read_state(path)
        self.resharded = saved.get("num_processes") not in (None, self.state.num_processes)
        try:
            self.accelerator.load_state(str(path))
        except Exception as err:  # noqa: BLE001 - a torn or foreign checkpoint
            raise ckpt.CheckpointError(f"cannot load checkpoint {path} ({type(err).__name__}: {err}); resume from "
                                       "an older step-N folder") from None
        changed = differences(saved.get("environment"), self.state.environment)
        self.state = dataclasses.replace(self.state, step=saved["step"], history=saved["history"],
                                         evals=saved["evals"], init=saved["init"])
        self.resumed_from = path
        if self.main:
            print(f"resumed from {path} at step {self.state.step}")
            if self.resharded:
                print(f"note: the checkpoint was written by {saved['num_processes']} processes and this run has "
                      f"{self.state.num_processes}, with the same {self.state.global_batch} blocks per step: the "
                      "data order is the same; the random states differ from an uninterrupted run's and queued "
                      "rollout rows are dropped")
            if changed:  # allowed, but the rest of the run may not match an uninterrupted one
                print(f"warning: the checkpoint was written under another environment ({'; '.join(changed)}); "
                      "the resumed steps may differ from an uninterrupted run's")
        return self.state

    def rank_state(self) -> dict[str, Any]:
        """This rank's own state saved with the checkpoint resumed from ({} when none: a fresh run, an older
        checkpoint, or another world size)."""
        if self.resumed_from is None or self.resharded:
            return {}
        path = self.resumed_from / f"rank{self.accelerator.process_index}_state.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def begin(self) -> None:
        """Clear a killed run's temp folders, write the resolved config, match ``metrics.jsonl`` to the state
        resumed from (:meth:`resume_metrics`), start the trackers."""
        if self.main:
            ckpt.clean_partial(self.out)
            final = self.out / "final"
            if (aside := restore_aside(final, is_saved_model)) is not None:
                print(f"restored {final} from {aside.name}, where a killed run had moved it", flush=True)
            self.out.mkdir(parents=True, exist_ok=True)
            save_config(self.cfg, self.out / "config.yaml")
            self.resume_metrics()
        if self.cfg.tracker != "none":
            self.accelerator.init_trackers(self.tracker_project, config={
                k: v for k, v in dataclasses.asdict(self.cfg).items() if isinstance(v, (int, float, str, bool))})
        self.accelerator.wait_for_everyone()

    # ---- loop ------------------------------------------------------------------------------
    def steps(self) -> Iterator[int]:
        """The steps still to run (0-based); opens the progress bar and times each step.

        The time from a step's start to its :meth:`record` is the training loop's own: held-out
        evaluations and checkpoints after the record are not in ``tokens_per_s``.
        """
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.cfg.max_steps, initial=self.state.step, disable=not self.main,
                        desc=self.progress, dynamic_ncols=True)
        self.rss.mark("setup")
        self._plotted_evals = len(self.state.evals)  # those before the loop (at init, resumed) are drawn at its end
        for step in range(self.state.step, self.cfg.max_steps):
            self._t_step = time.perf_counter()
            yield step
            self.rss.mark("eval_save")  # what the step did after its record: evaluation, checkpoint
            if len(self.state.evals) > self._plotted_evals:  # a held-out evaluation (not yet drawn by a checkpoint)
                self.plot()
        self.bar.close()

    def loop_seconds_now(self) -> float:
        """The training loop's seconds including the step in progress (``loop_seconds`` adds it at record)."""
        return self.loop_seconds + time.perf_counter() - self._t_step

    def record(self, step: int, terms: dict[str, float], lr: float, tokens: int, **extra: Any) -> None:
        """Book step ``step`` (0-based) that trained on ``tokens`` tokens; a non-finite loss stops the run."""
        seconds = time.perf_counter() - self._t_step
        entry = {"step": step + 1, "lr": lr, **extra, **terms}
        if not math.isfinite(terms["loss"]):
            last, resume = ckpt.last_good(self.out, step + 1)
            # The curve up to here and the step that broke it, on disk before the run stops.
            self.append_metrics({**entry, "diverged": True}, tokens, seconds)
            self.plot(diverged_at=step + 1)
            raise ckpt.TrainingDiverged(
                f"loss became {terms['loss']} at step {step + 1}; the last good checkpoint is "
                f"{last or 'none'}: lower lr or enable clipping, then {resume}")
        self.loop_tokens += tokens
        self.loop_seconds += seconds
        self.rss.mark("train")
        elapsed = self.loop_seconds
        self.state.step = step + 1
        self.state.history.append(entry)
        self.append_metrics(entry, tokens, seconds)
        self.bar.update(1)
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in terms.items() if v} | extra
                             | {"tok/s": f"{self.loop_tokens / max(elapsed, 1e-9):.0f}"})
        if self.cfg.tracker != "none" and (step + 1) % self.cfg.log_every == 0:
            self.accelerator.log(terms | {"lr": lr} | extra, step=step + 1)

    def append_metrics(self, entry: dict[str, Any], tokens: int, seconds: float) -> None:
        """Append step ``entry`` (its history record) to ``metrics.jsonl`` and flush it (main process).

        Besides the history's keys (``step``, ``lr``, the recipe's extras, the loss terms) a line has the
        step's ``tokens``, its own ``step_s`` and ``tokens_per_s``, and ``time`` (Unix seconds). A value that
        is not finite (the step a run diverged at, marked ``"diverged": true``) is written as null, so that
        the file stays strict JSON.
        """
        if not self.main:
            return
        line = {**entry, "tokens": tokens, "step_s": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
                "time": time.time()}
        with open(self.metrics_path, "a") as f:
            f.write(json_line(line))
            f.flush()

    def resume_metrics(self) -> None:
        """Make ``metrics.jsonl`` hold exactly the steps the run resumes from (main process), one line each.

        Lines past the resumed step (written before a kill or a divergence, or by a run resumed from an
        older checkpoint) go: those steps run again. A step the checkpoint holds keeps its line when the line
        agrees with the checkpoint's history; one whose line was lost (a machine that died before the
        file's tail reached disk) or disagrees is written again from the history, without the timings. A
        torn last line is dropped. A fresh run starts an empty file. The file is replaced atomically.
        """
        lines: dict[int, dict[str, Any]] = {}
        if self.metrics_path.is_file():
            for text in self.metrics_path.read_text().splitlines():
                try:
                    line = json.loads(text)
                except ValueError:
                    continue
                if isinstance(line, dict) and isinstance(line.get("step"), int):
                    lines[line["step"]] = line
        kept = []
        for entry in self.state.history:
            line = lines.get(entry["step"])
            agrees = line is not None and all(line.get(k) == v for k, v in entry.items())
            kept.append(json_line(line if agrees else entry))
        atomic_write_text(self.metrics_path, "".join(kept))

    def plot(self, diverged_at: int | None = None) -> None:
        """Redraw ``loss.png`` from the steps and evaluations so far (main process); ``diverged_at``: the step
        whose loss was not finite, marked on the plot.

        Mid-run, a plot that fails warns once and the run goes on: a training run never stops for its plot.
        """
        self._plotted_evals = len(self.state.evals)
        if not self.main:
            return
        title = (f"{getattr(self.cfg, 'teacher', '')}: {self.progress} ({self.out.name}), "
                 f"step {self.state.step}/{self.cfg.max_steps}")
        try:
            from distill.plots import plot_training  # matplotlib: a broken install warns too

            plot_training(self.state.history, self.state.evals, self.out / "loss.png", diverged_at=diverged_at,
                          title=f"{title}, diverged at step {diverged_at}" if diverged_at else title)
        except Exception as err:  # noqa: BLE001 - matplotlib, the disk: report, keep training
            if not self._plot_failed:
                self._plot_failed = True
                self.write(f"warning: could not draw {self.out / 'loss.png'} ({type(err).__name__}: {err}); "
                           f"the per-step metrics are in {self.metrics_path}")

    def write(self, text: str) -> None:
        if self.main:
            (self.bar.write if self.bar is not None else print)(text)

    def due(self, step: int, every: int) -> bool:
        """Whether a cadence of ``every`` steps (0: never) falls on step ``step`` (0-based)."""
        return bool(every) and (step + 1) % every == 0

    def last(self, step: int) -> bool:
        return step + 1 == self.cfg.max_steps

    def save_checkpoint(self, step: int, write_extra: Callable[[Path], None],
                        rank_state: Callable[[], dict[str, Any]] | None = None, *,
                        weights: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
        """Checkpoint after ``step`` steps: every rank writes its shard, then the main renames it whole.

        ``write_extra(folder)`` (main process only) adds what export needs to rebuild the model;
        ``rank_state()`` (every rank, JSON) what differs per rank, read back by :meth:`rank_state`.
        ``weights``: ``(name, tensor)`` pairs of this rank's shards; those that train are checked. An overflowing optimizer step
        can leave NaN/inf in them behind a finite loss; such a checkpoint would prune the good ones it
        replaces, so the run stops on the last good one instead (:func:`core.checkpoint.refuse_nonfinite`).
        """
        acc = self.accelerator
        ckpt.refuse_nonfinite(((n, t) for n, t in weights if t.requires_grad), self.out, step,
                              reduce=lambda t: acc.reduce(t.to(acc.device), reduction="sum"))
        tmp = ckpt.tmp_dir(self.out, step)
        if self.main:  # every rank writes into it (DeepSpeed shards, RNG states): it must exist first
            tmp.mkdir(parents=True, exist_ok=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp), safe_serialization=True)
        if rank_state is not None:
            atomic_write_text(tmp / f"rank{self.accelerator.process_index}_state.json", json.dumps(rank_state()))
        self.accelerator.wait_for_everyone()  # every rank's shard is on disk before the rename
        if self.main:
            write_extra(tmp)
            save_config(self.cfg, tmp / "config.yaml")
            ckpt.finalize(self.out, step, dataclasses.asdict(self.state), self.cfg.keep_checkpoints)
            self.plot()
        self.accelerator.wait_for_everyone()

    def maybe_exit(self, step: int) -> None:
        """Testing: die like a killed process after ``debug_exit_at_step`` (no cleanup, no final save)."""
        if self.cfg.debug_exit_at_step is not None and step + 1 == self.cfg.debug_exit_at_step:
            os._exit(137)

    def timing(self) -> dict[str, Any]:
        """Summary keys: the loop's own seconds, the run's wall time, threads, peak memory per phase (GB)."""
        self.rss.mark("after")  # the final evaluation and save
        return {"loop_s": self.loop_seconds, "wall_s": time.perf_counter() - self._t_wall,
                "threads": torch.get_num_threads(),
                "peak_rss_gb": {**self.rss.phases, "whole": self.rss.whole}}

    @property
    def tokens_per_s(self) -> float:
        return self.loop_tokens / max(self.loop_seconds, 1e-9)

    # ---- end -------------------------------------------------------------------------------
    def write_records(self, summary: dict[str, Any], title: str) -> None:
        """``summary.json`` and the final ``loss.png`` (main process), then end the trackers."""
        from distill.plots import plot_training

        if self.main:
            atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=1))
            plot_training(self.state.history, self.state.evals, self.out / "loss.png", title=title)
        self.accelerator.wait_for_everyone()
        if self.cfg.tracker != "none":
            self.accelerator.end_training()
