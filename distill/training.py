"""Small pieces every training recipe shares: the accelerator, the run folder check, the schedule.

The recipes keep their loops in plain view; these helpers only hold the parts that must behave the
same in every recipe (how a CPU run picks its process-group backend, when a run folder is refused).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from core import rundir
from core.config import ConfigError


def make_accelerator(cfg: Any, project_dir: Path) -> Accelerator:
    """An ``Accelerator`` from a recipe config (``mixed_precision``, ``grad_accum``, ``tracker``).

    ``mixed_precision=auto`` is bf16 on GPUs that support it and fp32 on CPU, where bf16 matmuls are
    several times slower. Without GPUs, distributed runs (DDP, DeepSpeed) need the gloo backend, or
    accelerate miscounts processes.
    """
    mixed = cfg.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    launched_apart = int(os.environ.get("WORLD_SIZE", "1")) > 1
    distributed = launched_apart or os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed and not torch.cuda.is_available() else []
    log_with = None if cfg.tracker == "none" else cfg.tracker
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mixed, log_with=log_with,
                              project_dir=str(project_dir), kwargs_handlers=handlers)
    if launched_apart and accelerator.num_processes == 1:
        raise ConfigError("several processes were launched but accelerate runs them apart; on CPU add "
                          "ACCELERATE_USE_CPU=true (see launch/README.md)")
    return accelerator


def check_output_dir(cfg: Any) -> Path:
    """Refuse a run folder this run must not use (see :func:`core.rundir.check_output_dir`); touches nothing."""
    return rundir.check_output_dir(cfg.output_dir, cfg.overwrite, cfg.resume)


def reduce_stats(accelerator: Accelerator, stats: Any) -> Any:
    """Sum an ``eval.metrics.LMStats`` over processes (every rank gets the total)."""
    from eval.metrics import LMStats

    totals = torch.tensor([stats.nll_sum, stats.tokens, stats.agree, stats.kl_sum, stats.ref_tokens],
                          dtype=torch.float64, device=accelerator.device)
    nll, tok, agree, kl, ref_tok = accelerator.reduce(totals, reduction="sum").tolist()
    return LMStats(nll_sum=nll, tokens=int(tok), agree=int(agree), kl_sum=kl, ref_tokens=int(ref_tok))


def warmup_cosine(warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """LR multiplier: linear warmup, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f
