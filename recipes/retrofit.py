"""Retrofit hybrid sparse attention into a pretrained model, then heal it with LoRA + self-distillation.

    accelerate launch recipes/retrofit.py                                  # SmolLM2-135M, the default config
    accelerate launch recipes/retrofit.py --config recipes/configs/retrofit_smollm2.yaml key=value ...

Reads top to bottom: config → data → models → loop → save. Several processes train it with DDP
(``launch/gpu_ddp.yaml``, on CPUs ``launch/cpu_ddp_2proc.yaml``); a DeepSpeed or FSDP launch is refused at start.

* The model is switched to hybrid attention (sinks + sliding window + periodic globals) with
  ``attention.retrofit``; the training forward runs exactly the mask that will be served (with a
  ``window_policy``, each step draws one of its windows and crops the batch to that window's
  longest length, so every trained token sees what it would see at inference).
* LoRA adapters on the attention projections (optionally the MLP), plus trainable norms and
  embeddings: the LongLoRA recipe, which found LoRA alone does not recover long-context quality.
* The teacher is the same pretrained weights with dense attention, frozen: logits KD
  (``distill.model.DistillModel`` → ``distill.losses``) plus an optional CE term on the data.
* At the end LoRA is merged (``merge_and_unload``) and ``final/`` is a plain HF directory whose
  config.json carries the hybrid spec: ``attention.load(dir)`` serves it hybrid, plain
  ``AutoModelForCausalLM.from_pretrained(dir)`` loads it dense.
* The closing evaluation (held-out perplexity and agreement of the merged model, the pass-key check of
  it and of the dense model) is cached: each measurement's numbers go to a small JSON keyed by a hash of
  the measured model as it computes (every state-dict tensor plus its config, so the hybrid spec and head
  roles) and of every setting that changes the result (held-out blocks, lengths, depths, trials, seed,
  batch size, tokenizer, precision, device, threads, torch/transformers, the eval code and, for the
  hybrid model, the attention code it runs through). The merged
  model's entries live in ``output_dir/eval_cache/``, so a run killed during the evaluation and resumed
  (``resume=latest``) measures only what is missing; the dense model's pass-key result, the same for every
  run on the same teacher and settings, lives in ``eval_cache_dir`` (default ``$HYBRID_DISTILL_CACHE/eval``,
  beside the prepared data), shared across runs. A used entry is logged in one line; a changed model or
  setting has another key and is measured again. Delete a folder to force a fresh measurement.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import json
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Python puts a script's folder first on sys.path, and this folder holds distill.py, which would shadow
# the `distill` package: keep the folder off sys.path so imports come from the installed packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, set_seed

import attention
from attention.errors import HybridAttentionError
from attention.gates import CONTEXTS as GATE_CONTEXTS
from attention.spec import CONFIG_KEY, HybridAttentionConfig
from core import checkpoint as ckpt
from core.config import ConfigError, check_fields, field, run_cli
from core.fsio import atomic_write_text
from core.models import ModelSourceError, cache_root, enable_checkpointing, load_causal_lm, peek_config
from core.tiny import TINY, tiny_teacher
from distill.config import check_sources
from distill.data import BUILTIN, build_data, parse_sources, steps_for_tokens
from distill.data.text import tokenizer_fingerprint
from distill.model import KD_KINDS, DistillModel, LossConfig
from distill.sources import load_recipe_tokenizer
from distill.training import (
    PRECISIONS,
    TRACKERS,
    Run,
    check_gate_positions,
    check_gate_prompts,
    evaluate,
    finish_run,
    save_hf_dir,
    start_run,
    target_count,
    token_weights,
    train_step,
    warmup_cosine,
)
from eval.fingerprint import json_hash
from eval.longctx import INTERIOR_DEPTHS, LongCtxError, check_prompt_fits, plot_heatmap, run_longctx

logger = get_logger(__name__)


# Keys a resume may change (core.config.check_resume_config): cadence, logging and where outputs go;
# max_steps may only grow. Anything else would make the finished model match neither config.
RESUME_SAFE = ("eval_every", "log_every", "save_every", "keep_checkpoints", "tracker", "output_dir", "resume",
               "overwrite", "debug_exit_at_step", "gate", "gate_prompts", "gradient_checkpointing", "threads",
               "longctx_lengths", "longctx_trials", "longctx_depths", "eval_cache_dir",
               # the global batch they make with the processes is checked on resume (check_resume_world)
               "micro_batch_size", "grad_accum")
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass
class RetrofitConfig:
    # model
    teacher: str = field("smollm2-135m-instruct", help="the dense model to retrofit (also the frozen teacher): an "
                         "HF directory, a hub name, 'smollm2-135m-instruct' (offline demo) or 'tiny-random' (tests)")
    tokenizer: str | None = field(None, help="tokenizer source; default: the teacher's")
    # hybrid attention spec (attention.HybridAttentionConfig), stored in final/config.json
    sink_tokens: int = field(128, ge=0,
                             help="first tokens every query attends to (attention sinks); 0 disables")
    window: int = field(512, gt=0, help="local window in tokens, counting the query itself (>= 1)")
    global_every: int = field(1024, ge=0,
                              help="every N-th position is a global key all later queries see; 0 disables")
    max_globals: int | None = field(None, ge=0,
                                    help="keep at most this many global keys (bounds the decode KV cache)")
    global_rows: bool = field(False, help="global tokens also attend to every earlier key (unbounded cache)")
    window_policy: list[Any] | None = field(default_factory=lambda: [[4096, 512], [None, 2048]],
                                            help="[[max_len, window], ..., [null, window]]: the window per "
                                            "input length; training samples one entry per step; null: `window`")
    # per-KV-head roles (attention.heads, attention.gates): the top share of heads by learned gate (or
    # needle-retrieval score) keep full attention, the rest stream; chosen on the dense model before LoRA,
    # saved in the spec, plotted to heads.png
    full_head_share: float = field(0.444, ge=0, le=1, help="fraction of (layer, KV head) pairs that keep full "
                                   "attention (retrieval heads); 0 = every head streams")
    head_score: str = field("gates", choices=("retrieval", "mass", "gates"), help="how heads are ranked: gates "
                            "(DuoAttention: one gate per KV head learned on the frozen model; keeps pass-key "
                            "retrieval best at equal share), retrieval (top-1 copy hits, Wu et al. 2024, no "
                            "training) or mass (attention mass on the needle)")
    head_samples: int = field(12, ge=1, help="synthetic needle samples (from the training text) for head scoring")
    head_sample_len: int = field(1536, ge=16, help="tokens per head-scoring sample (capped at seq_len)")
    gate_sample_len: int = field(1024, ge=16, help="head_score=gates: tokens per sample (capped at seq_len, or "
                                 "at the model's context with gate_context=dense); a gated step costs the tokens "
                                 "after sink_tokens + window")
    gate_steps: int = field(120, ge=1, help="head_score=gates: optimizer steps (one sample each)")
    gate_lr: float = field(0.05, gt=0, help="head_score=gates: Adam learning rate on the gates")
    gate_l1: float = field(0.05, ge=0, help="head_score=gates: weight of the mean gate (L1) next to the relative "
                           "hidden-state MSE")
    gate_context: str = field("gated", choices=GATE_CONTEXTS, help="head_score=gates: gated (exact: every "
                              "token past sink_tokens + window runs gated each step) or dense (the text before the "
                              "question keeps its full-attention states, only question + answer run gated: a step "
                              "costs a few tokens, so gate_sample_len may go up to the model's context)")
    gate_window: int | None = field(None, ge=1, help="head_score=gates: the streaming window while the gates train "
                                    "(null: window). Smaller puts more of each sample beyond it at the same cost")
    # LoRA + extra trainable pieces
    lora_r: int = field(16, ge=1, help="LoRA rank")
    lora_alpha: float = field(32.0, gt=0, help="LoRA scaling numerator (the update is scaled by alpha / r)")
    lora_dropout: float = field(0.0, ge=0, lt=1, help="dropout on the LoRA input")
    lora_mlp: bool = field(False, help="also put LoRA on the MLP projections (gate/up/down)")
    train_norms: bool = field(True, help="train every RMSNorm weight in full (LongLoRA: needed for long context)")
    train_embeddings: bool = field(True, help="train the input embeddings in full (tied heads train with them)")
    # data
    dataset: str = field(BUILTIN, help="training text: 'builtin:stdlib-docs' (offline default), a local "
                         ".jsonl/.txt/.parquet file or folder, or a hub dataset name")
    eval_dataset: str | None = field(None, help="held-out text; default: a held-out split of dataset")
    text_field: str = field("text", help="column holding the text (records with 'messages' use the chat template)")
    seq_len: int = field(2048, ge=2, help="tokens per packed training block")
    max_train_blocks: int | None = field(None, ge=1, help="use only the first N packed training blocks")
    eval_blocks: int = field(3, ge=1, help="held-out blocks per evaluated length")
    datasets: list | None = field(None, help="weighted mixture, overrides dataset: [{source: PATH_OR_NAME, "
                                  "weight: 0.7, text_field: text}, ...]; prepared once into data_cache")
    completion_only: bool = field(True, help="chat records: KD/CE terms only on assistant tokens")
    data_cache: str | None = field(None, help="prepared-data folder; default $HYBRID_DISTILL_CACHE/data")
    max_tokens: int | None = field(None, ge=1, help="train on this many tokens (sets max_steps from the global "
                                   "batch)")
    eval_seq_lens: list[int] = field(default_factory=lambda: [4096], help="extra held-out lengths evaluated at start and end "
                                     "(e.g. [4096]); seq_len is always evaluated", ge=2)
    longctx_lengths: list[int] = field(default_factory=lambda: [2048, 4096, 8192], ge=64, help="pass-key retrieval "
                                       "(eval.longctx) of the final model and the dense one at these lengths; "
                                       "[] skips it")
    longctx_trials: int = field(3, ge=1, help="pass-key samples per length × depth cell at the end of the run")
    longctx_depths: list[float] = field(default_factory=lambda: list(INTERIOR_DEPTHS), ge=0, le=1,
                                        help="needle depths of that check: interior ones, since a needle at 0 "
                                        "sits in the sink tokens and one at 1 in the window, where every head "
                                        "sees it (and this demo model echoes \"the pass key\" at depth 1 even dense)")
    eval_cache_dir: str | None = field(None, help="where the dense model's closing pass-key result is cached, shared "
                                      "across runs (keyed by its weights and the check's settings); default "
                                      "$HYBRID_DISTILL_CACHE/eval. The final model's results go to "
                                      "output_dir/eval_cache")
    # loop
    max_steps: int = field(30, ge=1, help="optimizer steps")
    micro_batch_size: int = field(1, ge=1, help="blocks per forward on each process")
    grad_accum: int = field(1, ge=1, help="micro-batches per optimizer step")
    lr: float = field(2e-4, gt=0, help="peak learning rate (AdamW) for LoRA, norms and embeddings")
    embedding_lr_ratio: float = field(0.1, ge=0,
                                      help="embeddings train at lr * this (they move the whole model)")
    min_lr_ratio: float = field(0.1, ge=0, le=1, help="cosine schedule ends at lr * min_lr_ratio")
    warmup_steps: int = field(4, ge=0, help="linear warmup steps")
    weight_decay: float = field(0.0, ge=0, help="AdamW weight decay")
    max_grad_norm: float = field(1.0, ge=0, help="gradient clipping (0 disables)")
    mixed_precision: str = field("auto", help="no | bf16 | fp16 | auto (bf16 on GPUs that support it, fp32 on "
                                 "CPU where bf16 matmul is slower)", choices=PRECISIONS)
    gradient_checkpointing: bool = field(False, help="recompute activations in backward to save memory")
    threads: int = field(0, ge=0, help="CPU intra-op threads per process; 0 = the cores available / local "
                         "processes, unless OMP_NUM_THREADS was set by you (distill/threads.py)")
    seed: int = field(0, ge=0, le=2**32 - 1, help="seed for LoRA init, data order and window sampling")
    # loss: self-distillation from the dense model
    kd_weight: float = field(1.0, ge=0, help="logits KD to the dense teacher, weight")
    kd_kind: str = field("forward_kl", choices=KD_KINDS, help=f"divergence: {', '.join(KD_KINDS)}")
    temperature: float = field(1.0, gt=0, help="KD temperature T (the term is scaled by T²)")
    beta: float = field(0.5, ge=0, le=1, help="JSD interpolation (0 = forward KL, 1 = reverse KL)")
    kd_chunk_size: int | None = field(1024, ge=1,
                                      help="tokens per chunk of the fused KD loss; empty = full logits")
    ce_weight: float = field(0.0, help="cross-entropy on the data, weight (pulls towards the training corpus and "
                             "away from the dense model; keep it small)", ge=0)
    # eval, logging, outputs
    eval_every: int = field(0, ge=0,
                            help="held-out evaluation at seq_len every N steps (0: only at start and end)")
    log_every: int = field(1, ge=1, help="tracker logging every N steps")
    tracker: str = field("none", choices=TRACKERS,
                         help="none | tensorboard | wandb (WANDB_MODE=offline works)")
    output_dir: str = field("runs/retrofit-smollm2", help="run folder: checkpoints/, final/, summary.json, loss.png, metrics.jsonl")
    overwrite: bool = field(False, help="replace an existing run in output_dir")
    resume: str | None = field(None, help="'latest' or a checkpoint folder to continue from")
    save_every: int = field(10, ge=0, help="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = field(1, ge=1, help="complete checkpoints kept on disk")
    gate: bool = field(False, help="run the release gate (eval.gate) against the dense teacher at the end")
    gate_prompts: int = field(100, ge=1, help="prompts from the bundled set used by the gate")
    debug_exit_at_step: int | None = field(None, ge=1,
                                           help="testing: exit abruptly (as if killed) after this step")

    def __post_init__(self) -> None:
        check_fields(self)  # every field's range/choices, declared above (core.config.field)
        if self.datasets:  # sources and weights checked before any model loads
            parse_sources(self.datasets)
        if self.resume is not None and self.overwrite:
            raise ConfigError("resume= and overwrite=true contradict each other; pick one")
        check_gate_prompts(self.gate, self.gate_prompts)  # else fewer silently, or a run whose gate cannot decide
        if self.gate_window is not None and (self.head_score != "gates" or self.full_head_share == 0):
            raise ConfigError(f"gate_window={self.gate_window} is never used: gates train only with head_score=gates "
                              f"and full_head_share > 0 (here {self.head_score}, {self.full_head_share:g}); drop it "
                              "(gate_window=null)")
        if self.longctx_lengths and not self.longctx_depths:  # else the closing check fails after training
            raise ConfigError("longctx_depths is empty; give at least one needle depth in [0, 1] (e.g. [0.5]), or "
                              "set longctx_lengths=[] to skip the pass-key check")
        spec = self.spec()  # validates the attention keys
        if spec.window_policy and spec.window_policy[0][0] == 1:  # training_window would crop steps to 1 token
            raise ConfigError(f"window_policy {[list(p) for p in spec.window_policy]} starts with bound 1: its steps "
                              "train on 1-token crops, with no next token to learn from; start the bounds at 2 or more")
        policy_windows = sorted({w for _, w in spec.window_policy or []})
        if policy_windows and self.window not in policy_windows:  # else window would pass as the one trained
            raise ConfigError(f"window={self.window} is never used: window_policy sets the window at every length "
                              f"({policy_windows}); set window to one of those, or window_policy=null for one window")
        try:
            self.losses()
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def spec(self) -> HybridAttentionConfig:
        try:
            if self.window_policy is not None and not all(
                    isinstance(p, (list, tuple)) and len(p) == 2 for p in self.window_policy):
                raise HybridAttentionError("window_policy needs [[max_len, window], ...] pairs, e.g. "
                                           "[[1024, 256], [null, 512]]")
            return HybridAttentionConfig(sink_tokens=self.sink_tokens, window=self.window,
                                         global_every=self.global_every, max_globals=self.max_globals,
                                         global_rows=self.global_rows, window_policy=self.window_policy)
        except (HybridAttentionError, TypeError, ValueError) as err:
            raise ConfigError(str(err).splitlines()[0] if str(err) else "invalid hybrid attention keys") from None

    def losses(self) -> LossConfig:
        """Self-distillation from the dense model: logits KD and optional CE; no other term."""
        return LossConfig(
            kd_weight=self.kd_weight, kd_kind=self.kd_kind, temperature=self.temperature, beta=self.beta,
            kd_chunk_size=self.kd_chunk_size, ce_weight=self.ce_weight, focal_weight=0.0, focal_alpha=0.25,
            focal_gamma=2.0, hidden_weight=0.0, hidden_layers=[], hidden_kind="nmse", attn_weight=0.0,
            attn_layers=[], attn_num_queries=0)

    def eval_lengths(self) -> list[int]:
        return sorted({self.seq_len, *self.eval_seq_lens})


# --------------------------------------------------------------------------------------------
# Pieces of the loop that read better with a name
# --------------------------------------------------------------------------------------------

def load_models(cfg: RetrofitConfig) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """``(model, dense_teacher, tokenizer)``: two copies of the same pretrained weights, fp32."""
    tokenizer = load_recipe_tokenizer(cfg.teacher, cfg.tokenizer)
    try:
        model = tiny_teacher(cfg.seed) if cfg.teacher == TINY else load_causal_lm(cfg.teacher, dense=True)
    except (ModelSourceError, OSError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    teacher = copy.deepcopy(model).eval().requires_grad_(False)
    return model, teacher, tokenizer


def make_hybrid(cfg: RetrofitConfig, model: torch.nn.Module, spec: HybridAttentionConfig) -> None:
    """Switch ``model`` to the hybrid spec (in place); its lengths were checked (:func:`check_lengths`)."""
    if getattr(model.config, "attention_dropout", 0.0):
        model.config.attention_dropout = 0.0  # the hybrid kernel has none; LoRA dropout regularizes instead
    try:
        attention.retrofit(model, spec)
    except HybridAttentionError as err:
        raise ConfigError(str(err)) from None


def add_adapters(model: torch.nn.Module, cfg: RetrofitConfig):
    """Wrap ``model`` with LoRA (in place) and unfreeze norms / embeddings; returns the PeftModel.

    Norms and embeddings are unfrozen on the base weights themselves rather than through peft's
    ``modules_to_save``: that would keep a second copy of each and, for tied embeddings, untie the
    head. Trained in place, ``merge_and_unload`` needs nothing more to ship them.
    """
    from peft import LoraConfig, get_peft_model  # after core: peft imports transformers' quantizers

    targets = list(ATTN_PROJ) + (list(MLP_PROJ) if cfg.lora_mlp else [])
    peft_model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                  lora_dropout=cfg.lora_dropout, target_modules=targets,
                                                  bias="none", task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():
        if cfg.train_norms and "norm" in name.rsplit(".", 2)[-2]:
            p.requires_grad_(True)
        if cfg.train_embeddings and "embed_tokens" in name:
            p.requires_grad_(True)
    return peft_model


def enable_gradient_checkpointing(model: torch.nn.Module, step_window: dict[str, int | None]) -> None:
    """Activation checkpointing whose recompute uses the window of the forward it replays.

    The recompute runs during backward, outside the forward's ``use_window`` block (on GPUs in
    autograd's own thread, where that context is not visible), so without this it would silently
    use the spec's window and the gradients would belong to another mask. ``context_fn`` is called
    at forward time, so it captures the step's window then.
    """
    def context_fn():
        return contextlib.nullcontext(), attention.use_window(step_window["window"])

    enable_checkpointing(model, use_reentrant=False, context_fn=context_fn)
    model.enable_input_require_grads()


def param_groups(model: torch.nn.Module, cfg: RetrofitConfig) -> list[dict]:
    lora, norms, emb = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (emb if "embed_tokens" in name else lora if "lora_" in name else norms).append(p)
    groups = [{"params": lora, "lr": cfg.lr}, {"params": norms, "lr": cfg.lr}]
    if emb:
        groups.append({"params": emb, "lr": cfg.lr * cfg.embedding_lr_ratio})
    return [g for g in groups if g["params"]]


def training_window(spec: HybridAttentionConfig, seq_len: int, seed: int, step: int) -> tuple[int, int]:
    """``(window, length)`` for a step: the served window and the longest length it is served at.

    Without a policy: the spec's window for ``seq_len``, on the whole block. With one, an entry
    whose length range starts below ``seq_len`` is drawn (seeded by step, so resume replays it)
    and the block is cropped to that entry's upper bound (the last entry, served to every longer input
    too, keeps the whole block): causality makes the crop's mask exactly the one served to an input of
    that length.
    """
    if not spec.window_policy:
        return spec.window_for(seq_len), seq_len
    entries, lower = [], 0
    last = len(spec.window_policy) - 1
    for i, (bound, w) in enumerate(spec.window_policy):
        if lower < seq_len:  # the last entry also serves every longer input (spec.window_for): no crop
            entries.append((w, seq_len if bound is None or i == last else min(bound, seq_len)))
        lower = math.inf if bound is None else bound
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return entries[int(torch.randint(len(entries), (1,), generator=g))]


def budget_steps(cfg: RetrofitConfig, spec: HybridAttentionConfig, global_batch: int) -> int:
    """Optimizer steps that train on at least ``max_tokens`` tokens, counting the tokens each step keeps after
    its window policy crop (:func:`training_window`)."""
    if not spec.window_policy:
        return steps_for_tokens(cfg.max_tokens, global_batch, cfg.seq_len)
    steps = tokens = 0
    while tokens < cfg.max_tokens:
        tokens += global_batch * training_window(spec, cfg.seq_len, cfg.seed, steps)[1]
        steps += 1
    return max(1, steps)


def heldout_blocks(cfg: RetrofitConfig, tokenizer, length: int, progress: bool = True) -> torch.Tensor:
    """``[n, length]`` held-out blocks (the same documents at every length, packed differently)."""
    data = build_data(tokenizer, dataset=cfg.dataset, datasets=cfg.datasets, eval_dataset=cfg.eval_dataset,
                      seq_len=length, eval_blocks=cfg.eval_blocks, text_field=cfg.text_field, min_train_blocks=0,
                      completion_only=cfg.completion_only, data_cache=cfg.data_cache, progress=progress)
    return data.eval


# --------------------------------------------------------------------------------------------
# The training function
# --------------------------------------------------------------------------------------------

def training_function(cfg: RetrofitConfig, accelerator: Accelerator) -> dict:
    set_seed(cfg.seed)
    spec = cfg.spec()
    run = Run(cfg, accelerator, tracker_project="hybrid-distill-retrofit", progress="retrofit")

    # ---- models -------------------------------------------------------------------------
    model, teacher, tokenizer = load_models(cfg)
    # Frozen and never prepared: on the training device now, since the head roles are scored on it (gate training).
    teacher = teacher.to(accelerator.device)
    # Again for a source whose config.json check_before_loading could not read (the demo teacher before conversion).
    check_lengths(cfg, spec, model.config, tokenizer)
    make_hybrid(cfg, model, spec)
    model.config.use_cache = False
    peft_model = add_adapters(model, cfg)
    step_window: dict[str, int | None] = {"window": None}  # the sampled window of the running step
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, step_window)

    # ---- data ---------------------------------------------------------------------------
    global_batch = cfg.micro_batch_size * cfg.grad_accum * accelerator.num_processes
    if cfg.max_tokens:  # a token budget sets the step count
        cfg.max_steps = budget_steps(cfg, spec, global_batch)
    main = accelerator.is_main_process
    with accelerator.main_process_first():  # one process prepares, the others map the cache
        data = build_data(tokenizer, dataset=cfg.dataset, datasets=cfg.datasets, eval_dataset=cfg.eval_dataset,
                          seq_len=cfg.seq_len, eval_blocks=cfg.eval_blocks, text_field=cfg.text_field,
                          min_train_blocks=global_batch, max_train_blocks=cfg.max_train_blocks,
                          completion_only=cfg.completion_only, data_cache=cfg.data_cache, progress=main)
        heldout = {cfg.seq_len: data.eval}
        for length in cfg.eval_lengths():  # the extra held-out lengths too: one prepare each, not one per rank
            if length not in heldout:
                heldout[length] = heldout_blocks(cfg, tokenizer, length, progress=main)
    order = data.order(global_batch, cfg.seed)

    if cfg.full_head_share > 0:  # which KV heads keep full attention, scored on the dense teacher
        spec = (resumed_head_roles(cfg, model, spec, accelerator.is_main_process)
                or choose_head_roles(cfg, model, teacher, tokenizer, spec, data.train, accelerator.is_main_process))

    # ---- teacher–student module, optimizer, schedule -------------------------------------
    # The student is the retrofitted model with its LoRA layers; DistillModel runs the dense
    # teacher on the same batch and computes KD (+ CE) through distill.losses.
    distill_model = DistillModel(model, teacher, cfg.losses(), tokenizer_size=len(tokenizer))
    groups = param_groups(distill_model, cfg)
    params = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))
    distill_model, optimizer, scheduler = accelerator.prepare(distill_model, optimizer, scheduler)
    trainable = sum(p.numel() for p in params)

    # ---- resume, then dense and hybrid-before perplexity ----------------------------------
    state = run.resume()
    run.begin()
    if not state.init:
        state.init = initial_perplexity(cfg, accelerator, run, model, teacher, heldout)
        run.write(f"({trainable:,} trainable parameters)")
    dense_ppl = state.init["dense"][str(cfg.seq_len)]

    def forward(micro):
        index, blocks = micro
        loss_mask = data.train.loss_mask(index)  # completion-only chat targets (None: every token)
        with attention.use_window(window):  # checkpoint recomputes get the window via step_window
            return distill_model(input_ids=blocks[:, :length].to(accelerator.device),
                                 loss_mask=None if loss_mask is None else loss_mask[:, :length].to(accelerator.device))

    def write_model_files(folder: Path) -> None:  # what export needs to rebuild the model
        model.config.save_pretrained(folder / "student")
        tokenizer.save_pretrained(folder / "student")

    # ---- loop ---------------------------------------------------------------------------
    distill_model.train()
    for step in run.steps():
        window, length = training_window(spec, cfg.seq_len, cfg.seed, step)
        step_window["window"] = window
        micro = list(order.micro_batches(data.train, step, accelerator.process_index, accelerator.num_processes,
                                         cfg.micro_batch_size))
        weights = token_weights(accelerator, [  # a mean over the step's tokens (completion-only masks differ)
            target_count(None if (m := data.train.loss_mask(index)) is None else m[:, :length],
                         (blocks.shape[0], length)) for index, blocks in micro])
        terms = train_step(accelerator, distill_model, optimizer, scheduler, params, micro, forward,
                           grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm, keep=("kd", "ce"),
                           weights=weights)
        run.record(step, terms, scheduler.get_last_lr()[0], tokens=global_batch * length, window=window,
                   tokens_per_block=length)
        if run.due(step, cfg.eval_every) and not run.last(step):
            s, _ = evaluate(accelerator, model, heldout[cfg.seq_len], cfg.micro_batch_size)
            state.evals.append({"step": step + 1, "perplexity": s.perplexity, "teacher_perplexity": dense_ppl})
            run.write(f"step {step + 1}: held-out perplexity {s.perplexity:.3f} (dense {dense_ppl:.3f})")
        if run.due(step, cfg.save_every) or run.last(step):
            run.save_checkpoint(step + 1, write_model_files, weights=distill_model.named_parameters())  # NaN/inf: stop
        run.maybe_exit(step)

    # ---- merge, save, measure what was saved ---------------------------------------------
    merged, prints = merge_and_save(cfg, accelerator, peft_model, teacher, tokenizer)
    summary = measure_and_summarize(cfg, accelerator, run, merged, teacher, heldout, spec,
                                    global_batch=global_batch, trainable=trainable, prints=prints)
    if cfg.longctx_lengths and accelerator.is_main_process:  # retrieval, which perplexity does not show
        summary["longctx"] = retrieval_check(cfg, merged, teacher, tokenizer, prints=prints, log=run.write)
    run.write_records(summary, title=f"{cfg.teacher}: hybrid retrofit ({Path(cfg.output_dir).name})")
    return summary


def merge_and_save(cfg: RetrofitConfig, accelerator: Accelerator, peft_model, teacher, tokenizer) -> tuple:
    """``(merged, prints)``: LoRA folded into the base weights (the same module objects), saved to ``final/``, and
    the fingerprints of the merged and dense models, hashed once for the closing evaluation's cache keys (under a
    second each at 135M)."""
    merged = peft_model.merge_and_unload()
    save_hf_dir(accelerator, merged, tokenizer, Path(cfg.output_dir) / "final")  # with the KV cache on
    return merged, {"merged": model_fingerprint(merged), "dense": model_fingerprint(teacher)}


def choose_head_roles(cfg: RetrofitConfig, model, teacher, tokenizer, spec: HybridAttentionConfig, train_blocks,
                      main: bool) -> HybridAttentionConfig:
    """The spec with retrieval heads kept full (attention.heads), applied to ``model``; plotted to heads.png."""
    from attention.heads import find_head_roles, plot_head_scores

    length, cap = head_sample_length(cfg, getattr(teacher.config, "max_position_embeddings", None))
    try:
        spec = find_head_roles(teacher, tokenizer, spec, train_blocks, share=cfg.full_head_share,
                               method=cfg.head_score, samples=cfg.head_samples, length=min(length, cap),
                               seed=cfg.seed, progress=main, gate_steps=cfg.gate_steps, gate_lr=cfg.gate_lr,
                               gate_l1=cfg.gate_l1, gate_window=cfg.gate_window, gate_context=cfg.gate_context)
    except HybridAttentionError as err:  # e.g. samples too short for the window: name the key to change
        raise head_roles_error(cfg, err, length, cap) from None
    # Every process scored the heads, and all train under the main process's roles: gate training on GPUs is not
    # bitwise reproducible, and a near-tied head could fall on either side of the share on different ranks.
    spec = broadcast_object_list([spec])[0]
    attention.retrofit(model, spec)  # the same model object under the LoRA wrapper: the new spec applies
    if main:
        plot_head_scores(spec, Path(cfg.output_dir) / "heads.png", title=f"{cfg.teacher}: full heads ({cfg.head_score})")
    return spec


def head_sample_length(cfg: RetrofitConfig, max_positions: int | None) -> tuple[int, int]:
    """``(length, cap)``: the head-scoring samples' configured length and what caps it (they use the smaller).

    Samples are capped at seq_len, except dense-context gates, whose cost does not grow with the length:
    theirs run on across training blocks up to the model's context.
    """
    length = cfg.gate_sample_len if cfg.head_score == "gates" else cfg.head_sample_len
    dense_gates = cfg.head_score == "gates" and cfg.gate_context == "dense"
    return length, ((max_positions or cfg.seq_len) if dense_gates else cfg.seq_len)


def head_roles_error(cfg: RetrofitConfig, err: Exception, length: int, cap: int) -> ConfigError:
    """The one-line error for head scoring that failed with ``err``, naming the key to change."""
    msg = str(err).splitlines()[0]
    if "pick a length" in msg:  # the length is a key, or seq_len / the model's context capping it
        dense_gates = cfg.head_score == "gates" and cfg.gate_context == "dense"
        key = "gate_sample_len" if cfg.head_score == "gates" else "head_sample_len"
        fixes = ([f"raise {key}"] if length <= cap else [] if dense_gates  # the model's context caps them
                 else [f"raise seq_len (it caps {key}={length} at {cap} tokens)"])
        window = "gate_window" if cfg.head_score == "gates" and cfg.gate_window is not None else "window"
        msg += ": " + ", or ".join([*fixes, f"lower {window} / sink_tokens"])
    return ConfigError(f"head roles: {msg}")


def resumed_head_roles(cfg: RetrofitConfig, model, spec: HybridAttentionConfig, main: bool
                       ) -> HybridAttentionConfig | None:
    """On resume: the spec with the head roles the run trained with, applied to ``model`` (None: choose them).

    The roles decide which heads stream, and choosing them again (minutes of gate training) need not
    give the same split: the checkpoint's ``student/config.json`` holds the spec with its
    ``full_heads`` and ``head_scores``, and that is what LoRA goes on training under. A checkpoint
    without them (an older run) chooses again, with a warning.
    """
    if cfg.resume is None:
        return None
    path = ckpt.resolve_resume(cfg.resume, cfg.output_dir)
    raw = (ckpt.model_config(path) or {}).get(CONFIG_KEY)
    try:
        saved = HybridAttentionConfig.from_dict(dict(raw)) if raw else None
    except (ValueError, TypeError):  # a spec that is no object (dict("...") is a ValueError) or not a valid one
        saved = None
    if saved is None or saved.head_scores is None or saved.streaming() != spec.streaming():
        if main:
            print(f"warning: {path} holds no head roles for this spec (an older run); choosing them again, which "
                  "may not give the split the checkpoint trained with")
        return None
    attention.retrofit(model, saved)  # the same model object under the LoRA wrapper: the saved spec applies
    return saved


def initial_perplexity(cfg: RetrofitConfig, accelerator: Accelerator, run: Run, model, teacher,
                       heldout: dict[int, torch.Tensor]) -> dict:
    """Dense and hybrid-before perplexity at every held-out length.

    The LoRA B matrices start at zero, so the model here is exactly "retrofit, no fine-tune".
    """
    init = {"dense": {}, "hybrid_before": {}}
    for length, blocks in sorted(heldout.items()):
        s, d = evaluate(accelerator, model, blocks, cfg.micro_batch_size, reference=teacher,
                        progress=f"held-out {length}, dense and hybrid")
        init["dense"][str(length)] = d.perplexity
        init["hybrid_before"][str(length)] = s.perplexity
        run.write(f"held-out perplexity at {length}: dense {d.perplexity:.3f}, hybrid before fine-tune "
                  f"{s.perplexity:.3f}")
    return init


def closing_heldout(cfg: RetrofitConfig, accelerator: Accelerator, merged, teacher,
                    heldout: dict[int, torch.Tensor], *, prints: dict[str, str] | None = None,
                    log: Callable[[str], None] = print) -> dict:
    """``{"perplexity": {length: ppl}, "top1_agreement", "kl"}`` of the merged model on the held-out blocks
    (agreement and KL to the dense model at seq_len); cached in ``output_dir/eval_cache`` (see the module doc).

    Every process takes the main process's cache decision: a hit skips the (collective) evaluation everywhere.
    """
    prints = prints or {"merged": model_fingerprint(merged), "dense": model_fingerprint(teacher)}
    settings = {
        "measurement": "heldout", "model": prints["merged"], "reference": prints["dense"],
        "blocks": {str(n): _tensor_hash(b) for n, b in sorted(heldout.items())}, "reference_at": cfg.seq_len,
        "micro_batch_size": cfg.micro_batch_size, "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision, **_machine(accelerator.device),
        "code": _source_hash("eval.metrics", *ATTENTION_CODE),
    }
    folder = Path(cfg.output_dir) / EVAL_CACHE
    hit = [cache_lookup(folder, "heldout", settings, log) if accelerator.is_main_process else None]
    hit = broadcast_object_list(hit)[0]
    if hit is not None:
        return hit
    after, agreement = {}, None
    for length, blocks in sorted(heldout.items()):
        s, _ = evaluate(accelerator, merged, blocks, cfg.micro_batch_size,
                        reference=teacher if length == cfg.seq_len else None, progress=f"held-out {length}, merged")
        after[str(length)] = s.perplexity
        if length == cfg.seq_len:
            agreement = s
    result = {"perplexity": after, "top1_agreement": agreement.top1_agreement, "kl": agreement.kl}
    if accelerator.is_main_process:
        cache_store(folder, "heldout", settings, result, log)
    return result


def measure_and_summarize(cfg: RetrofitConfig, accelerator: Accelerator, run: Run, merged, teacher,
                          heldout: dict[int, torch.Tensor], spec: HybridAttentionConfig, *, global_batch: int,
                          trainable: int, prints: dict[str, str] | None = None) -> dict:
    """Held-out perplexity of the merged model (what was saved) at every length, and the summary."""
    state = run.state
    dense_ppl = state.init["dense"][str(cfg.seq_len)]
    closing = closing_heldout(cfg, accelerator, merged, teacher, heldout, prints=prints, log=run.write)
    after = closing["perplexity"]
    state.evals.append({"step": cfg.max_steps, "perplexity": after[str(cfg.seq_len)], "teacher_perplexity": dense_ppl})

    def table(length: int) -> dict[str, float]:
        d, b, a = state.init["dense"][str(length)], state.init["hybrid_before"][str(length)], after[str(length)]
        return {"dense": d, "hybrid_before": b, "hybrid_after": a, "gap_before": b / d - 1, "gap_after": a / d - 1}

    key = str(cfg.seq_len)
    history = state.history
    return {
        "steps": cfg.max_steps,
        "seq_len": cfg.seq_len,
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "final_terms": history[-1] if history else {},
        "tokens_per_s": run.tokens_per_s,
        **run.timing(),  # loop_s (training steps only), wall_s, threads, peak_rss_gb per phase
        "tokens_seen": sum(h["tokens_per_block"] for h in history) * global_batch,
        "dense_ppl": dense_ppl,
        "hybrid_before_ppl": state.init["hybrid_before"][key],
        "hybrid_after_ppl": after[key],
        "perplexity": {str(n): table(n) for n in sorted(heldout)},
        "top1_agreement": closing["top1_agreement"],
        "kl_to_dense": closing["kl"],
        "hybrid_attention": spec.to_dict(),
        "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha, "mlp": cfg.lora_mlp, "norms": cfg.train_norms,
                 "embeddings": cfg.train_embeddings},
        "trainable_params": trainable,
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "final_dir": str(Path(cfg.output_dir) / "final"),
        "environment": state.environment,  # versions, commit, device: what makes the run reproducible
    }


def check_lengths(cfg: RetrofitConfig, spec: HybridAttentionConfig, model_config, tokenizer) -> None:
    """Every length of the config against the model (``model_config``: its config, read with or without its
    weights) and the tokenizer, so that none fails after the work it comes behind.

    * seq_len and eval_seq_lens within the model's positions;
    * the spec against the model's layers and KV heads;
    * the closing retrieval check's lengths within the positions and long enough for a pass-key prompt (it
      runs last, and would otherwise fail after the training it was meant to judge);
    * head-scoring samples (``full_head_share > 0``) long enough for a needle beyond the sinks and window.
    """
    limit = getattr(model_config, "max_position_embeddings", None)
    longest = max(cfg.eval_lengths())
    if limit is not None and longest > limit:
        raise ConfigError(f"seq_len/eval_seq_lens up to {longest} exceed the model's maximum of {limit} "
                          "positions; lower them")
    if limit is not None and all(spec.sink_tokens + w >= min(limit, b or limit) for b, w in spec.window_policy or
                                 [(None, spec.window)]):  # every input up to the limit sees every earlier key
        raise ConfigError(f"sink_tokens + window cover the model's whole context of {limit} positions at every length: "
                          "the hybrid pattern would be dense attention and the retrofit change nothing; lower window "
                          "(and window_policy) or sink_tokens")
    try:
        spec.check_model(model_config.num_hidden_layers,
                         getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads)
    except HybridAttentionError as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    check_gate_positions(cfg.gate, limit)  # else the gate fails after the training, no summary
    if cfg.longctx_lengths:
        if limit is not None and max(cfg.longctx_lengths) > limit:
            raise ConfigError(f"longctx_lengths up to {max(cfg.longctx_lengths)} exceed the model's maximum of "
                              f"{limit} positions; lower them")
        try:
            check_prompt_fits(tokenizer, cfg.longctx_lengths)
        except LongCtxError as err:
            raise ConfigError(f"longctx_lengths: {err}") from None
    if cfg.full_head_share > 0:
        check_head_samples(cfg, spec, limit, tokenizer)


def check_head_samples(cfg: RetrofitConfig, spec: HybridAttentionConfig, max_positions: int | None,
                       tokenizer) -> None:
    """Head scoring's needle samples fit their length (:func:`attention.heads.needle_samples` refuses a length
    that leaves too little filler beyond the sinks and window): built here from placeholder text, so that a
    too-short length fails before the model loads rather than after the data is prepared."""
    from attention.heads import spec_samples

    length, cap = head_sample_length(cfg, max_positions)
    n = min(length, cap)
    scored = spec.with_window(cfg.gate_window) if cfg.head_score == "gates" and cfg.gate_window else spec
    # Gates score half their samples with single needles (the other half fall back to them), the other
    # methods all: the single-needle samples are the ones a length must hold.
    count = cfg.head_samples - cfg.head_samples // 2 if cfg.head_score == "gates" else cfg.head_samples
    try:
        spec_samples(tokenizer, scored, torch.zeros(count, n, dtype=torch.long), count=count, length=n, seed=cfg.seed)
    except HybridAttentionError as err:
        raise head_roles_error(cfg, err, length, cap) from None


def check_before_loading(cfg: RetrofitConfig) -> None:
    """:func:`distill.config.check_sources`, then :func:`check_lengths` from the model's config.json and its
    tokenizer, before any weights load (a source whose config cannot be read so is checked once it loads)."""
    check_sources(cfg)
    model_config = peek_config(cfg.teacher)
    if model_config is None:
        return
    check_lengths(cfg, cfg.spec(), model_config, load_recipe_tokenizer(cfg.teacher, cfg.tokenizer))


def retrieval_check(cfg: RetrofitConfig, merged, teacher, tokenizer, *, prints: dict[str, str] | None = None,
                    log: Callable[[str], None] = print) -> dict:
    """Pass-key accuracy per length of the final (hybrid) model and the dense one; heatmap to longctx.png.

    Each model's result is cached (see the module doc): the hybrid one in ``output_dir/eval_cache``, the dense
    one in :func:`dense_cache_dir`, shared across runs.
    """
    out = {}
    for name, model in (("hybrid", merged), ("dense", teacher)):
        device = str(next(model.parameters()).device)
        fingerprint = (prints or {}).get("merged" if name == "hybrid" else "dense") or model_fingerprint(model)
        settings = {
            "measurement": "passkey", "model": fingerprint, "hybrid": getattr(model.config, CONFIG_KEY, None),
            "lengths": list(cfg.longctx_lengths), "depths": list(cfg.longctx_depths), "trials": cfg.longctx_trials,
            "seed": cfg.seed, "kinds": ["passkey"], "scoring": "exact", "tokenizer": tokenizer_fingerprint(tokenizer),
            "bos": tokenizer.bos_token_id, "dtype": str(next(model.parameters()).dtype), **_machine(device),
            "code": _source_hash("eval.longctx", *(ATTENTION_CODE if name == "hybrid" else ())),
        }
        folder = Path(cfg.output_dir) / EVAL_CACHE if name == "hybrid" else dense_cache_dir(cfg)
        result = cache_lookup(folder, f"passkey-{name}", settings, log)
        if result is None:
            result = run_longctx(model, tokenizer, lengths=cfg.longctx_lengths, depths=cfg.longctx_depths,
                                 trials=cfg.longctx_trials, kinds=("passkey",), seed=cfg.seed, device=device)
            cache_store(folder, f"passkey-{name}", settings, result, log)
        out[name] = result["accuracy"]["passkey"]
        if name == "hybrid":
            plot_heatmap(result, Path(cfg.output_dir) / "longctx.png", title=f"{cfg.teacher}: pass-key retrieval, hybrid")
    out["ratio"] = {n: (out["hybrid"][n] / out["dense"][n] if out["dense"][n] else None) for n in out["hybrid"]}
    out["depths"], out["trials"] = result["depths"], cfg.longctx_trials
    return out


# --------------------------------------------------------------------------------------------
# The closing evaluation's cache
# --------------------------------------------------------------------------------------------

EVAL_CACHE = "eval_cache"  # in output_dir: the results of the run's own (merged) model
# The code a hybrid model computes through (its fingerprint holds weights and config, not this code): part of
# the hybrid measurements' keys, so a fix to the kernel never reads the old kernel's results.
ATTENTION_CODE = ("attention.integration", "attention.functional", "attention.kernel", "attention.masks",
                  "attention.flex", "attention.spec")
# Config entries that change nothing a model computes: left out of its fingerprint.
_CONFIG_NOISE = ("_name_or_path", "use_cache", "transformers_version")


def dense_cache_dir(cfg: RetrofitConfig) -> Path:
    """Where the dense model's closing results are shared across runs: ``eval_cache_dir``, else
    ``$HYBRID_DISTILL_CACHE/eval`` (``core.models.cache_root``)."""
    return Path(cfg.eval_cache_dir) if cfg.eval_cache_dir else cache_root() / "eval"


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of a model as it computes: its config (so a hybrid spec and its head roles), whether it runs
    hybrid, train/eval mode, and every state-dict tensor's name, dtype, shape and bytes. A single changed
    weight gives another fingerprint, so a changed model can never read another's cached results."""
    h = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_NOISE}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(f"\nhybrid={attention.is_hybrid(model)} training={model.training}\n".encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def _tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + _tensor_bytes(t).tobytes()).hexdigest()


def _source_hash(*modules: str) -> str:
    """The measuring code itself (the modules' files): a fix to it never reads the old code's results."""
    h = hashlib.sha256()
    for name in modules:
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    return h.hexdigest()[:16]


def _machine(device: torch.device | str) -> dict:
    """What decides a measurement's last bits beside the model and the settings: packages, device, threads."""
    import transformers

    device = torch.device(device)
    where = {"device": device.type, "torch": torch.__version__, "transformers": transformers.__version__}
    if device.type == "cuda":
        where.update(device_name=torch.cuda.get_device_name(device),
                     matmul_precision=torch.get_float32_matmul_precision())
    else:
        where.update(cpu=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads())
    return where


def _cache_path(folder: Path, what: str, key: str) -> Path:
    return folder / f"{what}-{key[:32]}.json"


def cache_lookup(folder: Path, what: str, settings: dict, log: Callable[[str], None] = print) -> dict | None:
    """The cached result of measurement ``what`` under ``settings`` (None: not cached, or unreadable)."""
    key = json_hash(settings)
    path = _cache_path(folder, what, key)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("result"), dict):
        return None
    log(f"closing evaluation: {what} from the cache ({path}; same weights and settings), not measured again")
    return entry["result"]


def cache_store(folder: Path, what: str, settings: dict, result: dict, log: Callable[[str], None] = print) -> None:
    """Write ``result`` under ``settings``' key, whole or not at all; a cache that cannot be written only warns."""
    key = json_hash(settings)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(_cache_path(folder, what, key),
                          json.dumps({"key": key, "settings": settings, "result": result}, indent=1))
    except OSError as err:
        log(f"warning: could not cache the closing {what} result in {folder} ({err}); the run goes on")


def print_summary(summary: dict, out: Path) -> None:
    print("\n" + "=" * 78)
    print(f"run folder     {out}")
    print(f"model          {summary['final_dir']}   (attention.load: hybrid; from_pretrained: dense)")
    print(f"plots/summary  {out / 'loss.png'}   {out / 'summary.json'}")
    print("held-out ppl   length   dense   hybrid before   hybrid after   gap after")
    for length, row in summary["perplexity"].items():
        print(f"               {length:>6} {row['dense']:>7.3f} {row['hybrid_before']:>15.3f} "
              f"{row['hybrid_after']:>14.3f} {row['gap_after']:>+10.1%}")
    print(f"agreement      top-1 with dense {summary['top1_agreement']:.3f}, KL {summary['kl_to_dense']:.4f} "
          f"(at {summary['seq_len']})")
    print(f"throughput     {summary['tokens_per_s']:.0f} tokens/s over {summary['steps']} steps "
          f"({summary['trainable_params']:,} trainable parameters)")
    if "longctx" in summary:
        lc = summary["longctx"]
        print("pass-key       " + ", ".join(f"{n}: hybrid {lc['hybrid'][n]:.2f} / dense {lc['dense'][n]:.2f}"
                                            for n in lc["hybrid"])
              + f"   ({len(lc['depths'])} depths x {lc['trials']} per length)")
    if "gate" in summary:
        print(f"release gate   {summary['gate'].get('verdict')}   "
              f"({summary['gate'].get('report') or summary['gate'].get('error')})")
    print("=" * 78)


def main(argv: list[str] | None = None) -> None:
    # peft still calls a transformers property deprecated in v5; the warning says nothing to the user.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    # check_before_loading: missing local model and data paths, and every length the model's config.json and
    # tokenizer can judge, are refused before the run folder is claimed and any weights load.
    # DeepSpeed and FSDP launches are refused as early. Under an FSDP config on CPUs accelerate starts the processes
    # apart (DistributedType.NO with num_processes 2): each trained its own copy on its share of the data and
    # final/ held rank 0's alone. On GPUs LoRA's merge and the final save would meet sharded parameters, untested.
    cfg, accelerator, out = start_run(RetrofitConfig, argv, resume_safe=RESUME_SAFE, check=check_before_loading,
                                      without_deepspeed=(
        "retrofit.py trains small LoRA adapters with DDP, not DeepSpeed: launch it with launch/gpu_ddp.yaml "
        "(CPU: launch/cpu_ddp_2proc.yaml)"), without_fsdp=(
        "retrofit.py trains small LoRA adapters with DDP, not FSDP: launch it with launch/gpu_ddp.yaml "
        "(CPU: launch/cpu_ddp_2proc.yaml)"))
    summary = training_function(cfg, accelerator)
    finish_run(cfg, accelerator, out, summary, print_summary)


if __name__ == "__main__":
    run_cli(main)
