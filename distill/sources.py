"""Turn a recipe's model keys into loaded models: teacher, student and tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from distill.config import ConfigError
from distill.pretrained import ModelSourceError, load_causal_lm, load_tokenizer, resolve_model_path
from distill.student import derive_student
from distill.tiny import TINY, tiny_teacher, tiny_tokenizer


def load_pair(cfg: Any) -> tuple[torch.nn.Module | None, torch.nn.Module, Any]:
    """With ``cfg.teacher_cache`` set the returned teacher is ``None``.

``(teacher, student, tokenizer)`` from ``cfg.teacher`` / ``cfg.student`` / ``cfg.keep_layers``.

    The teacher is loaded in fp32 (the accelerator casts for mixed precision) and frozen. Without
    ``cfg.student`` the student is derived from the teacher by keeping ``cfg.keep_layers``.
    """
    cached = bool(getattr(cfg, "teacher_cache", None))
    try:
        if cached and cfg.student:
            # Distilling from a teacher cache: the teacher is never loaded.
            student = load_causal_lm(cfg.student)
            tokenizer = load_tokenizer(cfg.tokenizer or cfg.student)
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            return None, student, tokenizer
        if cfg.teacher == TINY:
            teacher, tokenizer = tiny_teacher(cfg.seed), tiny_tokenizer()
        else:
            teacher = load_causal_lm(cfg.teacher)
            tokenizer = load_tokenizer(cfg.tokenizer or cfg.teacher)
        if cfg.student:
            student = load_causal_lm(cfg.student)
        elif getattr(cfg, "student_init", "keep_layers") == "prune":  # issue 13: importance pruning + search
            from distill.prune import prune_for_recipe

            student = prune_for_recipe(teacher, tokenizer, cfg)
        else:
            try:
                student = derive_student(teacher, cfg.keep_layers)
            except ValueError as err:
                raise ConfigError(f"{err} (keep_layers)") from None
    except (ModelSourceError, OSError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    teacher.eval().requires_grad_(False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cached:  # the teacher was needed only to derive the student
        teacher = None
    return teacher, student, tokenizer


def teacher_dir(cfg: Any, out: Path) -> Path:
    """An HF directory of the teacher (the demo cache, a local dir, or a saved copy for tiny runs)."""
    if cfg.teacher == TINY:
        path = out / "teacher"
        if not (path / "config.json").is_file():
            tiny_teacher(cfg.seed).save_pretrained(path)
            tiny_tokenizer().save_pretrained(path)
        return path
    return Path(resolve_model_path(cfg.teacher))


def gate_against_teacher(cfg: Any, out: Path) -> dict[str, Any]:
    """Run the release gate: the final student against the teacher, on the bundled prompts."""
    from eval.gate import GateConfig, run_gate
    from eval.prompt_set import default_prompts_path

    teacher = teacher_dir(cfg, out)
    prompts = default_prompts_path()
    lines = [line for line in prompts.read_text().splitlines() if line.strip()]
    if cfg.gate_prompts < len(lines):  # a smaller, fixed subset of the bundled set
        prompts = out / "gate_prompts.jsonl"
        prompts.write_text("\n".join(lines[: cfg.gate_prompts]) + "\n")
    result = run_gate(GateConfig(candidate=str(out / "final"), baseline=str(teacher), out=str(out / "gate"),
                                 prompts=str(prompts)))
    return {"verdict": result.verdict, "exit_code": result.exit_code, "report": str(result.report_md)}
