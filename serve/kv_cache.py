"""Preallocated KV caches: one layout serves dense and hybrid (bounded) models.

Every row of the batch owns a fixed set of slots ``[batch, kv_heads, slots, head_dim]`` per layer:

* ``persistent`` slots first: the sink tokens (positions ``< sink_tokens``), then the periodic global
  tokens outside the sinks (the first ``max_globals``), written once and never evicted;
* a ring of ``ring`` slots: position ``p`` of a row with window ``w`` lands in ring slot ``p % w``,
  overwriting ``p - w``, the key that just left the window;
* one trash slot at the end that decode steps write into when a token needs no persistent slot, so a
  step never branches on data (the trash slot is never visible).

A dense model is the same cache with no persistent slots and a ring as long as the context, so
``p % w == p`` and nothing is ever evicted.

Keys are stored *after* RoPE at their absolute positions, exactly as the model saw them in training.
Evicting a key therefore never re-rotates the survivors, and a query attends to precisely the keys the
hybrid mask allows it, with the same rotations: decoding from this cache equals recomputing the whole
sequence with :func:`attention.masks.hybrid_mask` at every step.

A sink or global key still inside the window lives in both its persistent slot and the ring; the mask
shows the ring copy while ``i - p < w`` and the persistent copy afterwards, so no key counts twice.

Memory: ``sink_tokens + globals + window`` slots per row whatever the generated length. With
``global_every > 0`` and ``max_globals=None`` the globals grow with the sequence; the cache then
preallocates the globals for ``max_seq_len`` positions (``max_seq_len / global_every`` slots, still
constant during generation). ``global_rows=True`` needs the whole history and is refused.

Per-head roles (``spec.full_heads`` / ``full_layers``): :class:`MixedKVCache` keeps two of these
caches over flat (layer, KV head) pairs, a dense one for the full heads and a bounded one for the
streaming heads; each pair's keys sit in one head slot of its cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from attention.spec import HybridAttentionConfig


class KVCache(nn.Module):
    """Per-layer key/value buffers plus the absolute position held by every slot.

    Buffers: ``k``, ``v``: ``[layers, rows, kv_heads, slots, head_dim]``; ``slot_pos``: ``[rows, slots]``
    (int64, ``-1`` = empty); ``window``: ``[rows]`` (int64, the ring length each row uses).
    """

    def __init__(self, *, layers: int, rows: int, kv_heads: int, head_dim: int, max_seq_len: int,
                 spec: HybridAttentionConfig | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.spec = spec
        self.max_seq_len = max_seq_len
        if spec is None:
            self.sinks, self.first_global, n_globals, ring = 0, 0, 0, max_seq_len
        else:
            if spec.global_rows:
                raise ValueError("global_rows=True needs the whole history at decode time; export the model "
                                 "with global_rows=False to serve it with a bounded cache")
            self.sinks = min(spec.sink_tokens, max_seq_len)
            if spec.global_every > 0:
                # Globals at positions < sink_tokens are already sinks; count the rest.
                self.first_global = math.ceil(self.sinks / spec.global_every)
                reachable = math.ceil(max_seq_len / spec.global_every)
                total = reachable if spec.max_globals is None else min(spec.max_globals, reachable)
                n_globals = max(0, total - self.first_global)
            else:
                self.first_global, n_globals = 0, 0
            # The ring holds the largest window the policy can pick for this engine's lengths.
            ring = min(max(spec.windows), max_seq_len)
        self.n_globals = n_globals
        self.persistent = self.sinks + n_globals
        self.ring = ring
        self.trash = self.persistent + ring
        slots = self.trash + 1
        shape = (layers, rows, kv_heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("slot_pos", torch.full((rows, slots), -1, dtype=torch.long, device=device),
                             persistent=False)
        self.register_buffer("window", torch.full((rows,), ring, dtype=torch.long, device=device),
                             persistent=False)
        is_ring = torch.zeros(slots, dtype=torch.bool, device=device)
        is_ring[self.persistent:self.trash] = True
        self.register_buffer("is_ring", is_ring, persistent=False)

    # ---- bookkeeping -------------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def bounded(self) -> bool:
        return self.spec is not None

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers (the memory that scales with context)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def window_for(self, total_len: int) -> int:
        """The window a request of ``total_len`` tokens uses (the spec's policy; the whole ring if dense)."""
        if self.spec is None:
            return self.ring
        return min(self.spec.window_for(total_len), self.ring)

    def copy_rows_from(self, old: KVCache) -> None:
        """Copy every row of ``old`` (a cache of the same layout with fewer rows) into the first rows."""
        n = old.rows
        self.k[:, :n].copy_(old.k)
        self.v[:, :n].copy_(old.v)
        self.slot_pos[:n].copy_(old.slot_pos)
        self.window[:n].copy_(old.window)

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes per kind of head: every head is full in a dense cache, streaming in a bounded one."""
        return {"full": 0 if self.bounded else self.nbytes(), "streaming": self.nbytes() if self.bounded else 0}

    def reset_row(self, row: int, window: int) -> None:
        self.slot_pos[row].fill_(-1)
        self.window[row] = window

    def used_slots(self, max_pos: int) -> int:
        """How many leading slots can hold a key when no row is past ``max_pos`` (attend to no more)."""
        if self.bounded:
            return self.trash
        return min(self.ring, max_pos + 1)

    def _persistent_slot(self, pos: torch.Tensor) -> torch.Tensor:
        """Persistent slot of each position, ``self.trash`` when it needs none. ``pos``: any shape, int64."""
        slot = torch.full_like(pos, self.trash)
        if self.sinks:
            slot = torch.where(pos < self.sinks, pos, slot)
        if self.n_globals:
            ge = self.spec.global_every
            g = pos // ge - self.first_global
            is_g = (pos % ge == 0) & (pos >= self.sinks) & (g >= 0) & (g < self.n_globals)
            slot = torch.where(is_g, self.sinks + g, slot)
        return slot

    # ---- masks -------------------------------------------------------------------------------------------

    def visible(self, q_pos: torch.Tensor, rows: slice | torch.Tensor, n_slots: int) -> torch.Tensor:
        """Which cached slots each query sees.

        Args:
            q_pos: ``[batch, q]`` absolute query positions.
            rows: the cache rows of the batch.
            n_slots: attend to the first ``n_slots`` slots only.
        Returns:
            ``[batch, 1, q, n_slots]`` bool.
        """
        p = self.slot_pos[rows, :n_slots].unsqueeze(1)  # [b, 1, s]
        d = q_pos.unsqueeze(-1) - p  # [b, q, s]
        w = self.window[rows].view(-1, 1, 1)
        in_window = d < w
        ok = (p >= 0) & (d >= 0) & torch.where(self.is_ring[:n_slots], in_window, ~in_window)
        return ok.unsqueeze(1)

    # ---- writes ------------------------------------------------------------------------------------------

    def prefill_slots(self, row: int, positions: torch.Tensor
                      ) -> tuple[torch.Tensor | slice, torch.Tensor | slice]:
        """Where a prefill chunk of one row goes: ``(chunk_index, slot)`` pairs, each slot once.

        Only the last ``window`` positions of the chunk reach the ring (earlier ones would be overwritten
        within the same chunk), and sinks/globals also go to their persistent slots. A dense row holds
        position ``p`` at slot ``p``: there both are slices, so the writes are plain copies rather than
        a gather and a scatter per layer.
        """
        n = positions.shape[0]
        if not self.bounded:
            start = int(positions[0]) if n else 0
            return slice(0, n), slice(start, start + n)
        w = int(self.window[row])
        keep = torch.arange(max(0, n - w), n, device=positions.device)
        ring_slot = self.persistent + positions[keep] % w
        pslot = self._persistent_slot(positions)
        has_p = pslot != self.trash
        idx = torch.cat([keep, has_p.nonzero().flatten()])
        slot = torch.cat([ring_slot, pslot[has_p]])
        return idx, slot

    def write_prefill(self, layer: int, row: int, idx: torch.Tensor | slice, slot: torch.Tensor | slice,
                      k: torch.Tensor, v: torch.Tensor, heads: slice = slice(None)) -> None:
        """Store a chunk's keys/values. ``k``, ``v``: ``[kv_heads, chunk, head_dim]`` (of the ``heads`` range)."""
        self.k[layer, row, heads][:, slot] = k[:, idx]
        self.v[layer, row, heads][:, slot] = v[:, idx]

    def commit_prefill(self, row: int, positions: torch.Tensor, idx: torch.Tensor | slice,
                       slot: torch.Tensor | slice) -> None:
        self.slot_pos[row, slot] = positions[idx]

    def decode_slots(self, rows: slice, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring and persistent slot for one new token per row; records the positions. ``pos``: ``[batch]``."""
        ring_slot = self.persistent + pos % self.window[rows]
        pslot = self._persistent_slot(pos)
        r = torch.arange(pos.shape[0], device=pos.device)
        sp = self.slot_pos[rows]
        sp[r, ring_slot] = pos
        sp[r, pslot] = pos
        sp[:, self.trash] = -1
        return ring_slot, pslot

    def write_decode(self, layer: int, rows: slice, ring_slot: torch.Tensor, pslot: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor, heads: slice = slice(None)) -> None:
        """Store one token per row. ``k``, ``v``: ``[batch, kv_heads, head_dim]`` (of the ``heads`` range)."""
        r = torch.arange(k.shape[0], device=k.device)
        kl, vl = self.k[layer, rows, heads], self.v[layer, rows, heads]
        kl[r, :, ring_slot] = k
        vl[r, :, ring_slot] = v
        if self.persistent:
            kl[r, :, pslot] = k
            vl[r, :, pslot] = v


class MixedKVCache(nn.Module):
    """Full heads in a dense cache, streaming heads in a bounded one (per-head roles of the spec).

    Each cache is a :class:`KVCache` with one "layer" whose heads are the flat (layer, KV head) pairs
    of its kind, in layer order, so the pairs of one layer are a contiguous head range:
    ``full.k[0, rows, a:b]`` for ``(a, b) = full_range[layer]``. Both keep their own slot positions
    and masks; a row's window is the streaming cache's.
    """

    def __init__(self, *, layers: int, rows: int, kv_heads: int, head_dim: int, max_seq_len: int,
                 spec: HybridAttentionConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        spec.check_model(layers, kv_heads)
        self.spec = spec
        self.max_seq_len = max_seq_len
        self.full_heads = [spec.full_kv_heads(li, kv_heads) for li in range(layers)]
        self.stream_heads = [tuple(h for h in range(kv_heads) if h not in f) for f in self.full_heads]
        self.full_range, self.stream_range = _ranges(self.full_heads), _ranges(self.stream_heads)
        common = dict(layers=1, rows=rows, head_dim=head_dim, max_seq_len=max_seq_len, dtype=dtype, device=device)
        self.full = KVCache(kv_heads=self.full_range[-1][1], spec=None, **common)
        self.stream = KVCache(kv_heads=self.stream_range[-1][1], spec=spec.streaming(), **common)

    @property
    def rows(self) -> int:
        return self.full.rows

    @property
    def bounded(self) -> bool:
        return False  # the full heads grow with the context

    def nbytes(self) -> int:
        return self.full.nbytes() + self.stream.nbytes()

    def nbytes_by_kind(self) -> dict[str, int]:
        return {"full": self.full.nbytes(), "streaming": self.stream.nbytes()}

    def window_for(self, total_len: int) -> int:
        return self.stream.window_for(total_len)

    def reset_row(self, row: int, window: int) -> None:
        self.full.reset_row(row, self.full.ring)
        self.stream.reset_row(row, window)

    def used_slots(self, max_pos: int) -> int:
        """Slots of the *full* cache in use (the streaming cache always attends over all of its own)."""
        return self.full.used_slots(max_pos)

    def copy_rows_from(self, old: MixedKVCache) -> None:
        self.full.copy_rows_from(old.full)
        self.stream.copy_rows_from(old.stream)


def _ranges(per_layer: list[tuple[int, ...]]) -> list[tuple[int, int]]:
    """Contiguous ``(start, end)`` head range of each layer's pairs in a flat cache."""
    out, start = [], 0
    for heads in per_layer:
        out.append((start, start + len(heads)))
        start += len(heads)
    return out
