"""Plug hybrid attention into transformers models through their registries (no ``forward`` patched).

``retrofit(model, spec)`` registers one attention function with ``AttentionInterface`` and one mask
function with ``AttentionMaskInterface`` under :data:`ATTN_IMPLEMENTATION`, switches the model to
it with ``model.set_attn_implementation`` and stores the spec in ``model.config`` under
``CONFIG_KEY``. transformers does not write the attention implementation into ``config.json``, so a
saved hybrid model still loads as a dense one with plain ``from_pretrained``; ``load(path)`` brings
it back hybrid.

The base model's own sliding-window settings (Mistral ``sliding_window``, Qwen2
``use_sliding_window`` / ``layer_types``) are off while hybrid: transformers builds sliding KV caches
from them, which would drop the sink and global keys. ``revert`` puts them back. Mistral's window is
also kept in the config under :data:`BASE_KEY`, so that it survives a save: ``load`` then ``revert``
is the base model again.

The mask function returns a :class:`HybridMask` (the ``[batch, k_len]`` padding mask and where the
queries sit among the keys) instead of a dense ``[q, k]`` mask, which is what keeps prefill O(n).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from attention.errors import HybridAttentionError, SequenceTooLongError, UnsupportedArchitectureError
from attention.functional import hybrid_attention
from attention.spec import CONFIG_KEY, HybridAttentionConfig

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "hybrid_sparse"
# Tested end to end (tiny GQA configs of each in tests/test_attention_retrofit.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_REVERT_ATTR = "_hybrid_attention_revert"
# Config key of the base model's sliding-window settings that the retrofit turned off (saved with the spec).
BASE_KEY = "hybrid_attention_base"


@dataclasses.dataclass
class HybridMask:
    """What the hybrid attention function needs to know about padding, in O(k_len) memory.

    ``padding`` is ``[batch, k_len]`` bool (True = real token) or None for no padding; queries sit at
    key indices ``[query_start, query_start + q_len)``.
    """

    padding: torch.Tensor | None
    query_start: int
    # For a static (compileable) cache, generate builds each step's mask through the mask function and hands it
    # to the model, whose mask preprocessing then reads its ``ndim``: 4 lets it pass as an already prepared mask.
    ndim: ClassVar[int] = 4



@contextlib.contextmanager
def attention_swapped(model, name: str, forward: Callable) -> Iterator[None]:
    """Run ``model`` with ``forward`` registered as attention implementation ``name``, then restore.

    For measuring passes over a model (head scores, gate training) that replace its attention for a
    while: the previous implementation (or ``sdpa``) is set back however the block exits.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(name, forward)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous or "sdpa")

def _spec_from_config(config: Any) -> HybridAttentionConfig:
    raw = getattr(config, CONFIG_KEY, None)
    if raw is None:
        raise HybridAttentionError(f"model config has no {CONFIG_KEY!r}; call attention.retrofit(model, spec) first")
    if isinstance(raw, HybridAttentionConfig):
        return raw
    _check_stored(raw)
    return _parse_spec(json.dumps(raw, sort_keys=True))


def _check_stored(raw: Any, where: str = "the model config") -> None:
    """A spec stored in a config (``config.json``) is an object of spec keys: one line naming the fix otherwise."""
    if not isinstance(raw, dict):
        raise HybridAttentionError(f"{where}: {CONFIG_KEY!r} must be an object of hybrid attention keys, got "
                                   f"{raw!r}; fix or remove it")


def stored_spec(saved: dict[str, Any], where: str) -> HybridAttentionConfig:
    """The spec a saved ``config.json`` (``saved``, read at ``where``) carries, checked against the layers and KV
    heads it records, without any weights: one :class:`HybridAttentionError` line naming the file otherwise."""
    raw = saved.get(CONFIG_KEY)
    _check_stored(raw, where)
    try:
        spec = HybridAttentionConfig.from_dict(raw)
        layers = saved.get("num_hidden_layers")
        kv_heads = saved.get("num_key_value_heads") or saved.get("num_attention_heads")
        if isinstance(layers, int) and isinstance(kv_heads, int):
            spec.check_model(layers, kv_heads)
    except HybridAttentionError as err:
        raise HybridAttentionError(f"{where}: {str(err).splitlines()[0]}") from None
    return spec


@functools.lru_cache(maxsize=16)
def _parse_spec(raw_json: str) -> HybridAttentionConfig:
    # Parsed once per distinct spec: the attention function runs once per layer and step.
    return HybridAttentionConfig.from_dict(json.loads(raw_json))


def hybrid_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: q ``[b, h, q, d]``, k/v ``[b, kv_h, k, d]`` -> ``([b, q, h, d], None)``.

    ``sliding_window`` (Mistral / Qwen2) is ignored: the hybrid spec is the pattern.
    """
    if dropout:
        raise HybridAttentionError(f"hybrid attention has no attention dropout (got {dropout}); "
                                   "set config.attention_dropout = 0")
    config = module.config
    spec = _spec_from_config(config)
    padding, query_start, mask4 = None, None, None
    if isinstance(attention_mask, HybridMask):
        padding, query_start = attention_mask.padding, attention_mask.query_start
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4:
        mask4 = attention_mask
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
        padding = attention_mask
    elif attention_mask is not None:
        raise HybridAttentionError(f"unexpected attention mask {type(attention_mask).__name__}; "
                                   "pass a [batch, seq] padding mask")
    q_len, k_len = query.shape[2], key.shape[2]
    length = (k_len - q_len if query_start is None else query_start) + q_len
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and length > limit:
        raise SequenceTooLongError(f"sequence of {length} tokens exceeds max_position_embeddings={limit}; "
                                   "truncate the input or raise max_position_embeddings (with RoPE scaling)")
    out = hybrid_attention(query, key, value, spec, attention_mask=mask4 if mask4 is not None else padding,
                           scale=scaling, query_start=query_start, layer=getattr(module, "layer_idx", None))
    return out.transpose(1, 2).contiguous(), None


def hybrid_mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
                         mask_function: Any = None, attention_mask: torch.Tensor | HybridMask | None = None,
                         **kwargs: Any) -> HybridMask:
    """``AttentionMaskInterface`` entry: a :class:`HybridMask` instead of a dense 4-D mask.

    ``mask_function`` (causal, or sliding-window on Mistral / Qwen2) is ignored: the hybrid spec
    replaces it. Packed sequences (position ids restarting inside a row) are not supported.
    """
    if isinstance(attention_mask, HybridMask):  # prepared for this very step by generate (static cache)
        return attention_mask
    query_start = int(q_offset) - int(kv_offset)
    padding = None
    if attention_mask is not None:
        pad = attention_mask.bool()[:, kv_offset:kv_offset + kv_length]
        if pad.shape[-1] < kv_length:  # static caches keep empty slots after the seen tokens
            pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[-1]), value=False)
        if not bool(pad[:, : query_start + q_length].all()):
            padding = pad
    return HybridMask(padding=padding, query_start=query_start)


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, hybrid_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hybrid_mask_function)


def _check_supported(model: Any) -> None:
    model_type = getattr(model.config, "model_type", None)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    if can_set is not None and can_set():
        logger.warning("hybrid attention on untested model type %r (tested: %s)", model_type,
                       ", ".join(SUPPORTED_MODEL_TYPES))
        return
    raise UnsupportedArchitectureError(
        f"{type(model).__name__} ({model_type}) does not route attention through transformers' AttentionInterface; "
        f"hybrid attention supports {', '.join(SUPPORTED_MODEL_TYPES)}")


def _hybrid_settings(cfg: Any) -> dict[str, Any]:
    """The base config's sliding-window settings as hybrid attention needs them: only those that change.

    ``layer_types`` (Qwen2) decides each layer's KV cache and mask: all full. A model built with
    sliding layers keeps ``sliding_window`` (it builds their masks from it on every forward, and no
    layer uses them once all are full); without ``layer_types`` (Mistral), ``sliding_window`` itself
    makes the cache slide, so it goes.
    """
    new: dict[str, Any] = {}
    layer_types = getattr(cfg, "layer_types", None)
    sliding_layers = isinstance(layer_types, list) and "sliding_attention" in layer_types
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        new["layer_types"] = ["full_attention"] * len(layer_types)
    if getattr(cfg, "sliding_window", None) is not None and not sliding_layers:
        new["sliding_window"] = None
    if getattr(cfg, "use_sliding_window", None):
        new["use_sliding_window"] = False
    return new


def _stored_base(cfg: Any) -> dict[str, Any]:
    """The base model's settings saved under ``BASE_KEY`` by the retrofit that wrote a hybrid checkpoint."""
    stored = getattr(cfg, BASE_KEY, None)
    if stored is None:
        return {}
    if not isinstance(stored, dict) or not set(stored) <= {"sliding_window"}:
        raise HybridAttentionError(f"config {BASE_KEY!r} must be {{'sliding_window': <the base model's window>}}, "
                                   f"got {stored!r}; fix or remove it in config.json")
    return dict(stored)


def retrofit(model: Any, config: HybridAttentionConfig | dict | None = None) -> Any:
    """Switch ``model`` (in place) to hybrid attention; returns the model.

    ``config`` defaults to the spec already stored in ``model.config`` (as after loading a hybrid
    checkpoint), else ``HybridAttentionConfig()``. Sliding-window settings of the base config
    (Mistral ``sliding_window``, Qwen2 ``use_sliding_window`` / ``layer_types``) are switched off
    while hybrid, since a sliding KV cache would drop the sink and global keys; ``revert`` restores
    them. Mistral's ``sliding_window`` is also kept under ``BASE_KEY``, which is saved with the model:
    Mistral reads it on every forward, so a model loaded from the checkpoint gets it back on ``revert``.
    (Qwen2 builds its layers from ``layer_types``: one loaded from a hybrid checkpoint has full layers.)
    """
    _check_supported(model)
    if config is None:
        raw = getattr(model.config, CONFIG_KEY, None)
        if raw is not None:
            _check_stored(raw)
        spec = HybridAttentionConfig.from_dict(dict(raw)) if raw is not None else HybridAttentionConfig()
    elif isinstance(config, dict):
        spec = HybridAttentionConfig.from_dict(config)
    else:
        spec = config
    cfg = model.config
    spec.check_model(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    register()
    new = _hybrid_settings(cfg)
    if getattr(model, _REVERT_ATTR, None) is None:
        saved = {"attn": cfg._attn_implementation, **{name: getattr(cfg, name) for name in new}, **_stored_base(cfg)}
        object.__setattr__(model, _REVERT_ATTR, saved)
    window = getattr(model, _REVERT_ATTR).get("sliding_window")
    if window is not None:
        setattr(cfg, BASE_KEY, {"sliding_window": window})
    for name, value in new.items():
        setattr(cfg, name, value)
    setattr(cfg, CONFIG_KEY, spec.to_dict())
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def revert(model: Any) -> Any:
    """Undo :func:`retrofit`: the original attention implementation and sliding settings, no spec.

    On a model loaded with plain ``from_pretrained`` from a hybrid checkpoint (never retrofitted in
    this process) it restores the sliding settings saved under ``BASE_KEY``.
    """
    saved = getattr(model, _REVERT_ATTR, None)
    cfg = model.config
    if saved is None:
        for name, value in _stored_base(cfg).items():
            setattr(cfg, name, value)
        if cfg._attn_implementation == ATTN_IMPLEMENTATION:
            model.set_attn_implementation("sdpa")
    else:
        for name, value in saved.items():
            if name != "attn":
                setattr(cfg, name, value)
        model.set_attn_implementation(saved["attn"] or "sdpa")
        object.__delattr__(model, _REVERT_ATTR)
    for key in (CONFIG_KEY, BASE_KEY):
        if hasattr(cfg, key):
            delattr(cfg, key)
    return model


def is_hybrid(model: Any) -> bool:
    """Whether ``model`` currently runs hybrid attention."""
    return getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


def load(path: str | os.PathLike, **from_pretrained_kwargs: Any) -> Any:
    """Load a causal LM saved after :func:`retrofit` and switch it back to hybrid attention.

    Extra keyword arguments go to ``AutoModelForCausalLM.from_pretrained`` (``torch_dtype``, ...).
    """
    from transformers import AutoModelForCausalLM

    missing = HybridAttentionError(f"{path} has no {CONFIG_KEY!r} in its config.json; load it with "
                                   "from_pretrained and call attention.retrofit(model, spec)")
    local = Path(path) / "config.json"
    if local.is_file():  # a local checkpoint: refuse before the weights load
        try:
            saved = json.loads(local.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise HybridAttentionError(f"{local} is not valid JSON ({err}); fix or rewrite it") from None
        if not isinstance(saved, dict) or saved.get(CONFIG_KEY) is None:
            raise missing
        stored_spec(saved, str(local))  # a broken spec: before the weights load
    model = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
    if getattr(model.config, CONFIG_KEY, None) is None:
        raise missing
    return retrofit(model)
