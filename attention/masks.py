"""Boolean-mask reference of the hybrid pattern (tests and the SDPA fallback use it).

Dense ``[q_len, k_len]`` masks cost O(n²) memory: never use them on the fast path.
"""

from __future__ import annotations

import torch

from attention.spec import HybridAttentionConfig


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, spec: HybridAttentionConfig, window: int | None = None
            ) -> torch.Tensor:
    """Whether each query position may attend to each key position.

    Args:
        q_pos: ``[..., q]`` absolute query positions (int64).
        k_pos: ``[..., k]`` absolute key positions (int64).
        spec: the hybrid pattern.
        window: overrides ``spec.window`` (a window sampled from the policy).
    Returns:
        ``[..., q, k]`` bool, True = attend.
    """
    w = spec.window if window is None else window
    i = q_pos.unsqueeze(-1)
    j = k_pos.unsqueeze(-2)
    causal = j <= i
    ok = (j < spec.sink_tokens) | ((i - j) < w)
    if spec.global_every > 0:
        is_global = (j % spec.global_every) == 0
        if spec.max_globals is not None:
            is_global = is_global & (j // spec.global_every < spec.max_globals)
        ok = ok | is_global
        if spec.global_rows:
            row_global = (i % spec.global_every) == 0
            if spec.max_globals is not None:
                row_global = row_global & (i // spec.global_every < spec.max_globals)
            ok = ok | row_global
    return causal & ok


def hybrid_mask(seq_len: int, spec: HybridAttentionConfig, *, window: int | None = None,
                device: torch.device | str | None = None) -> torch.Tensor:
    """``[seq, seq]`` bool mask for a sequence starting at position 0 (``window`` default: the spec's for
    ``seq_len``, its ``window_policy``'s when it has one, as :func:`attention.hybrid_attention` picks it)."""
    pos = torch.arange(seq_len, device=device)
    return allowed(pos, pos, spec, spec.window_for(seq_len) if window is None else window)


def padded_hybrid_mask(attention_mask: torch.Tensor, spec: HybridAttentionConfig, *,
                       window: int | None = None) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` bool mask for a (left- or right-) padded batch.

    Positions count real tokens only, so a left-padded row sees the same pattern as the
    unpadded sequence. ``attention_mask`` is ``[batch, seq]`` (1 = real token). Padded query
    rows keep their own diagonal so softmax never sees an empty row. ``window`` default: the spec's
    for ``seq`` (padding included, as :func:`attention.hybrid_attention` picks it).
    """
    am = attention_mask.bool()
    pos = am.long().cumsum(-1) - 1
    window = spec.window_for(am.shape[-1]) if window is None else window
    m = allowed(pos, pos, spec, window) & am.unsqueeze(-2) & am.unsqueeze(-1)
    eye = torch.eye(am.shape[-1], dtype=torch.bool, device=am.device)
    m = m | (eye & ~am.unsqueeze(-1))
    return m.unsqueeze(1)


def query_key_mask(q_len: int, k_len: int, spec: HybridAttentionConfig, *,
                   attention_mask: torch.Tensor | None = None, window: int | None = None,
                   query_start: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """``[batch or 1, 1, q_len, k_len]`` bool mask for queries that are a slice of the key sequence.

    The general reference (and the masked-SDPA backend): query ``r`` sits at key index
    ``query_start + r`` (default: the last ``q_len`` keys, as in cached decoding). ``attention_mask``
    is ``[batch, k_len]`` (1 = real token); positions count real tokens only, keys that are not real
    are never seen, and a padded query row sees only its own key so softmax never gets an empty row.
    With ``q_len == k_len`` this equals :func:`padded_hybrid_mask` / :func:`hybrid_mask`. ``window`` default:
    the spec's for the ``query_start + q_len`` key slots up to the last query, as :func:`attention.hybrid_attention`
    picks it.
    """
    qs = k_len - q_len if query_start is None else query_start
    window = spec.window_for(qs + q_len) if window is None else window
    if attention_mask is None:
        kpos = torch.arange(k_len, device=device).unsqueeze(0)
        real = torch.ones_like(kpos, dtype=torch.bool)
    else:
        real = attention_mask.to(device=device).bool()
        kpos = real.long().cumsum(-1) - 1
    q_idx = torch.arange(qs, qs + q_len, device=real.device)
    qpos = kpos[:, q_idx]
    q_real = real[:, q_idx]
    k_idx = torch.arange(k_len, device=real.device)
    m = allowed(qpos, kpos, spec, window) & real.unsqueeze(-2) & q_real.unsqueeze(-1)
    m = m & (k_idx.unsqueeze(0) <= q_idx.unsqueeze(1))  # keys stored after a query (static cache) stay unseen
    own = k_idx.unsqueeze(0) == q_idx.unsqueeze(1)
    m = m | (own & ~q_real.unsqueeze(-1))
    return m.unsqueeze(1)


def head_query_key_mask(q_len: int, k_len: int, spec: HybridAttentionConfig, layer: int | None, heads: int,
                        kv_heads: int, *, attention_mask: torch.Tensor | None = None, window: int | None = None,
                        query_start: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """``[batch or 1, heads, q_len, k_len]`` bool reference with per-head roles.

    Query heads whose KV head keeps full attention in ``layer`` (``spec.full_kv_heads``) get the dense
    causal mask (padding rules as in :func:`query_key_mask`), the others the hybrid pattern.
    """
    stream = query_key_mask(q_len, k_len, spec, attention_mask=attention_mask, window=window,
                            query_start=query_start, device=device)
    full = spec.full_kv_heads(layer, kv_heads)
    if not full:
        return stream.expand(-1, heads, -1, -1)
    dense = query_key_mask(q_len, k_len, dense_spec(k_len), attention_mask=attention_mask,
                           query_start=query_start, device=device)
    is_full = torch.zeros(kv_heads, dtype=torch.bool, device=stream.device)
    is_full[list(full)] = True
    is_full = is_full.repeat_interleave(heads // kv_heads).view(1, heads, 1, 1)
    return torch.where(is_full, dense, stream)


def dense_spec(length: int) -> HybridAttentionConfig:
    """A spec whose pattern is plain causal attention for sequences up to ``length`` tokens."""
    return HybridAttentionConfig(sink_tokens=0, window=max(1, length), global_every=0)
