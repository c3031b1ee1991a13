"""Errors raised by the hybrid attention package: one line each, naming the fix."""

from __future__ import annotations


class HybridAttentionError(ValueError):
    """A hybrid attention spec, call or model that cannot work as given."""


class UnsupportedArchitectureError(HybridAttentionError):
    """The model's attention does not go through transformers' ``AttentionInterface``."""


class SequenceTooLongError(HybridAttentionError):
    """The input is longer than the model's ``max_position_embeddings``."""
