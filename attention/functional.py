"""The one public hybrid attention function and its backend dispatch.

Backends (force one with ``backend=`` or ``with use_backend(...)``):

* ``"blocksparse"``: ``attention.kernel``; CPU and GPU, work O(n * (sink + window + n / global_every)).
* ``"flex"``: torch FlexAttention with a cached block mask; CUDA only.
* ``"sdpa"``: masked SDPA with the boolean reference mask; O(q_len * k_len) memory, the fallback.
* ``"auto"`` (default): flex on CUDA when available; otherwise plain causal SDPA when the pattern is
  dense anyway (no longer than ``sink + window``), masked SDPA for short query chunks (decoding) and
  padding that is not one contiguous run per row, and the block-sparse kernel for everything else.

The window is resolved as: the ``window`` argument, else the innermost ``use_window(...)`` context
(the training recipe sets a sampled window this way), else ``spec.window_for(length)`` where length
is the number of key slots up to the last query (padding included).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from attention import flex
from attention.errors import HybridAttentionError
from attention.kernel import blocksparse_attention
from attention.masks import dense_spec, query_key_mask
from attention.spec import HybridAttentionConfig

BACKENDS = ("auto", "blocksparse", "flex", "sdpa")
# Query chunks up to this long go to masked SDPA under "auto": their mask is small and the kernel's
# per-call setup would dominate (cached decoding is q_len == 1).
DECODE_MAX_QUERIES = 16

_window_override: contextvars.ContextVar[int | None] = contextvars.ContextVar("hybrid_window", default=None)
_backend_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("hybrid_backend", default=None)


@contextlib.contextmanager
def use_window(window: int | None) -> Iterator[None]:
    """Use this local window for every hybrid attention call inside the block (``None``: the spec's).

    The training recipe samples a window from ``spec.window_policy`` and runs the forward pass under
    it; the backward pass reuses what the forward saved, so it need not stay inside the block.
    """
    if window is not None and int(window) < 1:
        raise HybridAttentionError(f"window must be >= 1 (it counts the token itself), got {window}")
    token = _window_override.set(None if window is None else int(window))
    try:
        yield
    finally:
        _window_override.reset(token)


@contextlib.contextmanager
def use_backend(backend: str | None) -> Iterator[None]:
    """Force a backend (one of ``BACKENDS``) for every hybrid attention call inside the block."""
    if backend is not None and backend not in BACKENDS:
        raise HybridAttentionError(f"unknown backend {backend!r}; use one of {BACKENDS}")
    token = _backend_override.set(backend)
    try:
        yield
    finally:
        _backend_override.reset(token)


def resolve_window(spec: HybridAttentionConfig, length: int, window: int | None = None) -> int:
    """The window for a call: explicit argument, else ``use_window`` context, else the spec's for ``length``."""
    w = window if window is not None else _window_override.get()
    w = spec.window_for(length) if w is None else int(w)
    if w < 1:
        raise HybridAttentionError(f"window must be >= 1 (it counts the token itself), got {w}")
    return w


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: HybridAttentionConfig, *,
                     attention_mask: torch.Tensor | None = None, window: int | None = None,
                     backend: str | None = None, scale: float | None = None,
                     query_start: int | None = None, layer: int | None = None) -> torch.Tensor:
    """Causal hybrid (sink + window + global) attention, with per-KV-head roles when the spec has them.

    Query heads whose KV head keeps full attention in ``layer`` (``spec.full_kv_heads``) run plain
    causal attention (the dense flash path), the others the hybrid pattern on the chosen backend;
    no ``[q, k]`` mask is built for either unless the backend is masked SDPA.

    Args:
        q: ``[batch, heads, q_len, head_dim]``.
        k, v: ``[batch, kv_heads, k_len, head_dim]``; ``heads`` a multiple of ``kv_heads`` (GQA, KV is
            never repeated on the block-sparse path).
        spec: the pattern.
        attention_mask: ``[batch, k_len]`` padding mask (1 = real token; positions count real tokens
            only, as in ``masks.padded_hybrid_mask``), or a 4-D ``[batch, 1|heads, q_len, k_len]``
            mask (bool = attend, or additive float) that is intersected with the pattern (masked SDPA).
        window: local window override (see module docstring for the resolution order).
        backend: ``"auto"`` (default), ``"blocksparse"``, ``"flex"`` or ``"sdpa"``.
        scale: softmax scale, default ``head_dim ** -0.5``.
        query_start: key index of the first query (default ``k_len - q_len``: queries are the last
            keys, as in cached decoding). Keys after the last query are ignored.
        layer: the decoder layer index, for the spec's per-head roles (None: every head streams).
    Returns:
        ``[batch, heads, q_len, head_dim]`` in the dtype of ``q``.
    """
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise HybridAttentionError(f"expected q [b, h, q, d] and k, v [b, kv_h, k, d]; got {tuple(q.shape)}, "
                                   f"{tuple(k.shape)}, {tuple(v.shape)}")
    heads, kv_heads, q_len, k_len = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise HybridAttentionError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    qs = k_len - q_len if query_start is None else int(query_start)
    if qs < 0 or qs + q_len > k_len:
        raise HybridAttentionError(f"queries [{qs}, {qs + q_len}) do not fit in {k_len} keys; pass a valid query_start")
    length = qs + q_len
    w = resolve_window(spec, length, window)
    name = backend or _backend_override.get() or "auto"
    if name not in BACKENDS:
        raise HybridAttentionError(f"unknown backend {name!r}; use one of {BACKENDS}")

    mask4 = attention_mask if attention_mask is not None and attention_mask.ndim == 4 else None
    padding = None
    if attention_mask is not None and mask4 is None:
        if attention_mask.ndim != 2 or attention_mask.shape != (q.shape[0], k_len):
            raise HybridAttentionError(f"attention_mask must be [batch, k_len] = {(q.shape[0], k_len)} or 4-D; "
                                       f"got {tuple(attention_mask.shape)}")
        padding = attention_mask.to(q.device).bool()
        if bool(padding.all()):
            padding = None
    # Keys stored after the last query are never seen (causal): drop them once here, so every backend
    # below works with "queries are the last q_len keys".
    if mask4 is None and length < k_len:
        k, v = k[:, :, :length], v[:, :, :length]
        padding = None if padding is None else padding[:, :length]

    full = spec.full_kv_heads(layer, kv_heads)
    if not full:
        return _run(q, k, v, spec, w, padding, mask4, qs, name, scale)
    # Full heads: plain causal attention. On the block-sparse backend that is the dense flash path;
    # masked SDPA and flex keep their own (reference / CUDA) implementations of it.
    dense, dense_name = dense_spec(length), "auto" if name == "blocksparse" else name
    if len(full) == kv_heads:
        return _run(q, k, v, dense, length, padding, mask4, qs, dense_name, scale)
    stream = [h for h in range(kv_heads) if h not in full]
    b, _, n, d = q.shape
    group = heads // kv_heads
    fi = torch.tensor(full, device=q.device)
    si = torch.tensor(stream, device=q.device)
    qg = q.view(b, kv_heads, group, n, d)

    def part(idx: torch.Tensor, pattern: HybridAttentionConfig, pw: int, pname: str) -> torch.Tensor:
        m4 = mask4
        if m4 is not None and m4.shape[1] == heads:  # a per-head 4-D mask follows its heads
            m4 = m4.view(m4.shape[0], kv_heads, group, *m4.shape[2:]).index_select(1, idx).flatten(1, 2)
        return _run(qg.index_select(1, idx).flatten(1, 2), k.index_select(1, idx), v.index_select(1, idx),
                    pattern, pw, padding, m4, qs, pname, scale)

    out_f, out_s = part(fi, dense, length, dense_name), part(si, spec, w, name)
    # Back to the model's head order: [full groups, streaming groups] -> kv head order.
    inverse = torch.argsort(torch.cat([fi, si]))
    out = torch.cat([out_f.view(b, len(full), group, n, d), out_s.view(b, len(stream), group, n, d)], 1)
    return out.index_select(1, inverse).view(b, heads, n, d)


def _run(q, k, v, spec: HybridAttentionConfig, w: int, padding, mask4, qs: int, name: str, scale) -> torch.Tensor:
    """One pattern for all heads given: keys already cut at the last query (unless ``mask4``)."""
    if mask4 is not None:
        return _sdpa_with_4d_mask(q, k, v, spec, w, mask4, qs, scale)
    q_len, length = q.shape[2], k.shape[2]
    heads, kv_heads = q.shape[1], k.shape[1]
    if name == "auto":
        name = _auto_backend(q, spec, w, padding, q_len, length)
    if name == "dense":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
    if name == "sdpa":
        return _masked_sdpa(q, k, v, spec, w, padding, scale)
    if name == "flex":
        if not q.is_cuda:
            raise HybridAttentionError("backend 'flex' needs CUDA tensors; use 'blocksparse' (or 'sdpa') on CPU")
        if not flex.available():
            raise HybridAttentionError("backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        return flex.flex_hybrid_attention(q, k, v, spec, w, padding=padding, scale=scale)
    return _blocksparse(q, k, v, spec, w, padding, scale)


def _auto_backend(q: torch.Tensor, spec: HybridAttentionConfig, window: int, padding: torch.Tensor | None,
                  q_len: int, length: int) -> str:
    if q.is_cuda and flex.available():
        return "flex"
    if padding is None and q_len == length and length <= spec.sink_tokens + window:
        return "dense"  # every query sees every earlier key: the pattern is plain causal attention
    if q_len <= DECODE_MAX_QUERIES:
        return "sdpa"
    return "blocksparse"


def _masked_sdpa(q, k, v, spec, window, padding, scale) -> torch.Tensor:
    mask = query_key_mask(q.shape[2], k.shape[2], spec, attention_mask=padding, window=window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _sdpa_with_4d_mask(q, k, v, spec, window, mask4, query_start, scale) -> torch.Tensor:
    pattern = query_key_mask(q.shape[2], k.shape[2], spec, window=window, query_start=query_start, device=q.device)
    if mask4.dtype == torch.bool:
        mask = mask4 & pattern
    else:
        mask = mask4.masked_fill(~pattern, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _blocksparse(q, k, v, spec, window, padding, scale) -> torch.Tensor:
    if padding is None:
        return _blocksparse_unpadded(q, k, v, spec, window, scale)
    b, heads, q_len, _ = q.shape
    k_len = k.shape[2]
    idx = torch.arange(k_len, device=padding.device)
    count = padding.sum(-1)
    first = torch.where(padding, idx, k_len).amin(-1)
    end = torch.where(padding, idx, -1).amax(-1) + 1
    if not bool(((count == end - first) | (count == 0)).all()):
        return _masked_sdpa(q, k, v, spec, window, padding, scale)  # holes inside a row: no contiguous layout
    qs = k_len - q_len
    # Padded query rows see only their own key (as in the reference), so their output is that value.
    out = v[:, :, qs:].repeat_interleave(heads // k.shape[1], dim=1).to(q.dtype)
    groups: dict[tuple[int, int, int], list[int]] = {}
    for row, (a, e, n) in enumerate(zip(first.tolist(), end.tolist(), count.tolist())):
        qa, qe = max(qs, a), min(k_len, e)
        if n and qa < qe:
            groups.setdefault((a, qa, qe), []).append(row)
    for (a, qa, qe), rows in groups.items():
        r = torch.tensor(rows, device=q.device)
        res = _blocksparse_unpadded(q[r, :, qa - qs:qe - qs], k[r, :, a:qe], v[r, :, a:qe], spec, window, scale)
        out = out.index_put((r.view(-1, 1, 1), torch.arange(heads, device=q.device).view(1, -1, 1),
                             torch.arange(qa - qs, qe - qs, device=q.device).view(1, 1, -1)), res)
    return out


def _blocksparse_unpadded(q, k, v, spec, window, scale) -> torch.Tensor:
    out = blocksparse_attention(q, k, v, spec, window, scale=scale)
    if spec.global_rows and spec.global_every > 0:
        out = _full_global_rows(out, q, k, v, spec, scale)
    return out


def _full_global_rows(out, q, k, v, spec, scale) -> torch.Tensor:
    """Overwrite the rows of global query tokens with full causal attention (``global_rows=True``)."""
    q_len, k_len = q.shape[2], k.shape[2]
    qpos = torch.arange(k_len - q_len, k_len, device=q.device)
    is_row = qpos % spec.global_every == 0
    if spec.max_globals is not None:
        is_row &= qpos // spec.global_every < spec.max_globals
    sel = is_row.nonzero().flatten()
    if sel.numel() == 0:
        return out
    mask = torch.arange(k_len, device=q.device).unsqueeze(0) <= qpos[sel].unsqueeze(1)
    rows = F.scaled_dot_product_attention(q[:, :, sel], k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
    return out.index_copy(2, sel, rows.to(out.dtype))
