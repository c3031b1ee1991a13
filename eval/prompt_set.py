"""Prompt files for the release gate: JSON Lines, one prompt per line.

Each line is an object with

* ``prompt`` (str, required, non-empty): the text given to the models;
* ``id`` (str or int, optional, unique): defaults to ``line-N``;
* ``reference`` (str, optional): the text outputs are scored against; give it on every line or
  on none (a half-referenced set would silently mix two kinds of score);
* ``chat`` (bool, optional): wrap the prompt in the tokenizer's chat template; overrides ``--chat``;
* ``category``, ``kind`` (str, optional): free labels shown in the report.

Any other key is an error, so that a misspelt ``refrence`` cannot quietly turn the gate into
drift mode. Blank lines are skipped. The bundled set is ``eval/prompts/default.jsonl``.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path

KNOWN_KEYS = ("id", "prompt", "reference", "chat", "category", "kind")


class GateInputError(ValueError):
    """Broken user input (file, line, option); the message is one line that names the fix."""

    exit_code = 3


class ModelLoadError(GateInputError):
    """A model or tokenizer directory that exists but cannot be loaded."""

    exit_code = 4


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    reference: str | None = None
    chat: bool | None = None
    category: str | None = None
    kind: str | None = None


def default_prompts_path() -> Path:
    return Path(__file__).resolve().parent / "prompts" / "default.jsonl"


def _read_jsonl(path: Path, what: str) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise GateInputError(f"{what} file {path} does not exist; check the path")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is no part of line 1
    except UnicodeDecodeError:
        raise GateInputError(f"{path.name}: not UTF-8 text; save it as UTF-8 JSON Lines") from None
    rows = []
    # Records end at \n only: str.splitlines() would also split at U+2028, U+2029 or U+0085, which JSON strings may
    # hold unescaped (json.dumps(ensure_ascii=False) writes them raw).
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise GateInputError(f"{path.name} line {lineno}: not valid JSON; fix or remove the line") from None
        if not isinstance(obj, dict):
            raise GateInputError(f"{path.name} line {lineno}: expected a JSON object like "
                                 '{"id": ..., "prompt": ...}; fix or remove the line')
        rows.append((lineno, obj))
    if not rows:
        raise GateInputError(f"{what} file {path} is empty; add one JSON object per line")
    return rows


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read and validate a prompt file; raises :class:`GateInputError` naming the line and the fix."""
    path = Path(path)
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, obj in _read_jsonl(path, "prompts"):
        where = f"{path.name} line {lineno}"
        for key in obj:
            if key not in KNOWN_KEYS:
                close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else f"; allowed keys: {', '.join(KNOWN_KEYS)}"
                raise GateInputError(f"{where}: unknown key '{key}'{hint}")
        text = obj.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise GateInputError(f"{where}: 'prompt' must be a non-empty string; fix or remove the line")
        pid = obj.get("id", f"line-{lineno}")
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise GateInputError(f"{where}: 'id' must be a string or an integer")
        pid = str(pid)
        if pid in seen:
            raise GateInputError(f"{where}: id '{pid}' already used on line {seen[pid]}; make ids unique")
        seen[pid] = lineno
        ref = obj.get("reference")
        if ref is not None and not isinstance(ref, str):
            raise GateInputError(f"{where}: 'reference' must be a string")
        chat = obj.get("chat")
        if chat is not None and not isinstance(chat, bool):
            raise GateInputError(f"{where}: 'chat' must be true or false")
        for key in ("category", "kind"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise GateInputError(f"{where}: '{key}' must be a string")
        prompts.append(Prompt(pid, text, ref, chat, obj.get("category"), obj.get("kind")))
    with_ref = sum(p.reference is not None for p in prompts)
    if 0 < with_ref < len(prompts):
        raise GateInputError(f"{path.name}: {with_ref} of {len(prompts)} prompts have a 'reference'; "
                             "give one on every line or on none")
    return prompts


def load_references(path: str | Path, prompts: list[Prompt]) -> list[str]:
    """References from a JSONL of ``{"id": ..., "reference": ...}``, in the order of ``prompts``."""
    path = Path(path)
    refs: dict[str, str] = {}
    for lineno, obj in _read_jsonl(path, "references"):
        where = f"{path.name} line {lineno}"
        if set(obj) != {"id", "reference"}:
            raise GateInputError(f"{where}: expected exactly the keys 'id' and 'reference'")
        if not isinstance(obj["reference"], str):
            raise GateInputError(f"{where}: 'reference' must be a string")
        rid = str(obj["id"])
        if rid in refs:
            raise GateInputError(f"{where}: id '{rid}' appears twice; keep one reference per prompt")
        refs[rid] = obj["reference"]
    missing = [p.id for p in prompts if p.id not in refs]
    if missing:
        raise GateInputError(f"{path.name}: no reference for prompt id '{missing[0]}' "
                             f"({len(missing)} missing); add them or drop --references")
    extra = sorted(set(refs) - {p.id for p in prompts})
    if extra:
        raise GateInputError(f"{path.name}: reference id '{extra[0]}' matches no prompt; remove it or fix the id")
    return [refs[p.id] for p in prompts]
