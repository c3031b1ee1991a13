"""Tokenize local ``.jsonl`` files with every core: byte ranges per worker, packed output per range.

``datasets.map(num_proc=N)`` first converts the whole file to Arrow in one process, then pickles the
tokenizer into each worker, writes every tokenized document back to Arrow, and the packer reads it
again: on two cores that serial load-and-repack share capped the speedup near 1.6×. Here the
file is cut into byte ranges at line ends; forked workers (which inherit the tokenizer, nothing
pickled) each parse their range's lines, tokenize them, and write packed token ids straight into
``part-K.{train,eval}[.mask].bin``; the parent only concatenates the parts in range order. The
result is byte-identical whatever the number of workers: a record's held-out coin flip depends on
its content only (:func:`distill.data.prepare.split_key`), and it lands at the same place in the
token stream (records are the non-blank lines over the files in order, as ``datasets``' json loader
counts them).

One pass over each range: no range needs to know how many records come before it. Only an error
message does (it names the record by its number in the file), and counts them then.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from distill.data.text import DataError, RecordError

_BATCH = 1000  # records per tokenizer call: large enough for the Rust batch path, small for memory
_MIN_RANGE = 1 << 20
_MAX_RANGE = 64 << 20

# The forked workers' job (set in the parent just before the pool forks; inherited, never pickled).
_JOB: dict | None = None


def byte_ranges(files: list[Path], num_proc: int) -> list[tuple[int, int, int]]:
    """``(file index, start, end)`` ranges ending at line ends, ~8 per worker (balance on a shared machine)."""
    total = sum(f.stat().st_size for f in files)
    target = int(min(_MAX_RANGE, max(_MIN_RANGE, total // max(1, num_proc * 8))))
    out = []
    for k, f in enumerate(files):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            start = 0
            while start < size:
                end = min(size, start + target)
                if end < size:
                    fh.seek(end)
                    fh.readline()  # finish the line the cut fell into
                    end = fh.tell()
                out.append((k, start, end))
                start = end
    return out


def _lines_at(path: Path, start: int, end: int):
    """``(offset, line)`` of the non-blank lines of ``path[start:end]`` (a range from :func:`byte_ranges`)."""
    with open(path, "rb") as fh:
        fh.seek(start)
        pos = start
        while pos < end:
            line = fh.readline()
            if not line:
                return
            if line.strip():
                yield pos, line
            pos += len(line)


def _lines(path: Path, start: int, end: int):
    """The non-blank lines of ``path[start:end]``."""
    return (line for _, line in _lines_at(path, start, end))


class _BadLine(Exception):
    """A line that is not UTF-8 or not JSON; :meth:`error` words it once the record's number is known."""

    def __init__(self, path: Path, offset: int, line: bytes, err: ValueError):
        super().__init__(path, offset, line, err)
        self.path, self.offset, self.line, self.err = path, offset, line, err

    def error(self, number: int) -> DataError:
        if isinstance(self.err, UnicodeDecodeError):  # a ValueError too: tell it apart from bad JSON
            return DataError(f"{self.path} is not UTF-8 (record {number}, byte {self.offset + self.err.start}: "
                             f"{self.err.reason}); re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
        return DataError(f"{self.path}: record {number} is not valid JSON ({self.line[:60]!r}); fix or remove "
                         "that line")


def _parse(path: Path, number: int, offset: int, line: bytes):
    """``json.loads(line)``; :class:`_BadLine` when it is not UTF-8 or not JSON."""
    try:
        return json.loads(line)
    except ValueError as err:
        raise _BadLine(path, offset, line, err) from None


def _records_before(path: Path, start: int) -> int:
    """How many records ``path`` holds before byte ``start`` (for an error message: the file's record number)."""
    return sum(1 for _ in _lines(path, 0, start))


def _tokenize_range(task: tuple[int, tuple[int, int, int]]) -> tuple[int, dict]:
    """Tokenize one range into its part files; ``{split: (tokens, docs)}``."""
    part, (k, start, end) = task
    job = _JOB
    fn, fields, folder, dtype, with_mask = job["fn"], job["fields"], job["folder"], job["dtype"], job["with_mask"]
    path = job["files"][k]
    outs = {s: open(folder / f"part-{part:06d}.{s}.bin", "wb") for s in ("train", "eval")}
    masks = {s: open(folder / f"part-{part:06d}.{s}.mask.bin", "wb") for s in ("train", "eval")} if with_mask else {}
    counts = {"train": [0, 0], "eval": [0, 0]}

    def flush(batch: list[dict], index: int) -> None:
        cols = {f: [r.get(f) if isinstance(r, dict) else None for r in batch] for f in fields}
        try:
            out = fn(cols, list(range(index, index + len(batch))))  # indices within the range
        except RecordError as err:
            raise RecordError(path, _records_before(path, start) + err.index, err.reason) from None
        for split, sel in (("train", [not h for h in out["heldout"]]), ("eval", list(out["heldout"]))):
            docs = [ids for ids, s in zip(out["ids"], sel) if s and ids]
            if not docs:
                continue
            outs[split].write(np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype).tobytes())
            if with_mask:
                m = [mk for mk, ids, s in zip(out["mask"], out["ids"], sel) if s and ids]
                masks[split].write(np.fromiter(itertools.chain.from_iterable(m), dtype=np.uint8).tobytes())
            counts[split][0] += sum(len(d) for d in docs)
            counts[split][1] += len(docs)

    try:
        batch: list[dict] = []
        index = 0
        for n, (offset, line) in enumerate(_lines_at(path, start, end)):
            try:
                batch.append(_parse(path, n, offset, line))
            except _BadLine as bad:
                raise bad.error(_records_before(path, start) + n) from None
            if len(batch) == _BATCH:
                flush(batch, index)
                index += len(batch)
                batch = []
        if batch:
            flush(batch, index)
    finally:
        for fh in (*outs.values(), *masks.values()):
            fh.close()
    return part, {s: tuple(c) for s, c in counts.items()}


def _append(src, dst) -> None:
    """Append file ``src`` to ``dst``: in the kernel where it can (no copy through Python), else buffered."""
    size = os.fstat(src.fileno()).st_size
    dst.flush()
    base = dst.seek(0, os.SEEK_END)
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < size:
                n = os.copy_file_range(src.fileno(), dst.fileno(), size - done, done, base + done)
                if n == 0:
                    break
                done += n
        except OSError:  # a file system without it: the buffered copy below does the rest
            pass
    src.seek(done)
    dst.seek(base + done)
    shutil.copyfileobj(src, dst, 16 << 20)


def first_record(files: list[Path]) -> dict:
    """The first record of the source (its fields decide text vs chat, as ``datasets`` infers a schema)."""
    for f in files:
        for offset, line in _lines_at(f, 0, f.stat().st_size):
            try:
                rec = _parse(f, 0, offset, line)
            except _BadLine as bad:
                raise bad.error(0) from None
            if not isinstance(rec, dict):
                raise DataError(f"{f}: records must be JSON objects like {{\"text\": ...}}, got {line[:60]!r}")
            return rec
    raise DataError(f"{files[0]} holds no records; add data or drop the source")


def tokenize_jsonl(files: list[Path], fn: Callable, fields: list[str], folder: Path, dtype: np.dtype,
                   with_mask: bool, num_proc: int, progress: bool, desc: str) -> dict:
    """Tokenize ``files`` into ``folder/{train,eval}[.mask].bin`` (token stream, not yet cut into blocks).

    ``fn`` is :func:`distill.data.prepare._tokenize_fn`'s batch function. Returns
    ``{split: (tokens, docs)}``, the number of workers used under ``"num_proc"`` and the seconds the
    final concatenation took under ``"concat_s"``.
    """
    global _JOB
    from tqdm.auto import tqdm

    units = byte_ranges(files, num_proc)
    nproc = min(num_proc, len(units))
    if nproc > 1 and "fork" not in mp.get_all_start_methods():
        nproc = 1  # no fork (Windows): one process; the output is the same
    _JOB = {"files": files, "fn": fn, "fields": fields, "folder": folder, "dtype": dtype, "with_mask": with_mask}
    name = desc.split(" (")[0].removeprefix("tokenize ")
    done: dict = {}
    try:
        with mp.get_context("fork").Pool(nproc) if nproc > 1 else _Serial() as pool:
            with tqdm(total=len(units), desc=desc, unit="range", disable=not progress) as bar:
                for part, c in pool.imap_unordered(_tokenize_range, list(enumerate(units))):
                    done[part] = c
                    bar.update(1)
    finally:
        _JOB = None
    t_cat = time.time()
    totals: dict = {"num_proc": nproc}
    names = [f"{s}{m}.bin" for s in ("train", "eval") for m in ("", ".mask") if m == "" or with_mask]
    size = sum((folder / f"part-{p:06d}.{n}").stat().st_size for p in range(len(units)) for n in names)
    with tqdm(total=size, desc=f"concatenate {name}", unit="B", unit_scale=True, disable=not progress) as bar:
        for fname in names:
            with open(folder / fname, "wb") as out:
                for part in range(len(units)):
                    piece = folder / f"part-{part:06d}.{fname}"
                    with open(piece, "rb") as fh:
                        _append(fh, out)
                    bar.update(piece.stat().st_size)
                    os.unlink(piece)
    for split in ("train", "eval"):
        totals[split] = (sum(done[p][split][0] for p in done), sum(done[p][split][1] for p in done))
    totals["concat_s"] = time.time() - t_cat
    return totals


class _Serial:
    """The pool's ``imap_unordered`` in this process (one worker, or no fork), in order."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def imap_unordered(fn, items):
        return map(fn, items)
