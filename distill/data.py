"""Training text: the built-in offline corpus, user datasets, packing, and a resumable order.

The built-in corpus (``core.corpus``) is the docstrings of the Python standard library.

User data goes through ``datasets``: local ``.jsonl`` / ``.json`` / ``.txt`` / ``.parquet`` files or
directories, or a hub name when online. Records with a ``messages`` list (chat format) are
rendered with the tokenizer's chat template; otherwise ``text_field`` is read.

Documents are tokenized, joined with EOS, and packed into fixed ``[seq_len]`` blocks: no padding,
so every micro-batch holds the same number of tokens and gradient accumulation is exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from core.config import ConfigError
from core.corpus import BUILTIN, heldout, stdlib_docs  # noqa: F401 - re-exported for recipes


class DataError(ConfigError):
    """A dataset problem; the message names the fix."""


def _load_records(source: str, split: str | None):
    import datasets

    path = Path(source)
    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        suffixes = {p.suffix for p in files}
        kinds = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
        usable = [p for p in files if p.suffix in kinds]
        if not usable:
            raise DataError(f"{source} holds no .jsonl/.json/.txt/.parquet files (found {sorted(suffixes)})")
        kind = kinds[usable[0].suffix]
        if any(kinds[p.suffix] != kind for p in usable):
            raise DataError(f"{source} mixes file types; keep one of jsonl/txt/parquet per dataset")
        return datasets.load_dataset(kind, data_files=[str(p) for p in usable], split="train")
    if source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".txt", ".parquet")):
        raise DataError(f"dataset {source} does not exist; check the path")
    try:
        return datasets.load_dataset(source, split=split or "train")
    except Exception as err:  # noqa: BLE001 - report any hub failure in one line
        raise DataError(f"cannot load dataset '{source}' ({type(err).__name__}); use a local file when offline") from None


def texts_from(source: str, tokenizer, *, text_field: str = "text", split: str | None = None) -> list[str]:
    """Documents of a dataset as strings (chat records rendered with the chat template)."""
    records = _load_records(source, split)
    cols = records.column_names
    if "messages" in cols:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"{source} is in chat format but the tokenizer has no chat template; use text records")
        return [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in records]
    if text_field not in cols:
        raise DataError(f"{source} has no '{text_field}' column (columns: {cols}); set text_field=")
    return [t for t in records[text_field] if isinstance(t, str) and t.strip()]


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize, join with EOS, and cut into ``[num_blocks, seq_len]`` (the remainder is dropped)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    if not texts:
        return torch.empty(0, seq_len, dtype=torch.long)
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    n = len(ids) // seq_len
    if n == 0:
        return torch.empty(0, seq_len, dtype=torch.long)
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


@dataclass
class PackedData:
    train: torch.Tensor  # [num_train_blocks, seq_len]
    eval: torch.Tensor  # [num_eval_blocks, seq_len]


def build_data(tokenizer, *, dataset: str, seq_len: int, eval_blocks: int, text_field: str = "text",
               eval_dataset: str | None = None, eval_fraction: float = 0.05, max_train_blocks: int | None = None,
               min_train_blocks: int = 1) -> PackedData:
    """Packed train/eval blocks for ``dataset`` (``builtin:stdlib-docs`` = the offline default)."""
    if dataset == BUILTIN:
        train = pack(stdlib_docs("train"), tokenizer, seq_len)
        held = pack(stdlib_docs("eval"), tokenizer, seq_len)
    else:
        texts = texts_from(dataset, tokenizer, text_field=text_field)
        if eval_dataset:
            train = pack(texts, tokenizer, seq_len)
            held = pack(texts_from(eval_dataset, tokenizer, text_field=text_field), tokenizer, seq_len)
        else:
            # Split by document, not by block, so no document straddles train and eval.
            is_eval = [heldout(f"{i}:{t[:64]}", eval_fraction) for i, t in enumerate(texts)]
            train = pack([t for t, e in zip(texts, is_eval) if not e], tokenizer, seq_len)
            held = pack([t for t, e in zip(texts, is_eval) if e], tokenizer, seq_len)
    if max_train_blocks is not None:
        train = train[:max_train_blocks]
    if train.shape[0] < min_train_blocks:
        raise DataError(
            f"dataset {dataset} gives {train.shape[0]} training blocks of {seq_len} tokens but the run needs "
            f"{min_train_blocks}; add data, lower seq_len, or lower max_steps/batch size"
        )
    if held.shape[0] < eval_blocks:
        if held.shape[0] == 0:
            raise DataError(f"dataset {dataset} leaves no held-out block of {seq_len} tokens; add data or "
                            "set eval_dataset=")
        eval_blocks = held.shape[0]
    return PackedData(train=train, eval=held[:eval_blocks])


class BlockOrder:
    """A deterministic, resumable order over training blocks.

    The blocks of global step ``t`` depend only on ``(seed, t)``: each epoch is a fresh seeded
    permutation, and process ``rank`` of ``world`` takes its contiguous slice of the step's global
    batch. Resuming at step ``t`` therefore replays exactly the data the uninterrupted run saw.
    """

    def __init__(self, num_blocks: int, global_batch: int, seed: int):
        if num_blocks < global_batch:
            raise DataError(
                f"{num_blocks} training blocks cannot fill one global batch of {global_batch}; add data or lower "
                "micro_batch_size / grad_accum"
            )
        self.num_blocks, self.global_batch, self.seed = num_blocks, global_batch, seed
        self.steps_per_epoch = num_blocks // global_batch
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_blocks, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def step_indices(self, step: int) -> torch.Tensor:
        """``[global_batch]`` block indices of global step ``step``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        return self._permutation(epoch)[k * self.global_batch: (k + 1) * self.global_batch]

    def micro_batches(self, blocks: torch.Tensor, step: int, rank: int, world: int, micro: int
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This process's micro-batches for global step ``step``: ``([micro] block indices, [micro, seq])``."""
        idx = self.step_indices(step)
        per_rank = self.global_batch // world
        mine = idx[rank * per_rank: (rank + 1) * per_rank]
        for i in range(0, per_rank, micro):
            index = mine[i: i + micro]
            yield index, blocks[index]


def eval_batches(blocks: torch.Tensor, batch_size: int, rank: int = 0, world: int = 1):
    """Held-out batches for this process (blocks strided across processes)."""
    mine = blocks[rank::world]
    for i in range(0, mine.shape[0], batch_size):
        yield {"input_ids": mine[i: i + batch_size]}
