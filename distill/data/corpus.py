"""A run's data: every source prepared (or streamed), its blocks memory-mapped, a mixture order over them."""

from __future__ import annotations

import math
import mmap
import os
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from distill.data.order import MixtureOrder
from distill.data.prepare import (
    PackSettings,
    Prepared,
    cache_key_fields,
    is_prepared_folder,
    open_prepared,
    prepare_source,
)
from distill.data.text import BUILTIN, DataError, SourceSpec, parse_sources


def _file_rows(arr: np.ndarray) -> tuple[str, int] | None:
    """``(file, byte position of row 0)`` of a C-contiguous view into a whole-file ``np.memmap``; else None."""
    mm = getattr(arr, "_mmap", None)
    if not isinstance(arr, np.memmap) or mm is None or not arr.flags.c_contiguous or not arr.filename:
        return None
    # numpy maps from the offset rounded down to the allocation granularity; the view may start later.
    start = arr.offset - arr.offset % mmap.ALLOCATIONGRANULARITY
    base = np.frombuffer(mm, dtype=np.uint8)
    return arr.filename, start + int(arr.__array_interface__["data"][0] - base.__array_interface__["data"][0])


@dataclass(frozen=True)
class FileArray:
    """A C-ordered 2-D array ``shape`` of ``dtype`` stored raw in the file ``path`` from byte ``offset``.

    :class:`Blocks` reads its rows with ``pread`` and never maps it, so thousands of them (the shards of a
    teacher cache) hold no file descriptor or mapping until read.
    """

    path: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, int]


class Blocks:
    """The training blocks of every source, laid end to end, read from the prepared files on demand.

    ``blocks[index]`` (``index`` a ``[n]`` tensor of global indices) copies only those rows into a
    ``[n, seq_len]`` int64 tensor, so a process's memory does not grow with the corpus. Rows of a
    prepared file are read with ``pread``, not through the memory map: a mapped read also maps the
    kernel's fault-around pages (64 KB per fault), so a process's RSS would grow with the corpus
    (by the clean, shared page-cache pages it touched) even though none of it is its own memory.
    """

    max_open_files = 64  # file descriptors kept open for reads (least recently used closed first)

    def __init__(self, parts: Sequence[np.ndarray | FileArray], masks: Sequence[np.ndarray | None], seq_len: int):
        self.parts, self.masks, self.seq_len = list(parts), list(masks), seq_len
        self.sizes = [p.shape[0] for p in self.parts]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._fds: OrderedDict[str, int] = OrderedDict()

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __getstate__(self) -> dict:  # file descriptors do not travel; reopened on first read
        return {**self.__dict__, "_fds": OrderedDict()}

    def _fd(self, name: str) -> int:
        fd = self._fds.pop(name, None)
        if fd is None:
            fd = os.open(name, os.O_RDONLY)
            while len(self._fds) >= self.max_open_files:
                os.close(self._fds.popitem(last=False)[1])
        self._fds[name] = fd  # most recently used last
        return fd

    def _rows(self, arr: np.ndarray | FileArray, local: np.ndarray) -> np.ndarray:
        """``arr[local]`` (``local`` sorted): ``pread`` per row from the file behind ``arr``, else indexing."""
        if isinstance(arr, FileArray):
            where = (arr.path, arr.offset)
        else:
            where = _file_rows(arr) if hasattr(os, "preadv") else None
        if where is None:
            return arr[local]
        name, pos0 = where
        fd = self._fd(name)
        rows = np.empty((local.size, arr.shape[1]), dtype=arr.dtype)
        step = arr.shape[1] * rows.itemsize
        for i, r in enumerate(local.tolist()):
            if os.preadv(fd, [memoryview(rows[i]).cast("B")], pos0 + r * step) != step:
                raise DataError(f"{name} is shorter than its metadata says; delete its folder and prepare again")
        return rows

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.offsets[-1]), self.seq_len

    def __len__(self) -> int:
        return self.shape[0]

    def _gather(self, index, arrays: Sequence[np.ndarray | None], dtype: np.dtype, fill: int) -> np.ndarray:
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.shape[0]):
            raise IndexError(f"block index out of range [0, {self.shape[0]})")
        out = np.empty((idx.size, self.seq_len), dtype=dtype)
        src = np.searchsorted(self.offsets, idx, side="right") - 1
        for s in np.unique(src):
            sel = src == s
            arr = arrays[s]
            if arr is None:
                out[sel] = fill
            else:
                # Sorted reads walk the file forward; fancy indexing on a memmap copies just these rows.
                local = idx[sel] - self.offsets[s]
                order = np.argsort(local, kind="stable")
                rows = np.empty((local.size, self.seq_len), dtype=arr.dtype)
                rows[order] = self._rows(arr, local[order])
                out[sel] = rows
        return out

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, tuple):  # (rows, columns), as on the in-memory [n, seq_len] tensor it replaces
            rows, *cols = index
            return self[rows][(slice(None), *cols) if not isinstance(rows, (int, np.integer)) else tuple(cols)]
        if isinstance(index, slice):
            index = np.arange(*index.indices(self.shape[0]))
        elif isinstance(index, (int, np.integer)):
            return self[torch.tensor([int(index)])][0]
        return torch.from_numpy(self._gather(index, self.parts, np.dtype(np.int64), 0))

    def rows(self, index) -> np.ndarray:
        """``[n, seq_len]`` rows ``index`` in the files' own dtype (no cast): other per-block arrays, e.g. the
        shards of a teacher cache."""
        return self._gather(index, self.parts, self.parts[0].dtype, 0)

    def loss_mask(self, index) -> torch.Tensor | None:
        """``[n, seq_len]`` bool, True where the token is a training target; None when every token is."""
        if all(m is None for m in self.masks):
            return None
        return torch.from_numpy(self._gather(index, self.masks, np.dtype(np.uint8), 1).astype(bool))

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        """Every block as one tensor: for small corpora only (e.g. a teacher-cache fingerprint)."""
        return self[slice(None)].to(dtype)


@dataclass
class SourceReport:
    name: str
    weight: float
    train_blocks: int | None
    eval_blocks: int
    tokens: int | None
    path: str | None
    seconds: float
    epochs: float | None = None


@dataclass
class PackedData:
    train: Blocks  # [num_train_blocks, seq_len] on demand
    eval: torch.Tensor  # [num_eval_blocks, seq_len]
    eval_mask: torch.Tensor | None = None  # [num_eval_blocks, seq_len] bool, completion-only sources
    weights: list[float] = field(default_factory=lambda: [1.0])
    sources: list[SourceReport] = field(default_factory=list)

    def order(self, global_batch: int, seed: int) -> MixtureOrder:
        """The mixture order of this data: each source sampled in proportion to its weight."""
        sizes = self.train.sizes  # None for a streamed source
        return MixtureOrder(sizes, self.weights, global_batch, seed)

    def summary(self, order: MixtureOrder | None = None, steps: int | None = None) -> dict:
        """Per-source blocks, tokens, weight and (with an order and step count) epochs."""
        rows = {}
        epochs = order.epochs(steps) if order is not None and steps is not None else [None] * len(self.sources)
        for r, e in zip(self.sources, epochs):
            rows[r.name] = {"weight": r.weight, "train_blocks": r.train_blocks, "eval_blocks": r.eval_blocks,
                            "tokens": r.tokens, "epochs": e, "cache": r.path}
        return rows


def steps_for_tokens(max_tokens: int, global_batch: int, seq_len: int) -> int:
    """Optimizer steps that train on at least ``max_tokens`` tokens."""
    return max(1, math.ceil(max_tokens / (global_batch * seq_len)))


def _split_eval(total: int, weights: Sequence[float], available: Sequence[int]) -> list[int]:
    """Held-out blocks per source: ``total`` shared by weight (largest remainder), capped by what exists."""
    p = np.asarray(weights, dtype=np.float64) / sum(weights)
    want = np.floor(p * total).astype(int)
    for i in np.argsort(-(p * total - want))[: total - int(want.sum())]:
        want[i] += 1
    got = np.minimum(want, available)
    # Give what a small source could not fill to the others, so the held-out set keeps its size.
    spare = total - int(got.sum())
    for i in np.argsort(-p):
        take = min(spare, int(available[i] - got[i]))
        got[i] += take
        spare -= take
    return [int(x) for x in got]


def build_data(tokenizer, *, dataset: str | None = BUILTIN, seq_len: int, eval_blocks: int, text_field: str = "text",
               eval_dataset: str | None = None, eval_fraction: float = 0.05, max_train_blocks: int | None = None,
               min_train_blocks: int = 1, datasets: list | None = None, completion_only: bool = True,
               streaming: bool = False, data_cache: str | None = None, num_proc: int | None = None,
               progress: bool = True) -> PackedData:
    """Prepared (cached, memory-mapped) train blocks and in-memory held-out blocks for a run.

    ``datasets`` (a weighted list) takes precedence over ``dataset``; each source is prepared once
    per (source, tokenizer, seq_len, packing settings) under ``data_cache`` and memory-mapped after.
    A source that is a prepared folder is opened directly and refused if built for another
    tokenizer or length. ``max_train_blocks`` caps each source.
    """
    specs = parse_sources(datasets, dataset, text_field=text_field, streaming=streaming)
    if any(s.streaming for s in specs):
        from distill.data.stream import build_stream_mixture, build_streaming

        if len(specs) == 1:
            data = build_streaming(tokenizer, specs[0], seq_len=seq_len, eval_blocks=eval_blocks,
                                   eval_fraction=eval_fraction, completion_only=completion_only,
                                   read_heldout=not eval_dataset)
        else:
            pack_as = PackSettings(seq_len, eval_fraction, completion_only, "train" if eval_dataset else "split")
            data = build_stream_mixture(
                tokenizer, specs, seq_len=seq_len, eval_blocks=eval_blocks, eval_fraction=eval_fraction,
                completion_only=completion_only, read_heldout=not eval_dataset, max_train_blocks=max_train_blocks,
                prepare=lambda spec: _open_or_prepare(spec, tokenizer, pack_as, data_cache, num_proc, progress))
        if eval_dataset:  # a separate held-out set is prepared (it is small) and used whole
            held = _open_or_prepare(parse_sources(None, eval_dataset, text_field=text_field)[0], tokenizer,
                                    PackSettings(seq_len, eval_fraction, completion_only, "eval"), data_cache,
                                    num_proc, progress)
            data.eval = torch.from_numpy(np.asarray(held.eval[:eval_blocks], dtype=np.int64))
            data.eval_mask = None if held.eval_mask is None else torch.from_numpy(
                np.asarray(held.eval_mask[:eval_blocks]).astype(bool))
        return data
    role = "train" if eval_dataset else "split"
    settings = PackSettings(seq_len, eval_fraction, completion_only, role)
    prepared: list[Prepared] = []
    reports: list[SourceReport] = []
    for spec in specs:
        t0 = time.time()
        prepared.append(_open_or_prepare(spec, tokenizer, settings, data_cache, num_proc, progress))
        reports.append(SourceReport(spec.name, spec.weight, None, 0, None, str(prepared[-1].path), time.time() - t0))
    if eval_dataset:
        held_specs = parse_sources(None, eval_dataset, text_field=text_field)
        held = [_open_or_prepare(s, tokenizer, PackSettings(seq_len, eval_fraction, completion_only, "eval"),
                                 data_cache, num_proc, progress) for s in held_specs]
        eval_parts = [(h.eval, h.eval_mask) for h in held]
        eval_counts = [min(eval_blocks, h.eval.shape[0]) for h in held]
    else:
        eval_parts = [(p.eval, p.eval_mask) for p in prepared]
        eval_counts = _split_eval(eval_blocks, [s.weight for s in specs], [p.eval.shape[0] for p in prepared])

    parts, masks = [], []
    for spec, p, r in zip(specs, prepared, reports):
        n = p.train.shape[0] if max_train_blocks is None else min(p.train.shape[0], max_train_blocks)
        if n == 0:
            raise DataError(f"dataset {spec.source} gives 0 training blocks of {seq_len} tokens; add data, lower "
                            "seq_len, or drop the source")
        mask = None if p.train_mask is None else p.train_mask[:n]
        if mask is not None and not _has_target(mask):  # a run would train on nothing: loss 0, perplexity NaN
            raise DataError(f"dataset {spec.source} has no assistant reply to train on in its {n} training blocks "
                            "(completion_only: only assistant tokens are targets); add assistant turns or set "
                            "completion_only=false")
        parts.append(p.train[:n])
        masks.append(mask)
        r.train_blocks, r.tokens = n, n * seq_len
    train = Blocks(parts, masks, seq_len)
    if train.shape[0] < min_train_blocks:
        names = ", ".join(s.source for s in specs)
        raise DataError(
            f"dataset {names} gives {train.shape[0]} training blocks of {seq_len} tokens but the run needs "
            f"{min_train_blocks}; add data, lower seq_len, or lower max_steps/batch size"
        )

    held_ids, held_masks = [], []
    any_mask = any(m is not None for _, m in eval_parts)
    # A separate eval_dataset's blocks are none of the training sources' held-out blocks: their reports keep 0.
    owners = [None] * len(eval_parts) if eval_dataset else reports
    for (ids, mask), n, r in zip(eval_parts, eval_counts, owners):
        held_ids.append(torch.from_numpy(np.asarray(ids[:n], dtype=np.int64)))
        if any_mask:
            held_masks.append(torch.ones(n, seq_len, dtype=torch.bool) if mask is None
                              else torch.from_numpy(np.asarray(mask[:n]).astype(bool)))
        if r is not None:
            r.eval_blocks = n
    eval_ids = torch.cat(held_ids) if held_ids else torch.empty(0, seq_len, dtype=torch.long)
    if eval_ids.shape[0] == 0:
        raise DataError(f"dataset {dataset if not datasets else 'mixture'} leaves no held-out block of {seq_len} "
                        "tokens; add data or set eval_dataset=")
    if any_mask and not _has_target(torch.cat(held_masks).numpy()):
        raise DataError(f"the held-out text ({eval_dataset or 'a split of the training data'}) has no assistant reply "
                        "to score (completion_only: only assistant tokens are targets); add assistant turns, raise "
                        "eval_blocks or set completion_only=false")
    return PackedData(train=train, eval=eval_ids, eval_mask=torch.cat(held_masks) if any_mask else None,
                      weights=[s.weight for s in specs], sources=reports)


def _has_target(mask: np.ndarray, rows: int = 4096) -> bool:
    """Whether a ``[blocks, seq]`` completion mask holds a target (a marked token after a block's first), read
    ``rows`` blocks at a time and stopping at the first: a chat corpus has one in its first rows."""
    return any(np.asarray(mask[lo: lo + rows, 1:]).any() for lo in range(0, mask.shape[0], rows))


def _open_or_prepare(spec: SourceSpec, tokenizer, settings: PackSettings, data_cache: str | None,
                     num_proc: int | None, progress: bool) -> Prepared:
    if is_prepared_folder(Path(spec.source).expanduser()):
        # A folder written by `python -m distill.data prepare`: use it only if it matches this run.
        fields = cache_key_fields(SourceSpec(BUILTIN), tokenizer, settings)
        return open_prepared(Path(spec.source).expanduser(), fields)
    return prepare_source(spec, tokenizer, settings, data_cache=data_cache, num_proc=num_proc, progress=progress)


def eval_batches(blocks: torch.Tensor, batch_size: int, rank: int = 0, world: int = 1,
                 mask: torch.Tensor | None = None) -> Iterator[dict]:
    """Held-out batches for this process (blocks ``[n, seq]`` strided across processes); ``loss_mask`` when given.

    Every rank gets the same number of batches, ``ceil(ceil(n / world) / batch_size)``: under ZeRO-3 each forward
    gathers the sharded weights with all ranks, so a rank that stopped one batch early would leave the others
    waiting forever. A rank whose share runs out first pads with filler batches (one block, ``loss_mask`` all
    False) that run the forward and score nothing.
    """
    mine = blocks[rank::world]
    mine_mask = mask[rank::world] if mask is not None else None
    fullest = -(-blocks.shape[0] // world)
    for i in range(0, fullest, batch_size):
        if i >= mine.shape[0]:
            yield {"input_ids": blocks[:1], "loss_mask": torch.zeros_like(blocks[:1], dtype=torch.bool)}
            continue
        batch = {"input_ids": mine[i: i + batch_size]}
        if mine_mask is not None:
            batch["loss_mask"] = mine_mask[i: i + batch_size]
        yield batch
