"""Hybrid sparse attention: sink tokens + sliding window + periodic global tokens."""

from attention.spec import CONFIG_KEY, HybridAttentionConfig

__all__ = ["CONFIG_KEY", "HybridAttentionConfig"]
