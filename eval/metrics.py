"""Held-out language-model metrics: perplexity, bits per byte, teacher agreement.

All metrics are token-weighted over the whole evaluation set (not a mean of per-batch means),
computed in fp32 from the models' logits, and skip positions whose label is ``ignore_index``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
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


#: Logit elements handled at once (128 MB in fp32): evaluation never holds more than a few such
#: copies beside the model's own ``[batch, seq, vocab]`` output, whatever the sequence and vocabulary.
CHUNK_ELEMENTS = 2**25


def _scored_chunks(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   *others: torch.Tensor | None, loss_mask: torch.Tensor | None = None
                   ) -> Iterator[tuple[torch.Tensor, ...]]:
    """Scored positions in order (batch-major), a bounded chunk at a time.

    Position t of row b is scored when it and its label t+1 are real tokens and, with ``loss_mask``
    ``[batch, seq]``, when the label t+1 is a target (as in training: chat data scores the
    assistant's tokens only). Yields
    ``(labels [n], logits [n, vocab] fp32, *others [n, vocab'])`` for each chunk; ``others`` are
    more ``[batch, seq, vocab']`` tensors sliced the same way (None stays None).
    """
    b, s = input_ids.shape
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    valid = valid[:, 1:] & valid[:, :-1]
    if loss_mask is not None:
        valid = valid & loss_mask[:, 1:].to(valid.device).bool()
    step = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    for row in range(b):
        for lo in range(0, s - 1, step):
            hi = min(lo + step, s - 1)
            keep = valid[row, lo:hi]
            if not bool(keep.any()):
                continue
            labels = input_ids[row, lo + 1:hi + 1][keep]
            yield (labels, logits[row, lo:hi][keep].float(),
                   *(None if o is None else o[row, lo:hi][keep] for o in others))


@torch.inference_mode()
def batch_stats(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                ref_logits: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> LMStats:
    """Stats of one batch.

    Args:
        logits: ``[batch, seq, vocab]`` of the evaluated model.
        input_ids: ``[batch, seq]``; the label of position t is token t+1.
        attention_mask: ``[batch, seq]``, 1 = real token.
        ref_logits: ``[batch, seq, vocab']`` of a reference (teacher); agreement and KL are taken over
            the first ``min(vocab, vocab')`` ids, the wider side's extra (padding) columns dropped.
        loss_mask: ``[batch, seq]`` bool, True where the token is a target (completion-only chat
            data); a position counts only when its label is a target. None: every token.

    Positions are taken a bounded chunk at a time (``CHUNK_ELEMENTS``), so nothing beyond the
    inputs is ``[tokens, vocab]``-sized.
    """
    stats = LMStats()
    for labels, lg, ref in _scored_chunks(logits, input_ids, attention_mask, ref_logits, loss_mask=loss_mask):
        n = labels.numel()
        stats.nll_sum += F.cross_entropy(lg, labels, reduction="sum").item()
        stats.tokens += n
        if ref is not None:
            # Compare on the ids both have: either side's extra columns are padding of its embedding matrix.
            width = min(lg.shape[-1], ref.shape[-1])
            ref, shared = ref.float()[..., :width], lg[..., :width]
            stats.agree += int((shared.argmax(-1) == ref.argmax(-1)).sum())
            stats.kl_sum += F.kl_div(F.log_softmax(shared, -1), F.log_softmax(ref, -1), log_target=True,
                                     reduction="sum").item()
            stats.ref_tokens += n
    return stats


@torch.inference_mode()
@torch.no_grad()
def evaluate_lm(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]],
                reference: torch.nn.Module | None = None, device: torch.device | str | None = None,
                progress: str | None = None) -> tuple[LMStats, LMStats | None]:
    """Stats of ``model`` over ``batches`` (with top-1 agreement and KL to ``reference``) and of ``reference``.

    Each batch is a dict with ``input_ids`` ``[batch, seq]`` and optionally ``attention_mask`` and
    ``loss_mask`` (``[batch, seq]`` bool: only positions whose label is a target count). The
    reference runs once per batch and only statistics are kept, never logits, so memory holds one
    batch of ``[batch, seq, vocab]`` whatever the number of batches.

    ``progress``: label of a tqdm bar over the batches on stderr (None: silent). Long-context
    evaluations take minutes; callers under several processes pass it on the main one only.
    """
    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    total, ref_total = LMStats(), (LMStats() if reference is not None else None)
    for batch in tqdm(batches, desc=progress, disable=progress is None, unit="batch"):
        ids = batch["input_ids"].to(device) if device is not None else batch["input_ids"]
        am, lm = batch.get("attention_mask"), batch.get("loss_mask")
        if am is not None and device is not None:
            am = am.to(device)
        logits = model(input_ids=ids, attention_mask=am).logits
        ref = reference(input_ids=ids, attention_mask=am).logits if reference is not None else None
        total.add(batch_stats(logits, ids, am, ref, loss_mask=lm))
        if ref is not None:
            ref_total.add(batch_stats(ref, ids, am, loss_mask=lm))
        del logits, ref
    model.train(was_training)
    return total, ref_total


def text_windows(tokenizer, text: str, seq_len: int = 512) -> tuple[list[list[int]], list[int]]:
    """Token windows that score every token of ``text`` exactly once, with the UTF-8 bytes each covers.

    The text is tokenized whole (prefixed with BOS when the tokenizer has one, so the first real
    token is predicted too). Consecutive windows overlap by one token: window ``k`` starts with the
    last token of window ``k-1``, whose prediction therefore moves to the next window. Summed over
    windows, the byte counts give the whole text, so bits per byte is exact rather than estimated.

    Returns:
        ``(windows, bytes)``: token id lists of length ≤ ``seq_len`` and, per window, the bytes of
        the text that its predicted tokens (positions 1..) span.
    """
    if seq_len < 2:
        raise ValueError("seq_len must be at least 2")
    fast = getattr(tokenizer, "is_fast", False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
    ids = list(enc["input_ids"])
    starts = [s for s, _ in enc["offset_mapping"]] if fast else None
    bos = tokenizer.bos_token_id is not None
    if bos:
        ids = [tokenizer.bos_token_id] + ids
        starts = [0] + starts if starts is not None else None
    total = len(text.encode("utf-8"))
    windows: list[list[int]] = []
    nbytes: list[int] = []
    start = 0
    while start < len(ids) - 1:
        end = min(start + seq_len, len(ids))
        windows.append(ids[start:end])
        if starts is not None:
            hi = starts[end] if end < len(ids) else len(text)
            lo = 0 if start == 0 and bos else starts[start + 1]  # BOS predicts the text from byte 0
            nbytes.append(len(text[lo:hi].encode("utf-8")))
        else:  # slow tokenizer: no offsets, share the bytes by predicted tokens
            # Round the running total, not each share: per-window rounding errors would add up, and the
            # windows' bytes would no longer sum to the text's.
            nbytes.append(round(total * (end - 1) / max(len(ids) - 1, 1)) - sum(nbytes))
        start = end - 1
    return windows, nbytes


@torch.inference_mode()
def window_stats(model: torch.nn.Module, windows: list[list[int]], nbytes: list[int] | None = None,
                 reference: torch.nn.Module | None = None, batch_size: int = 4, pad_id: int = 0,
                 device: torch.device | str | None = None, progress: str | None = None
                 ) -> tuple[list[LMStats], list[LMStats] | None]:
    """Per-window stats of ``model`` (and of ``reference`` itself) over token windows.

    Returning one :class:`LMStats` per window lets callers bootstrap intervals over windows;
    ``LMStats().add`` over the list gives the corpus totals. When ``reference`` is given, the
    model's stats include top-1 agreement and KL to it, and the reference's own loss comes back
    as the second list (its logits are computed anyway).
    """
    from tqdm.auto import tqdm

    device = device if device is not None else next(model.parameters()).device
    nbytes = nbytes if nbytes is not None else [0] * len(windows)
    own: list[LMStats] = []
    ref_own: list[LMStats] | None = [] if reference is not None else None
    for s in tqdm(range(0, len(windows), batch_size), desc=progress, disable=progress is None, unit="batch"):
        chunk = windows[s:s + batch_size]
        width = max(len(w) for w in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, w in enumerate(chunk):  # right padding: windows start at position 0
            ids[i, :len(w)] = torch.tensor(w)
            mask[i, :len(w)] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits
        ref = reference(input_ids=ids, attention_mask=mask).logits if reference is not None else None
        for i in range(len(chunk)):
            row = slice(i, i + 1)
            st = batch_stats(logits[row], ids[row], mask[row], None if ref is None else ref[row])
            st.bytes = nbytes[s + i]
            own.append(st)
            if ref_own is not None:
                rs = batch_stats(ref[row], ids[row], mask[row])
                rs.bytes = nbytes[s + i]
                ref_own.append(rs)
    return own, ref_own


def evaluate_text(model: torch.nn.Module, tokenizer, text: str, reference: torch.nn.Module | None = None,
                  seq_len: int = 512, batch_size: int = 4) -> LMStats:
    """Perplexity and bits per byte of ``model`` on ``text`` (agreement/KL to ``reference`` if given)."""
    windows, nbytes = text_windows(tokenizer, text, seq_len)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    own, _ = window_stats(model, windows, nbytes, reference, batch_size, pad)
    total = LMStats()
    for st in own:
        total.add(st)
    return total
