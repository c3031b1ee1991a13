"""Sampling parameters, the per-row token choice (greedy / temperature / top-k / top-p, seeded) and the
log-probabilities a request may ask for."""

from __future__ import annotations

import dataclasses
import math

import torch

# Below this a temperature is greedy in all but name, and dividing fp32 logits by it overflows; callers
# who mean greedy say temperature=0.
MIN_TEMPERATURE = 1e-3
# A nucleus this small keeps only the top token; below it the float32 cumulative sum cannot tell masses apart.
MIN_TOP_P = 1e-6
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed accepts
# Most alternatives a request may ask for per token (OpenAI's chat limit; vLLM's default cap).
MAX_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
    """How one request generates.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters. ``seed`` makes a
    sampled request reproducible whatever else shares its batch (each request owns its generator).
    ``stop`` strings end generation and are not returned; ``stop_token_ids=None`` means the model's EOS.
    ``logprobs=k`` reports each generated token's log-probability and the ``k`` most likely tokens' (0: the
    generated token's alone; None: nothing), under the model's own distribution: temperature 1, before top-k
    and top-p, whatever the sampling (:func:`token_logprobs`).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] = ()
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not MIN_TOP_P <= self.top_p <= 1:  # also refuses NaN
            raise ValueError(f"top_p must be in [{MIN_TOP_P}, 1], got {self.top_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None (off), got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the ``top`` alternatives' ``(token_id, logprob)``, most likely
    first (the generated token among them when it is one of the most likely; tokens at probability 0 left out)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """``token``'s log-probability under ``[vocab]`` ``logits`` at temperature 1, and the ``k`` most likely
    tokens'. Non-finite logits raise (a JSON reply cannot carry NaN)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logprobs[token])
    if not math.isfinite(chosen):
        raise FloatingPointError("non-finite logits; cannot report log-probabilities")
    if not k:
        return TokenLogprobs(token, chosen)
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]))
    # Tokens the model rules out (-inf) are left out rather than reported as -Infinity, which JSON cannot carry.
    return TokenLogprobs(token, chosen, tuple((i, v) for i, v in zip(ids.tolist(), values.tolist()) if v > -math.inf))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose a token from ``[vocab]`` fp32 logits."""
    if params.greedy:
        return int(logits.argmax())
    if not math.isfinite(float(logits.max())):
        raise FloatingPointError("non-finite logits; cannot sample")
    # Shift before scaling: every value is <= 0, so a small temperature can only underflow (to -inf,
    # probability 0), never overflow, and the top token keeps probability > 0.
    logits = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop[..., 0] = False  # even when top_p rounds to 0 in float32
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
