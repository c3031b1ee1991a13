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
    """``[seq, seq]`` bool mask for a sequence starting at position 0."""
    pos = torch.arange(seq_len, device=device)
    return allowed(pos, pos, spec, window)


def padded_hybrid_mask(attention_mask: torch.Tensor, spec: HybridAttentionConfig, *,
                       window: int | None = None) -> torch.Tensor:
    """``[batch, 1, seq, seq]`` bool mask for a (left- or right-) padded batch.

    Positions count real tokens only, so a left-padded row sees the same pattern as the
    unpadded sequence. ``attention_mask`` is ``[batch, seq]`` (1 = real token). Padded query
    rows keep their own diagonal so softmax never sees an empty row.
    """
    am = attention_mask.bool()
    pos = am.long().cumsum(-1) - 1
    m = allowed(pos, pos, spec, window) & am.unsqueeze(-2) & am.unsqueeze(-1)
    eye = torch.eye(am.shape[-1], dtype=torch.bool, device=am.device)
    m = m | (eye & ~am.unsqueeze(-1))
    return m.unsqueeze(1)
