"""Prepare once, map forever: tokenize a source with every core and pack it into memory-mapped blocks.

A prepared source is a folder ``<cache>/data/<name>-<key>/`` holding

* ``train.bin`` / ``eval.bin``: ``[blocks, seq_len]`` token ids, uint16 when the vocabulary fits,
  else uint32, read back with ``numpy.memmap`` (a process touches only the pages of blocks it reads);
* ``train.mask.bin`` / ``eval.mask.bin`` (chat sources with ``completion_only``): uint8, 1 where the
  token is an assistant token, i.e. a training target;
* ``meta.json``: the key fields, counts, sizes and timing.

The key hashes the source's identity (file paths, sizes, mtimes; or the hub name), the tokenizer's
full serialization, ``seq_len`` and the packing settings, so another tokenizer or length never
matches an old cache. The folder is built under a temporary name, fsynced, and renamed only when
complete: an interrupted prepare leaves a ``.tmp-*`` folder that no run reads (and the next prepare
removes once it is stale).

Held-out documents are chosen by a hash of their whole content (the text, or the canonical JSON of
the messages), so every copy of a duplicated document lands on the same side of the split.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.corpus import heldout
from core.fsio import fsync_dir, fsync_tree
from distill.data import parallel
from distill.data.text import (
    BUILTIN,
    DataError,
    RecordError,
    SourceSpec,
    chat_problem,
    checked_texts,
    encode_chat,
    encoding_error,
    load_records,
    local_files,
    source_identity,
    stdlib_docs,
    tokenizer_fingerprint,
)

# Bump when the on-disk layout, packing or split changes: old caches stop matching.
# 2: jsonl read directly; 3: the held-out coin flip keys on a hash of the whole document, not its index.
FORMAT = 3
_STALE_TMP_S = 24 * 3600
_MIN_RECORDS_PER_PROC = 2000  # below this a datasets worker's start-up (~1 s) costs more than it tokenizes
_MIN_BYTES_PER_PROC = 1 << 20  # a forked jsonl worker starts in ms; below ~1 MB of text it is not worth one


def data_cache_root(data_cache: str | None = None) -> Path:
    """``data_cache`` if given, else ``$HYBRID_DISTILL_CACHE/data`` (``~/.cache/hybrid_distill/data``)."""
    if data_cache:
        return Path(data_cache).expanduser()
    # Imported here: a process that only maps prepared data need not import the model loader.
    from core.models import cache_root

    return cache_root() / "data"


def default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class PackSettings:
    """What decides the packed blocks besides the source and tokenizer."""

    seq_len: int
    eval_fraction: float = 0.05
    completion_only: bool = True
    role: str = "split"  # split: held-out documents by hash | train: all train | eval: all held out

    def as_dict(self) -> dict:
        return {"seq_len": self.seq_len, "eval_fraction": self.eval_fraction,
                "completion_only": self.completion_only, "role": self.role, "format": FORMAT}


def cache_key_fields(spec: SourceSpec, tokenizer, settings: PackSettings) -> dict:
    return {"source": source_identity(spec.source, spec.split), "text_field": spec.text_field,
            "tokenizer": tokenizer_fingerprint(tokenizer), **settings.as_dict()}


def cache_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _slug(spec: SourceSpec) -> str:
    keep = "".join(c if c.isalnum() or c in "-_." else "-" for c in spec.name)
    return keep.strip("-.")[:40] or "data"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class Prepared:
    """A prepared source opened read-only: memory maps, never copies."""

    path: Path
    meta: dict
    train: np.ndarray  # [train_blocks, seq_len] memmap
    eval: np.ndarray  # [eval_blocks, seq_len] memmap
    train_mask: np.ndarray | None  # [train_blocks, seq_len] uint8 memmap
    eval_mask: np.ndarray | None


def _open_split(path: Path, name: str, meta: dict, dtype: np.dtype) -> np.ndarray:
    n, seq = meta[f"{name}_blocks"], meta["seq_len"]
    f = path / f"{name}.bin"
    if f.stat().st_size != n * seq * dtype.itemsize:
        raise DataError(f"{f} has {f.stat().st_size} bytes, expected {n * seq * dtype.itemsize}; the cache is "
                        f"damaged: delete {path} and prepare again")
    if n == 0:
        return np.zeros((0, seq), dtype=dtype)
    arr = np.memmap(f, dtype=dtype, mode="r", shape=(n, seq))
    raw = getattr(arr, "_mmap", None)
    if raw is not None and hasattr(mmap, "MADV_RANDOM"):
        # Training reads single blocks in shuffled order: read-ahead and fault-around would map (and
        # count in RSS) neighbouring blocks this process never uses.
        raw.madvise(mmap.MADV_RANDOM)
    return arr


def is_prepared_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder :func:`prepare_source` wrote: ``meta.json`` beside ``train.bin`` (a user's
    dataset folder may hold a ``meta.json`` of its own, e.g. a corpus card, and is data, not a cache)."""
    path = Path(path)
    return (path / "meta.json").is_file() and (path / "train.bin").is_file()


def open_prepared(path: str | Path, expect: dict | None = None) -> Prepared:
    """Open a prepared folder; ``expect`` (key fields of this run) must match what it was built with."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.exists():
        raise DataError(f"{path} is not a prepared data folder (no meta.json); run python -m distill.data prepare")
    try:
        meta = json.loads(meta_file.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("key_fields"), dict):
            raise ValueError("not a prepared folder's meta object")
        missing = [n for n in ("dtype", "has_mask", "seq_len", "train_blocks", "eval_blocks") if n not in meta]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise DataError(f"{meta_file} is unreadable ({type(err).__name__}: {str(err)[:80]}); the cache is damaged: "
                        f"delete {path} and prepare again") from None
    if expect is not None:
        built = meta["key_fields"]
        for name in ("tokenizer", "seq_len", "completion_only", "eval_fraction", "role", "format"):
            if built.get(name) != expect.get(name):
                raise DataError(f"{path} was prepared with {name}={built.get(name)} but this run uses "
                                f"{name}={expect.get(name)}; prepare it again with this run's config "
                                "(python -m distill.data prepare --config ...) or point at the matching folder")
    dtype = np.dtype(meta["dtype"])
    train, held = _open_split(path, "train", meta, dtype), _open_split(path, "eval", meta, dtype)
    tm = em = None
    if meta["has_mask"]:
        tm = _open_split(path, "train.mask", {**meta, "train.mask_blocks": meta["train_blocks"]}, np.dtype(np.uint8))
        em = _open_split(path, "eval.mask", {**meta, "eval.mask_blocks": meta["eval_blocks"]}, np.dtype(np.uint8))
    return Prepared(path, meta, train, held, tm, em)


# --------------------------------------------------------------------------------------------
# Tokenization (runs in the workers)
# --------------------------------------------------------------------------------------------

def _encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """Token ids of texts without special tokens: the Rust backend directly when that is the same thing.

    ``tokenizer(texts)`` calls the same ``encode_batch`` but also builds attention masks and Python
    dicts per text (~10 % of the CPU); with truncation or padding configured in the backend, or
    ``split_special_tokens``, the wrapper's own handling is needed, so it is used then.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or getattr(tokenizer, "split_special_tokens", False)):
        return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    return lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]


def split_key(content: str) -> str:
    """The held-out coin flip's key of a document: a hash of all of it, so equal documents flip alike.

    (Keyed by record index, each copy of a duplicated document got its own flip, and a document both
    trained on and held out inflates the held-out score.)
    """
    return hashlib.sha256(content.encode("utf-8", "surrogatepass")).hexdigest()


def _canonical(x):
    """``x`` without None-valued dict entries: ``datasets`` fills a field other records have with None."""
    if isinstance(x, dict):
        return {k: _canonical(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_canonical(v) for v in x]
    return x


def chat_key(messages: list[dict]) -> str:
    """:func:`split_key` of a conversation's canonical JSON: key order and None-valued fields do not matter,
    so both readers (jsonl and ``datasets``, which fills absent fields with None) flip it alike."""
    return split_key(json.dumps(_canonical(messages), sort_keys=True, separators=(",", ":")))


def _tokenize_fn(tokenizer, spec: SourceSpec, settings: PackSettings, chat: bool) -> Callable:
    eos = tokenizer.eos_token_id
    text_field = spec.text_field
    encode = _encoder(tokenizer)
    split = settings.role == "split"

    def fn(batch: dict, indices: list[int]) -> dict:
        if chat:
            for i, m in zip(indices, batch["messages"]):
                problem = chat_problem(m)
                if problem:  # the jsonl reader puts its file and in-file number on it
                    raise RecordError(spec.source, i, problem)
            ids, masks = encode_chat(tokenizer, batch["messages"], settings.completion_only)
            keys = [chat_key(m) for m in batch["messages"]] if split and "heldout" not in batch else None
        else:
            texts = [t if t.strip() else "" for t in checked_texts(spec.source, text_field, batch[text_field], indices)]
            ids = encode(texts)
            masks = None
            keys = [split_key(t) for t in texts] if split and "heldout" not in batch else None
            ids = [x if t else [] for x, t in zip(ids, texts)]  # empty records are dropped
        out_ids, out_mask = [], []
        for j, x in enumerate(ids):
            if not x:
                out_ids.append([])
                out_mask.append([])
                continue
            if eos is not None:  # the lists are this call's own: append in place, no copy
                x.append(eos)
            out_ids.append(x)
            if masks is not None:
                # The joining EOS is no target for chat: the template already ends each turn.
                out_mask.append(masks[j] + ([0] if eos is not None else []))
        if split:
            held = batch["heldout"] if keys is None else [heldout(k, settings.eval_fraction) for k in keys]
        else:
            held = [settings.role == "eval"] * len(ids)
        out = {"ids": out_ids, "heldout": held}
        if masks is not None:
            out["mask"] = out_mask
        return out

    return fn


def _records(spec: SourceSpec):
    """The source's records as a ``datasets.Dataset`` (Arrow on disk for files)."""
    import datasets

    if spec.source == BUILTIN:
        train, held = stdlib_docs("train"), stdlib_docs("eval")
        return datasets.Dataset.from_dict({"text": train + held, "heldout": [False] * len(train) + [True] * len(held)})
    return load_records(spec.source, spec.split)


class _Writer:
    """Appends packed tokens (and masks) to ``NAME.bin`` files; the tail short of a block is dropped at close."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype, with_mask: bool):
        self.f = open(folder / f"{name}.bin", "wb")
        self.m = open(folder / f"{name}.mask.bin", "wb") if with_mask else None
        self.dtype, self.tokens, self.docs = dtype, 0, 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None, docs: int) -> None:
        self.f.write(ids.astype(self.dtype, copy=False).tobytes())
        if self.m is not None:
            self.m.write(mask.astype(np.uint8, copy=False).tobytes())
        self.tokens += len(ids)
        self.docs += docs

    def close(self, seq_len: int) -> int:
        blocks = self.tokens // seq_len
        for fh, size in ((self.f, self.dtype.itemsize), (self.m, 1)):
            if fh is not None:
                fh.truncate(blocks * seq_len * size)
                fh.close()
        return blocks


def prepare_source(spec: SourceSpec, tokenizer, settings: PackSettings, *, data_cache: str | None = None,
                   num_proc: int | None = None, progress: bool = True) -> Prepared:
    """The prepared folder of ``spec`` for this tokenizer and settings: opened if cached, else built."""
    if spec.streaming:
        raise DataError(f"{spec.source} is set to stream; streamed sources are read on the fly, not prepared")
    fields = cache_key_fields(spec, tokenizer, settings)
    key = cache_key(fields)
    root = data_cache_root(data_cache)
    final = root / f"{_slug(spec)}-{key}"
    if (final / "meta.json").exists():
        return open_prepared(final, fields)
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(".tmp-*"):  # leftovers of killed prepares (not a live one: those are recent)
        if time.time() - old.stat().st_mtime > _STALE_TMP_S:
            shutil.rmtree(old, ignore_errors=True)
    tmp = root / f".tmp-{_slug(spec)}-{key}-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    t0 = time.time()
    try:
        direct = _jsonl_files(spec)
        if direct is not None:
            meta, stages = _tokenize_direct(spec, direct, tokenizer, settings, tmp, num_proc, progress)
        else:
            meta, stages = _tokenize_datasets(spec, tokenizer, settings, tmp, num_proc, progress)
        meta = {"key": key, "key_fields": fields, "source": spec.source, "seq_len": settings.seq_len, **meta}
        meta["bytes"] = sum(f.stat().st_size for f in tmp.glob("*.bin"))
        meta["seconds"] = time.time() - t0
        meta["stage_seconds"] = stages
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: marks the folder complete
        fsync_tree(tmp)  # the blocks and meta.json on disk before the name says complete
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same key first: theirs is equally good
            if not (final / "meta.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(root)  # the rename itself
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return open_prepared(final, fields)


def _jsonl_files(spec: SourceSpec) -> list[Path] | None:
    """The source's files when it is local ``.jsonl`` (tokenized by byte range); None: read via ``datasets``."""
    if spec.source == BUILTIN:
        return None
    local = local_files(spec.source)
    if local is None or any(p.suffix != ".jsonl" for p in local[1]):
        return None
    return local[1]


def _check_columns(spec: SourceSpec, cols: list[str], tokenizer) -> bool:
    """Whether the records are chat (``messages``); a one-line error when neither chat nor ``text_field``."""
    chat = "messages" in cols
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{spec.source} is in chat format but the tokenizer has no chat template; use text records")
    if not chat and spec.text_field not in cols:
        raise DataError(f"{spec.source} has no '{spec.text_field}' column (columns: {cols}); set text_field=")
    return chat


def _tokenize_direct(spec: SourceSpec, files: list[Path], tokenizer, settings: PackSettings, tmp: Path,
                     num_proc: int | None, progress: bool) -> tuple[dict, dict]:
    """Local ``.jsonl``: forked workers over byte ranges write the token streams (:mod:`distill.data.parallel`)."""
    t0 = time.time()
    first = parallel.first_record(files)
    chat = _check_columns(spec, sorted(first), tokenizer)
    with_mask = chat and settings.completion_only
    fields = ["messages" if chat else spec.text_field] + (["heldout"] if "heldout" in first else [])
    nproc = num_proc or default_num_proc()
    nproc = max(1, min(nproc, sum(f.stat().st_size for f in files) // _MIN_BYTES_PER_PROC))
    dtype = token_dtype(len(tokenizer))
    with _tokenizer_threads(nproc):
        totals = parallel.tokenize_jsonl(files, _tokenize_fn(tokenizer, spec, settings, chat), fields, tmp, dtype,
                                         with_mask, nproc, progress, f"tokenize {spec.name} ({nproc} proc)")
    t_tok = time.time()
    meta = {"dtype": dtype.name, "has_mask": with_mask, "chat": chat, "num_proc": totals["num_proc"],
            "reader": "jsonl-ranges"}
    for name in ("train", "eval"):
        tokens, docs = totals[name]
        blocks = tokens // settings.seq_len
        for suffix, size in ((".bin", dtype.itemsize), (".mask.bin", 1)):
            if suffix == ".bin" or with_mask:
                os.truncate(tmp / f"{name}{suffix}", blocks * settings.seq_len * size)
        meta |= {f"{name}_blocks": blocks, f"{name}_tokens": tokens, f"{name}_docs": docs}
    cat = totals["concat_s"]
    return meta, {"load": 0.0, "tokenize": t_tok - t0 - cat, "pack": time.time() - t_tok + cat}


class _tokenizer_threads:
    """Each worker is one core: the tokenizer's own thread pool on top would oversubscribe them."""

    def __init__(self, nproc: int):
        self.nproc = nproc

    def __enter__(self):
        self.saved = os.environ.get("TOKENIZERS_PARALLELISM")
        if self.nproc > 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = self.saved


def _tokenize_datasets(spec: SourceSpec, tokenizer, settings: PackSettings, tmp: Path, num_proc: int | None,
                       progress: bool) -> tuple[dict, dict]:
    """Other sources (hub, parquet, txt, json, the built-in): ``datasets.map(num_proc=...)``, then packed."""
    import datasets

    t0 = time.time()
    records = _records(spec)
    t_load = time.time()
    cols = records.column_names
    chat = _check_columns(spec, cols, tokenizer)
    with_mask = chat and settings.completion_only
    nproc = num_proc or default_num_proc()
    nproc = max(1, min(nproc, len(records) // _MIN_RECORDS_PER_PROC))
    dtype = token_dtype(len(tokenizer))
    bars_were_on = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        with _tokenizer_threads(nproc):
            mapped = records.map(
                _tokenize_fn(tokenizer, spec, settings, chat), batched=True, batch_size=1000, with_indices=True,
                num_proc=nproc if nproc > 1 else None, remove_columns=cols, features=mapped_features(dtype, with_mask),
                cache_file_name=str(tmp / "tokens.arrow"), desc=f"tokenize {spec.name} ({nproc} proc)",
            )
    except UnicodeDecodeError as err:  # pyarrow's json reader loads bytes that are not UTF-8; reading them fails
        raise encoding_error(spec.source, err) from None
    finally:
        if bars_were_on and not progress:
            datasets.enable_progress_bars()
    t_tok = time.time()
    writers = {"train": _Writer(tmp, "train", dtype, with_mask), "eval": _Writer(tmp, "eval", dtype, with_mask)}
    _pack(mapped, writers, with_mask, progress, f"pack {spec.name}")
    meta = {"dtype": dtype.name, "has_mask": with_mask, "chat": chat, "num_proc": nproc, "reader": "datasets"}
    for name, w in writers.items():
        meta |= {f"{name}_blocks": w.close(settings.seq_len), f"{name}_tokens": w.tokens, f"{name}_docs": w.docs}
    del mapped
    for f in [*tmp.glob("tokens*.arrow"), *tmp.glob("cache-*.arrow")]:
        f.unlink()
    return meta, {"load": t_load - t0, "tokenize": t_tok - t_load, "pack": time.time() - t_tok}


def mapped_features(dtype: np.dtype, with_mask: bool):
    """The intermediate table's schema: ids in the final files' dtype, a uint8 mask, a bool split flag.

    Left to inference, ``datasets`` stores Python ints as int64: that table was ~4x the final files.
    """
    import datasets

    as_list = getattr(datasets, "List", None) or datasets.Sequence  # List is datasets>=4; Sequence before
    feats = {"ids": as_list(datasets.Value(dtype.name)), "heldout": datasets.Value("bool")}
    if with_mask:
        feats["mask"] = as_list(datasets.Value("uint8"))
    return datasets.Features(feats)


def _pack(mapped, writers: dict, with_mask: bool, progress: bool = False, desc: str = "pack") -> None:
    """Stream the tokenized table in Arrow batches into the split writers, in document order."""
    import pyarrow.compute as pc
    from tqdm.auto import tqdm

    with tqdm(total=len(mapped), desc=desc, unit="doc", disable=not progress) as bar:
        for batch in mapped.with_format("arrow").iter(batch_size=10_000):
            held = batch.column("heldout").to_numpy(zero_copy_only=False)
            for name, sel in (("train", ~held), ("eval", held)):
                if not sel.any():
                    continue
                part = batch.filter(sel)
                ids = pc.list_flatten(part.column("ids")).to_numpy()
                mask = pc.list_flatten(part.column("mask")).to_numpy() if with_mask else None
                docs = int(pc.sum(pc.greater(pc.list_value_length(part.column("ids")), 0)).as_py() or 0)
                writers[name].add(ids, mask, docs)
            bar.update(batch.num_rows)
