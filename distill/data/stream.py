"""Streaming: sources too large to prepare, tokenized and packed on the fly (``streaming: true``).

Records come from ``datasets.load_dataset(..., streaming=True)`` (a hub name, or local files when
testing), are split into train / held-out per document by the same stable hash as prepared data,
tokenized in this process, joined with EOS and cut into blocks. Block ``k`` of the stream is the
k-th training block in stream order; the order gives step ``t`` blocks ``t·B .. t·B + B - 1``
(no shuffle: shuffle upstream, e.g. a shuffled hub dataset), each process its contiguous slice.

Resume position: the block number ``step · global_batch``; it is all a checkpoint needs (the step).
On resume each process re-reads the stream from its start and skips to that block, which costs
time proportional to the position (reading and tokenizing, no training).

Mixtures (``datasets:`` with ``streaming: true`` on some entries): a streamed source takes its
weight's share of every step like a prepared one, and its draws are numbered in stream order, so
its resume position is its own block number: the draws of steps ``0 .. t-1``, a closed form of
``t`` (:meth:`~distill.data.order.MixtureOrder.draws_before`). Each process still re-reads every
streamed source from its start up to that number. Prepared sources in the mixture keep their
shuffled, exactly resumable order.

What resume can and cannot guarantee: it replays exactly the blocks of the uninterrupted run when
every streamed source yields the same records in the same order (the same local files, or a hub dataset at the
same revision with the same shards). If the upstream data changed, resume still starts at the same
block *number*, but those blocks may hold other text. When the stream runs out it starts over
(epochs are not counted: the length of a stream is unknown until it ends).
"""

from __future__ import annotations

import itertools
import warnings
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch

from distill.data.prepare import PackSettings, _tokenize_fn
from distill.data.text import DataError, SourceSpec, encoding_error, load_records

RESUME_NOTE = ("streamed data resumes by re-reading the stream up to the checkpoint's block; exact only if the "
               "source yields the same records in the same order (same files / same hub revision)")


class _Packer:
    """Joins tokenized documents and cuts ``[seq_len]`` blocks (with masks), in stream order."""

    def __init__(self, seq_len: int, with_mask: bool):
        self.seq_len, self.with_mask = seq_len, with_mask
        self.ids: list[np.ndarray] = []
        self.mask: list[np.ndarray] = []
        self.n = 0

    def add(self, ids: list[int], mask: list[int] | None) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        self.ids.append(np.asarray(ids, dtype=np.int64))
        if self.with_mask:
            self.mask.append(np.asarray(mask, dtype=bool))
        self.n += len(ids)
        if self.n < self.seq_len:
            return
        flat = np.concatenate(self.ids)
        fm = np.concatenate(self.mask) if self.with_mask else None
        cut = self.n - self.n % self.seq_len
        for a in range(0, cut, self.seq_len):
            yield flat[a: a + self.seq_len], (fm[a: a + self.seq_len] if fm is not None else None)
        self.ids = [flat[cut:]]
        self.mask = [fm[cut:]] if fm is not None else []
        self.n -= cut


class StreamBlocks:
    """Training blocks of a streamed source, read in order; ``blocks[index]`` wants increasing indices
    (or indices among the latest :attr:`window` read, e.g. those of the current step)."""

    streaming = True

    def __init__(self, spec: SourceSpec, tokenizer, settings: PackSettings):
        self.spec, self.tokenizer, self.settings = spec, tokenizer, settings
        self.seq_len = settings.seq_len
        self.sizes = [None]
        self._it: Iterator | None = None
        self._pos = 0  # block number the iterator yields next
        # The blocks of the latest reads, so loss_mask(index) of any micro-batch of the step re-reads none
        # of them (the recipes read every micro-batch of a step first, then each one's mask, twice): as many
        # as this process reads in a step (:meth:`hold`, set by the order) or the largest index asked for,
        # never the whole stream.
        self._recent: OrderedDict[int, tuple[np.ndarray, np.ndarray | None]] = OrderedDict()
        self.window = 1
        self.restarts = 0

    @property
    def shape(self) -> tuple[None, int]:
        return None, self.seq_len

    def blocks(self, split: str) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Every ``split`` ('train' / 'eval') block of one pass over the stream."""
        try:
            yield from self._blocks(split)
        except UnicodeDecodeError as err:  # met mid-stream, maybe hours in: name the file, line and byte
            raise encoding_error(self.spec.source, err) from None

    def _blocks(self, split: str) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        records = load_records(self.spec.source, self.spec.split, streaming=True)
        batch: list[dict] = []
        index = 0
        packer: _Packer | None = None
        fn = None
        for rec in records:
            batch.append(rec)
            if len(batch) == 256:
                fn, packer = self._setup(batch, fn, packer)
                yield from self._emit(fn, packer, batch, index, split)
                index += len(batch)
                batch = []
        if batch:
            fn, packer = self._setup(batch, fn, packer)
            yield from self._emit(fn, packer, batch, index, split)

    def _setup(self, batch, fn, packer):
        if fn is None:
            chat = "messages" in batch[0]
            if not chat and self.spec.text_field not in batch[0]:
                raise DataError(f"{self.spec.source} has no '{self.spec.text_field}' column (columns: "
                                f"{sorted(batch[0])}); set text_field=")
            if chat and getattr(self.tokenizer, "chat_template", None) is None:
                raise DataError(f"{self.spec.source} is in chat format but the tokenizer has no chat template")
            fn = _tokenize_fn(self.tokenizer, self.spec, self.settings, chat)
            packer = _Packer(self.seq_len, chat and self.settings.completion_only)
        return fn, packer

    @staticmethod
    def _emit(fn, packer: _Packer, batch: list[dict], index: int, split: str):
        cols = {k: [r.get(k) for r in batch] for k in batch[0]}
        out = fn(cols, list(range(index, index + len(batch))))
        for j, ids in enumerate(out["ids"]):
            if ids and bool(out["heldout"][j]) == (split == "eval"):
                yield from packer.add(ids, out["mask"][j] if "mask" in out else None)

    def _read(self, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        if (hit := self._recent.get(k)) is not None:
            return hit
        if self._it is None or k < self._pos:
            if self._it is not None:
                warnings.warn(f"stream rewound to block {k}: re-reading from the start", stacklevel=3)
            self._it, self._pos = self.blocks("train"), 0
        while True:
            try:
                block = next(self._it)
            except StopIteration:  # a new pass over the stream continues the numbering
                if self._pos == 0:
                    raise DataError(f"stream {self.spec.source} gives no training block of {self.seq_len} tokens; "
                                    "add data or lower seq_len") from None
                self.restarts += 1
                self._it = self.blocks("train")
                continue
            self._pos += 1
            if self._pos - 1 == k:
                self._recent[k] = block
                while len(self._recent) > self.window:
                    self._recent.popitem(last=False)
                return block

    def hold(self, blocks: int) -> None:
        """Keep at least the latest ``blocks`` blocks read: one optimizer step of this process
        (``micro_batch_size × grad_accum``), so reading a block of the current step again never rewinds."""
        self.window = max(self.window, int(blocks))

    def _indices(self, index) -> np.ndarray:
        ks = np.asarray(index, dtype=np.int64).reshape(-1)
        self.window = max(self.window, len(ks))
        return ks

    def __getitem__(self, index) -> torch.Tensor:
        ks = self._indices(index)
        return torch.from_numpy(np.stack([self._read(int(k))[0] for k in ks]))

    def loss_mask(self, index) -> torch.Tensor | None:
        ks = self._indices(index)
        rows = [self._read(int(k))[1] for k in ks]
        if all(r is None for r in rows):
            return None
        return torch.from_numpy(np.stack(rows))


def build_streaming(tokenizer, spec: SourceSpec, *, seq_len: int, eval_blocks: int, eval_fraction: float,
                    completion_only: bool, read_heldout: bool = True):
    """:class:`~distill.data.corpus.PackedData` over a stream: held-out blocks read now, training on demand.

    ``read_heldout=False``: the caller brings its own held-out set; the stream's held-out documents
    are still left out of training (the split does not depend on where the held-out set comes from).
    """
    from distill.data.corpus import PackedData, SourceReport

    warnings.warn(RESUME_NOTE, stacklevel=3)
    settings = PackSettings(seq_len, eval_fraction, completion_only, "split")
    train = StreamBlocks(spec, tokenizer, settings)
    held, masks = [], []
    for ids, mask in (train.blocks("eval") if read_heldout else []):
        held.append(ids)
        masks.append(mask)
        if len(held) == eval_blocks:
            break
    if not read_heldout:
        return PackedData(train=train, eval=torch.empty(0, seq_len, dtype=torch.long), weights=[spec.weight],
                          sources=[SourceReport(spec.name, spec.weight, None, 0, None, None, 0.0)])
    if not held:
        raise DataError(f"stream {spec.source} leaves no held-out block of {seq_len} tokens; add data or set "
                        "eval_dataset=")
    eval_mask = torch.from_numpy(np.stack(masks)) if masks[0] is not None else None
    report = SourceReport(spec.name, spec.weight, None, len(held), None, None, 0.0)
    return PackedData(train=train, eval=torch.from_numpy(np.stack(held)), eval_mask=eval_mask,
                      weights=[spec.weight], sources=[report])


class MixedBlocks:
    """Training blocks of a mixture with streamed sources: global index ``local * S + s`` (see MixtureOrder).

    Prepared sources are memory-mapped :class:`~distill.data.corpus.Blocks`, streamed ones
    :class:`StreamBlocks`; the order hands each process a stream's blocks in increasing order.
    """

    streaming = True

    def __init__(self, parts: list, seq_len: int):
        self.parts, self.seq_len = parts, seq_len
        self.sizes = [None if getattr(p, "streaming", False) else p.shape[0] for p in parts]

    @property
    def shape(self) -> tuple[None, int]:
        return None, self.seq_len

    def hold(self, blocks: int) -> None:
        """Each streamed source keeps ``blocks`` recent blocks (:meth:`StreamBlocks.hold`); a bound on its share."""
        for p in self.parts:
            if getattr(p, "streaming", False):
                p.hold(blocks)

    def _split(self, index) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        return idx % len(self.parts), idx // len(self.parts)

    def __getitem__(self, index) -> torch.Tensor:
        source, local = self._split(index)
        out = torch.empty(len(source), self.seq_len, dtype=torch.long)
        for s in np.unique(source):
            sel = source == s
            out[torch.from_numpy(sel)] = self.parts[s][torch.from_numpy(local[sel])]
        return out

    def loss_mask(self, index) -> torch.Tensor | None:
        source, local = self._split(index)
        rows = {int(s): self.parts[s].loss_mask(torch.from_numpy(local[source == s])) for s in np.unique(source)}
        if all(r is None for r in rows.values()):
            return None
        out = torch.ones(len(source), self.seq_len, dtype=torch.bool)  # a source without a mask: every token
        for s, r in rows.items():
            if r is not None:
                out[torch.from_numpy(source == s)] = r
        return out


def build_stream_mixture(tokenizer, specs: list[SourceSpec], *, seq_len: int, eval_blocks: int, eval_fraction: float,
                         completion_only: bool, read_heldout: bool, max_train_blocks: int | None, prepare):
    """:class:`~distill.data.corpus.PackedData` of several weighted sources, at least one streamed.

    Prepared sources (``prepare(spec)`` gives their :class:`~distill.data.prepare.Prepared`) are
    mapped; streamed ones are read on the fly. Held-out blocks are shared by weight as for prepared
    mixtures (a stream gives its first held-out blocks). Resume: the order gives each stream the
    block numbers it gave the uninterrupted run (a closed form of the step), and each stream is
    re-read from its start up to that number, so resume is exact when every streamed source yields
    the same records in the same order (see the module docstring).
    """
    from distill.data.corpus import Blocks, PackedData, SourceReport, _split_eval

    warnings.warn(RESUME_NOTE, stacklevel=3)
    settings = PackSettings(seq_len, eval_fraction, completion_only, "split")
    parts, held_src, reports = [], [], []
    for spec in specs:
        if spec.streaming:
            parts.append(StreamBlocks(spec, tokenizer, settings))
            held_src.append(parts[-1])
            reports.append(SourceReport(spec.name, spec.weight, None, 0, None, None, 0.0))
            continue
        p = prepare(spec)
        n = p.train.shape[0] if max_train_blocks is None else min(p.train.shape[0], max_train_blocks)
        if n == 0:
            raise DataError(f"dataset {spec.source} gives 0 training blocks of {seq_len} tokens; add data, lower "
                            "seq_len, or drop the source")
        parts.append(Blocks([p.train[:n]], [None if p.train_mask is None else p.train_mask[:n]], seq_len))
        held_src.append(p)
        reports.append(SourceReport(spec.name, spec.weight, n, 0, n * seq_len, str(p.path), 0.0))
    train = MixedBlocks(parts, seq_len)
    if not read_heldout:
        return PackedData(train=train, eval=torch.empty(0, seq_len, dtype=torch.long),
                          weights=[s.weight for s in specs], sources=reports)
    want = _split_eval(eval_blocks, [s.weight for s in specs], [eval_blocks] * len(specs))
    ids, masks = [], []
    for src, n, r in zip(held_src, want, reports):
        if isinstance(src, StreamBlocks):
            rows = list(itertools.islice(src.blocks("eval"), n))
            got = [torch.from_numpy(np.asarray(i, dtype=np.int64)) for i, _ in rows]
            got_mask = [None if m is None else torch.from_numpy(np.asarray(m, dtype=bool)) for _, m in rows]
        else:
            got = list(torch.from_numpy(np.asarray(src.eval[:n], dtype=np.int64)))
            got_mask = [None] * len(got) if src.eval_mask is None else list(
                torch.from_numpy(np.asarray(src.eval_mask[:n]).astype(bool)))
        ids += got
        masks += got_mask
        r.eval_blocks = len(got)
    if not ids:
        raise DataError(f"the mixture leaves no held-out block of {seq_len} tokens; add data or set eval_dataset=")
    eval_mask = None if all(m is None for m in masks) else torch.stack(
        [torch.ones(seq_len, dtype=torch.bool) if m is None else m for m in masks])
    return PackedData(train=train, eval=torch.stack(ids), eval_mask=eval_mask, weights=[s.weight for s in specs],
                      sources=reports)
