"""Serving: the decode engine (dense and bounded hybrid KV caches), a generate CLI and an HTTP server."""

from serve.engine import Completion, Engine, Request
from serve.kv_cache import KVCache
from serve.sampling import SamplingParams

__all__ = ["Completion", "Engine", "KVCache", "Request", "SamplingParams"]
