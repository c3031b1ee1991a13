"""Which blocks each step reads: a pure function of ``(seed, step)``, with mixtures and epochs.

Nothing here holds state that grows with the corpus. A source's shuffle is a keyed Feistel
permutation computed per index (no ``randperm(N)`` array, which at 25M blocks would be 200 MB per
process), and a mixture's per-source draw counts come in closed form per step, so resuming at step
``t`` computes exactly the blocks the uninterrupted run read, in O(t) arithmetic on step numbers.

Mixture sampling is stratified, not random: each step gives source ``s`` ``floor(B·p_s)`` slots
plus one more on a fraction ``frac(B·p_s)`` of steps, chosen by systematic sampling along a
golden-ratio (Weyl) sequence. Cumulative counts then stay within a few blocks of ``n·p_s`` at every
``n`` (i.i.d. sampling would wander by ``sqrt(n·p(1-p))``: ±0.9 % at 10K blocks for p = 0.5).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from distill.data.text import DataError

_M64 = (1 << 64) - 1
_GOLDEN = 0.6180339887498949  # frac of the golden ratio: the most evenly spread Weyl sequence


def _mix64(x: int) -> int:
    """splitmix64 of a Python int (round keys)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """splitmix64 over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """A keyed pseudo-random bijection of ``[0, n)`` evaluated at ``positions`` (any shape).

    Four Feistel rounds over the smallest even bit width holding ``n``, with cycle walking: values
    that land at or beyond ``n`` are permuted again until they fall inside (expected < 4 passes).
    """
    x = np.asarray(positions, dtype=np.uint64)
    if n <= 1:
        return np.zeros_like(x, dtype=np.int64)
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    keys = [np.uint64(_mix64((key * 4 + r) & _M64)) for r in range(4)]

    def rounds(v: np.ndarray) -> np.ndarray:
        left, right = v >> half, v & mask
        for k in keys:
            left, right = right, left ^ (_mix64_np(right ^ k) & mask)
        return (left << half) | right

    y = rounds(x)
    out = y >= np.uint64(n)
    while out.any():
        y[out] = rounds(y[out])
        out = y >= np.uint64(n)
    return y.astype(np.int64)


class MixtureOrder:
    """A deterministic, resumable order over the training blocks of several weighted sources.

    Global block index ``offset_s + i`` is block ``i`` of source ``s`` (sources laid end to end).
    Step ``t``'s ``[global_batch]`` blocks depend only on ``(seed, t)``; process ``rank`` of ``world``
    takes its contiguous slice. A source whose draws run past its size starts a new epoch with a
    fresh permutation, so small sources repeat (reported by :meth:`epochs`) while large ones may be
    seen less than once. A source of size ``None`` is a stream: its draws are read in stream order,
    and in a mixture with a stream global index ``local * S + s`` is block ``local`` of source ``s``.
    """

    def __init__(self, sizes: Sequence[int | None], weights: Sequence[float], global_batch: int, seed: int):
        if len(sizes) != len(weights) or not sizes:
            raise DataError("one weight per source is needed")
        if any(w <= 0 for w in weights):
            raise DataError(f"mixture weights must be > 0, got {list(weights)}; remove a source to leave it out")
        total = sum(s or 0 for s in sizes)
        if all(s is not None for s in sizes) and total < global_batch:
            raise DataError(
                f"{total} training blocks cannot fill one global batch of {global_batch}; add data or lower "
                "micro_batch_size / grad_accum"
            )
        if any(s == 0 for s in sizes):
            raise DataError("a source has no training block; add data to it, lower seq_len, or drop it")
        self.sizes = list(sizes)
        # With a stream in a mixture the sources' sizes are not all known, so a global index cannot be
        # an offset into sources laid end to end: it is ``local * S + s`` instead (:meth:`source_of`).
        self.interleaved = len(sizes) > 1 and any(s is None for s in sizes)
        self.offsets = np.concatenate([[0], np.cumsum([s or 0 for s in sizes])[:-1]]).astype(np.int64)
        p = np.asarray(weights, dtype=np.float64)
        self.p = p / p.sum()
        self.global_batch, self.seed = global_batch, seed
        share = global_batch * self.p
        self.base = np.floor(share + 1e-9).astype(np.int64)
        frac = np.clip(share - self.base, 0.0, None)
        extra = global_batch - int(self.base.sum())
        # The fractions sum to `extra` up to rounding; rescale so systematic sampling picks exactly `extra`.
        self.frac_cum = np.cumsum(frac * (extra / frac.sum())) if extra > 0 else np.zeros_like(frac)
        self.extra = extra
        self.phase = (_mix64(seed) >> 11) / float(1 << 53)
        self._cached_step, self._cached_counts = 0, np.zeros(len(sizes), dtype=np.int64)

    # -- per-step counts ---------------------------------------------------------------------------

    def _bonus(self, steps: np.ndarray) -> np.ndarray:
        """``[len(steps), sources]`` 0/1: which sources get one slot beyond their floor at each step."""
        if self.extra == 0:
            return np.zeros((len(steps), len(self.p)), dtype=np.int64)
        u = np.mod(self.phase + steps.astype(np.float64) * _GOLDEN, 1.0)[:, None]
        upper = np.ceil(self.frac_cum[None, :] - u - 1e-12)
        lower = np.concatenate([np.zeros((len(steps), 1)), upper[:, :-1]], axis=1)
        return (upper - lower).astype(np.int64)

    def counts(self, step: int) -> np.ndarray:
        """``[sources]`` blocks drawn from each source at step ``step``."""
        return self.base + self._bonus(np.array([step]))[0]

    def draws_before(self, step: int) -> np.ndarray:
        """``[sources]`` blocks drawn from each source by steps ``0 .. step-1``: O(step), chunked."""
        if step == self._cached_step:
            return self._cached_counts.copy()
        if step == self._cached_step + 1:
            out = self._cached_counts + self.counts(step - 1)
        else:
            out = self.base * step
            for lo in range(0, step, 1 << 20):
                out = out + self._bonus(np.arange(lo, min(step, lo + (1 << 20)))).sum(0)
        self._cached_step, self._cached_counts = step, out
        return out.copy()

    # -- indices -----------------------------------------------------------------------------------

    def _block(self, source: int, draws: np.ndarray) -> np.ndarray:
        """Local block indices of a source's draws ``k`` (epoch ``k // n`` gets its own permutation)."""
        n = self.sizes[source]
        if n is None:
            return draws
        epochs, pos = np.divmod(draws, n)
        out = np.empty_like(draws)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = permute(pos[sel], n, _mix64((self.seed << 20) ^ (source << 40) ^ int(e)))
        return out

    def step_indices(self, step: int) -> torch.Tensor:
        """``[global_batch]`` global block indices of step ``step``."""
        start, counts = self.draws_before(step), self.counts(step)
        source = np.repeat(np.arange(len(self.p)), counts)
        draw = np.concatenate([start[s] + np.arange(c) for s, c in enumerate(counts)])
        if len(self.p) > 1:
            # Slots are shuffled within the step so every rank's slice holds every source.
            slot = np.random.default_rng([self.seed, step]).permutation(self.global_batch)
            source, draw = source[slot], draw[slot]
            for s in range(len(self.p)):
                if self.sizes[s] is None:
                    # A stream's draws go in slot order, so every process (and each micro-batch after the
                    # last) reads that stream forward only.
                    sel = source == s
                    draw[sel] = start[s] + np.arange(int(sel.sum()))
        out = np.empty(self.global_batch, dtype=np.int64)
        for s in range(len(self.p)):
            sel = source == s
            local = self._block(s, draw[sel])
            out[sel] = local * len(self.p) + s if self.interleaved else self.offsets[s] + local
        return torch.from_numpy(out)

    def source_of(self, index: torch.Tensor) -> np.ndarray:
        """Which source each global block index belongs to."""
        if self.interleaved:
            return np.asarray(index) % len(self.p)
        return np.searchsorted(self.offsets, np.asarray(index), side="right") - 1

    def epochs(self, step: int) -> list[float | None]:
        """Passes over each source after ``step`` steps (None for a stream)."""
        drawn = self.draws_before(step)
        return [None if n is None else float(d) / n for d, n in zip(drawn, self.sizes)]

    def micro_batches(self, blocks, step: int, rank: int, world: int, micro: int
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This process's micro-batches for step ``step``: ``([micro] block indices, [micro, seq])``.

        ``blocks[index]`` reads only those rows (a memory-mapped :class:`~distill.data.corpus.Blocks`
        or a tensor). A stream (``blocks.streaming``) is told to keep this process's blocks of the step,
        so the recipes' later ``loss_mask(index)`` of any micro-batch of the step reads none of them again.
        """
        idx = self.step_indices(step)
        per_rank = self.global_batch // world
        if getattr(blocks, "streaming", False):
            blocks.hold(per_rank)
        mine = idx[rank * per_rank: (rank + 1) * per_rank]
        for i in range(0, per_rank, micro):
            index = mine[i: i + micro]
            yield index, blocks[index]


class BlockOrder(MixtureOrder):
    """The one-source order: ``BlockOrder(num_blocks, global_batch, seed)``."""

    def __init__(self, num_blocks: int, global_batch: int, seed: int):
        super().__init__([num_blocks], [1.0], global_batch, seed)
        self.num_blocks = num_blocks
