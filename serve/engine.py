"""The decode engine: continuous batching over preallocated (dense or bounded) KV caches.

Each request owns one row of the cache. :meth:`Engine.step` admits waiting requests into free rows
(restoring any cached prompt prefix, :mod:`serve.prefix_cache`), prefills at most ``prefill_budget``
prompt tokens in forwards of at most ``prefill_chunk``, shortest remaining prompt first, then runs one
batched decode step over every row whose prompt is done. Requests that arrive during a step are
admitted between its prefill forwards, so a short prompt that arrives while a long one is being
prefilled goes next: its wait for a first token is bounded by one chunk, not by the step's budget
(``bench/serve_sched.py``). A long prompt is thus prefilled across several steps, interleaved with
decode steps, and never holds back the running requests' next tokens for more than one budget's
worth of prefill. Finished rows are freed at
once and reused by the next admission. The same loop serves the synchronous API
(:meth:`Engine.generate`, :meth:`Engine.stream`) and the HTTP server (:meth:`Engine.start` runs it in a
background thread; requests join between decode steps).

Usage::

    engine = Engine("path/to/model")            # hybrid if config.json has "hybrid_attention"
    engine.generate(["Hello"], SamplingParams(max_new_tokens=32))[0].text
    for delta in engine.stream("Hello", SamplingParams(temperature=0.7, seed=1)):
        print(delta, end="", flush=True)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from core.config import ConfigError
from core.models import SMOLLM2, cache_root, load_causal_lm, load_tokenizer, resolve_device, smollm2_gguf
from serve.heap import malloc_trim
from serve.kv_cache import KVCache, MixedKVCache
from serve.model import DecoderModel
from serve.prefix_cache import PrefixCache
from serve.quantize import is_quantized
from serve.sampling import Penalties, SamplingParams, TokenLogprobs, sample, token_logprobs, tokens_logprobs
from serve.structured import Constraint, Grammars
from serve.text import TextStream

logger = logging.getLogger(__name__)

# on_event(text_delta, token_id, finish_reason): one call per generated token (token_id set,
# finish_reason None), then exactly one final call (token_id None, finish_reason set).
EventCallback = Callable[[str, "int | None", "str | None"], None]


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    stop_token: int | None = None  # the stop token that ended it (not in token_ids); None: no stop token did
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids when the params asked (logprobs=k)
    # One per prompt token when the params asked (prompt_logprobs=k): None for the first, which nothing predicts.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Request:
    """One generation in flight. Created by :meth:`Engine.submit`; read-only for callers."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams, on_event: EventCallback | None,
                 tokenizer, stop_ids: set[int]) -> None:
        self.id = next(self._ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.on_event = on_event
        self.stop_ids = set() if params.ignore_eos else set(stop_ids)
        if params.stop_token_ids is not None:
            self.stop_ids = set(params.stop_token_ids)
        self.text = TextStream(tokenizer, params.stop, context_ids=prompt_ids)
        self.out_ids: list[int] = []
        # One per token of out_ids when the params ask (append-only: a reader may index it from another thread).
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self.penalties = Penalties(params, prompt_ids) if params.penalized else None
        self.constraint: Constraint | None = None  # params.grammar's matcher (Engine.submit makes it)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None if params.prompt_logprobs is None else [None]
        self.row = -1
        self.pos = -1  # absolute position of the last token fed to the model
        self.prefilled = 0  # prompt tokens already in the cache row (restored or prefilled)
        self.finish_reason: str | None = None
        self.stop_token: int | None = None
        self.cancelled = False
        self.generator: torch.Generator | None = None
        self.arrival = time.perf_counter()
        # Where the time to first token goes: arrival -> first prefill forward (waiting for the step in
        # flight, admission, earlier prompts) -> first token (its own prefill).
        self.prefill_start: float | None = None
        self.first_token_at: float | None = None
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache at admission
        self.error: BaseException | None = None  # what ended it with "error", when an exception did

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def adjusted(self) -> bool:
        """Whether its tokens are chosen from other logits than the model's (penalties, logit bias, a grammar)."""
        return self.penalties is not None or self.constraint is not None

    def choice_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The ``[vocab]`` logits its next token is chosen from: the model's, penalized, biased, then masked to
        what its grammar can take."""
        if self.penalties is not None:
            logits = self.penalties(logits)
        return logits if self.constraint is None else self.constraint(logits)

    def result(self) -> Completion:
        return Completion(self.text.text, list(self.out_ids), self.finish_reason or "", len(self.prompt_ids),
                          self.stop_token, None if self.logprobs is None else list(self.logprobs),
                          None if self.prompt_logprobs is None else list(self.prompt_logprobs))


def device_problem(device: str | None) -> str | None:
    """What is wrong with a ``--device`` flag, as a sentence naming the fix; None when this machine has it."""
    if device is None:
        return None
    try:
        resolve_device(device)
    except ConfigError as err:
        return f"--device: {err}"
    return None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of the serve CLIs: every option's default, except an unset one (None), whose help says in words
    what it resolves to (the model's, a computed value): "(default: None)" would contradict it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


# core.models.resolve_model_path's names for the demo teacher.
_SMOLLM2_NAMES = (SMOLLM2, "smollm2", "smollm2-135m")


def model_positions(name_or_path: str) -> int | None:
    """A model's ``max_position_embeddings`` from its config alone (no weights, no conversion): the demo
    teacher's converted cache or, before the first conversion, its GGUF header; an HF directory's or hub
    name's ``config.json``. None when it cannot be read here (loading the model then says why)."""
    try:
        from transformers import AutoConfig

        if name_or_path.lower() in _SMOLLM2_NAMES:
            cached = cache_root() / SMOLLM2
            if (cached / "config.json").is_file():
                config = AutoConfig.from_pretrained(cached)
            else:
                gguf = smollm2_gguf()
                config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        else:
            config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError):  # a missing path, an offline hub name, a config transformers cannot read
        return None
    positions = getattr(config, "max_position_embeddings", None)
    return positions if isinstance(positions, int) else None


def seq_len_problem(max_seq_len: int | None, positions: int | None, flag: str = "--max-seq-len") -> str | None:
    """What is wrong with a context limit, as a sentence naming the fix; None when usable (None: the model's).

    The one rule of the engine and its CLIs: at least 2 (a prompt token and a generated one), at most the
    model's ``max_position_embeddings``. Beyond it, positions the model never saw, and a KV cache sized for
    them: a huge value made the server start, then fail every request on the cache's allocation.
    """
    if max_seq_len is None:
        return None
    if max_seq_len < 2:
        return f"{flag} must be >= 2 (a prompt token and a generated one), got {max_seq_len}"
    if positions is not None and max_seq_len > positions:
        return (f"{flag} {max_seq_len} exceeds the model's max_position_embeddings={positions}; use at most "
                f"{positions}, or leave it unset for the model's")
    return None


def max_seq_len_problem(model: str, max_seq_len: int | None, flag: str = "--max-seq-len") -> str | None:
    """:func:`seq_len_problem` for a ``--max-seq-len`` flag and a ``--model`` name or directory, before anything
    loads (the config is read only when the value is not wrong on its face)."""
    return seq_len_problem(max_seq_len, None, flag) or (
        None if max_seq_len is None else seq_len_problem(max_seq_len, model_positions(model), flag))


class WarmupError(RuntimeError):
    """A warm-up request failed: serving would fail every request the same way. One line naming the fix."""


class GenerationError(RuntimeError):
    """:meth:`Engine.stream`'s request ended with ``"error"`` (its cause chained): the text so far is not whole."""


def _placement(model, device, dtype) -> tuple[torch.device, torch.dtype]:
    """Where and in what dtype an engine runs: as asked; else a live ``model`` where it is, in its dtype (``.to``
    works in place, so moving it would change the caller's model too); else CUDA + bf16 when available, CPU + fp32."""
    device = None if device == "auto" else device
    if model is not None and (first := next(model.parameters(), None)) is not None:
        device = device or first.device
        dtype = dtype or (first.dtype if first.is_floating_point() else None)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


class Engine:
    """Batched, streaming generation for Llama / Mistral / Qwen2 checkpoints (dense or hybrid).

    Args:
        model_dir: an HF model directory; a ``"hybrid_attention"`` entry in its ``config.json`` selects
            the bounded cache. Alternatively pass ``model=`` (an HF ``*ForCausalLM``) and ``tokenizer=``.
        device, dtype: for ``model_dir``, default CUDA + bf16 when available, else CPU + fp32; for ``model=``,
            default the model's own device and dtype (an engine never moves or casts a live model it was
            not asked to: ``Module.to`` works in place, so that would change the caller's model too).
        max_batch: most requests decoded together (cache rows).
        max_seq_len: longest prompt + generation a request may reach (default: the model's
            ``max_position_embeddings``); requests beyond it are refused, never truncated.
        prefill_chunk: prompt tokens per prefill forward at the start of a prompt (bounds activation
            memory for long prompts, and how long a newly arrived prompt waits for the forward in
            flight); deeper in a long prompt a forward takes fewer tokens of the same cost
            (:meth:`chunk_at`). A prompt whose remainder exceeds the chunk by at most a quarter of it
            is taken whole (:meth:`chunk_for`): a forward's weight pass costs as much as ~20 prompt
            tokens, so a 133-token prompt in one forward gets its first token sooner than in 128 + 5.
        chunk_by_cost: shrink chunks with depth as :meth:`chunk_at` says (default); False: always
            ``prefill_chunk`` tokens.
        compile: CUDA only: ``torch.compile`` the decode step (ignored on CPU).
        dense: force the dense cache even for a hybrid model (the full-attention baseline).
        fast_weights: decode from fused copies of the projections in CPU-friendly layouts (faster
            decode steps; one more copy of those weights in memory). Default: on for CPU, off
            elsewhere. See :mod:`serve.model`.
        prefill_budget: most prompt tokens prefilled per engine step, across requests (default
            ``max(512, prefill_chunk)``); decode steps run between budgets, so it bounds how long a long
            prompt delays everyone else's next token.
        prefill_step_s: while other requests are decoding, size each step's prefill to take about
            this long (tokens = seconds / the measured seconds per prefill token, at least
            ``min_prefill_tokens``, at most ``prefill_budget``), so a step's length, and with it the
            wait of a request arriving mid-step and every running request's next token, stays
            near this whatever the machine's speed. None (the default): always ``prefill_budget``
            tokens. With no one decoding, prompts prefill at the full budget. Off by default: on the
            loaded 2-core machine it was measured (``bench/serve_sched.py``) no better for short
            prompts' time to first token and worse for medium and long ones.
        min_prefill_tokens: the least a timed step prefills: a short prompt (up to this many tokens
            left) is prefilled whole, in one step, rather than spread over several with decode steps
            between; small chunks also cost more per token.
        prefix_cache_bytes: byte budget of the prompt-prefix cache (0 turns it off); see
            :mod:`serve.prefix_cache`.
        prefix_block: tokens per prefix-cache block (hits cover a multiple of it).
        threads: CPU: intra-op threads of the step loop's thread (:meth:`start`); default: what
            ``torch.get_num_threads()`` says when :meth:`start` is called. On CPU, run no multi-threaded torch
            work on any other thread of the process (load the model with ``torch.set_num_threads(1)``, as
            ``serve.server`` does): with GNU OpenMP, another thread's idle worker pool makes the loop's
            workers stop spinning between parallel regions (more threads than cores), and every small op
            then waits for a wake-up; measured on 2 cores, a 64-token prefill 55 ms → 95 ms.
        overtake_tokens: a waiting prompt of at most this many tokens does not wait for the forward in
            flight: it is admitted and prefilled between two of that forward's layers, and its first
            token sent, before the forward goes on (:meth:`overtake`). Default: what one prefill forward
            takes (``prefill_chunk`` plus its quarter tail); 0: off (prompts join between forwards). The
            prefill of a prompt that short is not itself overtaken: the one in flight finishes first.
    """

    def __init__(self, model_dir: str | Path | None = None, *, model=None, tokenizer=None,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 max_batch: int = 8, max_seq_len: int | None = None, prefill_chunk: int = 128,
                 compile: bool = False, dense: bool = False, fast_weights: bool | None = None,
                 prefill_budget: int | None = None, prefix_cache_bytes: int = 256 * 2**20,
                 prefix_block: int = 32, prefill_step_s: float | None = None, min_prefill_tokens: int = 128,
                 chunk_by_cost: bool = True, threads: int | None = None, overtake_tokens: int | None = None
                 ) -> None:
        device, dtype = _placement(model, device, dtype)
        model, tokenizer, seq_len = self._model_and_context(model_dir, model, tokenizer, dtype, max_seq_len)
        if is_quantized(model):
            # A quantized export keeps its stored dtype. Its int8 (W8A8) linears run through fused int8
            # copies in oneDNN's int8 GEMM (serve.model); other torchao layouts through torchao's own linears.
            dtype = model.dtype
        self.model = DecoderModel(model.to(device=device, dtype=dtype), fast_weights=fast_weights)
        extra = self.model.fast_weight_bytes()
        if extra:
            logger.info("decode weight copies: %.2f GiB (Engine(fast_weights=False) skips them)", extra / 2**30)
        self.tokenizer = tokenizer
        self.device = device
        self.dense = dense or self.model.spec is None
        self.max_batch = max_batch
        self.max_seq_len = seq_len
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_batch < 1:  # no cache row: every request would wait forever
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.prefill_chunk = prefill_chunk
        self._attn_ratio, self._ctx_cap, self._full_share = self._chunk_cost_model(chunk_by_cost)
        self.prefill_budget = prefill_budget or max(512, prefill_chunk)
        if self.prefill_budget < 1:
            raise ValueError(f"prefill_budget must be >= 1, got {prefill_budget}")
        if prefill_step_s is not None and not prefill_step_s > 0:
            raise ValueError(f"prefill_step_s must be > 0 seconds (or None for a fixed budget), got {prefill_step_s}")
        if min_prefill_tokens < 1:
            raise ValueError(f"min_prefill_tokens must be >= 1, got {min_prefill_tokens}")
        self.prefill_step_s, self.min_prefill_tokens = prefill_step_s, min_prefill_tokens
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        if overtake_tokens is not None and overtake_tokens < 0:
            raise ValueError(f"overtake_tokens must be >= 0 (0: off), got {overtake_tokens}")
        self._prefill_s_per_token: float | None = None  # moving average of measured prefill chunks
        self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_block) if prefix_cache_bytes else None
        if self.prefix_cache is not None and self.spec is not None and self.spec.has_head_roles:
            # Per-head roles give a MixedKVCache (a full and a bounded cache side by side); the prefix
            # cache stores and restores one KVCache's slots, so it is off for those models.
            logger.warning("prefix cache: off for a model with per-head roles (full_heads/full_layers); "
                           "prompts are prefilled in full")
            self.prefix_cache = None
        # A chunk may grow by a quarter (chunk_for); with a bounded cache and the prefix cache, not past
        # window - block, so that every prompt block is still in the ring when it is captured.
        self._max_tail = prefill_chunk // 4
        if self.prefix_cache is not None and self.spec is not None:
            window = min(self.spec.windows)
            self._max_tail = max(0, min(self._max_tail, window - prefix_block - prefill_chunk))
            if prefill_chunk + prefix_block > window:  # serve.prefix_cache: "Bounded (hybrid) caches"
                # The way out, when there is one: a window no longer than a block leaves no chunk size that works.
                fix = (f"prefill_chunk <= {window - prefix_block} caches all" if window > prefix_block else
                       f"no prefill_chunk caches all: the window is not longer than a {prefix_block}-token block")
                logger.warning("prefix cache: with prefill_chunk %d + block %d > window %d, prompt blocks can leave "
                               "the bounded cache before they are cached; only the start of long prompts is "
                               "cached (%s)", prefill_chunk, prefix_block, window, fix)
        self.overtake_tokens = prefill_chunk + self._max_tail if overtake_tokens is None else overtake_tokens
        self.overtakes = 0  # prompts prefilled inside another forward (overtake)
        self._overtaking = False
        self._overtake_s = 0.0  # seconds spent in overtaking prefills (taken out of the paused forward's timing)
        self._in_block, self._block_taken = [], set()  # overtakes into the decode block in flight (_decode_step)
        self.stop_ids = self._eos_ids(model)
        # on_forward(kind, start_s, end_s, tokens, request_ids): called after every forward ("prefill": one
        # request's chunk, tokens = its length; "decode": one token per id), perf_counter seconds; the
        # server's --step-log writes these, so a request's wait can be attributed to what ran meanwhile.
        self.on_forward: Callable[[str, float, float, int, list[int]], None] | None = None
        self.cache: KVCache | None = None
        self._min_rows = 1  # rows the cache is first made with (warmup: all of them)
        self._warming = False  # warmup() is running its requests (their failures are its to report)
        # CPU, glibc: every trim_every_s seconds of serving, the loop hands the heap's free pages back to the
        # OS (malloc_trim). Activations of every size, on several threads, leave free chunks in glibc's
        # arenas that it keeps: RSS otherwise creeps up for many minutes under varied traffic. None or 0: never.
        self.trim_every_s: float | None = 10.0
        self.trims = 0
        self._waiting: deque[Request] = deque()
        self._grammars: Grammars | None = None  # structured output, made at the first grammar (see grammars)
        self._calls: deque[Callable[[], None]] = deque()  # for the loop's thread, between steps (_on_loop)
        self._rows: list[Request | None] = []
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._shutdown = False
        # Decode inputs live in preallocated buffers, updated in place every step. Every tensor the engine keeps
        # and updates in place (these, the KV cache, the prefix cache's pool) is made outside inference mode: an
        # inference tensor could not be updated once a caller uses the engine outside torch.inference_mode().
        with torch.inference_mode(False):
            self._tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
            self._pos = torch.zeros(max_batch, dtype=torch.long, device=device)
        self._decode = self.model.decode_one_token
        self._compiled = compile and device.type == "cuda"
        if self._compiled:
            self._decode = torch.compile(self.model.decode_one_token, dynamic=True)

    # ---- setup helpers -----------------------------------------------------------------------------------

    @staticmethod
    def _model_and_context(model_dir, model, tokenizer, dtype, max_seq_len: int | None) -> tuple:
        """``(model, tokenizer, context limit)``: the model given, or loaded from ``model_dir``; the limit is
        ``max_seq_len`` or the model's ``max_position_embeddings``, never more (a ValueError naming the fix, from
        the config alone before weights load, and before decode weight copies or a KV cache are made)."""
        if model is None:
            if model_dir is None:
                raise ValueError("Engine needs model_dir or model=")
            problem = max_seq_len_problem(str(model_dir), max_seq_len, "max_seq_len")
            if problem:
                raise ValueError(problem)
            # dense=True: the engine runs the saved hybrid spec with its own kernels and caches
            # (serve.model reads it from the config), not through transformers' attention.
            model = load_causal_lm(str(model_dir), dtype=dtype, dense=True, attn_implementation="sdpa")
            tokenizer = tokenizer or load_tokenizer(str(model_dir))
        if tokenizer is None:
            raise ValueError("Engine(model=...) also needs tokenizer=")
        positions = getattr(model.config, "max_position_embeddings", None)
        positions = positions if isinstance(positions, int) else None
        problem = seq_len_problem(max_seq_len, positions, "max_seq_len")
        if problem:
            raise ValueError(problem)
        if max_seq_len is None and positions is None:
            raise ValueError("the model's config has no max_position_embeddings; pass max_seq_len")
        return model, tokenizer, max_seq_len or positions

    def _chunk_cost_model(self, by_cost: bool = True) -> tuple[float, int | None, float]:
        """``(ratio, context cap, full share)`` for :meth:`chunk_at`: attention multiply-adds per token per
        key over the projections' per token, all layers; the cap is what a streaming head of a hybrid model
        keeps (sinks + its largest window + a global per 1024 positions of an 8K prompt: an upper bound),
        None when dense; the share is the fraction of (layer, KV head) pairs that keep the full context
        (1 when dense, 0 without head roles). ``by_cost=False``: ratio 0 (every chunk ``prefill_chunk``)."""
        if not by_cost:
            return 0.0, None, 1.0
        m = self.model
        proj = sum(mod.weight.numel() for layer in m.layers for mod in layer.modules()
                   if isinstance(mod, torch.nn.Linear))
        if not proj:
            return 0.0, None, 1.0
        ratio = 2.0 * m.n_heads * m.head_dim * len(m.layers) / proj
        spec = None if self.dense else self.model.spec
        if spec is None:
            return ratio, None, 1.0
        cap = spec.sink_tokens + max(spec.windows) + (8192 // spec.global_every if spec.global_every else 0)
        pairs = len(m.layers) * m.n_kv
        return ratio, cap, spec.full_head_count(len(m.layers), m.n_kv) / pairs

    def _eos_ids(self, model) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(model, "generation_config", None), model.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
                break
        if not ids and getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def spec(self):
        """The hybrid spec served (None for a dense model or ``dense=True``)."""
        return None if self.dense else self.model.spec

    def encode(self, prompt: str | Sequence[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids of a prompt: a string, ids, or (``chat=True``) a string / list of chat messages."""
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return [int(t) for t in prompt]

    def check_request(self, n_prompt: int, params: SamplingParams) -> None:
        """Raise ``ValueError`` (one line, with the limits) if a request cannot be served whole."""
        if n_prompt < 1:
            raise ValueError("the prompt is empty; send at least one token")
        if n_prompt + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({n_prompt} tokens) + max new tokens ({params.max_new_tokens}) exceeds the "
                             f"context of {self.max_seq_len} tokens; shorten the prompt or lower max tokens")
        vocab = self.model.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias names token {max(params.logit_bias)} but the model's vocabulary has {vocab} "
                             f"tokens (ids 0 to {vocab - 1}); drop it")
        if params.grammar is not None:
            self.grammars.check(params.grammar)  # GrammarError is a ValueError

    @property
    def grammars(self) -> Grammars:
        """The compiler of requests' grammars (structured output), made at the first one."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.stop_ids)
        return self._grammars

    def _ensure_cache(self, rows: int) -> KVCache:
        """Grow the cache to ``rows`` rows (only when a request is admitted: never inside a forward)."""
        old = self.cache
        if old is not None and old.rows >= rows:
            return old
        rows = min(self.max_batch, max(rows, 2 * (old.rows if old else 0), self._min_rows, 1))
        with torch.inference_mode(False):  # a normal tensor: updated in place in and out of inference mode
            new = self.model.new_cache(rows, self.max_seq_len, dense=self.dense)
            if old is not None:
                new.copy_rows_from(old)
        self.cache = new
        self._rows.extend([None] * (rows - len(self._rows)))
        return new

    # ---- request lifecycle -------------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               on_event: EventCallback | None = None) -> Request:
        """Queue a request (thread-safe); it joins the batch at the next step."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_request(len(prompt_ids), params)
        vocab = self.model.config.vocab_size
        # An id outside the embedding fails the model's lookup: on CUDA a device-side assert, every request after it too.
        if not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise ValueError(f"prompt token {bad} is not in the model's vocabulary (ids 0 to {vocab - 1}); drop it")
        req = Request(prompt_ids, params, on_event, self.tokenizer, self.stop_ids)
        if params.grammar is not None:
            req.constraint = self.grammars.constraint(params.grammar)
        with self._lock:
            self._waiting.append(req)
            self._lock.notify_all()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (thread-safe); its row is freed before the next decode step."""
        req.cancelled = True
        with self._lock:
            self._lock.notify_all()

    @property
    def num_active(self) -> int:
        return sum(r is not None for r in self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def _finish(self, req: Request, reason: str) -> None:
        tail = "" if reason == "cancelled" else req.text.finish()  # before marking done: it may raise
        if reason == "length" and req.text.stopped:
            # A stop string in the text held back to the end (a decoder whose unsure characters cannot be told
            # from final ones): the output ends at a stop, as the client asked.
            reason = "stop"
        req.finish_reason = reason
        if req.row >= 0:
            self._rows[req.row] = None
        if req.on_event is not None:
            req.on_event(tail, None, reason)

    def _fail(self, req: Request, exc: BaseException) -> None:
        """Finish one request with ``"error"`` after its own step raised; the rest of the batch goes on.

        Safe for a request that was already finished (its row is freed, no second final event).
        """
        # A warm-up request's failure is raised by warmup() (WarmupError, this exception its cause): no traceback.
        logger.log(logging.DEBUG if self._warming else logging.ERROR, "request %d failed; finishing it alone",
                   req.id, exc_info=exc)
        if 0 <= req.row < len(self._rows) and self._rows[req.row] is req:
            self._rows[req.row] = None
        if req.done:
            return
        req.finish_reason, req.error = "error", exc
        if req.on_event is not None:
            try:
                req.on_event("", None, "error")
            except Exception:
                logger.exception("request %d: the error event could not be delivered", req.id)

    def _accept(self, req: Request, token: int, logits: torch.Tensor) -> None:
        """Record a token sampled from ``[vocab]`` ``logits``: stop token, stop string, or length may end the
        request."""
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        if token in req.stop_ids or (req.constraint is not None and token in req.constraint.end_ids):
            req.stop_token = token
            self._finish(req, "stop")
            return
        if req.constraint is not None:  # first: a token its grammar refuses fails the request with nothing recorded
            req.constraint.consume(token)
        if req.logprobs is not None:  # before the token is recorded: a failure leaves the two lists equal
            req.logprobs.append(token_logprobs(logits, token, req.params.logprobs))
        if req.penalties is not None:
            req.penalties.add(token)
        req.out_ids.append(token)
        delta = req.text.push(token)
        if req.on_event is not None:
            req.on_event(delta, token, None)
        if req.text.stopped or (req.constraint is not None and req.constraint.done):
            self._finish(req, "stop")
        elif len(req.out_ids) >= req.params.max_new_tokens:
            self._finish(req, "length")

    def _admit(self, req: Request, row: int | None = None) -> None:
        """Give ``req`` a free row (the first, or ``row``) and restore its cached prompt prefix; :meth:`_prefill`
        does the rest."""
        cache = self._ensure_cache(self.num_active + 1)
        row = self._rows.index(None) if row is None else row
        self._rows[row] = req
        req.row = row
        total = len(req.prompt_ids) + req.params.max_new_tokens
        cache.reset_row(row, cache.window_for(total))
        if not req.params.greedy:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(req.params.seed if req.params.seed is not None
                                      else int(torch.randint(0, 2**62, ()).item()))
        if self.prefix_cache is not None and req.prompt_logprobs is None:  # (its own logprobs need every position)
            req.prefilled = req.cached_tokens = self.prefix_cache.restore(cache, row, req.prompt_ids)
        self._pos[row] = req.prefilled

    def _admit_waiting(self) -> None:
        """Admit waiting requests (oldest first) while cache rows are free."""
        while self.num_active < self.max_batch:
            with self._lock:
                if not self._waiting:
                    break
                req = self._waiting.popleft()
            try:
                self._admit(req)
            except Exception as e:  # this request's admission: it alone fails
                self._fail(req, e)

    def _prefill(self) -> None:
        """Prefill up to ``prefill_budget`` prompt tokens, one chunk at a time, shortest remaining first.

        Between chunks, requests that arrived meanwhile are admitted and the shortest remaining prompt
        is picked again, so a short prompt overtakes a long one mid-step (module docstring). A prompt whose
        remainder fits in one chunk (and in the step's budget) is finished in this step even past what is
        left of the budget, once per step: cutting it would hold its first token behind a whole decode
        step to save less than a chunk. A step's prefill thus stays under twice its budget. A request whose prompt completes samples its first token here and joins this step's
        decode. Each request's prefill is its own: one that raises is finished with "error", the others go on.
        """
        budget = step_budget = self.step_prefill_budget()
        may_overrun = True
        while True:
            pending = [r for r in self._rows if r is not None and r.prefilled < len(r.prompt_ids)]
            if not pending:
                break
            req = min(pending, key=lambda r: len(r.prompt_ids) - r.prefilled)
            left = len(req.prompt_ids) - req.prefilled
            chunk = self.chunk_for(req.prefilled, len(req.prompt_ids))
            if budget >= min(left, chunk):
                allowance = min(left, chunk)
            elif left <= min(chunk, step_budget) and may_overrun:
                allowance, may_overrun = left, False
            elif budget > 0:
                allowance = budget
            else:
                break
            try:
                budget -= allowance - self._prefill_one(req, allowance)
            except Exception as e:  # this request's prefill, first sample or callback: it alone fails
                self._fail(req, e)
                budget -= allowance
            self._admit_waiting()

    def step_prefill_budget(self) -> int:
        """Prompt tokens this step may prefill: ``prefill_budget``, or time-sized while others decode."""
        decoding = any(r is not None and r.prefilled == len(r.prompt_ids) for r in self._rows)
        if self.prefill_step_s is None or not decoding or self._prefill_s_per_token is None:
            return self.prefill_budget
        timed = int(self.prefill_step_s / self._prefill_s_per_token)
        return max(min(self.min_prefill_tokens, self.prefill_budget), min(self.prefill_budget, timed))

    def _note_prefill_time(self, tokens: int, seconds: float) -> None:
        """Fold one chunk's measured seconds per token into the moving average (chunks of >= 16 tokens:
        tinier ones are dominated by per-call overhead and would shrink the budget for nothing)."""
        if tokens < 16 or self.device.type != "cpu":  # CUDA kernels run asynchronously: not timed here
            return
        rate = seconds / tokens
        old = self._prefill_s_per_token
        self._prefill_s_per_token = rate if old is None else 0.7 * old + 0.3 * rate

    def _prefill_one(self, req: Request, budget: int) -> int:
        """Prefill ``req`` within ``budget`` tokens (sampling its first token when done); the budget left.
        A short prompt that arrives meanwhile may run between the layers (:meth:`overtake`), unless this is
        itself an overtaking prefill."""
        cache = self.cache
        n = len(req.prompt_ids)
        logits = None
        while req.prefilled < n and budget > 0:
            start = req.prefilled
            t = min(self.chunk_for(start, n), budget)
            ids = torch.tensor(req.prompt_ids[start:start + t], dtype=torch.long, device=self.device)
            t0 = time.perf_counter()
            if req.prefill_start is None:
                req.prefill_start = t0
            # A prompt that could itself overtake is not overtaken: its prefill is about as long as the
            # arrival's, and finishing it first keeps the slower of the two first tokens lower.
            between = None if n <= self.overtake_tokens else self._overtake_hook(0)
            nested = self._overtake_s
            logits = self.model.prefill(cache, req.row, ids, start, between=between,
                                        logits="all" if req.prompt_logprobs is not None else start + t == n)
            if req.prompt_logprobs is not None:  # position p predicts prompt token p + 1 (the last: the first output)
                m = min(t, n - 1 - start)
                if m > 0:
                    req.prompt_logprobs += tokens_logprobs(logits[:m], req.prompt_ids[start + 1:start + 1 + m],
                                                           req.params.prompt_logprobs)
                logits = logits[-1]
            t1 = time.perf_counter()
            self._note_prefill_time(t, t1 - t0 - (self._overtake_s - nested))
            if self.on_forward is not None:
                self.on_forward("prefill", t0, t1, t, [req.id])
            req.prefilled += t
            budget -= t
            if self.prefix_cache is not None:
                self.prefix_cache.capture(cache, req.row, req.prompt_ids, req.prefilled, since=start)
        if req.prefilled < n:
            return budget
        req.pos = n - 1
        token = sample(req.choice_logits(logits), req.params, req.generator)
        self._accept(req, token, logits)
        if not req.done:
            self._tokens[req.row] = token
            self._pos[req.row] = req.pos + 1
        return budget

    def _overtake_hook(self, first_row: int) -> Callable[[], None] | None:
        """The ``between`` callback of a forward over rows ``< first_row`` (or of one row that is not free)."""
        if not self.overtake_tokens or self._overtaking:
            return None
        return lambda: self.overtake(first_row)

    def overtake(self, first_row: int = 0) -> Request | None:
        """Between two layers of a forward in flight, prefill a short prompt that has just arrived.

        A waiting request of at most ``overtake_tokens`` prompt tokens is given a free row of the cache as
        it stands (never a grown cache), prefilled whole and its first token sampled and sent; then the
        paused forward resumes. Its first token thus costs its own prefill and not also the rest of the
        forward in flight (a decode step, or a long prompt's chunk). Rows ``>= first_row`` (outside the
        paused forward) come first. A paused decode step runs over rows ``< first_row`` as one block,
        free ones included, and its remaining layers write a throw-away token into each of them: a free
        row there is taken only once per step, and what the step will overwrite in it is saved after the
        prefill and put back when the step ends (:meth:`_decode_step`), as for a row still prefilling
        (:meth:`_shield`). Every request's cache row, position and sampling state are its own, so every
        output is exactly what it would be without overtaking (greedy or seeded). The overtaking prefill
        cannot itself be overtaken. Returns the request, or None (nothing short waiting, no free row).
        Runs on the step loop's thread (the model's forwards).
        """
        if not self._waiting or self._overtaking:  # a deque's length: read without the lock
            return None
        cache = self.cache
        if cache is None or self.num_active >= self.max_batch:
            return None
        rows = min(cache.rows, len(self._rows))
        free = next((i for i in [*range(first_row, rows), *range(min(first_row, rows))]
                     if self._rows[i] is None and i not in self._block_taken), None)
        if free is None:
            return None
        with self._lock:
            req = next((r for r in self._waiting
                        if not r.cancelled and len(r.prompt_ids) <= self.overtake_tokens), None)
            if req is None:
                return None
            self._waiting.remove(req)
        # Inside the paused decode block: the slots its remaining layers write in this row, at the
        # position and window the step started with (admission resets both).
        paused_slots = None
        if free < first_row:
            paused_slots = self._decode_slots([free])
            self._block_taken.add(free)
        self._overtaking = True
        t0 = time.perf_counter()
        try:
            self._admit(req, row=free)
            self._prefill_one(req, len(req.prompt_ids))  # _overtaking: not itself overtaken
            if paused_slots is not None:
                self._in_block.append((req, self._save_slots(paused_slots), int(self._tokens[free])))
        except Exception as e:  # this request's admission, prefill, first sample or callback: it alone fails
            self._fail(req, e)
        finally:
            self._overtaking = False
            self._overtake_s += time.perf_counter() - t0
        self.overtakes += 1
        return req

    def chunk_at(self, start: int) -> int:
        """Prompt tokens in a prefill forward that starts at position ``start``.

        ``prefill_chunk`` at the start of a prompt; further in, fewer, so that every forward costs about
        the same multiply-adds: per token, the layers' projections (``P`` weights) plus attention over
        the context before it (``2 * heads * head_dim`` per key, per layer), so a chunk at position
        ``p`` holds ``prefill_chunk / (1 + ratio * p)`` tokens, ``ratio = 2 * heads * head_dim * layers
        / P`` (the context: the position for a full head, capped by the bounded cache for a streaming
        one, averaged over the (layer, KV head) pairs of a hybrid model). A chunk is what a newly
        arrived prompt may wait for, so this bounds that wait at any depth (``chunk_by_cost=False``:
        always ``prefill_chunk``). At least 16 tokens (or ``prefill_chunk`` if smaller).
        """
        if not self._attn_ratio:
            return self.prefill_chunk
        bounded = start if self._ctx_cap is None else min(start, self._ctx_cap)
        ctx = self._full_share * start + (1.0 - self._full_share) * bounded
        return max(min(16, self.prefill_chunk), int(self.prefill_chunk / (1.0 + self._attn_ratio * ctx)))

    def chunk_for(self, start: int, n: int) -> int:
        """Tokens of a ``n``-token prompt in the prefill forward that starts at ``start``.

        :meth:`chunk_at`, except that a remainder longer than the chunk by at most a quarter of it (and
        by no more than ``_max_tail``) goes in this forward whole: the tail forward it saves costs a full
        pass over the weights for a few tokens, while the few extra tokens lengthen this one (and the
        wait of a prompt arriving meanwhile) by only about as much as they cost.
        """
        chunk, left = self.chunk_at(start), n - start
        return left if left <= chunk + min(chunk // 4, self._max_tail) else min(chunk, left)

    def _shield(self, rows: list[int]) -> list[tuple]:
        """Save what a decode step would overwrite in rows that are still prefilling.

        The decode step runs over a contiguous block of rows, so a prefilling row inside it gets a
        throw-away token written at ``self._pos[row]`` (one ring slot and maybe one sink/global slot,
        plus their recorded positions). Saving those few slots and restoring them after the step is
        cheaper than gathering the decoding rows into a compact batch.
        """
        return self._save_slots(self._decode_slots(rows))

    def _decode_slots(self, rows: list[int]) -> list[tuple[KVCache, int, torch.Tensor]]:
        """The slots a decode step writes in each of ``rows`` (at ``self._pos[row]``), per cache part."""
        out = []
        for cache in self._cache_parts():
            for r in rows:
                pos = self._pos[r:r + 1]
                out.append((cache, r, torch.cat([cache.persistent + pos % cache.window[r], cache._persistent_slot(pos)])))
        return out

    @staticmethod
    def _save_slots(slots: list[tuple[KVCache, int, torch.Tensor]]) -> list[tuple]:
        """Copies of those slots' keys and values and of the rows' recorded positions (:meth:`_unshield`)."""
        return [(cache, r, s, cache.k[:, r][:, :, s].clone(), cache.v[:, r][:, :, s].clone(), cache.slot_pos[r].clone())
                for cache, r, s in slots]

    def _cache_parts(self) -> list[KVCache]:
        """The slot caches behind ``self.cache`` (a MixedKVCache holds a full and a bounded one)."""
        cache = self.cache
        return [cache.full, cache.stream] if isinstance(cache, MixedKVCache) else [cache]

    def _unshield(self, saved: list[tuple]) -> None:
        for cache, r, slots, k, v, slot_pos in saved:
            cache.k[:, r][:, :, slots] = k
            cache.v[:, r][:, :, slots] = v
            cache.slot_pos[r].copy_(slot_pos)

    def step(self) -> bool:
        """Admit waiting requests, then decode one token for every active row. Returns whether work remains."""
        with self._lock:
            cancelled = [r for r in self._waiting if r.cancelled]
            for req in cancelled:
                self._waiting.remove(req)
        cancelled += [r for r in self._rows if r is not None and r.cancelled]
        for req in cancelled:
            try:
                self._finish(req, "cancelled")
            except Exception as e:  # its callback: no one else's concern
                self._fail(req, e)
        self._admit_waiting()
        self._prefill()
        active = [r for r in self._rows if r is not None and r.prefilled == len(r.prompt_ids)]
        if active:
            self._decode_step(active)
        return bool(self._waiting) or self.num_active > 0

    def _decode_step(self, active: list[Request]) -> None:
        hi = max(r.row for r in active) + 1
        cache = self.cache
        n_slots = cache.used_slots(max(r.pos for r in active) + 1)
        saved = self._shield([r.row for r in self._rows[:hi] if r is not None and r.prefilled < len(r.prompt_ids)])
        row_slots = None
        if self.device.type == "cpu":  # (a mixed or bounded cache ignores them: DecoderModel.decode_one_token)
            # Each row's own span (rows not decoding: one slot, their output is thrown away), so a long
            # request does not make every row read its whole cache (DecoderModel.decode_one_token).
            row_slots = [1] * hi
            for r in active:
                row_slots[r.row] = cache.used_slots(r.pos + 1)
        t0 = time.perf_counter()
        between = None if self._compiled else self._overtake_hook(hi)  # (a compiled step takes no callback)
        # Free rows of this block that overtaking requests take: (request, what this step would overwrite in
        # its row, its first token), put back when the step ends; each row at most once per step (admission
        # resets the row's position and window, which locate the slots this step writes).
        self._in_block: list[tuple[Request, list[tuple], int]] = []
        self._block_taken: set[int] = set()
        tokens, pos = self._tokens[:hi], self._pos[:hi]
        if between is not None:  # an overtaking admission into a free row of this block changes both
            tokens, pos = tokens.clone(), pos.clone()
        logits = self._decode(cache, tokens, pos, n_slots, row_slots, between)
        in_block, self._in_block, self._block_taken = self._in_block, [], set()
        self._unshield(saved)
        for _, kept, _ in in_block:
            self._unshield(kept)
        if self.on_forward is not None:
            self.on_forward("decode", t0, time.perf_counter(), len(active), [r.id for r in active])
        nxt = logits.argmax(-1)
        # Per-row work is isolated: a row whose sampling, detokenization or callback raises is finished
        # with "error" and freed; the forward above is shared, so its failure is left to the caller.
        for r in active:
            if r.adjusted or not r.params.greedy:  # (greedy on the model's own logits: the argmax above)
                try:
                    nxt[r.row] = sample(r.choice_logits(logits[r.row]), r.params, r.generator)
                except Exception as e:
                    self._fail(r, e)
        self._tokens[:hi].copy_(nxt)
        for req, _, first in in_block:  # its first token, sampled by its own prefill, is its next input
            if self._rows[req.row] is req:
                self._tokens[req.row] = first
        tokens = nxt.tolist()
        for r in active:
            if r.done:
                continue
            r.pos += 1
            self._pos[r.row] = r.pos + 1
            try:
                self._accept(r, tokens[r.row], logits[r.row])
            except Exception as e:
                self._fail(r, e)

    # ---- synchronous API ---------------------------------------------------------------------------------

    def _run_until(self, reqs: list[Request]) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine runs in a background thread; use submit() with on_event instead")
        while not all(r.done for r in reqs):
            self._step_or_fail()

    def _step_or_fail(self) -> None:
        """:meth:`step` for the synchronous API: when it raises (the shared forward: a bug, OOM), every request in
        flight ends with "error", as in the background loop, before the exception reaches the caller; none is left
        in its row to run on with the caller's next requests."""
        try:
            self.step()
        except Exception as e:
            self._fail_in_flight(e)
            raise

    def _fail_in_flight(self, exc: BaseException) -> None:
        """Finish every request admitted or waiting with "error" (``exc`` its cause); one whose text tail or callback
        raises is still finished, and the others too."""
        with self._lock:
            reqs = [r for r in self._rows if r is not None] + list(self._waiting)
            self._waiting.clear()
        for r in reqs:
            if not r.done:
                r.error = exc
                try:
                    self._finish(r, "error")
                except Exception as e:
                    self._fail(r, e)

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, chat: bool = False) -> list[Completion]:
        """Generate for several prompts at once (continuous batching, ``max_batch`` at a time). A prompt that is
        refused (too long, a bad grammar) refuses the call with nothing left queued."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} sampling params")
        if self._thread is not None:  # before any is queued: the loop would run them for no one
            raise RuntimeError("the engine runs in a background thread; use submit() with on_event instead")
        reqs: list[Request] = []
        try:
            for p, sp in zip(prompts, plist):
                reqs.append(self.submit(self.encode(p, chat), sp))
        except BaseException:
            for req in reqs:  # the prompts queued before the refused one: finished at the next step, never run
                self.cancel(req)
            raise
        self._run_until(reqs)
        return [r.result() for r in reqs]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               chat: bool = False) -> Iterator[str]:
        """Yield text deltas of one prompt as they are produced (concatenated they equal the full text). A request
        the engine fails raises :class:`GenerationError` after the deltas it had (never a silent, cut end)."""
        if self._thread is not None:
            raise RuntimeError("the engine runs in a background thread; use submit() with on_event instead")
        out: deque[str] = deque()
        req = self.submit(self.encode(prompt, chat), params, lambda d, _t, _f: out.append(d) if d else None)
        try:
            while not req.done:
                self._step_or_fail()
                while out:
                    yield out.popleft()
            while out:
                yield out.popleft()
            if req.finish_reason == "error":
                cause = req.error or RuntimeError("unknown error")
                why = (str(cause).strip().splitlines() or [""])[0][:300]
                raise GenerationError(f"generation failed after {len(req.out_ids)} tokens "
                                      f"({type(cause).__name__}: {why})") from req.error
        finally:
            if not req.done:
                self.cancel(req)
                self.step()

    # ---- background loop (server) ------------------------------------------------------------------------

    def warmup(self, new_tokens: int = 4) -> float:
        """Get the first requests' costs out of the way: make the cache for all ``max_batch`` rows (it
        otherwise grows by doubling, each time a new allocation and a copy: 0.1-0.4 s on CPU at 4K
        context), render the chat template once, and run two short greedy generations of one prompt, the
        second restoring the first's prefix blocks (the first calls of the prefill, decode, restore and
        capture paths), after building the linear kernels of every chunk length serving can produce
        (:meth:`DecoderModel.warm_kernels`). The prefix cache is emptied afterwards, its counters zeroed.
        On the loop's thread when started (this call waits), else on this one. Returns the seconds it took.

        Raises :class:`WarmupError` when a warm-up request fails (a KV cache too large for memory, say): every
        request would then fail the same way, so a server must not open its port."""
        t0 = time.perf_counter()
        self._min_rows = self.max_batch
        # Each chunk length serving can produce (prompt chunks, the tails taken with them, decode batches):
        # built on the loop's thread when it runs, with the thread count the requests' forwards use.
        longest = self.prefill_chunk + self._max_tail  # chunk_for: the largest chunk
        self._on_loop(lambda: self.model.warm_kernels(min(longest, self.max_seq_len), self.max_batch))
        if getattr(self.tokenizer, "chat_template", None):
            self.encode([{"role": "user", "content": "Hello."}], chat=True)
        vocab = self.model.config.vocab_size
        n = 2 * self.prefix_cache.block + 3 if self.prefix_cache is not None else 16
        new_tokens = min(new_tokens, self.max_seq_len - 1)  # a prompt token left even at max_seq_len 2
        ids = [(3 + i) % vocab for i in range(min(n, self.max_seq_len - new_tokens))]
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        self._warming = True
        try:
            for _ in range(2 if self.prefix_cache is not None else 1):
                if self._thread is None:
                    req = self.submit(ids, params)
                    self._run_until([req])
                else:
                    done = threading.Event()
                    req = self.submit(ids, params,
                                      lambda _d, _t, finish, done=done: done.set() if finish is not None else None)
                    done.wait()
                if req.finish_reason == "error":  # the engine finished it alone (_fail)
                    cause = req.error or RuntimeError("unknown error")
                    why = (str(cause).strip().splitlines() or [""])[0][:300]
                    raise WarmupError(
                        f"warm-up: a {len(ids)}-token request failed ({type(cause).__name__}: {why}), as every "
                        f"request would; if memory ran out, the KV cache ({self.max_batch} rows x {self.max_seq_len} "
                        "positions) is too large: lower --max-batch or --max-seq-len") from req.error
        finally:
            self._warming = False
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
        return time.perf_counter() - t0

    def _on_loop(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the loop's thread between steps and wait for it; on this thread when not started."""
        if self._thread is None:
            fn()
            return
        done, failed = threading.Event(), []

        def call() -> None:
            try:
                fn()
            except BaseException as e:  # handed to the caller
                failed.append(e)
            finally:
                done.set()

        with self._lock:
            self._calls.append(call)
            self._lock.notify_all()
        done.wait()
        if failed:
            raise failed[0]

    def start(self) -> None:
        """Run the step loop in a daemon thread; feed it with :meth:`submit` (events via ``on_event``)."""
        if self._thread is not None:
            return
        self._shutdown = False
        threads = self.threads or torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, args=(threads,), name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._shutdown = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self, threads: int) -> None:
        torch.set_grad_enabled(False)
        torch.set_num_threads(threads)  # per thread under OpenMP: this one's, whatever the caller's
        trim = malloc_trim() if self.device.type == "cpu" else None
        last_trim = time.monotonic()
        while True:
            with self._lock:
                while not self._shutdown and not self._waiting and not self._calls and self.num_active == 0:
                    self._lock.wait()
                if self._shutdown:
                    return
                calls = list(self._calls)
                self._calls.clear()
            for call in calls:  # _on_loop
                call()
            if trim is not None and self.trim_every_s and time.monotonic() - last_trim >= self.trim_every_s:
                trim(0)  # a few ms on a GiB heap, between two steps
                self.trims += 1
                last_trim = time.monotonic()
            try:
                self.step()
            except Exception as e:  # a bug or OOM must not leave clients waiting forever
                logger.exception("engine step failed; failing the requests in flight")
                self._fail_in_flight(e)
