"""Content hashes of model directories, so cached generations never outlive the checkpoint.

A model's fingerprint is the SHA-256 of every top-level file of its directory (weights, config,
generation config, tokenizer, chat template) by name and content; documentation (``*.md``) and
hidden files are skipped. Hashing a 14 GB checkpoint takes seconds, so each file's digest is
memoised under its ``(path, size, mtime_ns)``: a rerun on an untouched directory reads no weights,
and rewriting a file (which changes its mtime) forces a fresh digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_SKIP_SUFFIXES = (".md", ".png")
_BLOCK = 1 << 22


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


class DigestMemo:
    """``{abs path: [size, mtime_ns, sha256]}`` persisted as JSON (``None`` path = memory only)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, list] = {}
        if path is not None and path.is_file():
            try:
                self.entries = json.loads(path.read_text())
            except (json.JSONDecodeError, OSError):
                self.entries = {}  # a corrupt memo only costs a rehash

    def digest(self, file: Path) -> str:
        st = file.stat()
        key = str(file.resolve())
        hit = self.entries.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        sha = file_sha256(file)
        self.entries[key] = [st.st_size, st.st_mtime_ns, sha]
        return sha

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.entries, indent=0, sort_keys=True))
        os.replace(tmp, self.path)


def model_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).iterdir()
                  if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_SKIP_SUFFIXES))


def directory_fingerprint(model_dir: str | Path, memo: DigestMemo | None = None) -> str:
    """SHA-256 over ``name\\0sha256\\n`` of each model file, sorted by name."""
    memo = memo or DigestMemo(None)
    h = hashlib.sha256()
    for f in model_files(Path(model_dir)):
        h.update(f"{f.name}\0{memo.digest(f)}\n".encode())
    return h.hexdigest()


def json_hash(obj: object) -> str:
    """SHA-256 of a canonical JSON encoding (sorted keys): equal settings ⇔ equal hash."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
