"""Block-sparse hybrid attention in plain PyTorch ops (CPU and GPU), forward and backward.

Queries are cut into blocks of ``B`` rows. Block ``t`` needs two key sets:

* one contiguous local span ``[start_t - m*B, start_t + B)`` with ``m*B >= window - 1``. Keys are laid
  out so that every span is a slice of one padded buffer: no gather, and the backward pass folds the
  overlapping span gradients back with ``m + 1`` shifted adds;
* the sink and global keys (a short sorted index list ``G``), counted only where they lie *outside*
  the local window (``j <= i - window``) so that no key is counted twice.

Work is ``n * (|G| + (m + 1) * B)`` instead of ``n**2 / 2``. Blocks are processed a few at a time
(each chunk's keys are the visible globals followed by the block's span, with a precomputed
additive mask) so that score tiles stay in cache. Inference runs each chunk through SDPA's fused
kernel; training computes fp32 scores with matmuls to keep the log-sum-exp, and the backward pass
recomputes probabilities from it instead of storing them: memory is O(n * head_dim) beyond the
inputs, never [n, n].

Rows that ``global_rows=True`` turns into full rows are not handled here; ``attention.functional``
overwrites them with a small dense computation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from attention.spec import HybridAttentionConfig

NEG_INF = float("-inf")
DEFAULT_BLOCK = 128
# Score elements per chunk of blocks: large enough to amortise Python overhead, small enough for L2/L3.
CHUNK_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class _Plan:
    """Index tables for one (length, offset, pattern) combination; cached, shared by forward and backward."""

    q_len: int
    q_offset: int  # absolute position of the first query; keys are positions [0, q_offset + q_len)
    block: int
    blocks: int  # T
    back: int  # m: local span = m + 1 blocks
    window: int
    key_start: int  # first key position held in the padded local buffer (may be negative)
    global_idx: torch.Tensor  # [G] sorted sink + global key positions
    band_bias: torch.Tensor  # [B, (m+1)*B] fp32, 0 / -inf
    early_bias: torch.Tensor  # [t_neg, B, (m+1)*B] fp32 for blocks whose span starts before position 0
    chunks: tuple[tuple[int, int, int], ...]  # (t0, t1, number of global keys any query in it can see)
    chunk_bias: tuple[torch.Tensor, ...] = ()  # per chunk [t1 - t0, B, cnt + (m+1)*B]: globals then span

    def local_bias(self, t0: int, t1: int) -> torch.Tensor:
        """``[t1 - t0, B, (m+1)*B]`` additive mask of the local spans of blocks ``t0..t1``."""
        t_neg = self.early_bias.shape[0]
        if t0 >= t_neg:
            return self.band_bias.unsqueeze(0).expand(t1 - t0, -1, -1)
        parts = [self.early_bias[t0:min(t1, t_neg)]]
        if t1 > t_neg:
            parts.append(self.band_bias.unsqueeze(0).expand(t1 - t_neg, -1, -1))
        return torch.cat(parts, 0)

    def global_bias(self, t0: int, t1: int, count: int) -> torch.Tensor:
        """``[t1 - t0, B, count]`` additive mask: a sink/global key counts only outside the local window."""
        qpos = self.q_offset + torch.arange(t0 * self.block, t1 * self.block, device=self.global_idx.device)
        ok = self.global_idx[:count].unsqueeze(0) <= (qpos - self.window).unsqueeze(1)
        bias = torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill_(~ok, NEG_INF)
        return bias.view(t1 - t0, self.block, count)


def global_positions(spec: HybridAttentionConfig, k_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[G]`` sorted positions of sink and global keys below ``k_len`` (no duplicates)."""
    sinks = torch.arange(min(spec.sink_tokens, k_len), device=device)
    if spec.global_every <= 0:
        return sinks
    glob = torch.arange(0, k_len, spec.global_every, device=device)
    if spec.max_globals is not None:
        glob = glob[: spec.max_globals]
    glob = glob[glob >= spec.sink_tokens]
    return torch.cat([sinks, glob])


@functools.lru_cache(maxsize=16)
def _plan(q_len: int, q_offset: int, sink: int, global_every: int, max_globals: int | None, window: int,
          block: int, rows_per_block: int, device: torch.device) -> _Plan:
    spec = HybridAttentionConfig(sink_tokens=sink, window=window, global_every=global_every,
                                 max_globals=max_globals)
    B = block
    T = -(-q_len // B)
    m = -(-(window - 1) // B)
    L = (m + 1) * B
    key_start = q_offset - m * B
    gidx = global_positions(spec, q_offset + q_len, device)

    # Local span of a block: query row r sits at span column m*B + r; key column c is allowed iff
    # 0 <= (m*B + r) - c < window.
    r = torch.arange(B, device=device).unsqueeze(1)
    c = torch.arange(L, device=device).unsqueeze(0)
    rel = m * B + r - c
    band = (rel >= 0) & (rel < window)
    band_bias = torch.zeros(B, L, device=device).masked_fill_(~band, NEG_INF)
    t_neg = min(T, max(0, -(key_start // B)))  # blocks whose span reaches negative positions
    if t_neg:
        kpos = key_start + torch.arange(t_neg, device=device).view(-1, 1, 1) * B + c.unsqueeze(0)
        early = band.unsqueeze(0) & (kpos >= 0)
        early_bias = torch.zeros(early.shape, device=device).masked_fill_(~early, NEG_INF)
    else:
        early_bias = torch.zeros(0, B, L, device=device)

    per_block = rows_per_block * (L + gidx.numel())
    step = max(1, CHUNK_ELEMENTS // max(1, per_block))
    chunks = []
    g_cpu = gidx.cpu()
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        last_q = q_offset + min(q_len, t1 * B) - 1
        count = int((g_cpu <= last_q - window).sum())
        chunks.append((t0, t1, count))
    plan = _Plan(q_len, q_offset, B, T, m, window, key_start, gidx, band_bias, early_bias, tuple(chunks))
    biases = tuple(torch.cat([plan.global_bias(t0, t1, cnt), plan.local_bias(t0, t1)], -1).contiguous()
                   for t0, t1, cnt in chunks)
    return dataclasses.replace(plan, chunk_bias=biases)


def _blocks(x: torch.Tensor, plan: _Plan, kv_heads: int) -> torch.Tensor:
    """``[b, h, n, d]`` -> ``[b, kv_heads, T, group * B, d]`` (zero-padded last block)."""
    b, h, n, d = x.shape
    B, T = plan.block, plan.blocks
    x = torch.nn.functional.pad(x, (0, 0, 0, T * B - n))
    x = x.view(b, kv_heads, h // kv_heads, T, B, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, kv_heads, T, (h // kv_heads) * B, d)


def _unblocks(x: torch.Tensor, plan: _Plan, heads: int) -> torch.Tensor:
    """Inverse of :func:`_blocks`: ``[b, kv_heads, T, group * B, d]`` -> ``[b, heads, n, d]``."""
    b, kvh, T, _, d = x.shape
    x = x.view(b, kvh, T, heads // kvh, plan.block, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, heads, T * plan.block, d)[:, :, : plan.q_len]


def _local_buffer(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """``[b, kvh, k_len, d]`` keys -> ``[b, kvh, (T + m) * B, d]``, row ``x`` = position ``key_start + x``."""
    start = plan.key_start
    need = (plan.blocks + plan.back) * plan.block
    src = x[:, :, max(0, start):]
    left = max(0, -start)
    right = need - left - src.shape[2]
    if right < 0:
        src, right = src[:, :, : src.shape[2] + right], 0
    return torch.nn.functional.pad(src, (0, 0, left, right))


def _spans(buf: torch.Tensor, plan: _Plan, t0: int, t1: int) -> torch.Tensor:
    """Overlapping view ``[b, kvh, t1 - t0, (m+1)*B, d]`` of the local spans of blocks ``t0..t1``."""
    b, kvh, rows, d = buf.shape
    B, L = plan.block, (plan.back + 1) * plan.block
    s = buf.stride()
    return buf.as_strided((b, kvh, t1 - t0, L, d), (s[0], s[1], B * s[2], s[2], s[3]),
                          buf.storage_offset() + t0 * B * s[2])


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / accumulation dtype: fp32 for half types, the input dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def _up(x: torch.Tensor) -> torch.Tensor:
    return x.to(_acc_dtype(x.dtype))


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, scale: float):
        ob, lse = _forward(q, k, v, plan, scale, need_lse=True)
        ctx.save_for_backward(q, k, v, ob, lse)
        ctx.plan, ctx.scale = plan, scale
        return _unblocks(ob, plan, q.shape[1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, ob, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        b, h, _, d = q.shape
        kvh = k.shape[1]
        B, m = plan.block, plan.back
        acc = _acc_dtype(q.dtype)
        qb = _blocks(q * scale, plan, kvh)
        dob = _blocks(grad_out.to(q.dtype), plan, kvh)
        delta = (_up(dob) * _up(ob)).sum(-1, keepdim=True)  # [b, kvh, T, R, 1]: rowsum(dO * O)
        kbuf, vbuf = _local_buffer(k, plan), _local_buffer(v, plan)
        kg, vg = k.index_select(2, plan.global_idx), v.index_select(2, plan.global_idx)
        dqb = torch.empty(qb.shape, dtype=acc, device=q.device)
        dkbuf = torch.zeros(kbuf.shape, dtype=acc, device=k.device)
        dvbuf = torch.zeros_like(dkbuf)
        dkg = torch.zeros(kg.shape, dtype=acc, device=k.device)
        dvg = torch.zeros_like(dkg)
        dk_blocks = dkbuf.view(b, kvh, plan.blocks + m, B, d)
        dv_blocks = dvbuf.view(b, kvh, plan.blocks + m, B, d)
        for (t0, t1, cnt), bias in zip(plan.chunks, plan.chunk_bias):
            cb = t1 - t0
            qc, doc = qb[:, :, t0:t1], dob[:, :, t0:t1]
            keys, vals = _chunk_keys(kbuf, kg, plan, t0, t1, cnt), _chunk_keys(vbuf, vg, plan, t0, t1, cnt)
            p = _scores(qc, keys, bias).sub_(lse[:, :, t0:t1]).exp_()  # [b, kvh, cb, R, cnt + L]
            ds = _up(torch.matmul(doc, vals.transpose(-1, -2))).sub_(delta[:, :, t0:t1]).mul_(p)
            dqb[:, :, t0:t1] = _up(torch.matmul(ds.to(q.dtype), keys))
            dkeys = _up(torch.matmul(ds.transpose(-1, -2).to(q.dtype), qc))  # [b, kvh, cb, cnt + L, d]
            dvals = _up(torch.matmul(p.transpose(-1, -2).to(q.dtype), doc))
            if cnt:
                dkg[:, :, :cnt] += dkeys[:, :, :, :cnt].sum(2)
                dvg[:, :, :cnt] += dvals[:, :, :, :cnt].sum(2)
            dks = dkeys[:, :, :, cnt:].view(b, kvh, cb, m + 1, B, d)
            dvs = dvals[:, :, :, cnt:].view(b, kvh, cb, m + 1, B, d)
            for i in range(m + 1):  # span i-th sub-block of block t is buffer block t + i
                dk_blocks[:, :, t0 + i:t1 + i] += dks[:, :, :, i]
                dv_blocks[:, :, t0 + i:t1 + i] += dvs[:, :, :, i]
        dq = _unblocks(dqb, plan, h) * scale
        dk = _fold_local(dkbuf, plan, k.shape[2]).index_add_(2, plan.global_idx, dkg)
        dv = _fold_local(dvbuf, plan, k.shape[2]).index_add_(2, plan.global_idx, dvg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _chunk_keys(buf: torch.Tensor, glob: torch.Tensor, plan: _Plan, t0: int, t1: int, cnt: int) -> torch.Tensor:
    """``[b, kvh, t1 - t0, cnt + L, d]``: the visible sink/global keys, then each block's local span."""
    spans = _spans(buf, plan, t0, t1)
    if not cnt:
        return spans
    b, kvh, cb, _, d = spans.shape
    return torch.cat([glob[:, :, None, :cnt].expand(b, kvh, cb, cnt, d), spans], 3)


def _scores(qc: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``[b, kvh, cb, R, K]`` masked scores in the accumulation dtype (queries are pre-scaled)."""
    s = _up(torch.matmul(qc, keys.transpose(-1, -2)))
    b, kvh, cb, R, K = s.shape
    B = bias.shape[1]
    s.view(b, kvh, cb, R // B, B, K).add_(bias.unsqueeze(1))
    return s


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, scale: float, need_lse: bool):
    """Blocked output ``[b, kvh, T, R, d]`` and, if asked, log-sum-exp ``[b, kvh, T, R, 1]``."""
    if not need_lse:
        return _forward_fused(q, k, v, plan, scale), None
    kvh = k.shape[1]
    qb = _blocks(q * scale, plan, kvh)  # [b, kvh, T, R, d], R = group * B
    kbuf, vbuf = _local_buffer(k, plan), _local_buffer(v, plan)
    kg, vg = k.index_select(2, plan.global_idx), v.index_select(2, plan.global_idx)
    ob = torch.empty_like(qb)
    lse = torch.empty((*qb.shape[:-1], 1), dtype=_acc_dtype(q.dtype), device=q.device)
    for (t0, t1, cnt), bias in zip(plan.chunks, plan.chunk_bias):
        keys, vals = _chunk_keys(kbuf, kg, plan, t0, t1, cnt), _chunk_keys(vbuf, vg, plan, t0, t1, cnt)
        s = _scores(qb[:, :, t0:t1], keys, bias)
        lse[:, :, t0:t1] = torch.logsumexp(s, -1, keepdim=True)
        ob[:, :, t0:t1] = torch.matmul(torch.softmax(s, -1).to(q.dtype), vals)
    return ob, lse


def _forward_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, scale: float) -> torch.Tensor:
    """Inference forward: each chunk of blocks is one fused SDPA call with the chunk's additive mask.

    SDPA's fused kernel keeps score tiles in cache (measurably faster than matmul + softmax on CPU)
    but does not return the log-sum-exp the backward pass needs, hence training uses ``_forward``.
    Blocks go to SDPA's batch dim and (batch, kv head, group) to its head dim, so the mask
    ``[cb, 1, B, K]`` broadcasts over heads and GQA maps query head ``j`` to key head ``j // group``.
    """
    b, h, _, d = q.shape
    kvh = k.shape[1]
    group, B = h // kvh, plan.block
    qb = _blocks(q, plan, kvh)
    kbuf, vbuf = _local_buffer(k, plan), _local_buffer(v, plan)
    kg, vg = k.index_select(2, plan.global_idx), v.index_select(2, plan.global_idx)
    ob = torch.empty_like(qb)
    for (t0, t1, cnt), bias in zip(plan.chunks, plan.chunk_bias):
        cb = t1 - t0
        keys = _chunk_keys(kbuf, kg, plan, t0, t1, cnt).permute(2, 0, 1, 3, 4).reshape(cb, b * kvh, -1, d)
        vals = _chunk_keys(vbuf, vg, plan, t0, t1, cnt).permute(2, 0, 1, 3, 4).reshape(cb, b * kvh, -1, d)
        qc = qb[:, :, t0:t1].permute(2, 0, 1, 3, 4).reshape(cb, b * kvh * group, B, d)
        o = torch.nn.functional.scaled_dot_product_attention(
            qc, keys, vals, attn_mask=bias.unsqueeze(1).to(q.dtype), scale=scale, enable_gqa=group > 1)
        ob[:, :, t0:t1] = o.view(cb, b, kvh, group * B, d).permute(1, 2, 0, 3, 4)
    return ob


def _fold_local(buf: torch.Tensor, plan: _Plan, k_len: int) -> torch.Tensor:
    """Gradient of :func:`_local_buffer`: ``[b, kvh, rows, d]`` -> ``[b, kvh, k_len, d]``."""
    start = plan.key_start
    out = torch.zeros(buf.shape[0], buf.shape[1], k_len, buf.shape[3], dtype=buf.dtype, device=buf.device)
    lo = max(0, start)
    left = max(0, -start)
    n = min(k_len - lo, buf.shape[2] - left)
    out[:, :, lo:lo + n] = buf[:, :, left:left + n]
    return out


def blocksparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: HybridAttentionConfig,
                          window: int, *, scale: float | None = None, block: int | None = None) -> torch.Tensor:
    """Hybrid attention for one unpadded layout, work O(n * (sink + window + n / global_every)).

    Args:
        q: ``[batch, heads, q_len, head_dim]``; queries are the *last* ``q_len`` key positions.
        k, v: ``[batch, kv_heads, k_len, head_dim]``, ``k_len >= q_len``, ``heads % kv_heads == 0``.
        spec: the pattern (``global_rows`` is ignored here, see ``attention.functional``).
        window: the local window to use (already resolved from the policy / override).
        scale: softmax scale, default ``head_dim ** -0.5``.
        block: query block size (default: 128, or less for small windows).
    Returns:
        ``[batch, heads, q_len, head_dim]`` in the dtype of ``q``.
    """
    q_len, k_len, d = q.shape[2], k.shape[2], q.shape[3]
    if block is None:
        block = DEFAULT_BLOCK
        while block > 16 and block > window:
            block //= 2
    rows = q.shape[0] * q.shape[1] * block
    plan = _plan(q_len, k_len - q_len, spec.sink_tokens, spec.global_every, spec.max_globals, window, block,
                 rows, q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _BlockSparseAttention.apply(q, k, v, plan, scale)
    ob, _ = _forward(q, k, v, plan, scale, need_lse=False)  # inference: no log-sum-exp, nothing saved
    return _unblocks(ob, plan, q.shape[1])
