"""Hybrid sparse attention: sink tokens + sliding window + periodic global tokens.

``hybrid_attention`` is the one attention function (backends: block-sparse kernel, FlexAttention,
masked SDPA); ``retrofit`` / ``revert`` / ``load`` plug it into transformers models through
``AttentionInterface``; ``use_window`` sets the window for the forward passes inside it.
"""

from attention.errors import HybridAttentionError, SequenceTooLongError, UnsupportedArchitectureError
from attention.functional import BACKENDS, hybrid_attention, resolve_window, use_backend, use_window
from attention.integration import (
    ATTN_IMPLEMENTATION,
    BASE_KEY,
    SUPPORTED_MODEL_TYPES,
    is_hybrid,
    load,
    retrofit,
    revert,
)
from attention.spec import CONFIG_KEY, HybridAttentionConfig

__all__ = [
    "ATTN_IMPLEMENTATION", "BACKENDS", "BASE_KEY", "CONFIG_KEY", "HybridAttentionConfig", "HybridAttentionError",
    "SUPPORTED_MODEL_TYPES", "SequenceTooLongError", "UnsupportedArchitectureError", "hybrid_attention",
    "is_hybrid", "load", "resolve_window", "retrofit", "revert", "use_backend", "use_window",
]
