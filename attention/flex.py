"""FlexAttention backend (CUDA): the hybrid pattern as a ``mask_mod`` with a cached block mask.

Import-safe everywhere: FlexAttention is imported lazily, and the compiled kernel is only built on
first use. On CPU the eager (unfused, O(n²) memory) FlexAttention path still runs, which the tests
use to check the ``mask_mod`` itself; ``attention.functional`` only dispatches here on CUDA.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from attention.spec import HybridAttentionConfig

BLOCK_MASK_CACHE_SIZE = 32


def available() -> bool:
    """Whether FlexAttention can be imported (torch >= 2.5)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _mask_mod(spec: HybridAttentionConfig, window: int, query_start: int,
              kpos: torch.Tensor | None, real: torch.Tensor | None):
    """``mask_mod(b, h, q_idx, kv_idx)`` of the pattern; ``kpos`` / ``real`` are ``[batch, k_len]`` when padded."""
    sink, every, max_g, rows = spec.sink_tokens, spec.global_every, spec.max_globals, spec.global_rows

    def mask_mod(b, h, q_idx, kv_idx):
        qi = q_idx + query_start
        if kpos is None:
            i, j = qi, kv_idx
        else:
            i, j = kpos[b, qi], kpos[b, kv_idx]
        ok = (j < sink) | (i - j < window)
        if every > 0:
            g = (j % every) == 0
            if max_g is not None:
                g = g & (j // every < max_g)
            ok = ok | g
            if rows:
                r = (i % every) == 0
                if max_g is not None:
                    r = r & (i // every < max_g)
                ok = ok | r
        ok = ok & (kv_idx <= qi) & (j <= i)
        if real is not None:
            q_real = real[b, qi]
            ok = (ok & q_real & real[b, kv_idx]) | (~q_real & (kv_idx == qi))
        return ok

    return mask_mod


@functools.lru_cache(maxsize=BLOCK_MASK_CACHE_SIZE)
def _cached_block_mask(spec_json: str, window: int, q_len: int, k_len: int, query_start: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    spec = HybridAttentionConfig.from_dict(json.loads(spec_json))
    return create_block_mask(_mask_mod(spec, window, query_start, None, None), None, None, q_len, k_len,
                             device=device)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: HybridAttentionConfig,
                          window: int, *, padding: torch.Tensor | None = None, query_start: int | None = None,
                          scale: float | None = None, compiled: bool | None = None) -> torch.Tensor:
    """``[b, h, q, d]`` hybrid attention via FlexAttention (same semantics as ``masks.query_key_mask``).

    ``padding`` is ``[b, k_len]`` bool (True = real token). The unpadded block mask is cached per
    (spec, window, lengths, device); a padded batch builds its own. ``compiled`` defaults to "on CUDA".
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q_len, k_len = q.shape[2], k.shape[2]
    qs = k_len - q_len if query_start is None else query_start
    if padding is None:
        block_mask = _cached_block_mask(spec.to_json(), window, q_len, k_len, qs, str(q.device))
    else:
        real = padding.to(q.device).bool()
        kpos = real.long().cumsum(-1) - 1
        block_mask = create_block_mask(_mask_mod(spec, window, qs, kpos, real), q.shape[0], None, q_len, k_len,
                                       device=q.device)
    use_compiled = q.is_cuda if compiled is None else compiled
    fn: Any = _compiled_flex() if use_compiled else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
