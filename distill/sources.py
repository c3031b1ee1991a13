"""Turn a recipe's model keys into loaded models: teacher, student and tokenizer."""

from __future__ import annotations

from typing import Any

import torch

from core.config import ConfigError
from core.models import ModelSourceError, load_causal_lm, load_tokenizer
from core.tiny import TINY, tiny_teacher, tiny_teacher_tokenizer
from distill.prune import prune_for_recipe
from distill.student import derive_student


def load_recipe_tokenizer(model: str, tokenizer: str | None = None):
    """The tokenizer a recipe trains with: ``tokenizer`` or the model's (the tiny one for ``tiny-random``).

    A tokenizer without a pad token pads with EOS. Sources that cannot be loaded raise a one-line
    :class:`ConfigError`.
    """
    try:
        tok = tiny_teacher_tokenizer() if (tokenizer or model) == TINY else load_tokenizer(tokenizer or model)
    except (ModelSourceError, OSError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_pair(cfg: Any) -> tuple[torch.nn.Module | None, torch.nn.Module, Any]:
    """``(teacher, student, tokenizer)`` from ``cfg.teacher`` / ``cfg.student`` / ``cfg.student_init``.

    The teacher is loaded in fp32 (the accelerator casts for mixed precision) and frozen. Without
    ``cfg.student`` the student is derived from the teacher: by keeping ``cfg.keep_layers``, or by
    importance pruning + search (``student_init=prune``, :mod:`distill.prune`; a resume reads back the
    student the fresh run searched). With ``cfg.teacher_cache`` set the returned teacher is ``None``.
    """
    cached = bool(getattr(cfg, "teacher_cache", None))
    try:
        if cached and cfg.student:
            # Distilling from a teacher cache: the teacher is never loaded.
            return None, load_causal_lm(cfg.student), load_recipe_tokenizer(cfg.student, cfg.tokenizer)
        teacher = tiny_teacher(cfg.seed) if cfg.teacher == TINY else load_causal_lm(cfg.teacher)
        tokenizer = load_recipe_tokenizer(cfg.teacher, cfg.tokenizer)
        if cfg.student:
            student = load_causal_lm(cfg.student)
        elif getattr(cfg, "student_init", "keep_layers") == "prune":
            student = prune_for_recipe(teacher, tokenizer, cfg)
        else:
            try:
                student = derive_student(teacher, cfg.keep_layers)
            except ValueError as err:
                raise ConfigError(f"{err} (keep_layers)") from None
    except (ModelSourceError, OSError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    teacher.eval().requires_grad_(False)
    if cached:  # the teacher was needed only to derive the student
        teacher = None
    return teacher, student, tokenizer
