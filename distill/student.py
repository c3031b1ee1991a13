"""Students derived from their teacher by keeping a subset of its layers.

Keeping layers (DistilBERT / Minitron-style depth pruning) gives a student that starts from the
teacher's own embeddings, head and blocks, so one real model makes a real teacher–student pair.
The kept indices are recorded in the student's config (``distill_kept_layers``) so the
``"derived"`` layer map can pair each student block with the teacher span it replaced.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

KEPT_KEY = "distill_kept_layers"
PRUNE_KEY = "distill_pruning"  # written by distill.prune: kept layers, channels, heads, neurons


def spread_layers(n_teacher: int, n_keep: int) -> list[int]:
    """``n_keep`` indices spread over ``n_teacher`` layers, always keeping the first and last."""
    if not 1 <= n_keep <= n_teacher:
        raise ValueError(f"cannot keep {n_keep} of {n_teacher} layers; choose 1..{n_teacher}")
    if n_keep == 1:
        return [n_teacher - 1]
    return sorted({round(i * (n_teacher - 1) / (n_keep - 1)) for i in range(n_keep)})


def parse_keep(keep: int | str | Sequence[int], n_teacher: int) -> list[int]:
    """An int or digit string (a count, spread), ``"0-4,25-29"`` ranges, or a list → sorted unique indices."""
    if isinstance(keep, str) and keep.strip().isdigit():  # "10" from a config: a count
        keep = int(keep)
    if isinstance(keep, int):
        return spread_layers(n_teacher, keep)
    if isinstance(keep, str):
        out: list[int] = []
        for part in keep.replace(" ", "").split(","):
            if not part:
                continue
            ends = part.split("-", 1) if "-" in part[1:] else [part]
            try:
                a, b = int(ends[0]), int(ends[-1])
            except ValueError:
                raise ValueError(f"keep_layers '{keep}': cannot read '{part}'; write a count ('10') or indices and "
                                 "ranges ('0-3,24-29')") from None
            if b < a:
                raise ValueError(f"keep_layers range '{part}' is empty; write ranges low-high, e.g. '{b}-{a}'")
            out.extend(range(a, b + 1))
        keep = out
    bad = [int(i) for i in keep if not -n_teacher <= int(i) < n_teacher]
    idx = sorted({int(i) % n_teacher for i in keep})
    if not idx or bad:
        raise ValueError(f"keep_layers {list(keep)} out of range for a {n_teacher}-layer teacher; use 0..{n_teacher - 1}")
    return idx


def cast_params(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its floating parameters in ``dtype`` and its buffers as built (returned, changed in place).

    ``model.to(dtype)`` would cast the rotary ``inv_freq`` too, which ``from_pretrained`` keeps in fp32: in bf16 its
    angles drift with position (0.004 in the logits at 200 tokens), so the student would differ from its teacher
    and from itself saved and loaded again.
    """
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return model


def derive_student(teacher: PreTrainedModel, keep_layers: int | str | Sequence[int]) -> PreTrainedModel:
    """A new model holding copies of ``teacher``'s embeddings, head, final norm and kept layers.

    Args:
        teacher: a decoder-only HF model with ``model.layers`` (Llama, Mistral, Qwen2 ...).
        keep_layers: how many layers to keep (spread evenly) or which ones.
    Returns:
        A trainable student in the teacher's dtype, sharing no storage with it.
    """
    base = getattr(teacher, "model", None)
    if base is None or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise ValueError(
            f"{type(teacher).__name__} has no model.layers; derive_student supports decoder-only HF models "
            "such as Llama, Mistral and Qwen2"
        )
    n = teacher.config.num_hidden_layers
    keep = parse_keep(keep_layers, n)
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in keep]
    setattr(config, KEPT_KEY, keep)
    dtype = next(teacher.parameters()).dtype
    # The plain constructor, not from_config: under ZeRO-3, from_config partitions parameters while
    # building; accelerate.prepare shards the student later anyway.
    student = cast_params(type(teacher)(config), dtype)
    from distill.distributed import gather_params

    with gather_params(teacher):  # a ZeRO-3 teacher holds only its shard of each weight
        src = {k: v.detach().clone() for k, v in teacher.state_dict().items()}
    dst = {}
    for key in student.state_dict():
        if key.startswith("model.layers."):
            _, _, i, rest = key.split(".", 3)
            dst[key] = src[f"model.layers.{keep[int(i)]}.{rest}"]
        else:
            dst[key] = src[key]
    with torch.no_grad():
        student.load_state_dict(dst, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        student.tie_weights()
    # The teacher's generation settings (e.g. a chat model's end-of-turn eos ids) go with the student, which is
    # saved with them; the constructor would rebuild them from config.json alone.
    student.generation_config = copy.deepcopy(teacher.generation_config)
    return student


def kept_layers(model: PreTrainedModel) -> list[int] | None:
    kept = getattr(model.config, KEPT_KEY, None)
    return list(kept) if kept is not None else None


def kept_channels(model: PreTrainedModel) -> list[int] | None:
    """The teacher hidden channels a width-pruned student kept (``distill.prune``), or ``None``."""
    record = getattr(model.config, PRUNE_KEY, None)
    channels = record.get("kept_channels") if isinstance(record, dict) else None
    return list(channels) if channels is not None else None
