"""Block-sparse hybrid attention in plain PyTorch ops (CPU and GPU), forward and backward.

Queries are cut into blocks of ``B`` rows. Block ``t`` needs two key sets:

* one contiguous local span ``[start_t - m*B, start_t + B)`` with ``m*B >= window - 1``. Keys are laid
  out so that every span is a slice of one padded buffer: no gather, and the backward pass folds the
  overlapping span gradients back with ``m + 1`` shifted adds;
* the sink and global keys (a short sorted index list ``G``), counted only where they lie *outside*
  the local window (``j <= i - window``) so that no key is counted twice.

Work is ``n * (|G| + (m + 1) * B)`` instead of ``n**2 / 2``.

Inference on CPU makes a handful of calls to torch's fused CPU flash-attention op, which also returns
the log-sum-exp (see ``_forward_flash``): the first ~window rows densely, every other block's local
span in one call (blocks in the batch dim, the spans an overlapping view of the keys, one
``[B, (m+1)*B]`` band mask for all), then the sink/global keys, merged by log-sum-exp. Few calls and
few large temporaries matter: on a shared 2-core machine every parallel region can wait a scheduler
slice for the second core, and fresh pages cost ~2 us each. A small block (``INFERENCE_BLOCK``) wastes
fewer masked span columns; the flash op tiles queries itself.

Training (and other devices) processes blocks a few at a time (each chunk's keys are the visible
globals followed by the block's span, with a precomputed additive mask) so that score tiles stay in
cache; it computes fp32 scores with matmuls to keep the log-sum-exp, and the backward pass recomputes
probabilities from it instead of storing them: memory is O(n * head_dim) beyond the inputs, never
[n, n].

Rows that ``global_rows=True`` turns into full rows are not handled here; ``attention.functional``
overwrites them with a small dense computation.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

import torch

from attention.spec import HybridAttentionConfig

NEG_INF = float("-inf")
DEFAULT_BLOCK = 128  # training / chunked path: big enough for efficient matmuls
# Inference (flash) path: the span (m+1)*B is 544 keys instead of 640 for window 512. Measured at 4K:
# 32 beats 64 by ~4% and 128 by ~12%; 16 is slower again (the flash op tiles queries by 32).
INFERENCE_BLOCK = 32
# Global keys, flash path: one masked call when the [rows, G] mask has at most this many elements
# (4K: 0.47M; fewest calls), else mask-free row segments (8K: 1.04M; the mask's memory traffic
# costs ~3% at 8K, ~8% at 16K) with runs of pieces shorter than MIN_GLOBAL_ROWS merged.
GLOBAL_MASK_ELEMENTS = 1 << 19
MIN_GLOBAL_ROWS = 256
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

    @functools.cached_property
    def chunk_bias(self) -> tuple[torch.Tensor, ...]:
        """Per chunk ``[t1 - t0, B, cnt + (m+1)*B]`` additive mask, globals then span (chunked path only)."""
        return tuple(torch.cat([self.global_bias(t0, t1, cnt), self.local_bias(t0, t1)], -1).contiguous()
                     for t0, t1, cnt in self.chunks)

    @property
    def early_rows(self) -> int:
        """Flash path: the first query rows, whose local span would start before position 0."""
        return min(self.q_len, max(0, self.back * self.block - self.q_offset))

    @functools.cached_property
    def early_mask(self) -> torch.Tensor | None:
        """``[R, q_offset + R]`` additive mask of the ``R`` early rows over all earlier keys (flash path).

        ``None`` where it is plain causal attention: no offset and every row within the window.
        """
        R, n_keys = self.early_rows, self.q_offset + self.early_rows
        if self.q_offset == 0 and R <= self.window:
            return None
        dev = self.global_idx.device
        i = self.q_offset + torch.arange(R, device=dev).unsqueeze(1)
        j = torch.arange(n_keys, device=dev)
        is_global = torch.zeros(n_keys, dtype=torch.bool, device=dev)
        is_global[self.global_idx[self.global_idx < n_keys]] = True
        ok = (j <= i) & ((i - j < self.window) | is_global)
        return torch.zeros(ok.shape, device=dev).masked_fill_(~ok, NEG_INF)

    @functools.cached_property
    def global_segments(self) -> tuple[tuple[int, int, int, torch.Tensor | None], ...]:
        """``(r0, r1, count, mask)``: rows ``[r0, r1)`` past the early ones see global keys ``G[:count]``.

        Flash path. Global ``g`` becomes visible at row ``g + window - q_offset``. Between such rows
        the count is constant and a segment needs no mask; runs of short pieces (the sink ramp,
        dense globals), or all pieces when the mask is small, are merged into one call with a
        ``[r1 - r0, count]`` additive mask.
        """
        g = self.global_idx.tolist()
        starts = [max(self.early_rows, p + self.window - self.q_offset) for p in g]
        bounds = sorted({s for s in starts if s < self.q_len}) + [self.q_len]
        pieces = list(zip(bounds[:-1], bounds[1:]))
        one_call = pieces and (self.q_len - pieces[0][0]) * len(g) <= GLOBAL_MASK_ELEMENTS
        min_rows = self.q_len + 1 if one_call else MIN_GLOBAL_ROWS
        segs = []
        i = 0
        while i < len(pieces):
            j = i + 1
            if pieces[i][1] - pieces[i][0] < min_rows:
                while j < len(pieces) and pieces[j][1] - pieces[j][0] < min_rows:
                    j += 1
            r0, r1 = pieces[i][0], pieces[j - 1][1]
            count = bisect.bisect_right(starts, r1 - 1)
            mask = None
            if j > i + 1:
                qpos = self.q_offset + torch.arange(r0, r1, device=self.global_idx.device)
                ok = self.global_idx[:count].unsqueeze(0) <= (qpos - self.window).unsqueeze(1)
                mask = torch.zeros(ok.shape, device=ok.device).masked_fill_(~ok, NEG_INF)
            segs.append((r0, r1, count, mask))
            i = j
        return tuple(segs)

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
        ob, lse = _forward(q, k, v, plan, scale)
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
            ds = torch.matmul(_up(doc), _up(vals).transpose(-1, -2)).sub_(delta[:, :, t0:t1]).mul_(p)
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
    """``[b, kvh, cb, R, K]`` masked scores in the accumulation dtype (queries are pre-scaled).

    The product itself runs in that dtype: half-precision scores, rounded before the softmax, cost ~10x
    the output error of fp32 ones (and the backward's ``dP - delta`` cancels what is left).
    """
    s = torch.matmul(_up(qc), _up(keys).transpose(-1, -2))
    b, kvh, cb, R, K = s.shape
    B = bias.shape[1]
    s.view(b, kvh, cb, R // B, B, K).add_(bias.unsqueeze(1))
    return s


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, scale: float):
    """Chunked matmul path: blocked output ``[b, kvh, T, R, d]`` and log-sum-exp ``[b, kvh, T, R, 1]``."""
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


@functools.cache
def cpu_flash_op():
    """torch's fused CPU flash-attention op (it returns the log-sum-exp), or None where missing or without GQA."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    try:  # fewer KV than query heads reached the CPU op in torch 2.9; a private op may also change
        op(torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8))
    except (RuntimeError, TypeError):
        return None
    return op


def merge_partial_attention(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor
                            ) -> torch.Tensor:
    """In place, ``out`` becomes the attention over two disjoint key sets from each set's own result.

    Softmax over both sets = the two partial outputs weighted by their share of the probability mass.

    Args:
        out, other: ``[b, h, q, d]`` attention over each key set; lse, other_lse: ``[b, h, q]``
            their log-sum-exp.
    Returns:
        ``out``.
    """
    return out.lerp_(other, torch.sigmoid(other_lse - lse).unsqueeze(-1).to(out.dtype))


def _span_view(x: torch.Tensor, lo: int, count: int, block: int, span: int) -> torch.Tensor:
    """``[count, b * kvh, span, d]`` overlapping view: span ``t`` is rows ``lo + t*block ..`` of ``x``.

    Batch and KV heads merge into one dim (the flash op's heads). A view straight into ``x`` where
    they can and the spans end inside it; otherwise into a zero-padded copy of the rows they cover
    (a ragged last block reads past the last key, and only padded query rows see those zeros).
    """
    b, kvh, k_len, d = x.shape
    hi = lo + (count - 1) * block + span
    if hi > k_len or x.stride(3) != 1 or (b > 1 and x.stride(0) != kvh * x.stride(1)):
        # pad keeps a permuted layout (transformers' [b, n, kvh, d] view): make it [b, kvh, n, d].
        x = torch.nn.functional.pad(x[:, :, lo:min(hi, k_len)], (0, 0, 0, max(0, hi - k_len))).contiguous()
        lo = 0
    s = x.stride()
    return x.as_strided((count, b * kvh, span, d), (block * s[2], s[1], s[2], s[3]), x.storage_offset() + lo * s[2])


def _forward_flash(op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan, scale: float) -> torch.Tensor:
    """Inference output ``[b, h, q_len, d]`` through the fused CPU flash op, in few calls.

    * The ``R`` early rows (their span would start before position 0) in one call over all earlier
      keys: plain causal for a prefill, else with ``plan.early_mask``.
    * The other rows in blocks of ``B``: blocks go to the op's batch dim and (batch, head) to its
      head dim, so one ``[1, 1, B, L]`` band mask serves all blocks, the key spans are a view into
      the keys, and GQA maps query head ``j`` to KV head ``j // group`` as the op expects.
    * The sink/global keys outside the window, per ``plan.global_segments``, merged by log-sum-exp.
    """
    q, k, v = (x if x.stride(3) == 1 else x.contiguous() for x in (q, k, v))  # the op reads rows whole
    b, h, n, d = q.shape
    B, L, R = plan.block, (plan.back + 1) * plan.block, plan.early_rows
    parts = []
    if R:
        n_keys, mask = plan.q_offset + R, plan.early_mask
        o, _ = op(q[:, :, :R], k[:, :, :n_keys], v[:, :, :n_keys], is_causal=mask is None,
                  attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)
        parts.append(o.reshape(b * h, R, d))
    if R < n:
        T = -(-(n - R) // B)
        qm = q[:, :, R:]
        if T * B != n - R:
            qm = torch.nn.functional.pad(qm, (0, 0, 0, T * B - (n - R)))
        qb = qm.reshape(b * h, T, B, d).transpose(0, 1)  # [T, b*h, B, d]; a view for batch 1
        lo = plan.q_offset + R - plan.back * B  # key position where the first block's span starts (>= 0)
        o, lse = op(qb, _span_view(k, lo, T, B, L), _span_view(v, lo, T, B, L),
                    attn_mask=plan.band_bias.view(1, 1, B, L).to(q.dtype), scale=scale)
        # The op's output [T, b*h, B, d] lies in memory as [b*h, T, B, d] (like the queries): views.
        parts.append(o.transpose(0, 1).reshape(b * h, T * B, d)[:, : n - R])
        lse = lse.transpose(0, 1).reshape(b, h, T * B)
    out = (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).view(b, h, n, d)
    if plan.global_segments:
        kg, vg = k.index_select(2, plan.global_idx), v.index_select(2, plan.global_idx)
        for r0, r1, cnt, mask in plan.global_segments:
            og, lg = op(q[:, :, r0:r1], kg[:, :, :cnt], vg[:, :, :cnt],
                        attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)
            merge_partial_attention(out[:, :, r0:r1], lse[:, :, r0 - R:r1 - R], og, lg)
    return out


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
        block: query block size (default: ``INFERENCE_BLOCK`` for CPU inference, else ``DEFAULT_BLOCK``;
            less for small windows).
    Returns:
        ``[batch, heads, q_len, head_dim]`` in the dtype of ``q``.
    """
    q_len, k_len, d = q.shape[2], k.shape[2], q.shape[3]
    # No key lies k_len or more positions back: a wider window is the same pattern, but would widen every
    # block's local span (work and memory O(q_len * window)) to keys that do not exist.
    window = min(window, k_len)
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    flash = None if training or q.device.type != "cpu" else cpu_flash_op()
    if block is None:
        block = DEFAULT_BLOCK if flash is None else INFERENCE_BLOCK
        while block > 16 and block > window:
            block //= 2
    rows = q.shape[0] * q.shape[1] * block
    plan = _plan(q_len, k_len - q_len, spec.sink_tokens, spec.global_every, spec.max_globals, window, block,
                 rows, q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if training:
        return _BlockSparseAttention.apply(q, k, v, plan, scale)
    if flash is not None:
        return _forward_flash(flash, q, k, v, plan, scale)
    ob, _ = _forward(q, k, v, plan, scale)
    return _unblocks(ob, plan, q.shape[1])
