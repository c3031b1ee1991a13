"""Sampling parameters, the per-row token choice (greedy / temperature / top-k / top-p, seeded), the logit
adjustments a request may ask for (repetition penalties, logit bias) and the log-probabilities it may ask for."""

from __future__ import annotations

import dataclasses
import math

import torch

from serve.structured import Grammar

# Below this a temperature is greedy in all but name, and dividing fp32 logits by it overflows; callers
# who mean greedy say temperature=0.
MIN_TEMPERATURE = 1e-3
# A nucleus this small keeps only the top token; below it the float32 cumulative sum cannot tell masses apart.
MIN_TOP_P = 1e-6
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed accepts
# Most alternatives a request may ask for per token (OpenAI's chat limit; vLLM's default cap).
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
# repetition_penalty's range: beyond a factor of 1000 either way, dividing or multiplying fp32 logits by it overflows
# (a positive logit to inf, a zero one times inf to NaN) and the sampler refuses the request's every token.
REPETITION_PENALTY_RANGE = (1e-3, 1e3)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100] (±100 bans or forces a token)
MAX_BIASED_TOKENS = 300  # most entries one request's logit_bias may hold (OpenAI's limit)


@dataclasses.dataclass
class SamplingParams:
    """How one request generates.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters. ``seed`` makes a
    sampled request reproducible whatever else shares its batch (each request owns its generator).
    ``stop`` strings end generation and are not returned; ``stop_token_ids=None`` means the model's EOS.
    ``logprobs=k`` reports each generated token's log-probability and the ``k`` most likely tokens' (0: the
    generated token's alone; None: nothing), under the model's own distribution: temperature 1, before
    penalties, top-k and top-p, whatever the sampling (:func:`token_logprobs`); ``prompt_logprobs=k`` the same
    for each prompt token after the first (the prompt is then prefilled whole, not restored from the prefix
    cache). Penalties against repeating (:class:`Penalties`): ``presence_penalty`` and ``frequency_penalty``
    (OpenAI's) lower a token's logit once if it was generated and per time it was; ``repetition_penalty``
    (CTRL's, as in transformers and vLLM; in [1e-3, 1e3]) divides a positive logit, or multiplies a negative one,
    of any token in the prompt or the output (1: off). ``logit_bias`` adds ``{token_id: bias}`` (each in
    [-100, 100]) to those logits before the token is chosen; -100 all but bans a token and +100 all but forces it,
    the log-probabilities stay the model's. The penalties and the bias change what is sampled, greedy included
    (:class:`Penalties`). ``grammar`` (:class:`serve.structured.Grammar`: a JSON schema, any JSON object, a regular
    expression) allows only the tokens that keep the output on it, and the request ends when it is whole.
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
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    grammar: Grammar | None = None

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
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None (off), got {k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:  # also refuses NaN
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), "
                                 f"got {getattr(self, name)}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:  # also refuses NaN
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = off), got {self.repetition_penalty}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_BIASED_TOKENS:
                raise ValueError(f"logit_bias may hold at most {MAX_BIASED_TOKENS} tokens, got {len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # also refuses NaN
                    raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                     f"got {bias} for token {token}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the logits a token is chosen from differ from the model's (penalties or a logit bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)


class Penalties:
    """One request's adjustments of the logits its tokens are chosen from: the penalties against repeating (its
    output token counts, its prompt's tokens) and its logit bias. Log-probabilities stay the model's."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        self.params = params
        self.prompt_ids = prompt_ids
        self.counts: torch.Tensor | None = None  # [vocab] times each token was generated, made at the first call
        self.seen: torch.Tensor | None = None  # [vocab] in the prompt or the output (repetition_penalty only)
        self.bias: torch.Tensor | None = None  # [vocab] logit_bias, dense (made at the first call)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``[vocab]`` logits with this request's penalties and bias applied (a new fp32 tensor)."""
        p = self.params
        if self.counts is None:
            vocab, device = logits.shape[-1], logits.device
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if p.repetition_penalty != 1:
                self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                self.seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=device)] = True
            if p.logit_bias:
                self.bias = torch.zeros(vocab, dtype=torch.float32, device=device)
                self.bias[torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)] = torch.tensor(
                    [float(b) for b in p.logit_bias.values()], device=device)
        out = logits.float()
        if self.seen is not None:
            scaled = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
            out = torch.where(self.seen, scaled, out)
        if p.frequency_penalty:
            out = out - p.frequency_penalty * self.counts
        if p.presence_penalty:
            out = out - p.presence_penalty * (self.counts > 0).float()
        if self.bias is not None:
            out = out + self.bias
        return out

    def add(self, token: int) -> None:
        """Count a generated token (after the logits it was chosen from were penalized)."""
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True


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
    return tokens_logprobs(logits[None], [token], k)[0]


def tokens_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """:func:`token_logprobs` of ``tokens[i]`` under ``logits[i]`` (``[n, vocab]``), at once."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    if not all(math.isfinite(c) for c in chosen):
        raise FloatingPointError("non-finite logits; cannot report log-probabilities")
    if not k:
        return [TokenLogprobs(t, c) for t, c in zip(tokens, chosen)]
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    # Tokens the model rules out (-inf) are left out rather than reported as -Infinity, which JSON cannot carry.
    return [TokenLogprobs(t, c, tuple((i, v) for i, v in zip(row_ids, row_values) if v > -math.inf))
            for t, c, row_ids, row_values in zip(tokens, chosen, ids.tolist(), values.tolist())]


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
