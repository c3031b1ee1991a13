"""Where training text comes from: the built-in corpus (:mod:`core.corpus`), user datasets, chat.

User files and hub datasets are read through ``datasets``; chat records (``messages``) are rendered
with the tokenizer's chat template, with a mask of the assistant's tokens; other records give their
``text_field``. :mod:`distill.data.prepare` packs what this module reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from core.config import ConfigError
from core.corpus import BUILTIN, stdlib_docs  # noqa: F401 - re-exported


class DataError(ConfigError):
    """A dataset problem; the message names the fix."""


_KINDS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


def local_files(source: str) -> tuple[str, list[Path]] | None:
    """``(datasets builder, files)`` of a local source, or None for a hub name."""
    path = Path(source).expanduser()
    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        suffixes = {p.suffix for p in files}
        usable = [p for p in files if p.suffix in _KINDS]
        if not usable:
            raise DataError(f"{source} holds no .jsonl/.json/.txt/.parquet files (found {sorted(suffixes)})")
        kind = _KINDS[usable[0].suffix]
        if any(_KINDS[p.suffix] != kind for p in usable):
            raise DataError(f"{source} mixes file types; keep one of jsonl/txt/parquet per dataset")
        return kind, usable
    if source.startswith((".", "/", "~")) or source.endswith((".jsonl", ".json", ".txt", ".parquet")):
        raise DataError(f"dataset {source} does not exist; check the path")
    return None


class RecordError(DataError):
    """Record ``index`` of ``where`` (a file, or a source read through ``datasets``) is unusable: ``reason``."""

    def __init__(self, where: str, index: int, reason: str):
        super().__init__(where, index, reason)  # the args rebuild it when it crosses a process boundary
        self.where, self.index, self.reason = str(where), index, reason

    def __str__(self) -> str:
        return f"{self.where}: record {self.index} {self.reason}; fix or remove that record"


def checked_texts(where: str, text_field: str, values: list, indices: Iterable[int]) -> list[str]:
    """``values`` of ``text_field`` as strings, a null as ``""`` (an empty record); a list or a number is a
    :class:`RecordError` naming record ``indices[j]`` of ``where``, not a record dropped without a word."""
    for i, t in zip(indices, values):
        if t is not None and not isinstance(t, str):
            raise RecordError(where, i, f"has '{text_field}' of type {type(t).__name__}, not a string (set "
                                        "text_field= to the column that holds the text)")
    return ["" if t is None else t for t in values]


def chat_problem(messages) -> str | None:
    """What is wrong with a record's ``messages`` (None when it is a list of ``{role, content}`` dicts)."""
    if messages is None:
        return "has no 'messages' list (chat and non-chat records are mixed)"
    if not isinstance(messages, list):
        return f"has 'messages' of type {type(messages).__name__}, not a list of {{role, content}} dicts"
    if not messages:
        return "has an empty 'messages' list"
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"has message {j} of type {type(m).__name__}, not a {{role, content}} dict"
        if not isinstance(m.get("role"), str):
            return f"has message {j} without a string 'role'"
        content = m.get("content")
        if not (isinstance(content, (str, list)) or (content is None and m.get("tool_calls"))):
            return f"has message {j} without a 'content' (a string or a list of parts)"
    return None


def not_utf8(path: Path) -> str | None:
    """Where ``path`` stops being UTF-8 (``"byte N: reason"``), or None when all of it decodes."""
    offset, carry = 0, b""  # offset: the file position of carry[0]
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(1 << 20)
            data = carry + chunk
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as err:
                if chunk and err.end == len(data):  # perhaps a character cut by the read: decide with the next one
                    carry, offset = data[err.start:], offset + err.start
                    continue
                return f"byte {offset + err.start}: {err.reason}"
            if not chunk:
                return None
            carry, offset = b"", offset + len(data)


def _utf8_error(f: Path, where: str) -> DataError:
    return DataError(f"{f} is not UTF-8 ({where}); re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def encoding_error(source: str, err: UnicodeDecodeError) -> DataError:
    """A one-line error for text that is not UTF-8 met after loading (pyarrow's json reader lets it through)."""
    local = local_files(source) if source != BUILTIN else None
    for f in (local[1] if local is not None else []):
        where = not_utf8(f)
        if where is not None:
            return _utf8_error(f, where)
    return DataError(f"{source} holds text that is not UTF-8 ({err.reason}); re-save it as UTF-8")


def _unreadable(source: str, kind: str, files: list[Path], err: Exception) -> DataError:
    """The one-line cause of ``datasets`` failing on local ``files``: an encoding, no records, or its own message."""
    if kind in ("text", "json"):
        for f in files:
            where = not_utf8(f)
            if where is not None:
                return _utf8_error(f, where)
    if all(f.stat().st_size == 0 for f in files):
        where = files[0] if len(files) == 1 else f"{source} (its {len(files)} files are empty)"
        return DataError(f"{where} holds no records; add data or drop the source")
    cause = err
    while cause.__cause__ is not None or (cause.__context__ is not None and not cause.__suppress_context__):
        cause = cause.__cause__ or cause.__context__
    detail = (str(cause).strip().splitlines() or [""])[0][:200]
    where = files[0] if len(files) == 1 else f"one of the {len(files)} files of {source}"
    return DataError(f"cannot read {where} as {kind} ({type(cause).__name__}: {detail}); fix the file or drop it")


def load_records(source: str, split: str | None, streaming: bool = False):
    import datasets

    local = local_files(source)
    if local is not None:
        kind, files = local
        if streaming:  # read lazily: a bad file shows when the stream reaches it
            return datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train", streaming=True)
        try:
            return datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train")
        except Exception as err:  # noqa: BLE001 - datasets wraps every reader error in DatasetGenerationError
            raise _unreadable(source, kind, files, err) from None
    try:
        return datasets.load_dataset(source, split=split or "train", streaming=streaming)
    except Exception as err:  # noqa: BLE001 - report any hub failure in one line
        raise DataError(f"cannot load dataset '{source}' ({type(err).__name__}); use a local file when offline") from None


def source_identity(source: str, split: str | None) -> dict:
    """What names a source's content for the cache key: files with sizes and times, or a hub name."""
    if source == BUILTIN:
        return {"builtin": source, "python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"]}
    local = local_files(source)
    if local is None:
        # No revision is known offline: a hub dataset that changes upstream keeps its cache until it is
        # cleared (the summary prints the cache folder).
        return {"hub": source, "split": split or "train"}
    _, files = local
    return {"files": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides token ids: vocabulary, merges, normalizers, chat template, EOS."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h = hashlib.sha256()
    h.update(backend.to_str().encode() if backend is not None
             else json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(f"|{type(tokenizer).__name__}|{tokenizer.eos_token_id}|{getattr(tokenizer, 'chat_template', None)}"
             .encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``datasets:``: where the text is, its mixture weight, how to read it."""

    source: str
    weight: float = 1.0
    text_field: str = "text"
    split: str | None = None
    streaming: bool = False

    @property
    def name(self) -> str:
        return Path(self.source).name if os.sep in self.source else self.source


_SPEC_KEYS = {"source", "weight", "text_field", "split", "streaming"}


def parse_sources(datasets: list | None, dataset: str | None = None, *, text_field: str = "text",
                  streaming: bool = False) -> list[SourceSpec]:
    """``datasets:`` entries (a string, or a mapping with source/weight/text_field/split/streaming) as specs.

    The single ``dataset:`` key is the one-entry mixture ``[{source: dataset, weight: 1}]``.
    """
    if not datasets:
        if not dataset:
            raise DataError("no training data: set dataset= or datasets=[{source: ..., weight: ...}]")
        return [SourceSpec(dataset, 1.0, text_field, None, streaming)]
    if not isinstance(datasets, (list, tuple)):  # a mapping would be read as its keys: a source named 'source'
        raise DataError(f"datasets must be a list of entries, got {datasets!r}; write [{{source: PATH_OR_NAME, "
                        "weight: 1.0}, ...]")
    specs = []
    for entry in datasets:
        if isinstance(entry, str):
            entry = {"source": entry}
        if not isinstance(entry, dict) or "source" not in entry:
            raise DataError(f"datasets entry {entry!r} needs a source; write {{source: PATH_OR_NAME, weight: 1.0}}")
        unknown = set(entry) - _SPEC_KEYS
        if unknown:
            raise DataError(f"datasets entry {entry['source']!r} has unknown keys {sorted(unknown)}; "
                            f"use {sorted(_SPEC_KEYS)}")
        try:
            weight = float(entry.get("weight", 1.0))
        except (TypeError, ValueError):
            raise DataError(f"weight of {entry['source']!r} must be a number, got {entry.get('weight')!r}") from None
        if not weight > 0:
            raise DataError(f"weight of {entry['source']!r} is {weight}; weights must be > 0 (remove the source "
                            "to leave it out)")
        if not math.isfinite(weight):  # one infinite weight makes every share inf / inf = NaN
            raise DataError(f"weight of {entry['source']!r} is {weight}; weights must be finite: give each source "
                            "its share, e.g. 0.7 and 0.3")
        for key, kind in (("streaming", bool), ("split", str), ("text_field", str)):
            if entry.get(key) is not None and not isinstance(entry[key], kind):  # bool("false") would be True
                raise DataError(f"{key} of {entry['source']!r} must be {'true or false' if kind is bool else 'text'}, "
                                f"got {entry[key]!r}")
        specs.append(SourceSpec(str(entry["source"]), weight, entry.get("text_field", text_field),
                                entry.get("split"), entry.get("streaming", streaming)))
    return specs


def _assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of each assistant turn.

    A turn's span runs from the end of the prompt rendered with ``add_generation_prompt`` to the end
    of the conversation rendered through that turn, so it includes the template's end-of-turn marker
    (the student must learn to stop) but not the role header.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(prompt)):
            raise DataError("the tokenizer's chat template does not render conversations prefix by prefix, so "
                            "assistant turns cannot be located; set completion_only=false")
        spans.append((len(prompt), len(through)))
    return text, spans


def encode_chat(tokenizer, conversations: list[list[dict]], completion_only: bool
                ) -> tuple[list[list[int]], list[list[int]] | None]:
    """Token ids of rendered conversations and, with ``completion_only``, a 0/1 mask per token (1 = assistant)."""
    rendered = [_assistant_spans(tokenizer, c) if completion_only else
                (tokenizer.apply_chat_template(c, tokenize=False), []) for c in conversations]
    enc = tokenizer([t for t, _ in rendered], add_special_tokens=False, return_offsets_mapping=completion_only)
    if not completion_only:
        return enc["input_ids"], None
    masks = []
    for (_, spans), offsets in zip(rendered, enc["offset_mapping"]):
        # A token counts when it overlaps an assistant span: a BPE token may carry the space before the
        # reply (" the" after "assistant:"), and it is still the reply's first token.
        masks.append([int(any(s < b and e > a for a, b in spans)) for s, e in offsets])
    return enc["input_ids"], masks


def texts_from(source: str, tokenizer, *, text_field: str = "text", split: str | None = None) -> list[str]:
    """Documents of a dataset as strings (chat records rendered with the chat template)."""
    records = load_records(source, split)
    cols = records.column_names
    if "messages" in cols:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"{source} is in chat format but the tokenizer has no chat template; use text records")
    elif text_field not in cols:
        raise DataError(f"{source} has no '{text_field}' column (columns: {cols}); set text_field=")
    try:
        if "messages" not in cols:
            texts = records[text_field]
            return [t for t in checked_texts(source, text_field, texts, range(len(texts))) if t.strip()]
        out = []
        for i, r in enumerate(records):
            problem = chat_problem(r["messages"])
            if problem:
                raise RecordError(source, i, problem)
            out.append(tokenizer.apply_chat_template(r["messages"], tokenize=False))
        return out
    except UnicodeDecodeError as err:
        raise encoding_error(source, err) from None


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
