"""Streaming detokenization: text deltas that are right across multi-byte characters, merges and stops.

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and for tokenizers
whose pieces merge with their neighbours (SentencePiece's leading space). :class:`IncrementalDetokenizer`
decodes a short window of the running token list and emits only what that window adds, holding back
text that ends in U+FFFD (an incomplete character). :class:`TextStream` adds stop strings on top: text
that could be the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Emits the text each new token adds. ``context_ids``: the last prompt tokens (for merge context)."""

    def __init__(self, tokenizer, context_ids: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(context_ids)[-4:]
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


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
