"""Placing the frozen teacher under each distributed backend.

The student goes through ``accelerator.prepare(student, optimizer, ...)`` like any trained model. The
teacher must not: it has no optimizer, it must not be DDP-wrapped (DDP would all-reduce gradients it
never has and register it for ``save_state``, copying a 17B model into every checkpoint), and under
ZeRO-3 it is the biggest thing in memory, so it has to be sharded too. :func:`prepare_teacher` picks
the right treatment from the accelerator's state:

=====================  ==========================================================================
backend                teacher placement
=====================  ==========================================================================
DeepSpeed ZeRO-3       its own inference engine (``deepspeed.initialize`` without optimizer); every
                       parameter is partitioned across ranks and gathered layer by layer in forward
DeepSpeed ZeRO-0/1/2   moved to the device, cast to the mixed-precision dtype; ZeRO <= 2 shards only
                       optimizer state and gradients, which a frozen teacher does not have, so an
                       engine would add nothing but its bookkeeping
FSDP2                  ``fully_shard`` per decoder layer + root, with the plugin's wrap policy and
                       mixed-precision policy (accelerate's FSDP2 preparation, without registering
                       the teacher for checkpointing)
FSDP1                  wrapped in ``FullyShardedDataParallel`` with the plugin's settings
DDP / single device    moved to the device, cast to the mixed-precision dtype (replicated per rank)
=====================  ==========================================================================

``accelerator.prepare_model(teacher, evaluation_mode=True)`` is deliberately not used: in accelerate it
only moves the model and wraps ``forward`` in autocast, it never shards (under FSDP it does not even
move the model), and it appends the teacher to ``accelerator._models`` so ``save_state`` would save it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "gather_params",
    "gathered_replica",
    "is_deepspeed",
    "is_fsdp",
    "is_zero3",
    "mixed_precision_dtype",
    "prepare_teacher",
    "teacher_deepspeed_config",
    "unwrap_teacher",
    "zero_stage",
]


def _deepspeed_plugin(accelerator: Any) -> Any | None:
    state = getattr(accelerator, "state", None)
    return getattr(state, "deepspeed_plugin", None)


def is_deepspeed(accelerator: Any) -> bool:
    """True when the accelerator runs with a DeepSpeed plugin."""
    return _deepspeed_plugin(accelerator) is not None


def zero_stage(accelerator: Any) -> int | None:
    """The DeepSpeed ZeRO stage (0-3), or ``None`` without DeepSpeed."""
    plugin = _deepspeed_plugin(accelerator)
    if plugin is None:
        return None
    stage = plugin.deepspeed_config.get("zero_optimization", {}).get("stage", plugin.zero_stage)
    return int(stage)


def is_zero3(accelerator: Any) -> bool:
    """True under DeepSpeed ZeRO stage 3 (parameters are partitioned across ranks)."""
    return zero_stage(accelerator) == 3


def is_fsdp(accelerator: Any) -> bool:
    """True when the accelerator runs with an FSDP plugin (FSDP1 or FSDP2)."""
    state = getattr(accelerator, "state", None)
    return getattr(state, "fsdp_plugin", None) is not None


def mixed_precision_dtype(accelerator: Any) -> torch.dtype | None:
    """``torch.bfloat16`` / ``torch.float16`` for bf16 / fp16 mixed precision, else ``None``."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(getattr(accelerator, "mixed_precision", "no")))


def configure_deepspeed(accelerator: Any, micro_batch_size: int, max_grad_norm: float) -> None:
    """Give DeepSpeed the recipe's micro batch and clipping before ``accelerator.prepare``; no-op without it.

    No dataloader goes through ``prepare``, so DeepSpeed cannot infer the micro batch. Under DeepSpeed
    ``accelerator.clip_grad_norm_`` does nothing (the engine clips inside its step, at the config's
    ``gradient_clipping``, which the launch YAML fixes): without this a recipe's ``max_grad_norm`` would be
    silently replaced by the YAML's value. 0 turns clipping off, as in the recipes.

    Under ZeRO-3 the engine is also told to gather whole weights on save
    (``stage3_gather_16bit_weights_on_model_save``, the YAML's ``zero3_save_16bit_model``): the recipe's
    ``final/`` is an ordinary HF directory gathered from the shards by ``accelerator.get_state_dict``, which
    refuses without it, and accelerate leaves it off when a launch config omits the key; the run would
    train to the end and then fail to write its student.
    """
    plugin = _deepspeed_plugin(accelerator)
    if plugin is None:
        return
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
    plugin.deepspeed_config["gradient_clipping"] = float(max_grad_norm)
    if zero_stage(accelerator) == 3:
        zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
        zero["stage3_gather_16bit_weights_on_model_save"] = True


def deepspeed_settings(accelerator: Any, model: Any) -> dict[str, Any] | None:
    """What the engine ``accelerator.prepare`` made of ``model`` trains with (``None`` without DeepSpeed)."""
    if not is_deepspeed(accelerator):
        return None
    return {"zero_stage": model.zero_optimization_stage(), "gradient_clipping": model.gradient_clipping(),
            "gradient_accumulation_steps": model.gradient_accumulation_steps(),
            "train_micro_batch_size_per_gpu": model.train_micro_batch_size_per_gpu()}


def teacher_deepspeed_config(accelerator: Any) -> dict[str, Any]:
    """A DeepSpeed config for a frozen, ZeRO-3-partitioned inference copy of the teacher.

    Built from scratch rather than copied from the training config so that nothing of the training
    side leaks in: no optimizer or scheduler block, no ``"auto"`` placeholders (which only
    ``accelerator.prepare`` resolves, and the teacher may be placed before it runs), no gradient
    clipping. What is kept: the stage, the micro batch (DeepSpeed insists on one even without
    training), the precision, and parameter offload, so a ``deepspeed_zero3_offload`` run also keeps
    the teacher's weights in CPU memory.
    """
    plugin = _deepspeed_plugin(accelerator)
    if plugin is None:
        raise ValueError("teacher_deepspeed_config needs an accelerator launched with a DeepSpeed config")
    source = plugin.deepspeed_config
    micro = source.get("train_micro_batch_size_per_gpu", "auto")
    micro = micro if isinstance(micro, int) and micro > 0 else 1
    zero_src = source.get("zero_optimization", {})
    zero: dict[str, Any] = {"stage": 3}
    # Small parameters (norms, biases) are kept whole on every rank instead of gathered each forward;
    # carry the user's choice over when there is one.
    for key in ("stage3_param_persistence_threshold", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                "stage3_max_reuse_distance"):
        value = zero_src.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            zero[key] = value
    offload = zero_src.get("offload_param") or {}
    if offload.get("device") in ("cpu", "nvme"):
        zero["offload_param"] = {k: v for k, v in offload.items() if v is not None}
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": mp == "bf16"},
        "fp16": {"enabled": mp == "fp16"},
        "steps_per_print": 2**31 - 1,  # DeepSpeed logs a line every N steps otherwise
        "wall_clock_breakdown": False,
    }


def _freeze(model: nn.Module) -> nn.Module:
    model.requires_grad_(False)
    model.eval()
    return model


def _prepare_zero3(accelerator: Any, teacher: nn.Module) -> nn.Module:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=teacher, config=teacher_deepspeed_config(accelerator))
    # The engine's forward runs the ZeRO-3 gather/release hooks; `.module` is the bare model, still
    # partitioned (its parameters are empty placeholders outside a gather). The engine's `eval()`
    # returns None, unlike nn.Module's, hence no chaining.
    engine.eval()
    return engine


def _prepare_fsdp(accelerator: Any, teacher: nn.Module) -> nn.Module:
    plugin = accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) == 2:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, teacher)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plugin.set_auto_wrap_policy(teacher)
    return FSDP(
        teacher,
        sharding_strategy=plugin.sharding_strategy,
        cpu_offload=plugin.cpu_offload,
        auto_wrap_policy=plugin.auto_wrap_policy,
        mixed_precision=plugin.mixed_precision_policy,
        sync_module_states=plugin.sync_module_states,
        use_orig_params=plugin.use_orig_params,
        limit_all_gathers=plugin.limit_all_gathers,
        device_id=accelerator.device,
    )


def prepare_teacher(accelerator: Any, teacher: nn.Module) -> nn.Module:
    """Freeze ``teacher`` and place it for the accelerator's backend (see the module docstring).

    Call it with the bare model, never through ``accelerator.prepare``. Returns the module to call
    for teacher forwards: a ``DeepSpeedEngine`` under ZeRO-3, an FSDP-sharded module under FSDP, the
    model itself otherwise. Outside ZeRO-3/FSDP the weights are cast to the mixed-precision dtype
    (bf16/fp16): a frozen model needs no fp32 master copy, and it halves the replicated footprint,
    matching what the ZeRO-3 engine does with ``bf16.enabled``.
    """
    _freeze(teacher)
    if is_zero3(accelerator):
        return _freeze(_prepare_zero3(accelerator, teacher))
    if is_fsdp(accelerator):
        return _freeze(_prepare_fsdp(accelerator, teacher))
    dtype = mixed_precision_dtype(accelerator)
    teacher = teacher.to(device=accelerator.device, dtype=dtype) if dtype else teacher.to(accelerator.device)
    return _freeze(teacher)


def _is_zero_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


@contextlib.contextmanager
def gather_params(params: nn.Parameter | Iterable[nn.Parameter] | nn.Module) -> Iterator[None]:
    """Make ZeRO-3-partitioned parameters whole for the duration of the block (read-only).

    Outside the block a ZeRO-3 parameter is an empty placeholder (``numel() == 0``); inside it holds
    the full tensor on every rank. Use it to read a teacher weight outside that module's own forward,
    e.g. ``teacher.lm_head.weight`` ``[vocab, hidden]`` for a chunked KD loss::

        with gather_params(teacher_model.lm_head.weight):
            loss = chunked_kd(student_hidden, teacher_hidden, teacher_model.lm_head.weight, ...)

    Edits made inside are discarded (``modifier_rank=None``): the teacher is frozen. For anything else
    (plain tensors, ZeRO <= 2, DDP) this is a no-op, so recipes can use it unconditionally. Every rank
    must enter the block (it is a collective).
    """
    if isinstance(params, nn.Module):
        params = list(params.parameters())
    elif isinstance(params, torch.Tensor):
        params = [params]
    else:
        params = list(params)
    zero = [p for p in params if _is_zero_param(p)]
    if not zero:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(zero, modifier_rank=None):
        yield


def _gather_chunks(named: list[tuple[str, nn.Parameter]]) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """``named`` in order, cut into runs of at most the largest parameter's element count (full sizes, also
    of ZeRO-3 placeholders): one gather per run holds no more than that weight would alone, and a model
    of many small weights still takes few collectives (a decoder layer's projections gather together)."""
    sizes = [int(getattr(p, "ds_numel", p.numel())) for _, p in named]
    budget = max(sizes, default=0)
    chunk: list[tuple[str, nn.Parameter]] = []
    total = 0
    for item, size in zip(named, sizes, strict=True):
        if chunk and total + size > budget:
            yield chunk
            chunk, total = [], 0
        chunk.append(item)
        total += size
    if chunk:
        yield chunk


def gathered_replica(model: nn.Module, replica: nn.Module | None = None) -> nn.Module:
    """A plain (unsharded) copy of ``model``'s current weights, for code that reads weights directly.

    Under ZeRO-3 a parameter is whole only inside a gather, and a module's forward hooks gather and
    release it again per call, as a collective every rank must join in the same order. Code that
    loops a data-dependent number of times per rank (a decode engine stopping rows at end of text)
    cannot use the sharded modules. It uses this replica instead: built once with the same config
    (``replica=None``), refreshed in place on later calls. Cost: one more full copy of the model per
    rank, and an all-gather + copy of every weight per refresh. The weights are gathered a few at a
    time (:func:`_gather_chunks`), never all at once: a gather of the whole model would hold a second
    full copy beside the replica for the length of the refresh. Every rank must call it (the gathers
    are collectives, joined in parameter order). Buffers (rotary tables) are never sharded and are
    copied too.

    Args:
        model: the (possibly ZeRO-3 partitioned) ``PreTrainedModel``.
        replica: the copy made by an earlier call, refreshed in place; ``None`` builds it.
    """
    params = dict(model.named_parameters())
    if replica is None:
        sample = next(iter(params.values()))
        dtype = sample.ds_tensor.dtype if _is_zero_param(sample) else sample.dtype
        device = sample.ds_tensor.device if _is_zero_param(sample) else sample.device
        with torch.device("meta"):
            replica = type(model)(model.config)
        replica = replica.to_empty(device=device).to(dtype)
        replica.tie_weights()
        replica.requires_grad_(False)
    own = dict(replica.named_parameters())
    if own.keys() != params.keys():
        raise RuntimeError(f"replica parameters differ from the model's: {sorted(own.keys() ^ params.keys())[:4]}")
    with torch.no_grad():
        for chunk in _gather_chunks(list(params.items())):
            with gather_params([p for _, p in chunk]):
                for name, p in chunk:
                    own[name].copy_(p)
    with torch.no_grad():
        for (name, b), (own_name, mine) in zip(model.named_buffers(), replica.named_buffers(), strict=True):
            if name != own_name:
                raise RuntimeError(f"replica buffer {own_name} does not match the model's {name}")
            mine.copy_(b)
    return replica


def unwrap_teacher(teacher: nn.Module) -> nn.Module:
    """The bare ``PreTrainedModel`` behind a DeepSpeed engine / FSDP1 wrapper (FSDP2 wraps in place)."""
    while True:
        inner = getattr(teacher, "module", None)
        if not isinstance(inner, nn.Module):
            return teacher
        teacher = inner
