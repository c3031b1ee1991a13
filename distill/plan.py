"""Per-GPU memory planner for teacher→student distillation: will it fit, and what to change if not.

    python -m distill.plan --config recipes/configs/deepseek_17b_to_7b.yaml --gpus 8 --gpu-mem-gb 80
    python -m distill.plan --teacher-shape deepseek-17b --student-shape deepseek-llm-7b --gpus 8 --gpu-mem-gb 80

The YAML is read as the distill recipe's own typed config (``distill.config.DistillConfig``): an
unknown key or a bad value is an error, and a key the YAML leaves out takes the recipe's default, so
the plan is of the run the recipe would start. Shapes come from its ``teacher_shape`` /
``student_shape`` (mappings or preset names) or from ``--teacher-shape`` / ``--student-shape``
presets: nothing is downloaded. Prints a table per training strategy, a verdict for the configured
one with the changes that would make it fit, and one last line of JSON.

Accounting, per GPU, with P = student parameters, T = teacher parameters, N = GPUs (all nodes):

* Model states follow DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs`` /
  ``estimate_zero3_model_states_mem_needs``; ``tests/test_plan.py`` checks agreement): with bf16/fp16
  mixed precision a parameter costs 2 B (16-bit weight) + 2 B (16-bit grad) + 4 B (fp32 grad) + 4 B
  (fp32 master) + 8 B (AdamW moments). ZeRO-1 shards the last three, ZeRO-2 also the 16-bit grad,
  ZeRO-3 everything, plus a working buffer to gather the largest layer (4 B × its parameters); like
  DeepSpeed's estimator, ZeRO-3 charges 18 B rather than 20 B per sharded parameter, because stage 3
  upcasts gradients to fp32 one sub-group at a time instead of keeping a whole fp32 copy. DeepSpeed
  has no ZeRO-1 estimator; ZeRO-1 here is ZeRO-2 with the 16-bit gradients replicated.
  Offloading the optimizer moves the fp32 pieces (and under ZeRO-2 the gradients) to CPU; offloading
  parameters too leaves only the gather buffer on the GPU. Without mixed precision there are no
  16-bit copies: 4 B weight + 4 B grad + 8 B moments. ``stage 0`` is plain DDP as accelerate runs it:
  fp32 weights and grads with autocast (16 B / parameter), nothing sharded.
* The teacher is frozen: weights only, in the mixed-precision dtype (bf16: 2 B), sharded under
  ZeRO-3 (plus its own largest-layer gather buffer), on CPU under ZeRO-3 parameter offload, replicated
  otherwise (see ``distill/distributed.py``).
* Activations (student; the teacher runs under ``no_grad`` and keeps one layer alive at a time) assume
  a fused attention kernel (SDPA/flash: no ``seq×seq`` matrix is stored). Per token and decoder layer
  the tensors saved for backward are the two norm inputs and outputs, q/k/v, rotated q/k, the
  attention output, and the four ``intermediate``-wide MLP tensors:
  ``(7·hidden + 3·kv_dim + 4·intermediate)`` elements. With gradient checkpointing only each layer's
  input is kept, plus one layer's full set while it is recomputed.
* Logits/loss buffers: student logits (16-bit) and their fp32 log-softmax, teacher logits (16-bit)
  and fp32 probabilities, and the fp32 gradient of the student logits: 16 B per token × vocab over
  the whole micro batch, or over one chunk of tokens with chunked KD.
* Calibration for ``distill.prune`` (one GPU, no gradients; :func:`calibration_bytes`): the teacher's
  weights, plus one decoder layer's live activations for one micro batch — its input (held by the
  block-influence hook), norm output, q/k/v, attention output and the three MLP-wide tensors in the
  weight dtype, and the hooks' fp32 copies (input, output, one head's contribution, the MLP
  activations) — ``b·t·(4·hidden + 2·kv_dim + 3·intermediate) + 4·t·(3·hidden + intermediate)`` bytes
  for ``t`` tokens. With layer offload (``--offload``: accelerate ``device_map="auto"``) the GPU holds
  one layer's weights instead of all of them and host RAM holds the teacher.
* Runtime overhead: a flat 2 GiB for the CUDA context, NCCL and DeepSpeed communication buckets. A
  plan fits when its total stays under 90 % of the GPU (the rest is allocator fragmentation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from core.config import ConfigError, build_config, load_yaml
from distill.config import DistillConfig

GIB = 2**30
OVERHEAD_BYTES = 2 * GIB
USABLE_FRACTION = 0.9
DEFAULT_KD_CHUNK_TOKENS = 1024
LOGIT_BYTES_PER_TOKEN_VOCAB = 2 + 4 + 2 + 4 + 4  # student 16-bit, its fp32 log-softmax, teacher 16-bit + fp32 probs, grad

SHAPE_KEYS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size")


class PlanError(ValueError):
    """A user-facing planner problem; one line naming the fix."""


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Llama-architecture decoder (DeepSeek-LLM, SmolLM2, Mistral, Qwen2 without biases)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.num_heads * self.head_dim * 2 + h * self.kv_dim * 2  # q, o + k, v
        return attn + 3 * h * i + 2 * h  # gate/up/down + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * self.layer_params + heads * self.embedding_params + self.hidden_size

    @property
    def largest_layer_params(self) -> int:
        """Parameters of the biggest single module ZeRO-3 must gather at once (embedding or a decoder layer)."""
        return max(self.embedding_params, self.layer_params)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> ModelShape:
        missing = [k for k in SHAPE_KEYS if k not in data]
        if missing:
            raise PlanError(f"{where} is missing {', '.join(missing)}; give all of {', '.join(SHAPE_KEYS)}")
        try:
            values = {k: int(data[k]) for k in SHAPE_KEYS}
        except (TypeError, ValueError):
            raise PlanError(f"{where} values must be integers; fix {where}") from None
        if any(v <= 0 for v in values.values()):
            raise PlanError(f"{where} values must be positive; fix {where}")
        if values["hidden_size"] % values["num_heads"] or values["num_heads"] % values["num_kv_heads"]:
            raise PlanError(f"{where}: hidden_size must divide by num_heads and num_heads by num_kv_heads")
        return cls(**values, tie_word_embeddings=bool(data.get("tie_word_embeddings", False)))


# Public shapes. deepseek-17b is a 17B-class member of the same family (no such checkpoint is
# published): DeepSeek-LLM's 40-layer, 5120-wide layout with the MLP widened to 19200 so the total is
# 17.04B parameters (the 13824 of a 13B model gives only 13.7B).
PRESETS: dict[str, ModelShape] = {
    "deepseek-17b": ModelShape(40, 5120, 19200, 40, 40, 102400),
    "deepseek-llm-7b": ModelShape(30, 4096, 11008, 32, 32, 102400),
    "smollm2-135m": ModelShape(30, 576, 1536, 9, 3, 49152, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Strategy:
    name: str
    zero_stage: int
    offload_optimizer: bool = False
    offload_params: bool = False
    launch: str = ""


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("ddp", 0, launch="gpu_ddp.yaml"),
    Strategy("zero1", 1, launch="deepspeed_zero2.yaml with zero_stage: 1"),
    Strategy("zero2", 2, launch="deepspeed_zero2.yaml"),
    Strategy("zero2_offload", 2, offload_optimizer=True, launch="deepspeed_zero2.yaml with offload_optimizer_device: cpu"),
    Strategy("zero3", 3, launch="deepspeed_zero3.yaml"),
    Strategy("zero3_offload_opt", 3, offload_optimizer=True,
             launch="deepspeed_zero3.yaml with offload_optimizer_device: cpu"),
    Strategy("zero3_offload", 3, offload_optimizer=True, offload_params=True, launch="deepspeed_zero3_offload.yaml"),
)
_BY_NAME = {s.name: s for s in STRATEGIES}


@dataclass
class Settings:
    """The training knobs that size memory, read from the recipe config."""

    micro_batch_size: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = False
    mixed_precision: str = "bf16"
    zero_stage: int = 3
    offload: str = "none"  # none | optimizer | all
    kd_chunk_tokens: int = 0  # 0 = full logits

    @property
    def strategy(self) -> Strategy:
        if self.zero_stage == 0:
            return _BY_NAME["ddp"]
        if self.zero_stage == 1:
            return _BY_NAME["zero1"]
        suffix = {"none": "", "optimizer": "_offload" if self.zero_stage == 2 else "_offload_opt", "all": "_offload"}
        return _BY_NAME[f"zero{self.zero_stage}{suffix[self.offload]}"]


@dataclass
class StrategyMemory:
    """Per-GPU bytes of one strategy, its parts, and whether it fits."""

    name: str
    launch: str
    student_params: int
    student_grads: int
    optimizer: int
    gather_buffer: int
    teacher: int
    activations: int
    activations_no_ckpt: int
    activations_ckpt: int
    logits: int
    logits_full: int
    logits_chunked: int
    overhead: int
    total: int
    fits: bool
    cpu_bytes_per_node: int

    def gib(self, key: str) -> float:
        return getattr(self, key) / GIB


@dataclass
class Plan:
    """The planner's answer: every strategy, the configured one, and what to change."""

    gpus: int
    gpu_mem_gb: float
    teacher: ModelShape
    student: ModelShape
    settings: Settings
    strategies: list[StrategyMemory]
    configured: str
    fits: bool
    suggestions: list[str] = field(default_factory=list)
    max_micro_batch: int = 0

    def strategy(self, name: str) -> StrategyMemory:
        return next(s for s in self.strategies if s.name == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "gpu_mem_gb": self.gpu_mem_gb,
            "teacher_params": self.teacher.num_params,
            "student_params": self.student.num_params,
            "settings": dataclasses.asdict(self.settings),
            "configured": self.configured,
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "suggestions": self.suggestions,
            "per_gpu_gib": {s.name: round(s.total / GIB, 2) for s in self.strategies},
            "fits_by_strategy": {s.name: s.fits for s in self.strategies},
        }


def model_state_bytes(params: int, largest_layer: int, strategy: Strategy, gpus: int,
                      mixed_precision: bool) -> tuple[int, int, int, int]:
    """Per-GPU (weights, grads, optimizer, gather buffer) bytes of a trained model under ``strategy``.

    The optimizer share includes the fp32 master weights and fp32 gradient copy of mixed precision.
    """
    n = gpus
    if strategy.zero_stage == 0:  # DDP + autocast: fp32 everything, replicated
        return 4 * params, 4 * params, 8 * params, 0
    w16 = 2 if mixed_precision else 4  # the weight/grad copy the model computes with
    fp32_extra = 8 if mixed_precision else 0  # fp32 master + fp32 grads, only with a 16-bit model copy
    opt_full = (8 + fp32_extra) * params
    if strategy.zero_stage == 1:
        return w16 * params, w16 * params, opt_full // n, 0
    if strategy.zero_stage == 2:
        if strategy.offload_optimizer:  # grads stream to the CPU optimizer in buckets
            return w16 * params, 0, 0, 0
        return w16 * params, w16 * params // n, opt_full // n, 0
    # ZeRO-3: 16-bit weight + grad of the largest layer gathered at once
    gather = 2 * w16 * largest_layer
    if strategy.offload_params:
        return 0, 0, 0, gather
    if strategy.offload_optimizer:
        return w16 * params // n, 0, 0, gather
    # DeepSpeed's stage-3 estimator charges 18 B per sharded parameter, not 20: stage 3 never holds a
    # whole fp32 gradient copy (gradients are upcast one sub-group at a time in the step). Follow it.
    opt3 = (opt_full - 2 * params) if mixed_precision else opt_full
    return w16 * params // n, w16 * params // n, opt3 // n, gather


def cpu_bytes_per_node(params: int, strategy: Strategy, gpus: int, nodes: int = 1, buffer_factor: float = 1.5) -> int:
    """Host memory per node for offloaded student states (DeepSpeed's estimate, with its 1.5 buffer); 0 if none.

    Assumes ``zero3_init_flag`` (models partitioned while built), as the launch configs set.
    """
    if strategy.zero_stage == 2 and strategy.offload_optimizer:
        return int(params * max(4 * gpus, 16) * buffer_factor)
    if strategy.zero_stage == 3 and strategy.offload_optimizer:
        return int(params * (18 if strategy.offload_params else 16) / nodes * buffer_factor)
    return 0


def teacher_bytes(teacher: ModelShape, strategy: Strategy, gpus: int, mixed_precision: bool) -> int:
    """Per-GPU bytes of the frozen teacher's weights (plus its ZeRO-3 gather buffer)."""
    b = 2 if mixed_precision else 4
    if strategy.zero_stage == 3:
        gather = b * teacher.largest_layer_params
        return gather if strategy.offload_params else b * teacher.num_params // gpus + gather
    return b * teacher.num_params


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, checkpointing: bool,
                     mixed_precision: bool) -> int:
    """Bytes of student activations saved for backward (see the module docstring for the formula)."""
    b = 2 if mixed_precision else 4
    tokens = micro_batch * seq_len
    per_layer = b * tokens * (7 * shape.hidden_size + 3 * shape.kv_dim + 4 * shape.intermediate_size)
    if checkpointing:
        return b * tokens * shape.hidden_size * shape.num_layers + per_layer
    return per_layer * shape.num_layers


def teacher_forward_bytes(teacher: ModelShape, micro_batch: int, seq_len: int, mixed_precision: bool) -> int:
    """Transient working set of one teacher layer under no_grad (its input, q/k/v, MLP intermediates)."""
    b = 2 if mixed_precision else 4
    return b * micro_batch * seq_len * (3 * teacher.hidden_size + 2 * teacher.kv_dim + 3 * teacher.intermediate_size)


def calibration_bytes(teacher: ModelShape, micro_batch: int, seq_len: int, mixed_precision: bool) -> dict[str, int]:
    """GPU bytes of ``distill.prune``'s calibration pass: resident teacher, or layer-by-layer offload."""
    b = 2 if mixed_precision else 4
    t = micro_batch * seq_len
    h, i = teacher.hidden_size, teacher.intermediate_size
    acts = b * t * (4 * h + 2 * teacher.kv_dim + 3 * i) + 4 * t * (3 * h + i)
    weights = b * teacher.num_params
    layer = b * max(teacher.layer_params, teacher.embedding_params)
    return {"weights": weights, "activations": acts, "resident": weights + acts + OVERHEAD_BYTES,
            "offload_gpu": layer + acts + OVERHEAD_BYTES, "offload_host": weights}


def logits_bytes(vocab: int, micro_batch: int, seq_len: int, chunk_tokens: int) -> int:
    """Student + teacher logits, fp32 softmax copies and the logit gradient, for the tokens held at once."""
    tokens = micro_batch * seq_len
    held = min(tokens, chunk_tokens) if chunk_tokens > 0 else tokens
    return LOGIT_BYTES_PER_TOKEN_VOCAB * held * vocab


def _strategy_memory(teacher: ModelShape, student: ModelShape, s: Settings, strategy: Strategy, gpus: int,
                     gpu_mem_gb: float, nodes: int = 1) -> StrategyMemory:
    mp = s.mixed_precision in ("bf16", "fp16")
    w, g, opt, gather = model_state_bytes(student.num_params, student.largest_layer_params, strategy, gpus, mp)
    t = teacher_bytes(teacher, strategy, gpus, mp) + teacher_forward_bytes(teacher, s.micro_batch_size, s.seq_len, mp)
    a_full = activation_bytes(student, s.micro_batch_size, s.seq_len, False, mp)
    a_ckpt = activation_bytes(student, s.micro_batch_size, s.seq_len, True, mp)
    chunk = s.kd_chunk_tokens or DEFAULT_KD_CHUNK_TOKENS
    l_full = logits_bytes(student.vocab_size, s.micro_batch_size, s.seq_len, 0)
    l_chunk = logits_bytes(student.vocab_size, s.micro_batch_size, s.seq_len, chunk)
    acts = a_ckpt if s.gradient_checkpointing else a_full
    logits = l_chunk if s.kd_chunk_tokens > 0 else l_full
    total = w + g + opt + gather + t + acts + logits + OVERHEAD_BYTES
    return StrategyMemory(
        name=strategy.name, launch=strategy.launch, student_params=w, student_grads=g, optimizer=opt,
        gather_buffer=gather, teacher=t, activations=acts, activations_no_ckpt=a_full, activations_ckpt=a_ckpt,
        logits=logits, logits_full=l_full, logits_chunked=l_chunk, overhead=OVERHEAD_BYTES, total=total,
        fits=total <= USABLE_FRACTION * gpu_mem_gb * GIB,
        cpu_bytes_per_node=cpu_bytes_per_node(student.num_params, strategy, gpus, nodes)
        + (2 if mp else 4) * teacher.num_params * int(strategy.offload_params) // nodes,
    )


def _evaluate(teacher: ModelShape, student: ModelShape, s: Settings, gpus: int, gpu_mem_gb: float,
              nodes: int = 1) -> list[StrategyMemory]:
    return [_strategy_memory(teacher, student, s, st, gpus, gpu_mem_gb, nodes) for st in STRATEGIES]


def _fits(teacher: ModelShape, student: ModelShape, s: Settings, gpus: int, gpu_mem_gb: float) -> bool:
    return _strategy_memory(teacher, student, s, s.strategy, gpus, gpu_mem_gb).fits


def _max_micro_batch(teacher: ModelShape, student: ModelShape, s: Settings, gpus: int, gpu_mem_gb: float,
                     limit: int = 4096) -> int:
    """The largest micro batch the configured strategy fits (0 if not even 1)."""
    best = 0
    mb = 1
    while mb <= limit and _fits(teacher, student, dataclasses.replace(s, micro_batch_size=mb), gpus, gpu_mem_gb):
        best, mb = mb, mb * 2
    lo, hi = best, min(mb, limit + 1)  # best fits, hi does not (or is past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(teacher, student, dataclasses.replace(s, micro_batch_size=mid), gpus, gpu_mem_gb):
            lo = mid
        else:
            hi = mid
    return lo


def _suggest(teacher: ModelShape, student: ModelShape, s: Settings, gpus: int, gpu_mem_gb: float) -> list[str]:
    """Changes that make the configured run fit, cheapest first (each one alone, or cumulative)."""
    out: list[str] = []
    cur = s
    steps: list[tuple[str, Settings]] = []
    if not cur.gradient_checkpointing:
        steps.append(("gradient_checkpointing=true", dataclasses.replace(cur, gradient_checkpointing=True)))
    if cur.kd_chunk_tokens <= 0:
        steps.append((f"chunked KD over {DEFAULT_KD_CHUNK_TOKENS} tokens (kd_chunk_size={DEFAULT_KD_CHUNK_TOKENS})",
                      dataclasses.replace(cur, kd_chunk_tokens=DEFAULT_KD_CHUNK_TOKENS)))
    for text, change in steps:
        if _fits(teacher, student, change, gpus, gpu_mem_gb):
            return [f"set {text}"]
    # Apply the free wins together, then try smaller batches, then heavier sharding.
    for _, change in steps:
        cur = dataclasses.replace(cur, gradient_checkpointing=cur.gradient_checkpointing or change.gradient_checkpointing,
                                  kd_chunk_tokens=max(cur.kd_chunk_tokens, change.kd_chunk_tokens))
    combined = [t for t, _ in steps]
    if combined and _fits(teacher, student, cur, gpus, gpu_mem_gb):
        return ["set " + " and ".join(combined)]
    mb = _max_micro_batch(teacher, student, cur, gpus, gpu_mem_gb)
    if mb >= 1:
        ga = math.ceil(s.micro_batch_size / mb)
        out.append("set " + " and ".join(combined + [f"micro_batch_size={mb}"])
                   + f" (gradient accumulation x{ga} keeps the effective batch)")
        return out
    for st in STRATEGIES:
        if (st.zero_stage, st.offload_optimizer, st.offload_params) <= (
                cur.strategy.zero_stage, cur.strategy.offload_optimizer, cur.strategy.offload_params):
            continue
        offload = "all" if st.offload_params else ("optimizer" if st.offload_optimizer else "none")
        trial = dataclasses.replace(cur, zero_stage=st.zero_stage, offload=offload)
        mb = _max_micro_batch(teacher, student, trial, gpus, gpu_mem_gb)
        if mb >= 1:
            extra = [f"micro_batch_size={mb}"] if mb < s.micro_batch_size else []
            return ["set " + " and ".join(combined + extra) + f" and switch to {st.name} (launch/{st.launch})"]
    return [f"nothing fits on {gpus} x {gpu_mem_gb:g} GB: add GPUs, shorten seq_len, or use a smaller teacher/student"]


def plan(config: dict[str, Any], gpus: int, gpu_mem_gb: float, teacher: ModelShape | str | None = None,
         student: ModelShape | str | None = None, nodes: int = 1) -> Plan:
    """Plan memory for a recipe config (a dict as loaded from YAML; unrelated keys are ignored).

    ``teacher`` / ``student`` (a :class:`ModelShape` or preset name) override the config's
    ``teacher_shape`` / ``student_shape``. ``gpus`` counts all GPUs; ``nodes`` only splits the host-RAM
    estimate of the offload strategies.
    """
    if gpus < 1 or gpu_mem_gb <= 0 or nodes < 1 or gpus % nodes:
        raise PlanError("--gpus must be >= 1, --gpu-mem-gb > 0, and --gpus a multiple of --nodes")
    t = _resolve_shape(teacher if teacher is not None else config.get("teacher_shape"), "teacher_shape")
    st = _resolve_shape(student if student is not None else config.get("student_shape"), "student_shape")
    s = settings_from_config(config)
    rows = _evaluate(t, st, s, gpus, gpu_mem_gb, nodes)
    configured = s.strategy.name
    fits = next(r for r in rows if r.name == configured).fits
    return Plan(gpus=gpus, gpu_mem_gb=gpu_mem_gb, teacher=t, student=st, settings=s, strategies=rows,
                configured=configured, fits=fits,
                suggestions=[] if fits else _suggest(t, st, s, gpus, gpu_mem_gb),
                max_micro_batch=_max_micro_batch(t, st, s, gpus, gpu_mem_gb))


def _resolve_shape(value: Any, where: str) -> ModelShape:
    if isinstance(value, ModelShape):
        return value
    if isinstance(value, str):
        if value not in PRESETS:
            raise PlanError(f"unknown shape preset '{value}' for {where}; choose one of {', '.join(PRESETS)}")
        return PRESETS[value]
    if isinstance(value, dict):
        return ModelShape.from_dict(value, where)
    raise PlanError(f"no {where} given; add a {where} mapping ({', '.join(SHAPE_KEYS)}) to the config "
                    f"or pass --{where.replace('_', '-')} PRESET")


def settings_from_config(config: dict[str, Any]) -> Settings:
    s = Settings()
    kd_chunk = config.get("kd_chunk_size", config.get("kd_chunk_tokens", 0))
    values = {
        "micro_batch_size": config.get("micro_batch_size", s.micro_batch_size),
        "seq_len": config.get("seq_len", config.get("max_seq_len", s.seq_len)),
        "zero_stage": config.get("zero_stage", s.zero_stage),
        "kd_chunk_tokens": kd_chunk or 0,
    }
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PlanError(f"config key '{key}' must be a non-negative integer, got {value!r}")
    if values["micro_batch_size"] < 1 or values["seq_len"] < 1:
        raise PlanError("micro_batch_size and seq_len must be >= 1")
    if values["zero_stage"] > 3:
        raise PlanError(f"zero_stage must be 0-3, got {values['zero_stage']}")
    mp = str(config.get("mixed_precision", s.mixed_precision)).lower()
    if mp not in ("bf16", "fp16", "no", "fp32"):
        raise PlanError(f"mixed_precision must be bf16, fp16 or no, got {mp!r}")
    offload = str(config.get("offload", "none")).lower()
    if offload not in ("none", "optimizer", "all"):
        raise PlanError(f"offload must be none, optimizer or all, got {offload!r}")
    if values["zero_stage"] < 2 and offload != "none":
        raise PlanError("offload needs zero_stage 2 or 3; raise zero_stage or set offload=none")
    if values["zero_stage"] == 2 and offload == "all":
        raise PlanError("ZeRO-2 cannot offload parameters; use offload=optimizer or zero_stage=3")
    return Settings(gradient_checkpointing=bool(config.get("gradient_checkpointing", False)),
                    mixed_precision="no" if mp == "fp32" else mp, offload=offload, **values)


def format_plan(p: Plan) -> str:
    """The human table."""
    s = p.settings
    lines = [
        f"teacher {p.teacher.num_params / 1e9:.2f}B params ({p.teacher.num_layers} layers, width {p.teacher.hidden_size})"
        f" -> student {p.student.num_params / 1e9:.2f}B ({p.student.num_layers} layers, width {p.student.hidden_size})",
        f"{p.gpus} GPUs x {p.gpu_mem_gb:g} GB, micro batch {s.micro_batch_size} x seq {s.seq_len}, "
        f"mixed precision {s.mixed_precision}, gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}, "
        f"KD logits {'chunked (' + str(s.kd_chunk_tokens) + ' tokens)' if s.kd_chunk_tokens else 'full'}",
        "",
        "per-GPU GiB       params  grads  optim  gather teacher  act(ckpt/none)  logits(chunk/full)  total  fits",
    ]
    for r in p.strategies:
        mark = "*" if r.name == p.configured else " "
        lines.append(
            f"{mark}{r.name:<17}{r.gib('student_params'):6.1f} {r.gib('student_grads'):6.1f} {r.gib('optimizer'):6.1f}"
            f" {r.gib('gather_buffer'):6.1f} {r.gib('teacher'):7.1f}   {r.gib('activations_ckpt'):5.1f}/{r.gib('activations_no_ckpt'):6.1f}"
            f"     {r.gib('logits_chunked'):5.1f}/{r.gib('logits_full'):6.1f}    {r.gib('total'):6.1f}  {'yes' if r.fits else 'NO'}"
            + (f"   (host RAM/node {r.cpu_bytes_per_node / GIB:.0f} GiB)" if r.cpu_bytes_per_node else "")
        )
    lines += [
        "",
        f"total = params + grads + optim + gather + teacher + act(as configured) + logits(as configured)"
        f" + {OVERHEAD_BYTES / GIB:.0f} GiB runtime; fits = total <= {USABLE_FRACTION:.0%} of the GPU. * = configured.",
    ]
    if p.fits:
        lines.append(f"configured {p.configured}: fits ({p.strategy(p.configured).gib('total'):.1f} GiB per GPU);"
                     f" largest micro batch that fits: {p.max_micro_batch}")
    else:
        lines.append(f"configured {p.configured}: does NOT fit ({p.strategy(p.configured).gib('total'):.1f} GiB per GPU)")
        lines += [f"  to fit: {x}" for x in p.suggestions]
    return "\n".join(lines)


_OVERRIDES = {"micro_batch_size": int, "seq_len": int, "zero_stage": int, "kd_chunk_size": int,
              "mixed_precision": str, "offload": str}


def recipe_config(path: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The distill recipe's resolved config (YAML, then ``overrides``) as the planner's input mapping.

    Built as the recipe builds it, so unknown keys and bad values fail here with the recipe's own
    one-line errors. ``mixed_precision=auto`` plans for GPUs (bf16); an unset ``zero_stage`` is ZeRO-3.
    """
    values = load_yaml(path) if path else {}
    values.update(overrides)
    cfg = dataclasses.asdict(build_config(DistillConfig, values, where=str(path or "the command line")))
    if cfg["mixed_precision"] == "auto":
        cfg["mixed_precision"] = "bf16"
    if cfg["zero_stage"] is None:
        cfg["zero_stage"] = Settings.zero_stage
    return cfg


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``, except an unset one (None: the config's value, said in its help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distill.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--config", help="recipe YAML with teacher_shape/student_shape and batch settings "
                                         "(unset: the recipe's defaults, with the flags below)")
    parser.add_argument("--gpus", type=int, default=8, help="total GPUs (all nodes)")
    parser.add_argument("--nodes", type=int, default=1, help="machines the GPUs are spread over (host-RAM estimate)")
    parser.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU in GiB (an '80 GB' H100/A100 has 79.6)")
    parser.add_argument("--teacher-shape", choices=sorted(PRESETS), help="teacher preset (overrides the config)")
    parser.add_argument("--student-shape", choices=sorted(PRESETS), help="student preset (overrides the config)")
    for key, tp in _OVERRIDES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=tp, dest=key, help=f"override the config's {key}")
    parser.add_argument("--gradient-checkpointing", choices=["true", "false"], help="override the config's value")
    args = parser.parse_args(argv)
    try:
        config = recipe_config(args.config, {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
                               | ({} if args.gradient_checkpointing is None
                                  else {"gradient_checkpointing": args.gradient_checkpointing == "true"}))
        if not (math.isfinite(args.gpu_mem_gb) and args.gpu_mem_gb > 0):
            raise PlanError(f"--gpu-mem-gb must be a positive number, got {args.gpu_mem_gb}")
        result = plan(config, args.gpus, args.gpu_mem_gb, teacher=args.teacher_shape, student=args.student_shape,
                      nodes=args.nodes)
    except (PlanError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_plan(result))
    calib = calibration_bytes(result.teacher, result.settings.micro_batch_size, result.settings.seq_len,
                              result.settings.mixed_precision in ("bf16", "fp16"))
    print(f"calibration (python -m distill.prune, micro batch {result.settings.micro_batch_size} x seq "
          f"{result.settings.seq_len}): teacher resident on one GPU {calib['resident'] / GIB:.1f} GiB "
          f"(weights {calib['weights'] / GIB:.1f} + activations {calib['activations'] / GIB:.2f} + runtime); "
          f"with --offload {calib['offload_gpu'] / GIB:.1f} GiB GPU + {calib['offload_host'] / GIB:.1f} GiB host RAM")
    print(json.dumps({**result.to_json(), "calibration_gib": {k: round(v / GIB, 2) for k, v in calib.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
