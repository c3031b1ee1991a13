"""Distill a frozen teacher into a smaller student.

    accelerate launch recipes/distill.py                                   # built-in SmolLM2 demo
    accelerate launch recipes/distill.py --config recipes/configs/NAME.yaml key=value ...
    accelerate launch --config_file launch/deepspeed_zero3.yaml recipes/distill.py --config ...

Reads top to bottom: config → data → models → loop → save. The losses, the teacher–student
module, checkpoints and data order live in ``distill/``; this file is the training loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.logging import get_logger  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from distill import checkpoint as ckpt  # noqa: E402
from distill.config import ConfigError, field, parse_config, run_cli, save_config  # noqa: E402
from distill.data import BUILTIN, BlockOrder, build_data, eval_batches  # noqa: E402
from distill.model import KD_KINDS, DistillModel, LossConfig, loss_config_from  # noqa: E402
from distill.plots import plot_training  # noqa: E402
from distill.training import check_output_dir, make_accelerator, reduce_stats, warmup_cosine  # noqa: E402
from eval.metrics import LMStats, batch_stats  # noqa: E402

logger = get_logger(__name__)
TRACKERS = ("none", "tensorboard", "wandb")


@dataclass
class DistillConfig:
    # models
    teacher: str = field("smollm2-135m-instruct", help="teacher: an HF directory, a hub name, "
                         "'smollm2-135m-instruct' (built-in demo, offline) or 'tiny-random' (tests)")
    student: str | None = field(None, help="student HF directory/hub name; empty: derive from the teacher")
    keep_layers: str = field("0-3,24-29", help="when deriving: how many teacher layers to keep ('10', spread "
                             "evenly) or which ('0-5,26-29')")
    # ---- issue 13: student derived by importance pruning + search (distill/prune.py) ----
    student_init: str = field("keep_layers", help="how to derive the student: keep_layers (the teacher layers in "
                              "keep_layers) | prune (importance pruning + search at target_params/target_ratio)")
    target_params: float | None = field(None, help="student_init=prune: budget in non-embedding parameters")
    target_ratio: float | None = field(None, help="student_init=prune: budget as a fraction of the teacher's "
                                       "non-embedding parameters")
    prune_axes: str = field("depth,mlp,heads,hidden", help="student_init=prune: what may be cut")
    prune_search_steps: int = field(20, help="student_init=prune: short-distill steps per top candidate")
    prune_top_k: int = field(3, help="student_init=prune: candidates short-distilled before picking the winner")
    prune_calib_blocks: int = field(32, help="student_init=prune: training blocks for the importance scores")
    prune_eval_blocks: int = field(8, help="student_init=prune: held-out blocks that rank candidates")
    prune_max_candidates: int = field(32, help="student_init=prune: architectures ranked at init (evenly spaced)")
    # ---- end issue 13 ----
    tokenizer: str | None = field(None, help="tokenizer source; default: the teacher's")
    # data
    dataset: str = field(BUILTIN, help="training text: 'builtin:stdlib-docs' (offline default), a local "
                         ".jsonl/.txt/.parquet file or folder, or a hub dataset name")
    eval_dataset: str | None = field(None, help="held-out text; default: a held-out split of dataset")
    text_field: str = field("text", help="column holding the text (records with 'messages' use the chat template)")
    seq_len: int = field(256, help="tokens per packed training block")
    max_train_blocks: int | None = field(None, help="use only the first N packed training blocks")
    eval_blocks: int = field(16, help="held-out blocks used for perplexity/agreement")
    # loop
    max_steps: int = field(24, help="optimizer steps")
    micro_batch_size: int = field(4, help="blocks per forward on each process")
    grad_accum: int = field(1, help="micro-batches per optimizer step")
    lr: float = field(3e-4, help="peak learning rate (AdamW)")
    min_lr_ratio: float = field(0.1, help="cosine schedule ends at lr * min_lr_ratio")
    warmup_steps: int = field(4, help="linear warmup steps")
    weight_decay: float = field(0.0, help="AdamW weight decay")
    max_grad_norm: float = field(1.0, help="gradient clipping (0 disables)")
    mixed_precision: str = field("auto", help="no | bf16 | fp16 | auto (bf16 on GPUs that support it, fp32 on "
                                 "CPU where bf16 matmul is slower)")
    gradient_checkpointing: bool = field(False, help="recompute student activations in backward to save memory")
    seed: int = field(0, help="seed for init, data order and sampling")
    # loss terms (weight 0 switches a term off)
    kd_weight: float = field(1.0, help="logits KD term weight")
    kd_kind: str = field("forward_kl", help=f"divergence: {', '.join(KD_KINDS)}")
    temperature: float = field(1.0, help="KD temperature T (the term is scaled by T²)")
    beta: float = field(0.5, help="JSD interpolation (0 = forward KL, 1 = reverse KL)")
    kd_chunk_size: int | None = field(1024, help="tokens per chunk of the fused KD loss; empty = full logits")
    ce_weight: float = field(1.0, help="cross-entropy on the data term weight")
    focal_weight: float = field(0.0, help="focal CE term weight (long-tail tokens)")
    focal_alpha: float = field(0.25, help="focal alpha")
    focal_gamma: float = field(2.0, help="focal gamma")
    hidden_weight: float = field(0.2, help="hidden-state term weight")
    hidden_layers: list[str] = field(default_factory=lambda: ["derived"], help="layer pairs 's:t', "
                                     "'relative' or 'derived' (a derived student's replaced spans)")
    hidden_kind: str = field("nmse", help="hidden-state distance: nmse (per-token MSE / teacher mean square, scale-free) "
                             "| mse | cosine")
    attn_weight: float = field(0.0, help="attention-map term weight")
    attn_layers: list[str] = field(default_factory=list, help="layer pairs for the attention-map term")
    attn_num_queries: int = field(64, help="query positions sampled per sequence for the attention-map term")
    teacher_cache: str | None = field(None, help="folder written by recipes/cache_teacher.py: train from cached "
                                      "top-k teacher log-probs without loading the teacher")
    # eval, logging, outputs
    eval_every: int = field(12, help="held-out evaluation every N steps (0: only at start and end)")
    log_every: int = field(1, help="tracker logging every N steps")
    tracker: str = field("none", help="none | tensorboard | wandb (WANDB_MODE=offline works)")
    output_dir: str = field("runs/smollm2-demo", help="run folder: checkpoints/, final/, summary.json, loss.png")
    overwrite: bool = field(False, help="replace an existing run in output_dir")
    resume: str | None = field(None, help="'latest' or a checkpoint folder to continue from")
    save_every: int = field(0, help="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = field(2, help="complete checkpoints kept on disk")
    compare_ce_only: bool = field(True, help="also train a CE-only student for the same steps and report both")
    gate: bool = field(False, help="run the release gate (eval.gate) against the teacher at the end")
    gate_prompts: int = field(100, help="prompts from the bundled set used by the gate")
    # planner inputs (python -m distill.plan); not used by the loop
    teacher_shape: dict | None = field(None, help="teacher shape for the memory planner")
    student_shape: dict | None = field(None, help="student shape for the memory planner")
    zero_stage: int | None = field(None, help="ZeRO stage assumed by the memory planner")
    debug_exit_at_step: int | None = field(None, help="testing: exit abruptly (as if killed) after this step")

    def __post_init__(self) -> None:
        for name in ("seq_len", "max_steps", "micro_batch_size", "grad_accum", "eval_blocks", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "eval_every", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.mixed_precision not in ("no", "bf16", "fp16", "auto"):
            raise ConfigError(f"mixed_precision '{self.mixed_precision}' is unknown; use no, bf16, fp16 or auto")
        if self.tracker not in TRACKERS:
            raise ConfigError(f"tracker '{self.tracker}' is unknown; use one of {', '.join(TRACKERS)}")
        if self.resume is not None and self.overwrite:
            raise ConfigError("resume= and overwrite=true contradict each other; pick one")
        if self.teacher_cache and (self.hidden_weight > 0 or self.attn_weight > 0):
            raise ConfigError("teacher_cache holds logits only: set hidden_weight=0 and attn_weight=0 "
                              "(hidden/attention terms need the live teacher)")
        if self.student_init not in ("keep_layers", "prune"):  # issue 13
            raise ConfigError(f"student_init '{self.student_init}' is unknown; use keep_layers or prune")
        if self.student_init == "prune" and (self.target_params is None) == (self.target_ratio is None):
            raise ConfigError("student_init=prune needs exactly one of target_params= or target_ratio=")
        if self.target_ratio is not None and not 0 < self.target_ratio <= 1:
            raise ConfigError(f"target_ratio must be in (0, 1], got {self.target_ratio}")
        if self.prune_search_steps < 0 or min(self.prune_top_k, self.prune_calib_blocks, self.prune_eval_blocks,
                                              self.prune_max_candidates - 1) < 1:
            raise ConfigError("prune_search_steps must be >= 0, prune_top_k/calib_blocks/eval_blocks >= 1 and "
                              "prune_max_candidates >= 2")
        if self.student_init == "prune" and self.student:
            raise ConfigError("student= loads a ready student; drop it or set student_init=keep_layers")
        try:
            self.losses()
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def losses(self) -> LossConfig:
        return loss_config_from(self)


# --------------------------------------------------------------------------------------------
# Pieces of the loop that read better with a name
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(accelerator: Accelerator, student, teacher, blocks: torch.Tensor, batch_size: int,
             teacher_logits_cache: dict | None = None) -> tuple[LMStats, LMStats | None]:
    """Held-out stats of ``student`` (with agreement/KL to ``teacher``) and of ``teacher`` itself.

    Both come from one teacher pass; ``teacher_logits_cache`` keeps the teacher's logits between
    calls (the held-out set and the teacher never change) when they are small enough.
    """
    was = student.training
    student.eval()
    stats, teacher_stats = LMStats(), (LMStats() if teacher is not None else None)
    for i, batch in enumerate(eval_batches(blocks, batch_size, accelerator.process_index,
                                           accelerator.num_processes)):
        ids = batch["input_ids"].to(accelerator.device)
        logits = student(input_ids=ids).logits
        ref = None
        if teacher is not None:
            if teacher_logits_cache is not None and i in teacher_logits_cache:
                ref = teacher_logits_cache[i]
            else:
                ref = teacher(input_ids=ids).logits
                if teacher_logits_cache is not None and ref.numel() * 4 < 512 * 2**20:
                    teacher_logits_cache[i] = ref
            teacher_stats.add(batch_stats(ref, ids))
        stats.add(batch_stats(logits, ids, None, ref))
    student.train(was)
    return reduce_stats(accelerator, stats), (reduce_stats(accelerator, teacher_stats) if teacher_stats else None)


def save_student(accelerator: Accelerator, model: DistillModel, tokenizer, path: Path) -> None:
    """Write an HF directory of the student alone (no projectors, no teacher), atomically."""
    student = accelerator.unwrap_model(model).student
    state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards; keys start with "student."
    if accelerator.is_main_process:
        tmp = path.with_name(f".tmp-{path.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        sd = {k[len("student."):]: v for k, v in state.items() if k.startswith("student.")}
        student.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


# --------------------------------------------------------------------------------------------
# The training function
# --------------------------------------------------------------------------------------------

def training_function(cfg: DistillConfig, accelerator: Accelerator, known_init: dict | None = None) -> dict:
    """Train one student; ``known_init`` reuses held-out metrics already measured on the same pair."""
    out = Path(cfg.output_dir)
    main = accelerator.is_main_process
    set_seed(cfg.seed)

    # ---- models -------------------------------------------------------------------------
    from distill.sources import load_pair  # heavy imports after the config is known good

    teacher, student, tokenizer = load_pair(cfg)
    if cfg.seq_len > student.config.max_position_embeddings:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's maximum of "
                          f"{student.config.max_position_embeddings} positions; lower seq_len")
    if cfg.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.config.use_cache = False

    # ---- data ---------------------------------------------------------------------------
    global_batch = cfg.micro_batch_size * cfg.grad_accum * accelerator.num_processes
    data = build_data(tokenizer, dataset=cfg.dataset, eval_dataset=cfg.eval_dataset, seq_len=cfg.seq_len,
                      eval_blocks=cfg.eval_blocks, text_field=cfg.text_field, min_train_blocks=global_batch,
                      max_train_blocks=cfg.max_train_blocks)
    order = BlockOrder(data.train.shape[0], global_batch, cfg.seed)

    # ---- teacher–student module, optimizer, schedule -------------------------------------
    from distill.distributed import is_zero3, prepare_teacher

    loss_cfg = cfg.losses()
    if is_zero3(accelerator) and loss_cfg.kd_chunk_size is not None:
        logger.warning("ZeRO-3 keeps head weights only inside the head's forward: using full-logits KD",
                       main_process_only=True)
        loss_cfg = dataclasses.replace(loss_cfg, kd_chunk_size=None)
    cache = None
    if cfg.teacher_cache:
        from distill.teacher_cache import TeacherCache

        cache = TeacherCache(cfg.teacher_cache, data.train)
    model = DistillModel(student, None if cache else teacher, loss_cfg, tokenizer_size=len(tokenizer),
                         cached_teacher=cache is not None)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # no dataloader goes through prepare(), so DeepSpeed learns the batch here
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if teacher is not None:
        teacher = prepare_teacher(accelerator, teacher)
        if cache is None:
            accelerator.unwrap_model(model).set_teacher(teacher)

    # ---- resume -------------------------------------------------------------------------
    start_step, history, evals, init = 0, [], [], dict(known_init or {})
    if init:
        evals.append({"step": 0, "perplexity": init["student_ppl_init"], "top1_agreement": init["top1_agreement_init"],
                      "kl_to_teacher": None, "teacher_perplexity": init.get("teacher_ppl")})
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
        accelerator.init_trackers("hybrid-distill", config={k: v for k, v in dataclasses.asdict(cfg).items()
                                                            if isinstance(v, (int, float, str, bool))})

    unwrapped = accelerator.unwrap_model(model)
    teacher_logits: dict = {}
    if not init and cache is not None:
        init["teacher_ppl"] = cache.meta.get("teacher_ppl")
    if not init or "student_ppl_init" not in init:
        t0 = time.time()
        s, t = evaluate(accelerator, unwrapped.student, teacher, data.eval, cfg.micro_batch_size, teacher_logits)
        if t is not None:
            init["teacher_ppl"] = t.perplexity
        init.update(student_ppl_init=s.perplexity, top1_agreement_init=s.top1_agreement)
        evals.append({"step": 0, "perplexity": s.perplexity, "top1_agreement": s.top1_agreement,
                      "kl_to_teacher": s.kl, "teacher_perplexity": init.get("teacher_ppl")})
        if main:
            print(f"held-out perplexity: teacher {init.get('teacher_ppl', float('nan')):.2f}, "
                  f"student at init {s.perplexity:.2f} ({time.time() - t0:.0f}s)")

    # ---- loop ---------------------------------------------------------------------------
    def save_checkpoint(step: int) -> None:
        tmp = ckpt.tmp_dir(out, step)
        if main:  # every rank writes into it (DeepSpeed shards, RNG states): it must exist first
            tmp.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp), safe_serialization=False)
        accelerator.wait_for_everyone()  # every rank's shard is on disk before the rename
        if main:
            unwrapped.student.config.save_pretrained(tmp / "student")
            unwrapped.student.generation_config.save_pretrained(tmp / "student")
            tokenizer.save_pretrained(tmp / "student")
            save_config(cfg, tmp / "config.yaml")
            ckpt.finalize(out, step, {"step": step, "history": history, "evals": evals, "init": init},
                          cfg.keep_checkpoints)
        accelerator.wait_for_everyone()

    model.train()
    tokens_per_step = global_batch * cfg.seq_len
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not main, desc="distill", dynamic_ncols=True)
    t_start, trained_tokens = time.time(), 0
    for step in range(start_step, cfg.max_steps):
        sums: dict[str, float] = {}
        micro = order.micro_batches(data.train, step, accelerator.process_index, accelerator.num_processes,
                                    cfg.micro_batch_size)
        for index, blocks in micro:
            ids = blocks.to(accelerator.device)
            topk = cache.lookup(index, accelerator.device) if cache is not None else None
            with accelerator.accumulate(model):
                output = model(input_ids=ids, teacher_topk=topk)
                loss = output.loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            terms = output.terms()
            terms["loss"] = float(loss.detach())
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + v / cfg.grad_accum
        terms = {k: float(v) for k, v in zip(sums, accelerator.reduce(
            torch.tensor(list(sums.values()), device=accelerator.device), reduction="mean").tolist())}
        if not math.isfinite(terms["loss"]):
            last = ckpt.latest_checkpoint(out)
            raise ckpt.TrainingDiverged(
                f"loss became {terms['loss']} at step {step + 1}; the last good checkpoint is "
                f"{last or 'none'}: lower lr or enable clipping, then resume=latest")
        trained_tokens += tokens_per_step
        elapsed = time.time() - t_start
        history.append({"step": step + 1, "lr": scheduler.get_last_lr()[0], **terms})
        bar.update(1)
        bar.set_postfix({k: f"{v:.3g}" for k, v in terms.items() if v} | {"tok/s": f"{trained_tokens / elapsed:.0f}"})
        if cfg.tracker != "none" and (step + 1) % cfg.log_every == 0:
            accelerator.log(terms | {"lr": history[-1]["lr"]}, step=step + 1)
        done = step + 1 == cfg.max_steps
        if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or done:
            s, _ = evaluate(accelerator, unwrapped.student, teacher, data.eval, cfg.micro_batch_size,
                            teacher_logits)
            evals.append({"step": step + 1, "perplexity": s.perplexity, "top1_agreement": s.top1_agreement,
                          "kl_to_teacher": s.kl, "teacher_perplexity": init.get("teacher_ppl")})
            if cfg.tracker != "none":
                accelerator.log({"eval/perplexity": s.perplexity, "eval/top1": s.top1_agreement}, step=step + 1)
            if main:
                bar.write(f"step {step + 1}: held-out perplexity {s.perplexity:.2f}, "
                          f"top-1 agreement {s.top1_agreement:.3f}")
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or done:
            save_checkpoint(step + 1)
        if cfg.debug_exit_at_step is not None and step + 1 == cfg.debug_exit_at_step:
            os._exit(137)  # simulate a kill: no cleanup, no final save
    bar.close()
    tokens_per_s = trained_tokens / max(time.time() - t_start, 1e-9)

    # ---- save ---------------------------------------------------------------------------
    save_student(accelerator, model, tokenizer, out / "final")
    final_eval = evals[-1] if evals else {}
    summary = {
        "steps": cfg.max_steps,
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "final_terms": history[-1] if history else {},
        "tokens_per_s": tokens_per_s,
        "teacher_ppl": init.get("teacher_ppl"),
        "student_ppl_init": init.get("student_ppl_init"),
        "student_ppl_final": final_eval.get("perplexity"),
        "top1_agreement_init": init.get("top1_agreement_init"),
        "top1_agreement": final_eval.get("top1_agreement"),
        "kl_to_teacher": final_eval.get("kl_to_teacher"),
        "num_processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "loss_weights": {k: getattr(cfg, k) for k in ("kd_weight", "ce_weight", "focal_weight", "hidden_weight",
                                                      "attn_weight")},
        "tokens_seen": cfg.max_steps * tokens_per_step,
        "final_dir": str(out / "final"),
    }
    if main:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        plot_training(history, evals, out / "loss.png", title=f"{cfg.teacher} → student ({out.name})")
    accelerator.wait_for_everyone()
    if cfg.tracker != "none":
        accelerator.end_training()
    return summary


def print_summary(summary: dict, out: Path) -> None:
    def f(x):
        return "n/a" if x is None else f"{x:,.2f}"
    print("\n" + "=" * 72)
    print(f"run folder     {out}")
    print(f"student        {summary['final_dir']}   (load with AutoModelForCausalLM.from_pretrained)")
    print(f"plots/summary  {out / 'loss.png'}   {out / 'summary.json'}")
    print(f"held-out ppl   teacher {f(summary['teacher_ppl'])} | student init {f(summary['student_ppl_init'])} "
          f"| student final {f(summary['student_ppl_final'])}")
    if "ce_only_ppl_final" in summary:
        print(f"ablation       CE-only student, same steps: {f(summary['ce_only_ppl_final'])} "
              f"(distilled student is {summary['ppl_ratio_vs_ce_only']:.2f}× its perplexity)")
    print(f"agreement      top-1 with teacher {f(summary['top1_agreement'])} "
          f"(init {f(summary['top1_agreement_init'])})")
    print(f"throughput     {summary['tokens_per_s']:.0f} tokens/s over {summary['steps']} steps")
    if "gate" in summary:
        print(f"release gate   {summary['gate']['verdict']}   ({summary['gate']['report']})")
    print("=" * 72)


def main() -> None:
    cfg = parse_config(DistillConfig)
    out = check_output_dir(cfg)
    accelerator = make_accelerator(cfg, out)
    if cfg.overwrite and accelerator.is_main_process and out.exists():
        shutil.rmtree(out)
    accelerator.wait_for_everyone()
    summary = training_function(cfg, accelerator)

    if cfg.compare_ce_only:
        # The ablation: same student init, steps, data order and schedule; CE on the data only.
        base = dataclasses.replace(
            cfg, output_dir=str(out / "ce_only"), kd_weight=0.0, hidden_weight=0.0, attn_weight=0.0,
            focal_weight=0.0, ce_weight=1.0, compare_ce_only=False, gate=False, resume=None, overwrite=True,
            save_every=0, teacher_cache=None, debug_exit_at_step=None,
        )
        if accelerator.is_main_process:
            print("\nablation: training a CE-only student for the same steps")
        known = {k: summary[k] for k in ("teacher_ppl", "student_ppl_init", "top1_agreement_init")}
        ce = training_function(base, accelerator, known_init=known)
        summary["ce_only_ppl_final"] = ce["student_ppl_final"]
        summary["ce_only_top1_agreement"] = ce["top1_agreement"]
        summary["ppl_ratio_vs_ce_only"] = summary["student_ppl_final"] / ce["student_ppl_final"]
        summary["beats_ce_only"] = summary["student_ppl_final"] < ce["student_ppl_final"]
    summary["beats_init"] = (summary["student_ppl_final"] or math.inf) < (summary["student_ppl_init"] or 0)

    if cfg.gate and accelerator.is_main_process:
        from distill.sources import gate_against_teacher

        summary["gate"] = gate_against_teacher(cfg, out)
    if accelerator.is_main_process:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print_summary(summary, out)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    run_cli(main)
