"""On-policy distillation: the student continues prompts with the toolkit's own decode engine.

Off-policy KD trains only on fixed text, so the student never sees (nor learns to recover from) the
prefixes it produces itself. On a share ``fraction`` of the micro-batches, :class:`OnPolicy` instead

1. takes prompts (text prefixes of the micro-batch's own packed blocks, or the user turns of a
   chat dataset),
2. lets the *current* student continue them with :class:`serve.engine.Engine` (batched, KV-cached,
   seeded per row),
3. runs the usual teacher–student forward on prompt + continuation — the teacher scores every
   rollout in one forward — with the loss counted on the generated tokens only and only the
   divergence terms on (CE on the student's own samples would just reinforce them).

Weights: the engine is built once over the live student's modules, so prefill reads the very
parameters the optimizer updates. Decode on CPU runs from the engine's fused copies of the
projections in oneDNN's layout (:mod:`serve.model`; ~1.7x faster decode steps on the demo student
than the model's own weights), which are snapshots: :class:`Rollouts` rebuilds them whenever the
student's parameters changed since the last rollout (an in-place optimizer update bumps each
parameter's version counter), so at most once per optimizer step, ~0.7 s on the demo student
(``rollout_tok_s`` counts it as generation time). On GPU the engine keeps no copies and nothing is
synced. The prompt-prefix cache is off: its stored keys and values would outlive the weights that
made them. Under ZeRO-3 the parameters exist only as shards, and the engine's data-dependent number of
forward calls per rank cannot join ZeRO-3's per-module gathers; there the engine decodes from a plain
replica refreshed once per optimizer step that generates (one extra student copy per rank; the refresh
gathers a few weights at a time, :func:`distill.distributed.gathered_replica`).

Which micro-batches go on-policy is a fixed function of (step, micro-batch index): every rank makes
the same choice (DDP ranks stay in step) and a resumed run makes the same choices again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

import torch

from core.config import ConfigError
from distill.data.text import SourceSpec, parse_sources
from distill.distributed import gathered_replica, is_zero3
from serve.engine import Engine
from serve.sampling import MAX_BIASED_TOKENS, MAX_LOGIT_BIAS, MIN_TEMPERATURE, SamplingParams

PROMPT_SOURCES = ("prefix", "chat")


class OnPolicyError(ConfigError):
    """Settings or data that on-policy training cannot use; the message names the fix."""


@dataclass
class OnPolicySettings:
    """The on-policy knobs of a recipe config (see ``recipes/distill.py`` for their help)."""

    fraction: float = 0.0
    max_new_tokens: int = 64
    temperature: float = 1.0
    prompt_tokens: int = 64
    prompts: str = "prefix"
    seed: int = 0
    kd_kind: str | None = None  # divergence on the rollouts (None: the loss config's kd_kind)
    rows: int = 0  # prompts rolled out per on-policy micro-batch (0: the micro-batch size)
    rollout_rows: int = 0  # rows decoded per engine call, the surplus queued for later micro-batches (0: rows)

    def check(self, seq_len: int, *, kd_weight: float, cached_teacher: bool, micro_batch_size: int) -> None:
        """Everything that can be checked before a model loads; one-line errors."""
        if not 0.0 <= self.fraction <= 1.0:
            raise OnPolicyError(f"on_policy_fraction must be in [0, 1] (the share of on-policy micro-batches), "
                                f"got {self.fraction}")
        if self.fraction == 0:
            return
        if self.max_new_tokens < 1 or self.prompt_tokens < 1:
            raise OnPolicyError("gen_max_new_tokens and gen_prompt_tokens must be >= 1")
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise OnPolicyError(f"gen_temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (the engine samples no "
                                f"cooler), got {self.temperature}")
        if self.prompts not in PROMPT_SOURCES:
            raise OnPolicyError(f"gen_prompts '{self.prompts}' is unknown; use one of {', '.join(PROMPT_SOURCES)}")
        if not 0 <= self.rows <= micro_batch_size:
            raise OnPolicyError(f"gen_batch_size must be in [0, micro_batch_size={micro_batch_size}] (0: the "
                                f"micro-batch size), got {self.rows}")
        rows = self.rows or micro_batch_size
        if self.rollout_rows and (self.rollout_rows % rows or self.rollout_rows > micro_batch_size):
            raise OnPolicyError(f"gen_rollout_rows must be 0 or a multiple of gen_batch_size ({rows}) no larger than "
                                f"micro_batch_size={micro_batch_size}, got {self.rollout_rows}")
        if self.prompt_tokens + self.max_new_tokens > seq_len:
            raise OnPolicyError(f"gen_prompt_tokens ({self.prompt_tokens}) + gen_max_new_tokens ({self.max_new_tokens}) "
                                f"exceeds seq_len {seq_len}; lower them or raise seq_len")
        if kd_weight <= 0:
            raise OnPolicyError("on-policy micro-batches train on the divergence only: set kd_weight > 0")
        if cached_teacher:
            raise OnPolicyError("on-policy rollouts need the live teacher to score them; drop teacher_cache or set "
                                "on_policy_fraction=0")


def is_on_policy(step: int, micro: int, grad_accum: int, fraction: float) -> bool:
    """Whether micro-batch ``micro`` of optimizer step ``step`` is on-policy.

    Spreads the on-policy share evenly: micro-batch ``i`` (counted over the whole run) is on-policy
    when ``floor((i + 1) * fraction) > floor(i * fraction)``, so any window of ``n`` micro-batches
    holds ``n * fraction`` of them, give or take one.
    """
    i = step * grad_accum + micro
    return math.floor((i + 1) * fraction + 1e-9) > math.floor(i * fraction + 1e-9)


def prefix_prompts(blocks: torch.Tensor, prompt_tokens: int) -> list[list[int]]:
    """``[rows, seq]`` packed blocks → the first ``prompt_tokens`` ids of each row."""
    return [row[:prompt_tokens].tolist() for row in blocks]


def chat_prompts(dataset: str | list[SourceSpec], tokenizer, prompt_tokens: int, max_records: int | None = None,
                 seed: int = 0) -> list[list[int]]:
    """Each chat record's conversation up to its first user turn, rendered for generation.

    ``dataset``: one source, or the run's sources (:func:`~distill.data.text.parse_sources` of its
    ``datasets:`` mixture); sources without chat records are passed over. Records longer than
    ``prompt_tokens`` are skipped (never truncated). A source of more than ``max_records`` records
    contributes a seeded sample of that many (in dataset order; a streamed one, its first records), so
    start time and memory stay bounded whatever its size. One-line error when no source has chat
    records or none fits.
    """
    import numpy as np

    from distill.data.text import BUILTIN, load_records

    specs = [SourceSpec(dataset)] if isinstance(dataset, str) else list(dataset)
    names = ", ".join(s.source for s in specs)
    pools = []
    for spec in specs:
        if spec.source == BUILTIN:  # plain text, and no ``datasets`` source: loading it failed the whole pool
            continue
        records = load_records(spec.source, spec.split, streaming=spec.streaming)
        if spec.streaming:
            records = list(itertools.islice(records, max_records))
        elif max_records is not None and len(records) > max_records:
            pick = np.random.default_rng(seed).choice(len(records), size=max_records, replace=False)
            records = records.select(np.sort(pick).tolist())
        columns = set(records[0]) if isinstance(records, list) and records else set(records.column_names or ())
        if "messages" in columns:
            pools.append(records)
    if not pools:
        raise OnPolicyError(f"{names} has no chat records ('messages'); use gen_prompts=prefix")
    if getattr(tokenizer, "chat_template", None) is None:
        raise OnPolicyError("gen_prompts=chat needs a tokenizer with a chat template; use gen_prompts=prefix")
    out, seen = [], 0
    for r in itertools.chain.from_iterable(pools):
        msgs = r["messages"] or []
        first = next((i for i, m in enumerate(msgs) if m.get("role") == "user" and m.get("content")), None)
        if first is None:
            continue
        seen += 1
        text = tokenizer.apply_chat_template(msgs[: first + 1], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= prompt_tokens:
            out.append(list(ids))
    if not out:
        why = "no record has a user turn" if not seen else f"no user turn fits in gen_prompt_tokens={prompt_tokens}"
        raise OnPolicyError(f"{names} has no usable prompts ({why}); raise gen_prompt_tokens or use gen_prompts=prefix")
    return out


def has_chat(spec: SourceSpec) -> bool | None:
    """Whether a source holds chat records, where that is known without reading it through ``datasets``: the
    built-in corpus and ``.txt`` files never do, a local ``.jsonl``'s first record says; None: not known here."""
    from distill.data.parallel import first_record
    from distill.data.text import BUILTIN, local_files

    if spec.source == BUILTIN:
        return False
    local = local_files(spec.source)
    if local is None:  # a hub name
        return None
    kind, files = local
    if kind == "text":
        return False
    return "messages" in first_record(files) if all(p.suffix == ".jsonl" for p in files) else None


def check_prompt_sources(specs: list[SourceSpec]) -> None:
    """:func:`chat_prompts`' "no chat records" refusal, before any model loads, where :func:`has_chat` can tell."""
    if not any(has_chat(s) is not False for s in specs):
        raise OnPolicyError(f"{', '.join(s.source for s in specs)} has no chat records ('messages'); use "
                            "gen_prompts=prefix")


def rollout_seed(seed: int, step: int, micro: int, rank: int, row: int) -> int:
    """A distinct, reproducible sampling seed for every rollout row of the run."""
    x = seed
    for part in (step, micro, rank, row):
        x = (x * 1_000_003 + part + 1) % (2**61 - 1)
    return x


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int
                  ) -> dict[str, torch.Tensor]:
    """Prompt + continuation rows, right-padded, with labels on the continuation only.

    Returns ``input_ids`` ``[rows, longest]``, ``attention_mask`` ``[rows, longest]`` and ``labels``
    ``[rows, longest]`` (the generated ids at their positions, -100 on prompt and padding), in the
    HF convention :class:`distill.model.DistillModel` reads: position t predicts ``labels[t + 1]``.
    """
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        ids[r, :n] = torch.tensor(p + c, dtype=torch.long)
        mask[r, :n] = 1
        if c:
            labels[r, len(p):n] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class Rollouts:
    """:class:`serve.engine.Engine` over a live student (its parameters used in place, never copied).

    Args:
        student: the HF causal LM being trained (unwrapped from DDP).
        tokenizer: its tokenizer.
        max_batch: rows decoded together (the micro-batch size).
        max_seq_len: prompt + continuation budget (the engine refuses longer requests).
        fast_weights: the engine's decode copies (None: its default, on for CPU); refreshed whenever
            the student's weights changed (module docstring).
        sharded: the student's parameters are ZeRO-3 partitioned: decode from a replica.
    """

    def __init__(self, student, tokenizer, max_batch: int, max_seq_len: int, fast_weights: bool | None = None,
                 sharded: bool = False):
        self.student = student
        self.replica = gathered_replica(student) if sharded else None
        self.synced_step: int | None = None
        self.model = student if self.replica is None else self.replica  # what the engine reads
        p = next(self.model.parameters())
        was = student.training
        # prefix_cache_bytes=0: a cached prompt prefix would hold keys/values of weights since updated.
        self.engine = Engine(model=self.model, tokenizer=tokenizer, device=p.device, dtype=p.dtype,
                             max_batch=max_batch, max_seq_len=max_seq_len, fast_weights=fast_weights,
                             prefix_cache_bytes=0)
        student.train(was)  # the engine puts its model in eval mode; training continues in train mode
        self._synced = self._weights_version()
        self._copies_step: int | None = None  # the optimizer step the decode copies were built at
        self.syncs = 0  # decode-copy refreshes so far

    def _weights_version(self) -> tuple[tuple[int, int], ...]:
        """Changes whenever a parameter is replaced or updated in place (``Tensor._version``)."""
        return tuple((q.data_ptr(), q._version) for q in self.model.parameters())

    def sync(self, step: int | None = None) -> None:
        """Refresh the engine's decode copies if the student's weights changed since the last sync.

        A new optimizer ``step`` always refreshes: some updates change a parameter without bumping its
        ``_version`` (``AdamW(fused=True)``, writes through ``.data``), and the copies must not go stale.
        """
        if self.engine.model.fast_weight_bytes() == 0:
            return
        version = self._weights_version()
        if version != self._synced or (step is not None and step != self._copies_step):
            self.engine.model.refresh_fast_weights()
            self._synced, self._copies_step = version, step
            self.syncs += 1

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], step: int | None = None,
                 with_stop: bool = True) -> list[list[int]]:
        """Continuations (token ids) of ``prompts`` with the current weights, ending in the stop token when one
        ended them (``with_stop``): where the student chose to stop is a position the teacher judges too.

        ``step``: the optimizer step; a sharded student's replica is refreshed when it changes (every
        rank calls this at the same steps, so the refresh's collective lines up).
        """
        if self.replica is not None and (step is None or step != self.synced_step):
            gathered_replica(self.student, self.replica)
            self.synced_step = step
        was = self.student.training
        self.student.eval()
        try:
            self.sync(step)
            done = self.engine.generate(prompts, params)
        finally:
            self.student.train(was)
        if failed := [i for i, c in enumerate(done) if c.finish_reason == "error"]:
            raise OnPolicyError(f"the engine failed on rollout rows {failed} (see its log: e.g. non-finite logits "
                                "from diverged weights); lower lr or check the run")
        return [c.token_ids + ([c.stop_token] if with_stop and c.stop_token is not None else []) for c in done]


class OnPolicy:
    """The on-policy micro-batch: rollouts from the current student, then a divergence-only step.

    Args:
        settings: the on-policy knobs.
        model: the prepared (possibly DDP-wrapped) :class:`distill.model.DistillModel`.
        unwrapped: the same module unwrapped (its ``student`` generates; its ``loss_config`` is
            swapped for the divergence-only one during on-policy forwards).
        tokenizer: the student's tokenizer.
        micro_batch_size, rank: rows per micro-batch and this process's rank (seeds differ per rank).
            An on-policy micro-batch rolls out ``settings.rows`` of them (all when 0): fewer rows make it
            cheaper while it still makes one update toward the student's own samples.
            ``settings.rollout_rows`` (a multiple of that, at most the micro-batch) are decoded in one
            engine call and queued: the next on-policy micro-batches train on the queued rows without
            decoding, which is cheaper per row (batched decode is memory-bound on one row) but
            slightly stale (sampled by weights up to ``rollout_rows / rows - 1`` on-policy
            micro-batches old). The queue is checkpointed per rank (:meth:`state_dict`), so a
            resumed run trains on the rows it would have had.
        prompts: fixed prompt pool (chat user turns); None = prefixes of each micro-batch's blocks.
    """

    def __init__(self, settings: OnPolicySettings, model, unwrapped, tokenizer, micro_batch_size: int, rank: int = 0,
                 prompts: list[list[int]] | None = None, sharded: bool = False):
        self.s = settings
        self.model, self.unwrapped = model, unwrapped
        self.rank = rank
        self.pool = prompts
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.rows = settings.rows or micro_batch_size
        self.rollout_rows = settings.rollout_rows or self.rows
        self.queue: list[tuple[list[int], list[int]]] = []  # (prompt, continuation) rolled out ahead of use
        # Rollouts sample the vocabulary the loss compares (``DistillModel.vocab``): the student's rows past it are
        # padding that the teacher may lack (its embedding failed on such an id) and the loss's softmax leaves out.
        extra = range(unwrapped.vocab, unwrapped.student.config.vocab_size)
        if len(extra) > MAX_BIASED_TOKENS:
            raise OnPolicyError(f"the student has {len(extra)} vocabulary rows past the {unwrapped.vocab} it shares "
                                f"with the teacher; on-policy rollouts can ban at most {MAX_BIASED_TOKENS}: set "
                                "on_policy_fraction=0 or resize the student's vocabulary")
        self.banned = {t: -MAX_LOGIT_BIAS for t in extra} or None
        self.rollouts = Rollouts(unwrapped.student, tokenizer, self.rollout_rows,
                                 settings.prompt_tokens + settings.max_new_tokens, sharded=sharded)
        cfg = unwrapped.loss_config
        # The divergence (and hidden/attention matching, which is valid on any shared text) only.
        self.loss_config = dataclasses.replace(cfg, ce_weight=0.0, focal_weight=0.0,
                                               kd_kind=settings.kd_kind or cfg.kd_kind)
        self.gen_seconds = 0.0
        self.gen_tokens = 0
        self.micro_batches = 0
        self.engine_calls = 0  # fewer than micro_batches when rollout rows are queued

    def wants(self, step: int, micro: int, grad_accum: int) -> bool:
        return self.s.fraction > 0 and is_on_policy(step, micro, grad_accum, self.s.fraction)

    def prompts_for(self, blocks: torch.Tensor, step: int, micro: int) -> list[list[int]]:
        """Prompts of one rollout: its blocks' prefixes, or pool entries chosen by a seeded draw."""
        if self.pool is None:
            return prefix_prompts(blocks[: self.rollout_rows], self.s.prompt_tokens)
        g = torch.Generator().manual_seed(rollout_seed(self.s.seed, step, micro, self.rank, 10**6))
        pick = torch.randint(len(self.pool), (min(self.rollout_rows, blocks.shape[0]),), generator=g).tolist()
        return [self.pool[i] for i in pick]

    def params_for(self, n: int, step: int, micro: int) -> list[SamplingParams]:
        return [SamplingParams(max_new_tokens=self.s.max_new_tokens, temperature=self.s.temperature,
                               seed=rollout_seed(self.s.seed, step, micro, self.rank, r), logit_bias=self.banned)
                for r in range(n)]

    def generate(self, blocks: torch.Tensor, step: int, micro: int) -> dict[str, torch.Tensor]:
        """One on-policy micro-batch's rows (rolled out now, or queued by an earlier rollout).

        Returns the :func:`rollout_batch` tensors (on CPU).
        """
        if not self.queue:
            prompts = self.prompts_for(blocks, step, micro)
            t0 = time.perf_counter()
            completions = self.rollouts.generate(prompts, self.params_for(len(prompts), step, micro), step)
            self.gen_seconds += time.perf_counter() - t0
            self.gen_tokens += sum(len(c) for c in completions)
            self.engine_calls += 1
            self.queue = list(zip(prompts, completions))
        take, self.queue = self.queue[: self.rows], self.queue[self.rows:]
        self.micro_batches += 1
        return rollout_batch([p for p, _ in take], [c for _, c in take], self.pad_id)

    def forward(self, blocks: torch.Tensor, step: int, micro: int, device: torch.device):
        """Rollouts, then one teacher–student forward on them with the divergence-only losses."""
        batch = {k: v.to(device) for k, v in self.generate(blocks, step, micro).items()}
        saved = self.unwrapped.loss_config
        self.unwrapped.loss_config = self.loss_config
        try:
            return self.model(**batch)
        finally:
            self.unwrapped.loss_config = saved

    def state_dict(self) -> dict:
        """This rank's queued rollout rows, what a resumed run needs to train as if never stopped.

        The counters of :meth:`stats` are not in it: like ``tokens_per_s`` they cover this process's own loop.
        """
        return {"queue": [[p, c] for p, c in self.queue]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (an empty dict, from a checkpoint without it, keeps a fresh start)."""
        self.queue = [(list(p), list(c)) for p, c in state.get("queue", [])]

    def stats(self, elapsed: float) -> dict[str, float]:
        """Rollout tokens/s, the share of ``elapsed`` training seconds spent generating, and counts (this rank)."""
        return {"rollout_tok_s": self.gen_tokens / max(self.gen_seconds, 1e-9),
                "gen_time_share": self.gen_seconds / max(elapsed, 1e-9),
                "rollout_tokens": float(self.gen_tokens), "rollout_calls": float(self.engine_calls),
                "on_policy_micro_batches": float(self.micro_batches)}


def settings_from(cfg) -> OnPolicySettings:
    """:class:`OnPolicySettings` from a recipe config's ``on_policy_fraction`` / ``gen_*`` fields."""
    return OnPolicySettings(fraction=cfg.on_policy_fraction, max_new_tokens=cfg.gen_max_new_tokens,
                            temperature=cfg.gen_temperature, prompt_tokens=cfg.gen_prompt_tokens,
                            prompts=cfg.gen_prompts, seed=cfg.seed, kd_kind=cfg.gen_kd_kind, rows=cfg.gen_batch_size,
                            rollout_rows=cfg.gen_rollout_rows)


def build(cfg, accelerator, model, tokenizer) -> OnPolicy | None:
    """The recipe's on-policy helper (None when ``on_policy_fraction`` is 0), after ``accelerator.prepare``."""
    settings = settings_from(cfg)
    if settings.fraction == 0:
        return None
    unwrapped = accelerator.unwrap_model(model)
    limit = unwrapped.student.config.max_position_embeddings
    if settings.prompt_tokens + settings.max_new_tokens > limit:
        raise OnPolicyError(f"gen_prompt_tokens + gen_max_new_tokens exceeds the student's context of {limit} "
                            "tokens; lower them")
    sources = parse_sources(cfg.datasets, cfg.dataset, text_field=cfg.text_field, streaming=cfg.streaming)
    pool = (chat_prompts(sources, tokenizer, settings.prompt_tokens, cfg.gen_prompt_pool, cfg.seed)
            if settings.prompts == "chat" else None)
    return OnPolicy(settings, model, unwrapped, tokenizer, cfg.micro_batch_size, accelerator.process_index, pool,
                    sharded=is_zero3(accelerator))
