"""Distill a frozen teacher into a smaller student.

    accelerate launch recipes/distill.py                                   # built-in SmolLM2 demo
    accelerate launch recipes/distill.py --config recipes/configs/NAME.yaml key=value ...
    accelerate launch --config_file launch/deepspeed_zero3.yaml recipes/distill.py --config ...

Reads top to bottom: config → data → models → loop → save. The config (every key, its meaning and
range) is ``distill.config.DistillConfig``; the losses, the teacher–student module, checkpoints and
data order live in ``distill/``; this file is the training loop.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

# Python puts a script's folder first on sys.path, and this folder holds distill.py, which would shadow
# the `distill` package: keep the folder off sys.path so imports come from the installed packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, set_seed

from core import checkpoint as ckpt
from core.config import ConfigError, run_cli
from core.models import enable_checkpointing, peek_config
from distill import on_policy
from distill.config import RESUME_SAFE, DistillConfig, check_sources
from distill.data import build_data, parse_sources, steps_for_tokens
from distill.distributed import configure_deepspeed, deepspeed_settings, is_fsdp, is_zero3, prepare_teacher
from distill.layers import LayerMapError, parse_layer_pairs
from distill.model import DistillModel, LossConfig, check_pair
from distill.prune import PRUNED_DIR, check_recipe_search
from distill.sources import load_pair, load_recipe_tokenizer
from distill.student import KEPT_KEY, parse_keep
from distill.teacher_cache import TeacherCache, check_meta, check_vocabulary, fingerprint, read_meta
from distill.training import (
    Run,
    check_gate_positions,
    check_resume,
    evaluate,
    finish_run,
    save_hf_dir,
    start_run,
    target_count,
    token_weights,
    train_step,
    warmup_cosine,
)

logger = get_logger(__name__)

# DistillModel calls the teacher's inner model and reads head weights outside the modules' forward, which
# FSDP2's per-module sharding does not allow; DeepSpeed ZeRO-3 is handled (distill/distributed.py).
NO_FSDP = ("recipes/distill.py does not run under FSDP; launch with launch/gpu_ddp.yaml (DDP) or "
           "launch/deepspeed_zero2.yaml / launch/deepspeed_zero3.yaml (DeepSpeed ZeRO-2/3)")


# --------------------------------------------------------------------------------------------
# Pieces of the recipe that read better with a name
# --------------------------------------------------------------------------------------------

def check_lengths(cfg: DistillConfig, config, role: str = "model") -> None:
    """seq_len within a model's positions (``config``: its config, read with or without its weights; ``role``: how
    the error names it); the config already keeps the on-policy prompt and continuation within seq_len."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the {role}'s maximum of {limit} positions; lower seq_len")


def check_before_loading(cfg: DistillConfig) -> None:
    """:func:`distill.config.check_sources`, a teacher cache's ``meta.json`` (:func:`check_cache`), a max_tokens or
    max_train_blocks that cannot fill one step, a pruning search's settings (:func:`distill.prune.check_recipe_search`),
    chat prompts from data without chat, then what the models' config.json files and the tokenizer can judge without
    the weights: the lengths (:func:`check_lengths`; with gate=true, the gate's windows), keep_layers against the
    teacher's depth, the pairing (:func:`check_pairing`), the tokenizer against the vocabularies (:func:`check_vocab`)
    and a cache's vocabulary and tokenizer. A source whose config cannot be read so (the demo teacher before its one-time conversion) is checked
    once it loads."""
    check_sources(cfg)
    check_cache(cfg)
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # every process of `accelerate launch` has it
    blocks = cfg.micro_batch_size * cfg.grad_accum * processes  # per optimizer step
    if cfg.max_tokens is not None and cfg.max_tokens < blocks * cfg.seq_len:  # rounded up to whole steps: below one
        raise ConfigError(f"max_tokens {cfg.max_tokens} is less than one optimizer step of {blocks * cfg.seq_len} "
                          f"tokens (micro_batch_size × grad_accum × {processes} process(es) × seq_len); raise "
                          "max_tokens or lower micro_batch_size/grad_accum")
    specs = parse_sources(cfg.datasets, cfg.dataset, streaming=cfg.streaming)
    if cfg.max_train_blocks is not None and not any(s.streaming for s in specs) and (
            len(specs) * cfg.max_train_blocks < blocks):  # each source capped: the data would fail after the models load
        raise ConfigError(f"max_train_blocks {cfg.max_train_blocks} leaves at most {len(specs) * cfg.max_train_blocks} "
                          f"training blocks but one step takes {blocks} (micro_batch_size × grad_accum × {processes} "
                          "process(es)); raise max_train_blocks or lower micro_batch_size/grad_accum")
    if not cfg.student and cfg.student_init == "prune" and cfg.resume is None:  # a resume reads its student back
        check_recipe_search(cfg)
    if cfg.on_policy_fraction > 0 and cfg.gen_prompts == "chat":  # prompts from data that has no chat
        on_policy.check_prompt_sources(parse_sources(cfg.datasets, cfg.dataset, text_field=cfg.text_field,
                                                     streaming=cfg.streaming))

    teacher = None if cfg.teacher_cache and cfg.student else peek_config(cfg.teacher)
    derived = not cfg.student  # a derived student keeps the teacher's positions
    student = teacher if derived else peek_config(cfg.student)
    if student is not None:
        check_lengths(cfg, student)
    if teacher is not None and not derived:  # the live teacher reads the same blocks (its targets past its context
        check_lengths(cfg, teacher, "teacher")  # would be from positions it never learned)
    if cfg.gate:  # the closing gate scores the student and the teacher on its windows (a cached run's teacher too)
        gate_teacher = peek_config(cfg.teacher) if teacher is None else teacher
        for role, config in (("teacher", gate_teacher), ("student", student)):  # a derived student: the teacher's
            check_gate_positions(cfg.gate, getattr(config, "max_position_embeddings", None), role)
    kept = None
    if derived and cfg.student_init == "keep_layers" and teacher is not None:
        try:
            kept = parse_keep(cfg.keep_layers, teacher.num_hidden_layers)
        except ValueError as err:
            raise ConfigError(f"{err} (keep_layers)") from None
    if teacher is not None and not cfg.teacher_cache and (kept is not None or (student is not None and not derived)):
        check_pairing(cfg, teacher, student, kept)
    tokenizer = None
    if cfg.tokenizer and (teacher is not None or student is not None):  # another model's tokenizer
        tokenizer = load_recipe_tokenizer(cfg.student if cfg.teacher_cache and cfg.student else cfg.teacher,
                                          cfg.tokenizer)
        check_vocab(len(tokenizer), {"teacher": teacher, "student": student})
    if cfg.teacher_cache and student is not None:  # the cache's vocabulary and tokenizer: the run's?
        tokenizer = tokenizer or load_recipe_tokenizer(cfg.student or cfg.teacher, cfg.tokenizer)
        check_vocabulary(read_meta(cfg.teacher_cache), cfg.teacher_cache, vocab_size=student.vocab_size,
                         tokenizer=tokenizer)


def check_vocab(tokenizer_size: int, configs: dict) -> None:
    """Token ids index each model's embedding (``configs``: role → config, or None where not known): a tokenizer of
    more tokens than a vocabulary fails at the first forward (IndexError; a device-side assert on a GPU)."""
    for role, config in configs.items():
        vocab = getattr(config, "vocab_size", None)
        if vocab is not None and tokenizer_size > vocab:
            raise ConfigError(f"the tokenizer has {tokenizer_size} tokens but the {role}'s vocabulary has {vocab}; "
                              f"set tokenizer= to one of the {role}'s size (or leave it empty for the teacher's own)")


def check_pairing(cfg: DistillConfig, teacher, student, kept: list[int] | None) -> None:
    """What :class:`~distill.model.DistillModel` judges of a live teacher and its student, from their configs
    (``kept``: the teacher layers a keep_layers student keeps; None: ``student`` is given): one vocabulary
    (:func:`~distill.model.check_pair`) and ``hidden_layers`` / ``attn_layers`` pairs within both models."""
    if kept is None:
        with warnings.catch_warnings():  # padding rows: warned once, when the models are paired
            warnings.simplefilter("ignore")
            size = (len(load_recipe_tokenizer(cfg.teacher, cfg.tokenizer))
                    if student.vocab_size != teacher.vocab_size else None)
            check_pair(SimpleNamespace(config=student), SimpleNamespace(config=teacher), size)
        n_student, kept = student.num_hidden_layers, getattr(student, KEPT_KEY, None)
    else:
        n_student = len(kept)
    for key, weight, spec in (("hidden_layers", cfg.hidden_weight, cfg.hidden_layers),
                              ("attn_layers", cfg.attn_weight, cfg.attn_layers)):
        if weight > 0:
            try:
                parse_layer_pairs(spec, n_student, teacher.num_hidden_layers, kept)
            except LayerMapError as err:
                raise LayerMapError(f"{err} ({key})") from None


def check_cache(cfg: DistillConfig) -> None:
    """A ``teacher_cache`` that is no cache, or one of another mode, temperature, divergence or seq_len: refused
    from its ``meta.json`` alone, before the run folder is claimed (``overwrite=true`` would have removed the old
    run) and before any model loads."""
    if cfg.teacher_cache:
        check_meta(read_meta(cfg.teacher_cache), cfg.teacher_cache, temperature=cfg.temperature, kd_kind=cfg.kd_kind,
                   seq_len=cfg.seq_len)


def load_models(cfg: DistillConfig):
    """``(teacher or None, student, tokenizer)``: the pair, the student ready to train."""
    check_cache(cfg)  # already checked before the run folder was claimed; cheap, and load_models stands alone
    teacher, student, tokenizer = load_pair(cfg)
    check_lengths(cfg, student.config)  # for a source check_before_loading could not read without loading it
    if teacher is not None:
        check_lengths(cfg, teacher.config, "teacher")
    check_vocab(len(tokenizer), {"teacher": getattr(teacher, "config", None), "student": student.config})
    if cfg.gradient_checkpointing:
        enable_checkpointing(student, use_reentrant=False)
    student.config.use_cache = False
    return teacher, student, tokenizer


def losses_for(cfg: DistillConfig, accelerator: Accelerator) -> LossConfig:
    """The loss settings of the config, with full-logits KD under ZeRO-3."""
    loss_cfg = cfg.losses()
    if is_zero3(accelerator) and loss_cfg.kd_chunk_size is not None:
        logger.warning("ZeRO-3 keeps head weights only inside the head's forward: using full-logits KD",
                       main_process_only=True)
        loss_cfg = dataclasses.replace(loss_cfg, kd_chunk_size=None)
    return loss_cfg


# --------------------------------------------------------------------------------------------
# The training function
# --------------------------------------------------------------------------------------------

def cached_teacher(cfg: DistillConfig, accelerator: Accelerator, data, student, tokenizer) -> TeacherCache | None:
    """The teacher's cached targets for ``data.train``, checked against the student and the training blocks; None
    without a cache, or at ``kd_weight=0`` (the CE-only ablation of a cached run reads nothing from it, and needs
    no teacher either)."""
    if not (cfg.teacher_cache and cfg.kd_weight):
        return None
    return TeacherCache(cfg.teacher_cache, data.train, vocab_size=student.config.vocab_size, tokenizer=tokenizer,
                        temperature=cfg.temperature,  # hashed once meta.json's block count and the rest agree
                        data_fingerprint=lambda: shared_fingerprint(accelerator, data.train))


def shared_fingerprint(accelerator: Accelerator, blocks) -> str:
    """:func:`distill.teacher_cache.fingerprint` of the training blocks ``[n, seq]``, hashed by the main process
    only and sent to the others: every rank holds the same blocks, and reading a corpus of billions of tokens
    once per rank would multiply the start-up time and the disk traffic by the world size."""
    return broadcast_object_list([fingerprint(blocks) if accelerator.is_main_process else None])[0]


def step_weights(accelerator: Accelerator, data, micro: list, policy, step: int, grad_accum: int) -> list[float]:
    """Each micro-batch's loss weight: a step is a mean over its data tokens, whatever each micro-batch's share
    of completion-only targets (:func:`distill.training.token_weights`); on-policy micro-batches weigh 1."""
    return token_weights(accelerator, [
        None if policy is not None and policy.wants(step, j, grad_accum)
        else target_count(data.train.loss_mask(index), tuple(blocks.shape)) for j, (index, blocks) in micro])


def training_function(cfg: DistillConfig, accelerator: Accelerator, known_init: dict | None = None) -> dict:
    """Train one student; ``known_init`` reuses held-out metrics already measured on the same pair."""
    if is_fsdp(accelerator):
        raise ConfigError(NO_FSDP)
    main = accelerator.is_main_process
    set_seed(cfg.seed)
    run = Run(cfg, accelerator, tracker_project="hybrid-distill", progress="distill")

    # ---- models -------------------------------------------------------------------------
    teacher, student, tokenizer = load_models(cfg)

    # ---- data ---------------------------------------------------------------------------
    global_batch = cfg.micro_batch_size * cfg.grad_accum * accelerator.num_processes
    if cfg.max_tokens:  # a token budget sets the step count
        cfg.max_steps = steps_for_tokens(cfg.max_tokens, global_batch, cfg.seq_len)
    with accelerator.main_process_first():  # one process prepares, the others map the cache
        data = build_data(tokenizer, **cfg.data_args(), seq_len=cfg.seq_len, eval_blocks=cfg.eval_blocks,
                          min_train_blocks=global_batch, progress=main)
    order = data.order(global_batch, cfg.seed)

    # ---- teacher–student module, optimizer, schedule -------------------------------------
    loss_cfg = losses_for(cfg, accelerator)
    cache = cached_teacher(cfg, accelerator, data, student, tokenizer)
    model = DistillModel(student, None if cache else teacher, loss_cfg, tokenizer_size=len(tokenizer),
                         cached_teacher=cache is not None, cached_vocab=cache and cache.meta.get("vocab_size"))
    configure_deepspeed(accelerator, cfg.micro_batch_size, cfg.max_grad_norm)  # micro batch, clipping; no-op without
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if teacher is not None:
        teacher = prepare_teacher(accelerator, teacher)
        if cache is None:
            accelerator.unwrap_model(model).set_teacher(teacher)
    unwrapped = accelerator.unwrap_model(model)
    policy = on_policy.build(cfg, accelerator, model, tokenizer)  # rollouts: serve's engine over the live student

    # ---- resume, then held-out metrics at init -------------------------------------------
    state = run.resume()
    if policy is not None:  # rollout rows queued at the checkpoint, on this rank
        policy.load_state_dict(run.rank_state())
    run.begin()
    if not state.init:
        state.init = initial_metrics(cfg, accelerator, run, unwrapped.student, teacher, data.eval, cache, known_init,
                                     heldout_mask=data.eval_mask)

    def forward(micro):
        j, (index, blocks) = micro
        if policy is not None and policy.wants(step, j, cfg.grad_accum):  # on-policy micro-batch (step: the loop's)
            return policy.forward(blocks, step, j, accelerator.device)
        topk = cache.lookup(index, accelerator.device) if cache is not None else None
        loss_mask = data.train.loss_mask(index)  # completion-only chat targets (None: every token)
        return model(input_ids=blocks.to(accelerator.device), teacher_topk=topk,
                     loss_mask=None if loss_mask is None else loss_mask.to(accelerator.device))

    def write_student_files(folder: Path) -> None:  # what export needs to rebuild the student
        unwrapped.student.config.save_pretrained(folder / "student")
        unwrapped.student.generation_config.save_pretrained(folder / "student")
        tokenizer.save_pretrained(folder / "student")

    # ---- loop ---------------------------------------------------------------------------
    model.train()
    for step in run.steps():
        micro = list(enumerate(order.micro_batches(data.train, step, accelerator.process_index,
                                                   accelerator.num_processes, cfg.micro_batch_size)))
        weights = step_weights(accelerator, data, micro, policy, step, cfg.grad_accum)
        terms = train_step(accelerator, model, optimizer, scheduler, params, micro, forward,
                           grad_accum=cfg.grad_accum, max_grad_norm=cfg.max_grad_norm, weights=weights)
        if policy is not None:  # rollout tokens/s and share of time generating so far (this rank, this step included)
            terms |= policy.stats(run.loop_seconds_now())
        run.record(step, terms, scheduler.get_last_lr()[0], tokens=global_batch * cfg.seq_len)
        if run.due(step, cfg.eval_every) or run.last(step):
            s, _ = evaluate(accelerator, unwrapped.student, data.eval, cfg.micro_batch_size,
                            reference=None if cache else teacher, mask=data.eval_mask, progress="held-out")
            state.evals.append({"step": step + 1, "perplexity": s.perplexity, "top1_agreement": s.top1_agreement,
                                "kl_to_teacher": s.kl, "teacher_perplexity": state.init.get("teacher_ppl")})
            if cfg.tracker != "none":
                accelerator.log({"eval/perplexity": s.perplexity, "eval/top1": s.top1_agreement}, step=step + 1)
            run.write(f"step {step + 1}: held-out perplexity {s.perplexity:.2f}, "
                      f"top-1 agreement {s.top1_agreement:.3f}")
        if run.due(step, cfg.save_every) or run.last(step):
            run.save_checkpoint(step + 1, write_student_files, policy.state_dict if policy is not None else None,
                                weights=model.named_parameters())  # a run stops before saving NaN/inf weights
        run.maybe_exit(step)

    # ---- save ---------------------------------------------------------------------------
    full_state = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards; keys start with "student."
    save_hf_dir(accelerator, unwrapped.student, tokenizer, Path(cfg.output_dir) / "final",
                state_dict={k[len("student."):]: v for k, v in full_state.items() if k.startswith("student.")}
                if main else None)
    del full_state
    summary = build_summary(cfg, accelerator, run, tokens_per_step=global_batch * cfg.seq_len)
    summary["data"] = data.summary(order, cfg.max_steps)  # per source: weight, blocks, epochs
    if (engine := deepspeed_settings(accelerator, model)) is not None:  # what the engine trained with (stage, clipping, ...)
        summary["deepspeed"] = engine
    if policy is not None:
        summary["on_policy"] = policy.stats(run.loop_seconds)
    run.write_records(summary, title=f"{cfg.teacher} → student ({Path(cfg.output_dir).name})")
    return summary


def initial_metrics(cfg: DistillConfig, accelerator: Accelerator, run: Run, student, teacher, heldout: torch.Tensor,
                    cache: TeacherCache | None, known: dict | None, heldout_mask: torch.Tensor | None = None) -> dict:
    """Held-out perplexity of teacher and student before training (reused from ``known`` when given).

    ``heldout_mask``: completion-only targets of chat data (only those count, as in training).
    """
    if known:
        init = dict(known)
        kl = None
    else:
        s, t = evaluate(accelerator, student, heldout, cfg.micro_batch_size, reference=teacher, mask=heldout_mask,
                        progress="held-out, before training")
        teacher_ppl = t.perplexity if t is not None else (cache.meta.get("teacher_ppl") if cache else None)
        init = {"teacher_ppl": teacher_ppl, "student_ppl_init": s.perplexity, "top1_agreement_init": s.top1_agreement}
        kl = s.kl
        run.write(f"held-out perplexity: teacher {teacher_ppl or float('nan'):.2f}, student at init {s.perplexity:.2f}")
    run.state.evals.append({"step": 0, "perplexity": init["student_ppl_init"], "top1_agreement": init["top1_agreement_init"],
                            "kl_to_teacher": kl, "teacher_perplexity": init.get("teacher_ppl")})
    return init


def build_summary(cfg: DistillConfig, accelerator: Accelerator, run: Run, tokens_per_step: int) -> dict:
    """What ``summary.json`` records of a finished run (``tokens_per_s`` is the loop's own)."""
    state = run.state
    final_eval, init, history = state.evals[-1], state.init, state.history
    return {
        "steps": cfg.max_steps,
        "final_loss": history[-1]["loss"] if history else float("nan"),
        "final_terms": history[-1] if history else {},
        "tokens_per_s": run.tokens_per_s,
        **run.timing(),  # loop_s (training steps only), wall_s, threads, peak_rss_gb per phase
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
        "final_dir": str(Path(cfg.output_dir) / "final"),
        "environment": state.environment,  # versions, commit, device: what makes the run reproducible
    }


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
    for name, d in summary.get("data", {}).items():
        print(f"data           {name}: weight {d['weight']:g}, {d['train_blocks']} blocks, "
              f"{'streamed' if d['epochs'] is None else format(d['epochs'], '.2f') + ' epochs'}")
    if (gate := summary.get("gate")) is not None:  # a gate that could not run has its error in place of a report
        print(f"release gate   {gate['verdict']}   ({gate['report'] or gate.get('error')})")
    print("=" * 72)


def ablation_exit_at_step(cfg: DistillConfig) -> int | None:
    """Testing: ``debug_exit_at_step`` past ``max_steps`` kills the CE-only ablation after its step
    ``debug_exit_at_step - max_steps`` (the two runs' steps counted as one sequence); up to ``max_steps`` it kills
    the distillation run only (:meth:`distill.training.Run.maybe_exit`)."""
    exit_at = cfg.debug_exit_at_step
    return exit_at - cfg.max_steps if exit_at is not None and exit_at > cfg.max_steps else None


def resume_ablation(cfg: DistillConfig, base: DistillConfig, accelerator: Accelerator) -> DistillConfig:
    """The CE-only ablation's config ``base``, set to resume from ``ce_only/``'s latest checkpoint when the run
    itself was resumed (a fresh run replaced the whole folder: its ablation starts fresh).

    The checkpoint's config is checked as the run's is (:func:`distill.training.check_resume`). The run's own
    check has already refused any change the user made, so an ablation checkpoint that differs was written with
    other derived settings (another student source, an older toolkit) and cannot give this run's ablation:
    ``ce_only/`` is removed and the ablation starts over, saying why in one line. So is one that an older
    toolkit wrote beside the distilled student (``model_1``: the accelerator still held the first run's model).
    """
    folder = Path(base.output_dir)
    last = ckpt.latest_checkpoint(folder) if cfg.resume is not None else None
    if last is None:
        return base
    resumed = dataclasses.replace(base, resume=str(last), overwrite=False)
    if any(p.name.startswith(("model_1", "pytorch_model_1")) for p in last.iterdir()):
        # Written beside the distilled student (an older toolkit kept it in the accelerator): its first model
        # is the distilled one, which a resume would load into the CE-only student.
        why = "it holds the distilled student's weights too"
    else:
        try:
            check_resume(resumed, folder, RESUME_SAFE)
            return resumed
        except ConfigError as err:
            why = str(err).split("; ")[0]
    accelerator.wait_for_everyone()  # every rank has decided before the folder goes
    if accelerator.is_main_process:
        print(f"ablation: not resuming {last}, written with other settings ({why}); the CE-only student starts over")
        shutil.rmtree(folder)
    accelerator.wait_for_everyone()
    return base


def main(argv: list[str] | None = None) -> None:
    # check_before_loading: missing local model and data paths, and the lengths and layers the models' config.json
    # can judge, are refused before the run folder is claimed and before the teacher loads.
    cfg, accelerator, out = start_run(DistillConfig, argv, resume_safe=RESUME_SAFE, without_fsdp=NO_FSDP,
                                      check=check_before_loading)
    summary = training_function(cfg, accelerator)

    if cfg.compare_ce_only:
        # The ablation: same student init, steps, data order and schedule; CE on the data only. It keeps the
        # run's teacher_cache, so that a cached run with a student never loads the teacher (nor needs it). A searched
        # student is the one the fresh run saved (a resumed run searched nothing, and must not search again).
        # It checkpoints like the run (save_every, keep_checkpoints) into ce_only/, and a resumed run resumes it.
        searched = not cfg.student and cfg.student_init == "prune" and (out / PRUNED_DIR).is_dir()
        base = dataclasses.replace(
            cfg, output_dir=str(out / "ce_only"), kd_weight=0.0, hidden_weight=0.0, attn_weight=0.0,
            focal_weight=0.0, ce_weight=1.0, compare_ce_only=False, gate=False, resume=None, overwrite=True,
            debug_exit_at_step=ablation_exit_at_step(cfg), on_policy_fraction=0.0,
            student=str(out / PRUNED_DIR) if searched else cfg.student,
        )
        # A fresh start for the accelerator: it holds the distilled run's model, optimizer and scheduler (memory,
        # and every ablation checkpoint would save them too), and under DeepSpeed its first engine, which
        # accelerator.backward would keep stepping while the ablation's optimizer did nothing.
        accelerator.free_memory()
        base = resume_ablation(cfg, base, accelerator)
        if accelerator.is_main_process:
            print("\nablation: training a CE-only student for the same steps")
        known = {k: summary[k] for k in ("teacher_ppl", "student_ppl_init", "top1_agreement_init")}
        ce = training_function(base, accelerator, known_init=known)
        summary["ce_only_ppl_final"] = ce["student_ppl_final"]
        summary["ce_only_top1_agreement"] = ce["top1_agreement"]
        summary["ppl_ratio_vs_ce_only"] = summary["student_ppl_final"] / ce["student_ppl_final"]
        summary["beats_ce_only"] = summary["student_ppl_final"] < ce["student_ppl_final"]
    summary["beats_init"] = (summary["student_ppl_final"] or math.inf) < (summary["student_ppl_init"] or 0)
    finish_run(cfg, accelerator, out, summary, print_summary)


if __name__ == "__main__":
    run_cli(main)
