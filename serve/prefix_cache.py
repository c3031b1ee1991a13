"""Prefix caching: requests that share a token prefix reuse its keys/values instead of recomputing them.

A chat system prompt or a few-shot header is the same token prefix in every request; prefilling it
again each time is most of the time to first token for short questions. :class:`PrefixCache` keeps the
keys/values of prompt prefixes in blocks of ``block`` tokens, chained from the start of the prompt:
a block is found by *(its parent block, its own tokens)*, so a hit means the whole prefix up to and
including that block is token-for-token identical. Keys are exact tuples, not hashes, so two different
prefixes never share an entry.

Exactness. The keys/values of position ``p`` depend only on the tokens ``<= p`` (causal attention) and
on the attention pattern of the row: for a hybrid model, its window (the spec's ``window_policy`` may
pick a different one by request length), so the window is part of the root key. Restoring ``n`` cached
positions writes them where a prefill of ``0 .. n - 1`` would have written them
(:meth:`serve.kv_cache.KVCache.prefill_slots`), then the engine prefills only the rest. Greedy outputs
equal the uncached engine's (tests/test_serve_prefix_cache.py, dense and hybrid).

Bounded (hybrid) caches. A hit restores any prefix length, but blocks can only be *captured* while
every one of their positions is still held by the row (in the ring or a sink/global slot): the engine
captures after each prefill chunk, so a prompt is fully cacheable whenever ``prefill_chunk + block <=
window`` (or the chunks are whole blocks no longer than the window). Past that, positions leave the ring before they are captured, the chain stops at the first
block that was evicted and only the prefix before it is cached (``uncapturable_blocks`` in
:meth:`stats` counts those). Generated tokens are never cached (only prompts repeat).

Memory: an LRU over blocks with a byte budget; leaves go first (evicting a block whose children are
still cached would strand them), and :meth:`stats` reports bytes, hits and evictions for ``/metrics``.
Blocks live in a pool of fixed-size slots, reserved in slabs of ``slab_blocks`` as the cache first fills
and never handed back (at most the budget): capturing and evicting only move data between slots. One
allocation per block instead churned the C heap by ~100 MB per long prompt and the fragmented heap kept
growing: repeating the same ~4K-token requests (demo student, 64 MB budget) added 31-47 MB of resident
memory each time; with the pool, 1 MB, as with no prefix cache at all.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, fields

import torch

from serve.kv_cache import KVCache

_Key = tuple  # (parent id | ("root", window), block token ids)


@dataclass
class _Block:
    """One cached block: its keys/values are slot ``slot`` of the pool."""

    id: int
    key: _Key
    parent: _Block | None
    slot: int
    children: int = 0


class _Pool:
    """Fixed-size slots for blocks: ``k(i)``, ``v(i)`` are ``[layers, kv_heads, block, head_dim]`` views.

    Slabs of ``slab`` slots are reserved when no slot is free, up to ``capacity`` slots in all, and kept.
    """

    def __init__(self, cache: KVCache, block: int, max_bytes: int, slab: int) -> None:
        self.shape = self.layout(cache, block)
        self.dtype, self.device = cache.k.dtype, cache.k.device
        self.block_bytes = 2 * math.prod(self.shape) * cache.k.element_size()
        self.capacity, self.slab = max_bytes // self.block_bytes, slab
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._free: list[int] = []
        self.reserved = 0  # slots in all slabs

    @staticmethod
    def layout(cache: KVCache, block: int) -> tuple[int, int, int, int]:
        """One block's ``[layers, kv_heads, block, head_dim]`` in ``cache``."""
        return cache.k.shape[0], cache.k.shape[2], block, cache.k.shape[4]

    def fits(self, cache: KVCache) -> bool:
        return (self.layout(cache, self.shape[2]) == self.shape and cache.k.dtype == self.dtype
                and cache.k.device == self.device)

    def take(self) -> int | None:
        """A free slot, reserving a slab if none is; None at capacity."""
        if not self._free:
            n = min(self.slab, self.capacity - self.reserved)
            if n <= 0:
                return None
            with torch.inference_mode(False):  # written in and out of inference mode (serve.engine)
                self._k.append(torch.zeros((n, *self.shape), dtype=self.dtype, device=self.device))
                self._v.append(torch.zeros((n, *self.shape), dtype=self.dtype, device=self.device))
            self._free.extend(range(self.reserved + n - 1, self.reserved - 1, -1))
            self.reserved += n
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def _at(self, slabs: list[torch.Tensor], slot: int) -> torch.Tensor:
        # slabs are reserved in order, all of self.slab slots except possibly the last
        return slabs[slot // self.slab][slot % self.slab]

    def k(self, slot: int) -> torch.Tensor:
        return self._at(self._k, slot)

    def v(self, slot: int) -> torch.Tensor:
        return self._at(self._v, slot)

    def reserved_bytes(self) -> int:
        return self.reserved * self.block_bytes


@dataclass
class PrefixStats:
    bytes: int = 0
    blocks: int = 0
    lookups: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    evicted_blocks: int = 0
    uncapturable_blocks: int = 0


class PrefixCache:
    """Block-chained LRU of prompt-prefix keys/values under a byte budget.

    Args:
        max_bytes: most bytes of cached keys/values (blocks beyond it are evicted, least recently used
            leaves first; a block larger than the whole budget is never stored).
        block: tokens per block; a hit covers a multiple of it (the rest of the prompt is prefilled).
        slab_blocks: pool slots reserved at a time (see the module doc).
    """

    def __init__(self, max_bytes: int, block: int = 32, slab_blocks: int = 16) -> None:
        if max_bytes < 0 or block < 1 or slab_blocks < 1:
            raise ValueError(f"prefix cache needs max_bytes >= 0, block >= 1 and slab_blocks >= 1, got "
                             f"{max_bytes}, {block}, {slab_blocks}")
        self.max_bytes = max_bytes
        self.block = block
        self.slab_blocks = slab_blocks
        self._blocks: OrderedDict[_Key, _Block] = OrderedDict()
        self._ids = itertools.count()
        self._pool: _Pool | None = None  # made by the first capture, from the cache's layout
        self.stats = PrefixStats()

    def _pool_for(self, cache: KVCache) -> _Pool:
        if self._pool is None:
            self._pool = _Pool(cache, self.block, self.max_bytes, self.slab_blocks)
        elif not self._pool.fits(cache):
            raise ValueError("this prefix cache holds blocks of another cache layout (layers, KV heads, head "
                             "size, dtype or device); use one prefix cache per engine")
        return self._pool

    def reserved_bytes(self) -> int:
        """Bytes of pool slabs reserved so far (>= ``stats.bytes``; at most the budget, and kept)."""
        return 0 if self._pool is None else self._pool.reserved_bytes()

    # ---- lookup / restore --------------------------------------------------------------------------------

    def _root(self, window: int) -> _Key:
        return ("root", window)

    def _chain(self, ids: list[int], window: int, limit: int) -> list[_Block]:
        """The cached blocks covering ``ids[:limit]`` from the start (stops at the first miss)."""
        chain: list[_Block] = []
        parent: object = self._root(window)
        b = self.block
        for s in range(0, limit - b + 1, b):
            blk = self._blocks.get((parent, tuple(ids[s:s + b])))
            if blk is None:
                break
            chain.append(blk)
            parent = blk.id
        return chain

    def restore(self, cache: KVCache, row: int, ids: list[int]) -> int:
        """Write the longest cached prefix of ``ids`` into ``row`` (already reset); returns its length.

        At least one prompt token is always left to prefill (its logits give the first new token).
        """
        window = int(cache.window[row])
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(ids)
        chain = self._chain(ids, window, len(ids) - 1)
        if not chain:
            return 0
        for blk in reversed(chain):  # the root ends most recent: leaves are evicted before their parents
            self._blocks.move_to_end(blk.key)
        b, n, pool = self.block, len(chain) * self.block, self._pool_for(cache)
        pos = torch.arange(n, device=cache.k.device)
        idx, slot = cache.prefill_slots(row, pos)
        k_row, v_row = cache.k[:, row], cache.v[:, row]  # [layers, kv_heads, slots, head_dim]
        if not cache.bounded:  # a dense row holds position p at slot p: one copy per block, no temporaries
            for j, blk in enumerate(chain):
                k_row[:, :, j * b:(j + 1) * b].copy_(pool.k(blk.slot))
                v_row[:, :, j * b:(j + 1) * b].copy_(pool.v(blk.slot))
        else:  # the positions the row keeps (ring, sinks, globals), block by block
            for j, blk in enumerate(chain):
                sel = (idx >= j * b) & (idx < (j + 1) * b)
                if bool(sel.any()):
                    k_row[:, :, slot[sel]] = pool.k(blk.slot)[:, :, idx[sel] - j * b]
                    v_row[:, :, slot[sel]] = pool.v(blk.slot)[:, :, idx[sel] - j * b]
        cache.commit_prefill(row, pos, idx, slot)
        self.stats.hit_tokens += n
        return n

    # ---- capture -----------------------------------------------------------------------------------------

    def _held_slots(self, cache: KVCache, row: int, pos: torch.Tensor) -> torch.Tensor | None:
        """The slot holding each position of ``pos`` in ``row`` (ring copy, else persistent), or None."""
        ring = cache.persistent + pos % int(cache.window[row])
        slot_pos = cache.slot_pos[row]
        ok = slot_pos[ring] == pos
        if bool(ok.all()):
            return ring
        pslot = cache._persistent_slot(pos)
        slot = torch.where(ok, ring, pslot)
        if not bool((slot_pos[slot] == pos).all()):
            return None
        return slot

    def capture(self, cache: KVCache, row: int, ids: list[int], upto: int, since: int = 0) -> None:
        """Store the blocks of ``ids[:upto]`` (positions ``< upto`` already prefilled in ``row``).

        ``since``: the ``upto`` of this row's previous call for the same prompt (0: none); a block the ring
        has lost counts in ``uncapturable_blocks`` only in the call where it is first whole, not again at
        every later chunk.
        """
        if self.max_bytes == 0:
            return
        pool = self._pool_for(cache)
        window = int(cache.window[row])
        parent_key: object = self._root(window)
        parent: _Block | None = None
        b = self.block
        for s in range(0, upto - b + 1, b):
            key = (parent_key, tuple(ids[s:s + b]))
            blk = self._blocks.get(key)
            if blk is None:
                pos = torch.arange(s, s + b, device=cache.k.device)
                slot = self._held_slots(cache, row, pos)
                if slot is None:  # evicted from the bounded cache before we saw it: the chain ends here
                    self.stats.uncapturable_blocks += int(s + b > since)
                    return
                if pool.block_bytes > self.max_bytes or not self._make_room(pool.block_bytes, keep=parent):
                    return
                at = pool.take()
                if at is None:  # every slot is held by a protected ancestor
                    return
                torch.index_select(cache.k[:, row], 2, slot, out=pool.k(at))
                torch.index_select(cache.v[:, row], 2, slot, out=pool.v(at))
                blk = _Block(next(self._ids), key, parent, at)
                self._blocks[key] = blk
                self.stats.bytes += pool.block_bytes
                self.stats.blocks += 1
                if parent is not None:
                    parent.children += 1
            parent, parent_key = blk, blk.id

    def _make_room(self, nbytes: int, keep: _Block | None) -> bool:
        """Evict least recently used leaves until ``nbytes`` more fit (never ``keep`` or its ancestors)."""
        protected = set()
        while keep is not None:
            protected.add(keep.id)
            keep = keep.parent
        while self.stats.bytes + nbytes > self.max_bytes:
            victim = next((blk for blk in self._blocks.values() if blk.children == 0 and blk.id not in protected),
                          None)
            if victim is None:
                return False
            del self._blocks[victim.key]
            self._pool.give(victim.slot)
            self.stats.bytes -= self._pool.block_bytes
            self.stats.blocks -= 1
            self.stats.evicted_blocks += 1
            if victim.parent is not None:
                victim.parent.children -= 1
        return True

    def gauges(self) -> dict[str, tuple[str, object]]:
        """``name -> (help, read())`` for the server's ``/metrics`` (Prometheus gauges)."""
        st = self.stats
        return {
            "prefix_cache_bytes": ("Bytes of cached prompt-prefix keys/values.", lambda: st.bytes),
            "prefix_cache_budget_bytes": ("Byte budget of the prefix cache.", lambda: self.max_bytes),
            "prefix_cache_reserved_bytes": ("Bytes of prefix-cache pool slots reserved (kept; at most the budget).",
                                            self.reserved_bytes),
            "prefix_cache_blocks": ("Prefix blocks cached.", lambda: st.blocks),
            "prefix_cache_hit_tokens": ("Prompt tokens restored from the prefix cache (total).",
                                        lambda: st.hit_tokens),
            "prefix_cache_prompt_tokens": ("Prompt tokens looked up in the prefix cache (total).",
                                           lambda: st.prompt_tokens),
            "prefix_cache_evicted_blocks": ("Prefix blocks evicted to stay within the budget (total).",
                                            lambda: st.evicted_blocks),
            "prefix_cache_uncapturable_blocks": ("Prefix blocks the bounded cache had evicted before they "
                                                 "could be cached (total).", lambda: st.uncapturable_blocks),
        }

    def clear(self) -> None:
        """Drop every block and zero the counters (in place: the gauges read this stats object); the pool's
        slabs stay reserved, their slots free."""
        for blk in self._blocks.values():
            self._pool.give(blk.slot)
        self._blocks.clear()
        for f in fields(self.stats):
            setattr(self.stats, f.name, 0)
