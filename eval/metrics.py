"""Held-out language-model metrics: perplexity, bits per byte, teacher agreement.

All metrics are token-weighted over the whole evaluation set (not a mean of per-batch means),
computed in fp32 from the models' logits, and skip positions whose label is ``ignore_index``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass
class LMStats:
    """Token-weighted sums; combine across batches/processes, then read the metrics."""

    nll_sum: float = 0.0  # sum of -log p(label) in nats
    tokens: int = 0
    agree: int = 0  # top-1 matches with the reference model
    kl_sum: float = 0.0  # sum of KL(p_ref || p_model) in nats
    ref_tokens: int = 0
    bytes: int = 0  # UTF-8 bytes of the scored text, for bits per byte

    def add(self, other: LMStats) -> LMStats:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)
        return self

    @property
    def loss(self) -> float:
        return self.nll_sum / max(self.tokens, 1)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0)) if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        return self.nll_sum / math.log(2) / self.bytes if self.bytes else float("nan")

    @property
    def top1_agreement(self) -> float:
        return self.agree / self.ref_tokens if self.ref_tokens else float("nan")

    @property
    def kl(self) -> float:
        return self.kl_sum / self.ref_tokens if self.ref_tokens else float("nan")

    def as_dict(self) -> dict[str, float]:
        return {
            "loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens,
            "top1_agreement": self.top1_agreement, "kl_to_reference": self.kl,
            "bits_per_byte": self.bits_per_byte,
        }


def _shift(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align logits at t with labels at t+1; returns ``([N, vocab] logits, [N] labels, [b, s-1] valid)``."""
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    valid = valid[:, 1:] & valid[:, :-1]
    return logits[:, :-1], input_ids[:, 1:], valid


@torch.inference_mode()
def batch_stats(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                ref_logits: torch.Tensor | None = None) -> LMStats:
    """Stats of one batch.

    Args:
        logits: ``[batch, seq, vocab]`` of the evaluated model.
        input_ids: ``[batch, seq]``; the label of position t is token t+1.
        attention_mask: ``[batch, seq]``, 1 = real token.
        ref_logits: ``[batch, seq, vocab']`` of a reference (teacher); vocab' ≥ vocab rows are
            sliced to the evaluated model's vocabulary.
    """
    lg, labels, valid = _shift(logits, input_ids, attention_mask)
    lg = lg[valid].float()
    labels = labels[valid]
    stats = LMStats(nll_sum=F.cross_entropy(lg, labels, reduction="sum").item(), tokens=labels.numel())
    if ref_logits is not None:
        ref = ref_logits[:, :-1][valid].float()[..., : lg.shape[-1]]
        stats.agree = int((lg.argmax(-1) == ref.argmax(-1)).sum())
        ref_logp = F.log_softmax(ref, -1)
        stats.kl_sum = F.kl_div(F.log_softmax(lg, -1), ref_logp, log_target=True, reduction="sum").item()
        stats.ref_tokens = labels.numel()
    return stats


@torch.inference_mode()
def evaluate_lm(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]],
                reference: torch.nn.Module | None = None, device: torch.device | str | None = None) -> LMStats:
    """Perplexity (and agreement with ``reference`` when given) of ``model`` over ``batches``.

    Each batch is a dict with ``input_ids`` ``[batch, seq]`` and optionally ``attention_mask``.
    """
    was_training = model.training
    model.eval()
    total = LMStats()
    for batch in batches:
        ids = batch["input_ids"].to(device) if device is not None else batch["input_ids"]
        am = batch.get("attention_mask")
        if am is not None and device is not None:
            am = am.to(device)
        logits = model(input_ids=ids, attention_mask=am).logits
        ref = reference(input_ids=ids, attention_mask=am).logits if reference is not None else None
        total.add(batch_stats(logits, ids, am, ref))
    model.train(was_training)
    return total
