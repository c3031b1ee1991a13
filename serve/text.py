"""Streaming detokenization: text deltas that are right across multi-byte characters, merges and stops.

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and for tokenizers
whose pieces merge with their neighbours (SentencePiece's leading space). :class:`IncrementalDetokenizer`
decodes a short window of the running token list and emits only what that window adds, holding back the
characters that later tokens may still change: the U+FFFD that stands for an incomplete UTF-8 character.
A U+FFFD that no later byte can turn into a character (a byte that never starts or continues one) is
final text and goes out at once, so a stop string may contain it. :class:`TextStream` adds stop strings on
top: text that could be the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from collections.abc import Sequence

REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> byte: printable Latin-1 bytes stand for themselves, the
    other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    return table


class _TokenBytes:
    """The UTF-8 bytes a decoder builds from each token, for the two decoders that work on bytes.

    ``byte_level`` (GPT-2 style BPE: Llama 3, Qwen, SmolLM) maps every character of a piece to a byte and
    replaces each invalid or incomplete stretch of the result with one U+FFFD. ``byte_fallback``
    (SentencePiece: Llama 2, Mistral) has ``<0xXX>`` pieces; a run of them decodes whole when it is valid
    UTF-8 and to one U+FFFD per byte otherwise. Any other decoder: ``kind`` is None.
    """

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.kind = self._kind(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", ()))
        self.chars = _byte_level_chars() if self.kind == "byte_level" else {}

    @staticmethod
    def _kind(tokenizer) -> str | None:
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        try:
            spec = json.loads(decoder.__getstate__())
        except Exception:  # a slow tokenizer, no decoder, or one that cannot be read: treated as unknown
            return None
        types = {d.get("type") for d in spec.get("decoders", [spec])}
        return "byte_level" if "ByteLevel" in types else "byte_fallback" if "ByteFallback" in types else None

    def of(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for alone: a piece of a character's UTF-8 bytes for byte-level BPE,
        one byte for a ``<0xXX>`` piece, a special token's own text."""
        piece = self.tok.convert_ids_to_tokens(token_id) or ""
        if token_id in self.special:
            return piece.encode()
        if self.kind == "byte_level":
            return b"".join(bytes([self.chars[c]]) if c in self.chars else c.encode() for c in piece)
        if self.kind == "byte_fallback":
            m = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        return self.tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode()

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """The pieces of ``ids`` that reach the decoder (special tokens are skipped when decoding)."""
        return [p for i, p in zip(ids, self.tok.convert_ids_to_tokens(list(ids))) if i not in self.special and p]

    def byte_run(self, ids: Sequence[int]) -> tuple[int, bytes]:
        """``byte_fallback``: where the run of ``<0xXX>`` pieces that ends ``ids`` begins (``len(ids)``: no run),
        and its bytes. Special tokens inside it do not end it: decoding drops them before it joins the run."""
        i, run = len(ids), []
        while i > 0:
            if ids[i - 1] not in self.special:
                m = _BYTE_PIECE.fullmatch(self.tok.convert_ids_to_tokens(ids[i - 1]) or "")
                if m is None:
                    break
                run.append(int(m.group(1), 16))
            i -= 1
        return i, bytes(reversed(run))

    def invalid_run(self, ids: Sequence[int]) -> int | None:
        """``byte_fallback``: the start of the byte run that ends ``ids`` when it holds a byte no continuation can
        mend (it then decodes to one U+FFFD per byte whatever follows); None otherwise."""
        if self.kind != "byte_fallback":
            return None
        start, data = self.byte_run(ids)
        try:
            _incomplete(data, strict=True)
        except UnicodeDecodeError:
            return start
        return None

    def unsure(self, ids: Sequence[int], text: str) -> int | None:
        """How many trailing characters of ``text`` (the decoding of ``ids``) a later token may still change;
        None when unknown (another decoder, or a decoding these rules do not explain)."""
        trailing = len(text) - len(text.rstrip(REPLACEMENT))
        if self.kind == "byte_level":
            data = b"".join(bytes([self.chars[c]]) if c in self.chars else c.encode()
                            for p in self.pieces(ids) for c in p)
            return 1 if trailing and _incomplete(data) else 0
        if self.kind == "byte_fallback":
            _, data = self.byte_run(ids)
            try:
                pending = _incomplete(data, strict=True)
            except UnicodeDecodeError:  # a byte no continuation can mend: every U+FFFD of the run is final
                return 0
            if not pending:  # the run is whole characters: the U+FFFD is a character of the text itself
                return 0
            return len(data) if trailing >= len(data) else None
        return None


def _incomplete(data: bytes, strict: bool = False) -> bool:
    """Whether ``data`` ends in the first bytes of a UTF-8 character (a later byte may complete it).
    ``strict``: raise UnicodeDecodeError if any byte is invalid wherever it is."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict" if strict else "replace")
    decoder.decode(data, final=False)
    return bool(decoder.getstate()[0])


# One byte table per tokenizer (its decoder's kind is read once).
_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_bytes(tokenizer) -> _TokenBytes:
    try:
        found = _TOKEN_BYTES.get(tokenizer)
    except TypeError:  # not weak-referenceable: built each time
        return _TokenBytes(tokenizer)
    if found is None:
        found = _TOKEN_BYTES[tokenizer] = _TokenBytes(tokenizer)
    return found


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The UTF-8 bytes one token stands for (what OpenAI's log-probabilities call a token's ``bytes``), which can
    be part of a character where the token's own decoding cannot show it. For byte-level BPE the bytes of a
    generation's tokens, joined, are its text's."""
    return _token_bytes(tokenizer).of(token_id)


class IncrementalDetokenizer:
    """Emits the text each new token adds. ``context_ids``: the last prompt tokens (for merge context)."""

    def __init__(self, tokenizer, context_ids: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(context_ids)[-4:]
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # tokens before this are already emitted
        # Characters of the window's text beyond ``ids[prefix:read]``'s already emitted while the window's end
        # is still unsure (text before an incomplete character is final and goes out at once).
        self.partial = 0
        self.token_bytes = _token_bytes(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _unsure(self, now: str) -> int:
        """Trailing characters of the window's text ``now`` that later tokens may still change."""
        if not now.endswith(REPLACEMENT):
            return 0
        unsure = self.token_bytes.unsure(self.ids[self.prefix:], now)
        return len(now) if unsure is None else unsure  # unknown: all of it waits, as for an unsure character

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        start, unsure = len(before) + self.partial, self._unsure(now)
        end = len(now) - unsure
        if end <= start:
            return ""
        if unsure:
            self.partial += end - start
        else:
            # The next window starts at the tokens just emitted (for their merges with what follows), or
            # earlier, at the start of an invalid byte run: the run decodes as one, and a window that cut it
            # would decode its later bytes as if the bad one were not there.
            invalid = self.token_bytes.invalid_run(self.ids[self.prefix:])
            start_at = self.read if invalid is None else min(self.read, self.prefix + invalid)
            self.prefix, self.read, self.partial = start_at, len(self.ids), 0
        return now[start:end]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        start = len(before) + self.partial
        self.prefix = self.read = len(self.ids)
        self.partial = 0
        return now[start:]


class TextStream:
    """Token ids in, safe text deltas out; stops at the first stop string (which is not returned)."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), context_ids: Sequence[int] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, context_ids)
        self.stop = [s for s in stop if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _held(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.text += self.detok.add(token_id)
        return self._emit(final=False)

    def finish(self) -> str:
        """Flush at the end of generation (held characters and stop-string prefixes are released)."""
        if not self.stopped:
            self.text += self.detok.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stop and not self.stopped:
            hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.stopped = True
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._held()
        delta = self.text[self.sent:end]
        self.sent = end
        return delta
