"""Retrofit hybrid sparse attention into a pretrained model, then heal it with LoRA + self-distillation.

    accelerate launch recipes/retrofit.py                                  # SmolLM2-135M, the default config
    accelerate launch recipes/retrofit.py --config recipes/configs/retrofit_smollm2.yaml key=value ...

Reads top to bottom: config → data → models → loop → save.

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
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.logging import get_logger  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from attention.errors import HybridAttentionError  # noqa: E402
from attention.spec import HybridAttentionConfig  # noqa: E402
from distill import checkpoint as ckpt  # noqa: E402
from distill.config import ConfigError, field, parse_config, run_cli, save_config  # noqa: E402
from distill.data import BUILTIN, BlockOrder, build_data, eval_batches  # noqa: E402
from distill.model import KD_KINDS, LossConfig, loss_config_from  # noqa: E402
from distill.training import check_output_dir, make_accelerator, reduce_stats, warmup_cosine  # noqa: E402
from eval.metrics import LMStats, batch_stats  # noqa: E402

logger = get_logger(__name__)
TRACKERS = ("none", "tensorboard", "wandb")
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass
class RetrofitConfig:
    # model
    teacher: str = field("smollm2-135m-instruct", help="the dense model to retrofit (also the frozen teacher): an "
                         "HF directory, a hub name, 'smollm2-135m-instruct' (offline demo) or 'tiny-random' (tests)")
    tokenizer: str | None = field(None, help="tokenizer source; default: the teacher's")
    # hybrid attention spec (attention.HybridAttentionConfig), stored in final/config.json
    sink_tokens: int = field(128, help="first tokens every query attends to (attention sinks); 0 disables")
    window: int = field(512, help="local window in tokens, counting the query itself (>= 1)")
    global_every: int = field(1024, help="every N-th position is a global key all later queries see; 0 disables")
    max_globals: int | None = field(None, help="keep at most this many global keys (bounds the decode KV cache)")
    global_rows: bool = field(False, help="global tokens also attend to every earlier key (unbounded cache)")
    window_policy: list[Any] | None = field(None, help="[[max_len, window], ..., [null, window]]: the window per "
                                            "input length; training samples one entry per step")
    # per-KV-head roles (issue 14, attention.heads): the top share of heads by needle-retrieval score keep full
    # attention, the rest stream; chosen on the dense model before LoRA, saved in the spec, plotted to heads.png
    full_head_share: float = field(0.25, help="fraction of (layer, KV head) pairs that keep full attention "
                                   "(retrieval heads); 0 = every head streams")
    head_score: str = field("retrieval", help="how heads are ranked: retrieval (top-1 copy hits, Wu et al. 2024) "
                            "or mass (attention mass on the needle)")
    head_samples: int = field(12, help="synthetic needle samples (from the training text) for head scoring")
    head_sample_len: int = field(1536, help="tokens per head-scoring sample (capped at seq_len)")
    # LoRA + extra trainable pieces
    lora_r: int = field(16, help="LoRA rank")
    lora_alpha: float = field(32.0, help="LoRA scaling numerator (the update is scaled by alpha / r)")
    lora_dropout: float = field(0.0, help="dropout on the LoRA input")
    lora_mlp: bool = field(False, help="also put LoRA on the MLP projections (gate/up/down)")
    train_norms: bool = field(True, help="train every RMSNorm weight in full (LongLoRA: needed for long context)")
    train_embeddings: bool = field(True, help="train the input embeddings in full (tied heads train with them)")
    # data
    dataset: str = field(BUILTIN, help="training text: 'builtin:stdlib-docs' (offline default), a local "
                         ".jsonl/.txt/.parquet file or folder, or a hub dataset name")
    eval_dataset: str | None = field(None, help="held-out text; default: a held-out split of dataset")
    text_field: str = field("text", help="column holding the text (records with 'messages' use the chat template)")
    seq_len: int = field(2048, help="tokens per packed training block")
    max_train_blocks: int | None = field(None, help="use only the first N packed training blocks")
    eval_blocks: int = field(3, help="held-out blocks per evaluated length")
    eval_seq_lens: list[int] = field(default_factory=lambda: [4096], help="extra held-out lengths evaluated at start and end "
                                     "(e.g. [4096]); seq_len is always evaluated")
    # loop
    max_steps: int = field(30, help="optimizer steps")
    micro_batch_size: int = field(1, help="blocks per forward on each process")
    grad_accum: int = field(1, help="micro-batches per optimizer step")
    lr: float = field(2e-4, help="peak learning rate (AdamW) for LoRA, norms and embeddings")
    embedding_lr_ratio: float = field(0.1, help="embeddings train at lr * this (they move the whole model)")
    min_lr_ratio: float = field(0.1, help="cosine schedule ends at lr * min_lr_ratio")
    warmup_steps: int = field(4, help="linear warmup steps")
    weight_decay: float = field(0.0, help="AdamW weight decay")
    max_grad_norm: float = field(1.0, help="gradient clipping (0 disables)")
    mixed_precision: str = field("auto", help="no | bf16 | fp16 | auto (bf16 on GPUs that support it, fp32 on "
                                 "CPU where bf16 matmul is slower)")
    gradient_checkpointing: bool = field(False, help="recompute activations in backward to save memory")
    seed: int = field(0, help="seed for LoRA init, data order and window sampling")
    # loss: self-distillation from the dense model
    kd_weight: float = field(1.0, help="logits KD to the dense teacher, weight")
    kd_kind: str = field("forward_kl", help=f"divergence: {', '.join(KD_KINDS)}")
    temperature: float = field(1.0, help="KD temperature T (the term is scaled by T²)")
    beta: float = field(0.5, help="JSD interpolation (0 = forward KL, 1 = reverse KL)")
    kd_chunk_size: int | None = field(1024, help="tokens per chunk of the fused KD loss; empty = full logits")
    ce_weight: float = field(0.0, help="cross-entropy on the data, weight (pulls towards the training corpus and "
                             "away from the dense model; keep it small)")
    # eval, logging, outputs
    eval_every: int = field(0, help="held-out evaluation at seq_len every N steps (0: only at start and end)")
    log_every: int = field(1, help="tracker logging every N steps")
    tracker: str = field("none", help="none | tensorboard | wandb (WANDB_MODE=offline works)")
    output_dir: str = field("runs/retrofit-smollm2", help="run folder: checkpoints/, final/, summary.json, loss.png")
    overwrite: bool = field(False, help="replace an existing run in output_dir")
    resume: str | None = field(None, help="'latest' or a checkpoint folder to continue from")
    save_every: int = field(10, help="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = field(1, help="complete checkpoints kept on disk")
    gate: bool = field(False, help="run the release gate (eval.gate) against the dense teacher at the end")
    gate_prompts: int = field(100, help="prompts from the bundled set used by the gate")
    debug_exit_at_step: int | None = field(None, help="testing: exit abruptly (as if killed) after this step")

    def __post_init__(self) -> None:
        for name in ("seq_len", "max_steps", "micro_batch_size", "grad_accum", "eval_blocks", "keep_checkpoints",
                     "lora_r"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "eval_every", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if any(n < 2 for n in self.eval_seq_lens):
            raise ConfigError(f"eval_seq_lens must be >= 2 tokens each, got {self.eval_seq_lens}")
        if self.lr <= 0 or self.lora_alpha <= 0:
            raise ConfigError(f"lr and lora_alpha must be > 0, got lr={self.lr}, lora_alpha={self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.embedding_lr_ratio < 0:
            raise ConfigError(f"embedding_lr_ratio must be >= 0, got {self.embedding_lr_ratio}")
        if self.mixed_precision not in ("no", "bf16", "fp16", "auto"):
            raise ConfigError(f"mixed_precision '{self.mixed_precision}' is unknown; use no, bf16, fp16 or auto")
        if self.tracker not in TRACKERS:
            raise ConfigError(f"tracker '{self.tracker}' is unknown; use one of {', '.join(TRACKERS)}")
        if not 0.0 <= self.full_head_share <= 1.0 or self.head_score not in ("retrieval", "mass"):
            raise ConfigError(f"full_head_share must be in [0, 1] and head_score retrieval or mass; got "
                              f"{self.full_head_share}, {self.head_score!r}")
        if self.head_samples < 1:
            raise ConfigError(f"head_samples must be >= 1, got {self.head_samples}")
        if self.resume is not None and self.overwrite:
            raise ConfigError("resume= and overwrite=true contradict each other; pick one")
        self.spec()  # validates the attention keys
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
        return loss_config_from(self)

    def eval_lengths(self) -> list[int]:
        return sorted({self.seq_len, *self.eval_seq_lens})


# --------------------------------------------------------------------------------------------
# Pieces of the loop that read better with a name
# --------------------------------------------------------------------------------------------

def load_models(cfg: RetrofitConfig) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """``(model, dense_teacher, tokenizer)``: two copies of the same pretrained weights, fp32."""
    from distill.pretrained import ModelSourceError, load_causal_lm, load_tokenizer
    from distill.tiny import TINY, tiny_teacher, tiny_tokenizer

    try:
        if cfg.teacher == TINY:
            model, tokenizer = tiny_teacher(cfg.seed), tiny_tokenizer()
        else:
            model = load_causal_lm(cfg.teacher)
            tokenizer = load_tokenizer(cfg.tokenizer or cfg.teacher)
    except (ModelSourceError, OSError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    teacher = copy.deepcopy(model).eval().requires_grad_(False)
    return model, teacher, tokenizer


def add_adapters(model: torch.nn.Module, cfg: RetrofitConfig):
    """Wrap ``model`` with LoRA (in place) and unfreeze norms / embeddings; returns the PeftModel.

    Norms and embeddings are unfrozen on the base weights themselves rather than through peft's
    ``modules_to_save``: that would keep a second copy of each and, for tied embeddings, untie the
    head. Trained in place, ``merge_and_unload`` needs nothing more to ship them.
    """
    from peft import LoraConfig, get_peft_model

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
    import contextlib

    import attention

    def context_fn():
        return contextlib.nullcontext(), attention.use_window(step_window["window"])

    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False,
                                                                           "context_fn": context_fn})
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
    and the block is cropped to that entry's upper bound: causality makes the crop's mask exactly
    the one served to an input of that length.
    """
    if not spec.window_policy:
        return spec.window_for(seq_len), seq_len
    entries, lower = [], 0
    for bound, w in spec.window_policy:
        if lower < seq_len:
            entries.append((w, seq_len if bound is None else min(bound, seq_len)))
        lower = math.inf if bound is None else bound
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return entries[int(torch.randint(len(entries), (1,), generator=g))]


@torch.no_grad()
def evaluate(accelerator: Accelerator, model, blocks: torch.Tensor, batch_size: int, reference=None) -> LMStats:
    """Held-out perplexity of ``model`` (and its agreement/KL with ``reference``), summed over processes."""
    was = model.training
    model.eval()
    stats = LMStats()
    for batch in eval_batches(blocks, batch_size, accelerator.process_index, accelerator.num_processes):
        ids = batch["input_ids"].to(accelerator.device)
        logits = model(input_ids=ids).logits
        ref = reference(input_ids=ids).logits if reference is not None else None
        stats.add(batch_stats(logits, ids, None, ref))
        del logits, ref
    model.train(was)
    return reduce_stats(accelerator, stats)


def heldout_blocks(cfg: RetrofitConfig, tokenizer, length: int) -> torch.Tensor:
    """``[n, length]`` held-out blocks (the same documents at every length, packed differently)."""
    data = build_data(tokenizer, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset, seq_len=length,
                      eval_blocks=cfg.eval_blocks, text_field=cfg.text_field, min_train_blocks=0)
    return data.eval


def save_merged(accelerator: Accelerator, model: torch.nn.Module, tokenizer, path: Path) -> None:
    """Write the merged model as an HF directory (its config carries the hybrid spec), atomically."""
    if accelerator.is_main_process:
        tmp = path.with_name(f".tmp-{path.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


# --------------------------------------------------------------------------------------------
# The training function
# --------------------------------------------------------------------------------------------

def training_function(cfg: RetrofitConfig, accelerator: Accelerator) -> dict:
    import attention
    from distill.model import DistillModel

    out = Path(cfg.output_dir)
    main = accelerator.is_main_process
    set_seed(cfg.seed)
    spec = cfg.spec()

    # ---- models -------------------------------------------------------------------------
    model, teacher, tokenizer = load_models(cfg)
    longest = max(cfg.eval_lengths())
    if longest > model.config.max_position_embeddings:
        raise ConfigError(f"seq_len/eval_seq_lens up to {longest} exceed the model's maximum of "
                          f"{model.config.max_position_embeddings} positions; lower them")
    if getattr(model.config, "attention_dropout", 0.0):
        model.config.attention_dropout = 0.0  # the hybrid kernel has none; LoRA dropout regularizes instead
    try:
        attention.retrofit(model, spec)
    except HybridAttentionError as err:
        raise ConfigError(str(err)) from None
    model.config.use_cache = False
    peft_model = add_adapters(model, cfg)
    step_window: dict[str, int | None] = {"window": None}  # the sampled window of the running step
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model, step_window)

    # ---- data ---------------------------------------------------------------------------
    global_batch = cfg.micro_batch_size * cfg.grad_accum * accelerator.num_processes
    data = build_data(tokenizer, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset, seq_len=cfg.seq_len,
                      eval_blocks=cfg.eval_blocks, text_field=cfg.text_field, min_train_blocks=global_batch,
                      max_train_blocks=cfg.max_train_blocks)
    order = BlockOrder(data.train.shape[0], global_batch, cfg.seed)
    heldout = {cfg.seq_len: data.eval}
    for length in cfg.eval_lengths():
        if length not in heldout:
            heldout[length] = heldout_blocks(cfg, tokenizer, length)

    # ---- head roles (issue 14): which KV heads keep full attention, scored on the dense teacher --------
    if cfg.full_head_share > 0:
        from attention.heads import find_head_roles, plot_head_scores

        spec = find_head_roles(teacher, tokenizer, spec, data.train, share=cfg.full_head_share,
                               method=cfg.head_score, samples=cfg.head_samples,
                               length=min(cfg.head_sample_len, cfg.seq_len), seed=cfg.seed, progress=main)
        attention.retrofit(model, spec)  # the same model object under the LoRA wrapper: the new spec applies
        if main:
            plot_head_scores(spec, out / "heads.png", title=f"{cfg.teacher}: full heads ({cfg.head_score})")

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
    teacher = teacher.to(accelerator.device)
    trainable = sum(p.numel() for p in params)

    # ---- resume -------------------------------------------------------------------------
    start_step, history, evals, init = 0, [], [], {}
    if cfg.resume is not None:
        path = ckpt.resolve_resume(cfg.resume, out)
        state = ckpt.read_state(path)
        try:
            accelerator.load_state(str(path))
        except Exception as err:  # noqa: BLE001 - a torn or foreign checkpoint
            raise ckpt.CheckpointError(f"cannot load checkpoint {path} ({type(err).__name__}: {err}); resume from "
                                       "an older step-N folder") from None
        start_step, history, evals, init = state["step"], state["history"], state["evals"], state["init"]
        if main:
            print(f"resumed from {path} at step {start_step}")
    if main:
        ckpt.clean_partial(out)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    if cfg.tracker != "none":
        accelerator.init_trackers("hybrid-distill-retrofit", config={
            k: v for k, v in dataclasses.asdict(cfg).items() if isinstance(v, (int, float, str, bool))})

    if not init:
        # Dense and hybrid-before at every held-out length; the LoRA B matrices start at zero, so
        # the model here is exactly "retrofit, no fine-tune".
        t0 = time.time()
        init = {"dense": {}, "hybrid_before": {}}
        for length, blocks in sorted(heldout.items()):
            init["dense"][str(length)] = evaluate(accelerator, teacher, blocks, cfg.micro_batch_size).perplexity
            init["hybrid_before"][str(length)] = evaluate(accelerator, model, blocks, cfg.micro_batch_size).perplexity
        if main:
            for length in sorted(heldout):
                print(f"held-out perplexity at {length}: dense {init['dense'][str(length)]:.3f}, hybrid before "
                      f"fine-tune {init['hybrid_before'][str(length)]:.3f}")
            print(f"({time.time() - t0:.0f}s; {trainable:,} trainable parameters)")

    # ---- loop ---------------------------------------------------------------------------
    def save_checkpoint(step: int) -> None:
        tmp = ckpt.tmp_dir(out, step)
        accelerator.save_state(str(tmp), safe_serialization=False)
        if main:
            model.config.save_pretrained(tmp / "student")
            tokenizer.save_pretrained(tmp / "student")
            save_config(cfg, tmp / "config.yaml")
            ckpt.finalize(out, step, {"step": step, "history": history, "evals": evals, "init": init},
                          cfg.keep_checkpoints)
        accelerator.wait_for_everyone()

    distill_model.train()
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not main, desc="retrofit", dynamic_ncols=True)
    t_start, trained_tokens = time.time(), 0
    for step in range(start_step, cfg.max_steps):
        window, length = training_window(spec, cfg.seq_len, cfg.seed, step)
        step_window["window"] = window
        sums: dict[str, float] = {}
        micro = order.micro_batches(data.train, step, accelerator.process_index, accelerator.num_processes,
                                    cfg.micro_batch_size)
        for _, blocks in micro:
            ids = blocks[:, :length].to(accelerator.device)
            with accelerator.accumulate(distill_model):
                with attention.use_window(window):
                    output = distill_model(input_ids=ids)
                loss = output.loss
                accelerator.backward(loss)  # checkpoint recomputes get the window via step_window
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            terms = {k: v for k, v in output.terms().items() if k in ("kd", "ce")}
            terms["loss"] = float(loss.detach())
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + v / cfg.grad_accum
        terms = {k: float(v) for k, v in zip(sums, accelerator.reduce(
            torch.tensor(list(sums.values()), device=accelerator.device), reduction="mean").tolist())}
        if not math.isfinite(terms["loss"]):
            last = ckpt.latest_checkpoint(out)
            raise ckpt.TrainingDiverged(
                f"loss became {terms['loss']} at step {step + 1}; the last good checkpoint is "
                f"{last or 'none'}: lower lr, then resume=latest")
        trained_tokens += global_batch * length
        elapsed = time.time() - t_start
        history.append({"step": step + 1, "lr": scheduler.get_last_lr()[0], "window": window, "tokens": length,
                        **terms})
        bar.update(1)
        bar.set_postfix({k: f"{v:.3g}" for k, v in terms.items()} | {"win": window,
                                                                      "tok/s": f"{trained_tokens / elapsed:.0f}"})
        if cfg.tracker != "none" and (step + 1) % cfg.log_every == 0:
            accelerator.log(terms | {"lr": history[-1]["lr"], "window": window}, step=step + 1)
        done = step + 1 == cfg.max_steps
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and not done:
            s = evaluate(accelerator, model, heldout[cfg.seq_len], cfg.micro_batch_size)
            evals.append({"step": step + 1, "perplexity": s.perplexity,
                          "teacher_perplexity": init["dense"][str(cfg.seq_len)]})
            if main:
                bar.write(f"step {step + 1}: held-out perplexity {s.perplexity:.3f} "
                          f"(dense {init['dense'][str(cfg.seq_len)]:.3f})")
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or done:
            save_checkpoint(step + 1)
        if cfg.debug_exit_at_step is not None and step + 1 == cfg.debug_exit_at_step:
            os._exit(137)  # simulate a kill: no cleanup, no final save
    bar.close()
    tokens_per_s = trained_tokens / max(time.time() - t_start, 1e-9)

    # ---- merge, save, measure what was saved ---------------------------------------------
    merged = peft_model.merge_and_unload()  # same module objects: folds LoRA into the base weights
    merged.config.use_cache = True
    save_merged(accelerator, merged, tokenizer, out / "final")
    merged.config.use_cache = False
    after, agreement = {}, None
    for length, blocks in sorted(heldout.items()):
        s = evaluate(accelerator, merged, blocks, cfg.micro_batch_size,
                     reference=teacher if length == cfg.seq_len else None)
        after[str(length)] = s.perplexity
        if length == cfg.seq_len:
            agreement = s
    evals.append({"step": cfg.max_steps, "perplexity": after[str(cfg.seq_len)],
                  "teacher_perplexity": init["dense"][str(cfg.seq_len)]})

    def table(length: int) -> dict[str, float]:
        d, b, a = init["dense"][str(length)], init["hybrid_before"][str(length)], after[str(length)]
        return {"dense": d, "hybrid_before": b, "hybrid_after": a, "gap_before": b / d - 1, "gap_after": a / d - 1}

    key = str(cfg.seq_len)
    summary = {
        "steps": cfg.max_steps,
        "seq_len": cfg.seq_len,
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "final_terms": history[-1] if history else {},
        "tokens_per_s": tokens_per_s,
        "tokens_seen": sum(h["tokens"] for h in history) * global_batch,
        "dense_ppl": init["dense"][key],
        "hybrid_before_ppl": init["hybrid_before"][key],
        "hybrid_after_ppl": after[key],
        "perplexity": {str(n): table(n) for n in sorted(heldout)},
        "top1_agreement": agreement.top1_agreement,
        "kl_to_dense": agreement.kl,
        "hybrid_attention": spec.to_dict(),
        "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha, "mlp": cfg.lora_mlp, "norms": cfg.train_norms,
                 "embeddings": cfg.train_embeddings},
        "trainable_params": trainable,
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "final_dir": str(out / "final"),
    }
    if main:
        from distill.plots import plot_training

        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        plot_training(history, evals, out / "loss.png", title=f"{cfg.teacher}: hybrid retrofit ({out.name})")
    if cfg.tracker != "none":
        accelerator.end_training()
    return summary


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
    if "gate" in summary:
        print(f"release gate   {summary['gate'].get('verdict')}   ({summary['gate'].get('report')})")
    print("=" * 78)


def main() -> None:
    import warnings

    # peft still calls a transformers property deprecated in v5; the warning says nothing to the user.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    cfg = parse_config(RetrofitConfig)
    out = check_output_dir(cfg)
    accelerator = make_accelerator(cfg, out)
    if cfg.overwrite and accelerator.is_main_process and out.exists():
        shutil.rmtree(out)
    accelerator.wait_for_everyone()
    summary = training_function(cfg, accelerator)

    if cfg.gate and accelerator.is_main_process:
        try:
            from distill.sources import gate_against_teacher
        except ImportError as err:
            summary["gate"] = {"verdict": "skipped", "report": f"eval.gate unavailable ({err})"}
        else:
            summary["gate"] = gate_against_teacher(cfg, out)
    if accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print_summary(summary, out)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    run_cli(main)
