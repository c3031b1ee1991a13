"""Block-sparse hybrid attention in plain PyTorch ops (CPU and GPU), forward and backward.

Queries are cut into blocks of ``B`` rows. Block ``t`` needs two key sets:

* one contiguous local span ``[start_t - m*B, start_t + B)`` with ``m*B >= window - 1``. Keys are laid
  out so that every span is a slice of one padded buffer: no gather, and the backward pass folds the
  overlapping span gradients back with ``m + 1`` shifted adds;
* the sink and global keys (a short sorted index list ``G``), counted only where they lie *outside*
  the local window (``j <= i - window``) so that no key is counted twice.

Work is ``n * (|G| + (m + 1) * B)`` instead of ``n**2 / 2``. Blocks are processed a few at a time so
that the score tiles stay in cache; the softmax is assembled from the two parts with fp32 running
max / sum (flash-attention style), and the backward pass recomputes scores from the saved
log-sum-exp instead of keeping probabilities: memory is O(n * head_dim) beyond the inputs.

Rows that ``global_rows=True`` turns into full rows are not handled here; ``attention.functional``
overwrites them with a small dense computation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from attention.spec import HybridAttentionConfig

NEG_INF = float("-inf")
DEFAULT_BLOCK = 128
# Score elements per chunk of blocks: large enough to amortise Python overhead, small enough for L2/L3.
CHUNK_ELEMENTS = 1 << 20


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


@functools.lru_cache(maxsize=64)
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
    t_neg = min(T, max(0, -(-(-key_start) // B)))  # blocks whose span reaches negative positions
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
    return _Plan(q_len, q_offset, B, T, m, window, key_start, gidx, band_bias, early_bias, tuple(chunks))


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
        b, h, _, d = q.shape
        kvh = k.shape[1]
        qb = _blocks(q * scale, plan, kvh)  # [b, kvh, T, R, d], R = group * B
        kbuf, vbuf = _local_buffer(k, plan), _local_buffer(v, plan)
        kg = k.index_select(2, plan.global_idx)
        vg = v.index_select(2, plan.global_idx)
        ob = torch.empty_like(qb)
        lse = torch.empty(qb.shape[:-1], dtype=_acc_dtype(q.dtype), device=q.device)
        group = h // kvh
        for t0, t1, cnt in plan.chunks:
            o, lse_c = _chunk_forward(qb[:, :, t0:t1], kbuf, vbuf, kg, vg, plan, t0, t1, cnt, group)
            ob[:, :, t0:t1] = o
            lse[:, :, t0:t1] = lse_c
        ctx.save_for_backward(q, k, v, ob, lse)
        ctx.plan, ctx.scale = plan, scale
        return _unblocks(ob, plan, h)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, ob, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        b, h, _, d = q.shape
        kvh = k.shape[1]
        group = h // kvh
        B, L = plan.block, (plan.back + 1) * plan.block
        qb = _blocks(q * scale, plan, kvh)
        dob = _blocks(grad_out.to(q.dtype), plan, kvh)
        delta = (_up(dob) * _up(ob)).sum(-1)  # [b, kvh, T, R]: rowsum(dO * O) of the softmax backward
        kbuf, vbuf = _local_buffer(k, plan), _local_buffer(v, plan)
        kg = k.index_select(2, plan.global_idx)
        vg = v.index_select(2, plan.global_idx)
        dqb = torch.zeros_like(qb, dtype=_acc_dtype(q.dtype))
        dkbuf = torch.zeros(kbuf.shape, dtype=_acc_dtype(k.dtype), device=k.device)
        dvbuf = torch.zeros_like(dkbuf)
        dkg = torch.zeros(kg.shape, dtype=_acc_dtype(k.dtype), device=k.device)
        dvg = torch.zeros_like(dkg)
        dk_blocks = dkbuf.view(b, kvh, plan.blocks + plan.back, B, d)
        dv_blocks = dvbuf.view(b, kvh, plan.blocks + plan.back, B, d)
        for t0, t1, cnt in plan.chunks:
            cb = t1 - t0
            qc, doc = qb[:, :, t0:t1], dob[:, :, t0:t1]
            ks, vs = _spans(kbuf, plan, t0, t1), _spans(vbuf, plan, t0, t1)
            lse_c = lse[:, :, t0:t1].unsqueeze(-1)
            delta_c = delta[:, :, t0:t1].unsqueeze(-1)
            # Local part: [b, kvh, cb, R, L]
            p = _local_scores(qc, ks, plan, t0, t1, group).sub_(lse_c).exp_()
            dp = _up(torch.matmul(doc, vs.transpose(-1, -2)))
            ds = p * dp.sub_(delta_c)
            dqb[:, :, t0:t1] += _up(torch.matmul(ds.to(q.dtype), ks))
            dks = _up(torch.matmul(ds.transpose(-1, -2).to(q.dtype), qc)).view(b, kvh, cb, plan.back + 1, B, d)
            dvs = _up(torch.matmul(p.transpose(-1, -2).to(q.dtype), doc)).view(b, kvh, cb, plan.back + 1, B, d)
            for i in range(plan.back + 1):
                dk_blocks[:, :, t0 + i:t1 + i] += dks[:, :, :, i]
                dv_blocks[:, :, t0 + i:t1 + i] += dvs[:, :, :, i]
            if cnt:
                qf = qc.reshape(b, kvh, -1, d)
                dof = doc.reshape(b, kvh, -1, d)
                pg = _global_scores(qf, kg[:, :, :cnt], plan, t0, t1, cnt, group)
                pg = pg.sub_(lse_c.reshape(b, kvh, -1, 1)).exp_()
                dpg = _up(torch.matmul(dof, vg[:, :, :cnt].transpose(-1, -2)))
                dsg = pg * dpg.sub_(delta_c.reshape(b, kvh, -1, 1))
                dqb[:, :, t0:t1] += _up(torch.matmul(dsg.to(q.dtype), kg[:, :, :cnt])).view(qc.shape)
                dkg[:, :, :cnt] += _up(torch.matmul(dsg.transpose(-1, -2).to(q.dtype), qf))
                dvg[:, :, :cnt] += _up(torch.matmul(pg.transpose(-1, -2).to(q.dtype), dof))
        dq = _unblocks(dqb, plan, h) * scale
        dk = _fold_local(dkbuf, plan, k.shape[2])
        dv = _fold_local(dvbuf, plan, k.shape[2])
        dk.index_add_(2, plan.global_idx, dkg)
        dv.index_add_(2, plan.global_idx, dvg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _fold_local(buf: torch.Tensor, plan: _Plan, k_len: int) -> torch.Tensor:
    """Gradient of :func:`_local_buffer`: ``[b, kvh, rows, d]`` -> ``[b, kvh, k_len, d]``."""
    start = plan.key_start
    out = torch.zeros(buf.shape[0], buf.shape[1], k_len, buf.shape[3], dtype=buf.dtype, device=buf.device)
    lo = max(0, start)
    left = max(0, -start)
    n = min(k_len - lo, buf.shape[2] - left)
    out[:, :, lo:lo + n] = buf[:, :, left:left + n]
    return out


def _local_scores(qc: torch.Tensor, ks: torch.Tensor, plan: _Plan, t0: int, t1: int, group: int) -> torch.Tensor:
    """``[b, kvh, cb, R, L]`` fp32 masked scores of a chunk's queries against their local spans."""
    s = _up(torch.matmul(qc, ks.transpose(-1, -2)))
    b, kvh, cb, _, L = s.shape
    s.view(b, kvh, cb, group, plan.block, L).add_(plan.local_bias(t0, t1).unsqueeze(1))
    return s


def _global_scores(qf: torch.Tensor, kg: torch.Tensor, plan: _Plan, t0: int, t1: int, cnt: int,
                   group: int) -> torch.Tensor:
    """``[b, kvh, cb * R, cnt]`` fp32 masked scores against the sink/global keys."""
    s = _up(torch.matmul(qf, kg.transpose(-1, -2)))
    b, kvh = s.shape[:2]
    s.view(b, kvh, t1 - t0, group, plan.block, cnt).add_(plan.global_bias(t0, t1, cnt).unsqueeze(1))
    return s


def _chunk_forward(qc, kbuf, vbuf, kg, vg, plan: _Plan, t0: int, t1: int, cnt: int, group: int):
    b, kvh, cb, R, d = qc.shape
    ks, vs = _spans(kbuf, plan, t0, t1), _spans(vbuf, plan, t0, t1)
    s = _local_scores(qc, ks, plan, t0, t1, group)
    mx = s.amax(-1, keepdim=True)
    if cnt:
        qf = qc.reshape(b, kvh, cb * R, d)
        sg = _global_scores(qf, kg[:, :, :cnt], plan, t0, t1, cnt, group).view(b, kvh, cb, R, cnt)
        mx = torch.maximum(mx, sg.amax(-1, keepdim=True))
    p = s.sub_(mx).exp_()
    denom = p.sum(-1, keepdim=True)
    o = _up(torch.matmul(p.to(qc.dtype), vs))
    if cnt:
        pg = sg.sub_(mx).exp_()
        denom += pg.sum(-1, keepdim=True)
        o += _up(torch.matmul(pg.view(b, kvh, cb * R, cnt).to(qc.dtype), vg[:, :, :cnt])).view(o.shape)
    o.div_(denom)
    return o.to(qc.dtype), (mx + denom.log()).squeeze(-1)


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
    return _BlockSparseAttention.apply(q, k, v, plan, scale if scale is not None else 1.0 / math.sqrt(d))
