"""The distill recipe's configuration: one typed dataclass, every key with its meaning and range.

It lives in the library (not in ``recipes/distill.py``) because two programs read it: the recipe,
and the memory planner (``python -m distill.plan``), which must accept exactly the recipe's keys with
the recipe's defaults. ``python recipes/distill.py --help`` lists every key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import ConfigError, check_fields, check_output_dir, field
from core.models import SMOLLM2, ModelSourceError, resolve_model_path
from core.tiny import TINY
from distill import on_policy
from distill.data import BUILTIN, DataError, parse_sources
from distill.data.text import local_files
from distill.model import HIDDEN_KINDS, KD_KINDS, LossConfig
from distill.training import PRECISIONS, TRACKERS, check_gate_prompts

# Keys a resume may change (core.config.check_resume_config): cadence, logging and where outputs go;
# max_steps may only grow. Anything else would make the finished model match neither config.
RESUME_SAFE = ("eval_every", "log_every", "save_every", "keep_checkpoints", "tracker", "output_dir", "resume",
               "overwrite", "debug_exit_at_step", "gate", "gate_prompts", "gradient_checkpointing",
               "compare_ce_only", "teacher_shape", "student_shape", "zero_stage", "offload", "threads",
               # the global batch they make with the processes is checked on resume (check_resume_world)
               "micro_batch_size", "grad_accum")


@dataclass
class DistillConfig:
    # models
    teacher: str = field("smollm2-135m-instruct", help="teacher: an HF directory, a hub name, "
                         "'smollm2-135m-instruct' (built-in demo, offline) or 'tiny-random' (tests)")
    student: str | None = field(None, help="student HF directory/hub name; empty: derive from the teacher")
    keep_layers: str = field("0-3,24-29", help="student_init=keep_layers: how many teacher layers to keep ('10', "
                             "spread evenly) or which ('0-5,26-29')")
    student_init: str = field("prune", choices=("prune", "keep_layers"), help="how a student is derived when "
                              "student is empty: prune (importance pruning + a short-distill search at "
                              "target_params/target_ratio, distill/prune.py) | keep_layers (the teacher layers "
                              "in keep_layers)")
    target_params: float | None = field(None, gt=0, help="student_init=prune: budget in non-embedding parameters")
    target_ratio: float | None = field(None, gt=0, le=1, help="student_init=prune: budget as a fraction of the "
                                       "teacher's non-embedding parameters; with neither budget given, a third "
                                       "(the size of 10 of the demo teacher's 30 layers)")
    prune_axes: str = field("depth,mlp,heads,hidden", help="student_init=prune: what may be cut")
    prune_search_steps: int = field(4, ge=0, help="student_init=prune: short-distill steps per top candidate")
    prune_top_k: int = field(2, ge=1, help="student_init=prune: candidates short-distilled before picking the winner")
    prune_calib_blocks: int = field(8, ge=1, help="student_init=prune: training blocks for the importance scores")
    prune_eval_blocks: int = field(4, ge=1, help="student_init=prune: held-out blocks that rank candidates, the "
                                   "ones after the eval_blocks the run reports (the held-out text needs both)")
    prune_max_candidates: int = field(16, ge=2, help="student_init=prune: architectures ranked at init (evenly "
                                      "spaced)")
    prune_block_score: str = field("bi", choices=("bi", "loss"), help="student_init=prune: score blocks by block "
                                   "influence (one pass) or by the loss increase when each is skipped (one per layer)")
    tokenizer: str | None = field(None, help="tokenizer source; default: the teacher's")
    # data
    dataset: str = field(BUILTIN, help="training text: 'builtin:stdlib-docs' (offline default), a local "
                         ".jsonl/.txt/.parquet file or folder, or a hub dataset name")
    eval_dataset: str | None = field(None, help="held-out text; default: a held-out split of dataset")
    text_field: str = field("text", help="column holding the text (records with 'messages' use the chat template)")
    seq_len: int = field(256, ge=2, help="tokens per packed training block")
    max_train_blocks: int | None = field(None, ge=1, help="use only the first N packed training blocks")
    eval_blocks: int = field(16, ge=1, help="held-out blocks used for perplexity/agreement")
    datasets: list | None = field(None, help="weighted mixture, overrides dataset: [{source: PATH_OR_NAME, "
                                  "weight: 0.7, text_field: text}, ...]; prepared once into data_cache")
    completion_only: bool = field(True, help="chat records: KD/CE/hidden terms only on assistant tokens")
    streaming: bool = field(False, help="read the sources on the fly instead of preparing them (or per entry: "
                            "datasets: [{source: ..., streaming: true}]; resume re-reads each stream up to the "
                            "step; see distill/data/stream.py)")
    data_cache: str | None = field(None, help="prepared-data folder; default $HYBRID_DISTILL_CACHE/data")
    max_tokens: int | None = field(None, ge=1, help="train on this many tokens (sets max_steps from the global "
                                   "batch)")
    # loop
    max_steps: int = field(24, ge=1, help="optimizer steps")
    micro_batch_size: int = field(4, ge=1, help="blocks per forward on each process")
    grad_accum: int = field(1, ge=1, help="micro-batches per optimizer step")
    lr: float = field(1e-3, gt=0, help="peak learning rate (AdamW)")
    min_lr_ratio: float = field(0.1, ge=0, le=1, help="cosine schedule ends at lr * min_lr_ratio")
    warmup_steps: int = field(4, ge=0, help="linear warmup steps")
    weight_decay: float = field(0.0, ge=0, help="AdamW weight decay")
    max_grad_norm: float = field(1.0, ge=0, help="gradient clipping (0 disables)")
    mixed_precision: str = field("auto", help="no | bf16 | fp16 | auto (bf16 on GPUs that support it, fp32 on "
                                 "CPU where bf16 matmul is slower)", choices=PRECISIONS)
    gradient_checkpointing: bool = field(False, help="recompute student activations in backward to save memory")
    threads: int = field(0, ge=0, help="CPU intra-op threads per process; 0 = the cores available / local "
                         "processes, unless OMP_NUM_THREADS was set by you (distill/threads.py)")
    seed: int = field(0, ge=0, le=2**32 - 1, help="seed for init, data order and sampling")
    # loss terms (weight 0 switches a term off)
    kd_weight: float = field(1.0, ge=0, help="logits KD term weight")
    kd_kind: str = field("forward_kl", choices=KD_KINDS, help=f"divergence: {', '.join(KD_KINDS)}")
    temperature: float = field(1.0, gt=0, help="KD temperature T (the term is scaled by T²)")
    beta: float = field(0.5, ge=0, le=1, help="JSD interpolation (0 = forward KL, 1 = reverse KL); skew_kl / "
                        "skew_reverse_kl: the share alpha of the divergence's first distribution in the mixture "
                        "(DistiLLM: 0.1)")
    kd_chunk_size: int | None = field(1024, ge=1,
                                      help="tokens per chunk of the fused KD loss; empty = full logits")
    ce_weight: float = field(1.0, ge=0, help="cross-entropy on the data term weight")
    focal_weight: float = field(0.0, ge=0, help="focal CE term weight (long-tail tokens)")
    focal_alpha: float = field(0.25, ge=0, le=1, help="focal alpha")
    focal_gamma: float = field(2.0, ge=0, help="focal gamma")
    hidden_weight: float = field(0.2, ge=0, help="hidden-state term weight")
    hidden_layers: list[str] = field(default_factory=lambda: ["derived"], help="layer pairs 's:t', "
                                     "'relative' or 'derived' (a derived student's replaced spans)")
    hidden_kind: str = field("nmse", help="hidden-state distance: nmse (per-token MSE / teacher mean square, scale-free) "
                             "| mse | cosine", choices=HIDDEN_KINDS)
    attn_weight: float = field(0.0, ge=0, help="attention-map term weight")
    attn_layers: list[str] = field(default_factory=list, help="layer pairs for the attention-map term")
    attn_num_queries: int = field(64, ge=1,
                                  help="query positions sampled per sequence for the attention-map term")
    teacher_cache: str | None = field(None, help="folder written by recipes/cache_teacher.py: train from cached "
                                      "teacher targets (top-k or sampled) without loading the teacher")
    # on-policy distillation (distill/on_policy.py)
    on_policy_fraction: float = field(0.0, ge=0, le=1, help="share of micro-batches whose continuations the "
                                      "student generates (with serve's engine) from prompts; loss on the generated "
                                      "tokens only")
    gen_max_new_tokens: int = field(64, ge=1, help="on-policy: tokens generated per prompt")
    gen_temperature: float = field(1.0, ge=0, help="on-policy: sampling temperature of the rollouts (0 = greedy)")
    gen_prompt_tokens: int = field(64, ge=1, help="on-policy: prompt length (prefix of each block) or, with "
                                   "gen_prompts=chat, the longest user-turn prompt used")
    gen_kd_kind: str | None = field(None, choices=KD_KINDS, help="on-policy: divergence on the rollouts (default: "
                                    "kd_kind); reverse_kl is what GKD / MiniLLM use on the student's own samples")
    gen_batch_size: int = field(0, ge=0, help="on-policy: prompts rolled out per on-policy micro-batch (0: "
                                "micro_batch_size); fewer make an on-policy step cheaper, so it costs fewer data steps")
    gen_rollout_rows: int = field(0, ge=0, help="on-policy: rows decoded per engine call (0: gen_batch_size); a "
                                  "multiple of gen_batch_size up to micro_batch_size, the surplus queued for the next "
                                  "on-policy micro-batches (cheaper per row, slightly stale)")
    gen_prompts: str = field("prefix", choices=("prefix", "chat"), help="on-policy prompts: prefix (the start of "
                             "each training block) | chat (the first user turn of each chat record in dataset)")
    gen_prompt_pool: int = field(16384, ge=1, help="on-policy, gen_prompts=chat: at most this many records (a "
                                 "seeded sample, the same on every rank) are tokenized into the prompt pool, so a "
                                 "large chat set costs bounded start time and memory")
    # eval, logging, outputs
    eval_every: int = field(12, ge=0, help="held-out evaluation every N steps (0: only at start and end)")
    log_every: int = field(1, ge=1, help="tracker logging every N steps")
    tracker: str = field("none", choices=TRACKERS,
                         help="none | tensorboard | wandb (WANDB_MODE=offline works)")
    output_dir: str = field("runs/smollm2-demo", help="run folder: checkpoints/, final/, summary.json, loss.png, metrics.jsonl")
    overwrite: bool = field(False, help="replace an existing run in output_dir")
    resume: str | None = field(None, help="'latest' or a checkpoint folder to continue from")
    save_every: int = field(500, ge=0, help="checkpoint every N steps (0: only at the end, so a killed run has "
                                            "nothing to resume from)")
    keep_checkpoints: int = field(2, ge=1, help="complete checkpoints kept on disk")
    compare_ce_only: bool = field(True, help="also train a CE-only student for the same steps and report both")
    gate: bool = field(False, help="run the release gate (eval.gate) against the teacher at the end")
    gate_prompts: int = field(100, ge=1, help="prompts from the bundled set used by the gate")
    # planner inputs (python -m distill.plan); not used by the loop
    teacher_shape: dict | None = field(None, help="teacher shape for the memory planner")
    student_shape: dict | None = field(None, help="student shape for the memory planner")
    zero_stage: int | None = field(None, choices=(0, 1, 2, 3),
                                   help="ZeRO stage assumed by the memory planner")
    offload: str = field("none", choices=("none", "optimizer", "all"),
                         help="DeepSpeed offload assumed by the memory planner (none | optimizer | all)")
    debug_exit_at_step: int | None = field(None, ge=1,
                                           help="testing: exit abruptly (as if killed) after this step; past "
                                                "max_steps, after step N - max_steps of the CE-only ablation")

    def __post_init__(self) -> None:
        check_fields(self)  # every field's range/choices, declared above (core.config.field)
        if self.target_params is not None and self.target_ratio is not None:
            raise ConfigError("give one budget: target_params= or target_ratio=, not both")
        specs = parse_sources(self.datasets) if self.datasets else []  # checked before any model loads
        if self.teacher_cache and (self.streaming or any(s.streaming for s in specs)):
            raise ConfigError("teacher_cache indexes prepared blocks, and a streamed source has none: set "
                              "streaming=false (prepare the data: python -m distill.data prepare)")
        if self.max_train_blocks is not None and (all(s.streaming or self.streaming for s in specs) if specs
                                                  else self.streaming):
            raise ConfigError("max_train_blocks caps prepared data, and a stream has no blocks to cap (it is read "
                              "until it runs out, then again): drop max_train_blocks, or set streaming=false")
        if self.resume is not None and self.overwrite:
            raise ConfigError("resume= and overwrite=true contradict each other; pick one")
        check_gate_prompts(self.gate, self.gate_prompts)  # else fewer silently, or a run whose gate cannot decide
        if self.teacher_cache and (self.hidden_weight > 0 or self.attn_weight > 0):
            raise ConfigError("teacher_cache holds logits only: set hidden_weight=0 and attn_weight=0 "
                              "(hidden/attention terms need the live teacher)")
        try:
            self.losses()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        on_policy.settings_from(self).check(self.seq_len, kd_weight=self.kd_weight,
                                            cached_teacher=bool(self.teacher_cache),
                                            micro_batch_size=self.micro_batch_size)

    def data_args(self) -> dict:
        """The config's data keys for :func:`~distill.data.build_data`: the recipe and prune's calibration read the same data."""
        return {"dataset": self.dataset, "datasets": self.datasets, "eval_dataset": self.eval_dataset,
                "text_field": self.text_field, "max_train_blocks": self.max_train_blocks,
                "completion_only": self.completion_only, "streaming": self.streaming, "data_cache": self.data_cache}

    def losses(self) -> LossConfig:
        return LossConfig(
            kd_weight=self.kd_weight, kd_kind=self.kd_kind, temperature=self.temperature, beta=self.beta,
            kd_chunk_size=self.kd_chunk_size, ce_weight=self.ce_weight, focal_weight=self.focal_weight,
            focal_alpha=self.focal_alpha, focal_gamma=self.focal_gamma, hidden_weight=self.hidden_weight,
            hidden_layers=self.hidden_layers, hidden_kind=self.hidden_kind, attn_weight=self.attn_weight,
            attn_layers=self.attn_layers, attn_num_queries=self.attn_num_queries)


# --------------------------------------------------------------------------------------------
# Sources that are local paths must exist: checked before a run folder is claimed or a model loads
# --------------------------------------------------------------------------------------------

def check_model_source(name: str, key: str) -> None:
    """A one-line :class:`ModelSourceError` naming ``key`` when ``name`` is a local model path that does not exist
    or is not an HF model directory (the loader's own rule, ``core.models.resolve_model_path``, without loading).

    Built-in names (``tiny-random``, ``smollm2-135m-instruct``) and hub names pass: offline, a hub name can only
    be tried by loading it.
    """
    if name == TINY or name.lower() in (SMOLLM2, "smollm2", "smollm2-135m"):
        return  # built in (the SmolLM2 alias may convert a cache on first use: left to the loader)
    try:
        resolve_model_path(name)
    except ModelSourceError as err:
        raise ModelSourceError(f"{key}: {str(err).splitlines()[0]}") from None


def check_data_source(source: str, key: str) -> None:
    """A one-line :class:`~distill.data.DataError` naming ``key`` when ``source`` is clearly a local path
    (``./``, ``/``, ``~``, or a .jsonl/.json/.txt/.parquet name: the data reader's own rule) that does not exist.

    The built-in corpus, existing files and folders, and hub names pass; what a file holds is read with the data.
    """
    if source == BUILTIN or Path(source).expanduser().exists():
        return
    try:
        local_files(source)  # for a path that does not exist: raises when it is clearly local, else a hub name
    except DataError:
        raise DataError(f"{key} {source} does not exist; check the path") from None


def check_sources(cfg: Any) -> None:
    """The model and data sources of a recipe's config (``DistillConfig``, the retrofit recipe's) that are local
    paths exist: one line naming the key, before the run folder is claimed and before the teacher loads.

    Not part of ``__post_init__``: the memory planner and ``python -m distill.data prepare`` read configs written
    for the machine that trains (``dataset: /data/train.jsonl``), and must accept them elsewhere.
    """
    models = []
    if not (getattr(cfg, "teacher_cache", None) and getattr(cfg, "student", None)):  # else the teacher never loads
        models.append(("teacher", cfg.teacher))
    elif getattr(cfg, "gate", False):  # ... until the gate compares the final student with it, after the run
        models.append(("teacher (gate=true compares the student with it)", cfg.teacher))
    models += [(key, getattr(cfg, key, None)) for key in ("student", "tokenizer")]
    for key, name in models:
        if name:
            check_model_source(name, key)
    specs = parse_sources(cfg.datasets, cfg.dataset)  # neither set: a DataError naming both keys
    for spec in specs:
        check_data_source(spec.source, "datasets source" if cfg.datasets else "dataset")
    if cfg.eval_dataset:
        check_data_source(cfg.eval_dataset, "eval_dataset")
    if getattr(cfg, "data_cache", None):
        check_output_dir(cfg.data_cache, "data_cache", writable=False)  # a file: now, not after the models load
    if getattr(cfg, "overwrite", False):
        inputs = [("teacher", cfg.teacher), *models[-2:], ("teacher_cache", getattr(cfg, "teacher_cache", None)),
                  *(("datasets source" if cfg.datasets else "dataset", s.source) for s in specs),
                  ("eval_dataset", cfg.eval_dataset)]
        check_inputs_outside(cfg.output_dir, inputs)


def check_inputs_outside(output_dir: str, inputs: list[tuple[str, str | None]]) -> None:
    """A one-line :class:`ConfigError` when a local input (``(key, path)``) lies inside ``output_dir``, which
    ``overwrite=true`` removes before anything loads: the run would delete what it was about to read."""
    out = Path(output_dir).expanduser()
    for key, source in inputs:
        path = Path(source).expanduser() if source else None
        if path is not None and path.exists() and (
                out.absolute() in path.absolute().parents or out.resolve() in path.resolve().parents):
            raise ConfigError(f"{key} {source} lies inside output_dir {output_dir}, which overwrite=true removes "
                              "first; move it out of that folder or choose another output_dir=")
