"""Stop strings against the text as it is decoded: U+FFFD in a stop, stops beside incomplete UTF-8 characters."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import serve.engine as engine_mod
from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.sampling import SamplingParams
from serve.text import IncrementalDetokenizer, TextStream


def byte_ids(tok, data: bytes) -> list[int]:
    """One token per byte of ``data`` (any bytes, valid UTF-8 or not) for the byte-level BPE tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return tok.convert_tokens_to_ids([table[b] for b in data])


def fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: a few word pieces and one ``<0xXX>`` token per byte (byte fallback)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for word in ("▁STOP", "▁ab", "cd", "x"):
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def fb_ids(tok, pieces: list[str | int]) -> list[int]:
    """Ids of word pieces (str) and byte tokens (int)."""
    return tok.convert_tokens_to_ids([p if isinstance(p, str) else f"<0x{p:02X}>" for p in pieces])


def run(stream: TextStream, ids: list[int]) -> tuple[list[str], int | None]:
    """Deltas pushed, then the tail of finish(); and how many tokens it took to stop (None: never during push)."""
    out, stopped_at = [], None
    for n, i in enumerate(ids, 1):
        out.append(stream.push(i))
        if stream.stopped and stopped_at is None:
            stopped_at = n
    out.append(stream.finish())
    return out, stopped_at


def test_a_stop_of_replacement_characters_stops_when_the_bytes_are_known_to_be_invalid():
    tok = tiny_tokenizer()
    # 0x80 alone can never start a character: each one is a final U+FFFD as soon as it arrives.
    ids = byte_ids(tok, b"ab" + b"\x80" * 6)
    out, stopped_at = run(TextStream(tok, stop=["\ufffd"]), ids)
    assert stopped_at == 3 and "".join(out) == "ab"
    out, stopped_at = run(TextStream(tok, stop=["b\ufffd\ufffd"]), ids)
    assert stopped_at == 4 and "".join(out) == "a"


def test_a_replacement_character_stop_does_not_match_a_character_still_being_completed():
    tok = tiny_tokenizer()
    # é is C3 A9: after C3 alone the text decodes to U+FFFD, but it is not one.
    ids = byte_ids(tok, "abé and €x".encode())
    out, stopped_at = run(TextStream(tok, stop=["\ufffd"]), ids)
    assert stopped_at is None and "".join(out) == "abé and €x"


def test_a_stop_beside_an_incomplete_character_stops_at_its_own_token():
    tok = tiny_tokenizer()
    # "Ġw\xc3" is one token of the tiny vocabulary: " w" and the first byte of "ö" (C3 B6).
    ids = byte_ids(tok, b"ab") + tok.convert_tokens_to_ids(["ĠwÃ"]) + byte_ids(tok, b"\xb6rld")
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(i) for i in ids]
    assert deltas[:4] == ["a", "b", " w", "ö"] and "".join(deltas) + d.flush() == "ab wörld"
    out, stopped_at = run(TextStream(tok, stop=["b w"]), ids)
    assert stopped_at == 3 and "".join(out) == "a"
    # A stop that spans the split character.
    out, stopped_at = run(TextStream(tok, stop=["wör"]), ids)
    assert stopped_at == 5 and "".join(out) == "ab "


def test_byte_fallback_groups_are_held_until_known_and_invalid_ones_released():
    tok = fallback_tokenizer()
    # 中 is E4 B8 AD; the group decodes to U+FFFD per byte until it is whole, then to the character.
    ids = fb_ids(tok, ["▁ab", 0xE4, 0xB8, 0xAD, "cd"])
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(i) for i in ids]
    assert all("\ufffd" not in x for x in deltas) and "".join(deltas) + d.flush() == tok.decode(ids)
    assert tok.decode(ids) == "ab中cd"
    # A group with a byte that can never be part of a character: its U+FFFDs are final and a stop sees them.
    ids = fb_ids(tok, ["▁ab", 0xFF, 0x80, "x", "x", "x"])
    out, stopped_at = run(TextStream(tok, stop=["\ufffd\ufffd"]), ids)
    assert stopped_at == 3 and "".join(out) == "ab"
    # ... but not one that a later byte completes.
    ids = fb_ids(tok, ["▁ab", 0xE4, 0xB8, 0xAD, "x"])
    out, stopped_at = run(TextStream(tok, stop=["\ufffd"]), ids)
    assert stopped_at is None and "".join(out) == "ab中x"


def scripted(engine: Engine, script: list[int], stop: str, monkeypatch) -> engine_mod.Request:
    """Run one request whose sampler follows ``script`` (whatever the logits) to its end."""
    sp = SamplingParams(max_new_tokens=len(script), temperature=1.0, seed=0, stop=[stop], ignore_eos=True)
    req = engine.submit([1, 5, 9], sp)
    monkeypatch.setattr(engine_mod, "sample", lambda *_a, **_k: script[len(req.out_ids)])
    engine._run_until([req])
    assert req.out_ids == script[:len(req.out_ids)]
    return req


@pytest.mark.parametrize("stop,last", [("\ufffd", "\x80"), (" w", "ĠwÃ")])
def test_engine_reports_stop_when_the_stop_shows_in_the_last_token(stop, last, monkeypatch):
    tok = tiny_tokenizer()
    engine = Engine(model=tiny_model("llama", seed=6), tokenizer=tok, max_batch=1, max_seq_len=64)
    # The last token: a byte that is never valid UTF-8, or " w" with the first byte of "ö".
    script = byte_ids(tok, b"hi") + (byte_ids(tok, last.encode("latin-1")) if len(last) == 1
                                     else tok.convert_tokens_to_ids([last]))
    req = scripted(engine, script, stop, monkeypatch)
    assert req.finish_reason == "stop" and req.text.text == "hi"


class RawBytes:
    """A tokenizer whose ids are bytes and whose decoder this package cannot follow byte by byte."""

    all_special_ids: list[int] = []
    eos_token_id = None
    chat_template = None

    def decode(self, ids, **_kw) -> str:
        return bytes(ids).decode("utf-8", "replace")


def test_a_stop_found_only_when_held_text_is_flushed_is_reported_as_stop(monkeypatch):
    engine = Engine(model=tiny_model("llama", seed=6, vocab=256), tokenizer=RawBytes(), max_batch=1, max_seq_len=64)
    # An unknown decoder: text ending in U+FFFD waits for the next token, so the stop shows only at the end.
    req = scripted(engine, [104, 105, 0x80, 0x80], "\ufffd", monkeypatch)
    assert req.finish_reason == "stop" and req.text.text == "hi"


@pytest.mark.parametrize("scheme", ["byte_level", "byte_fallback"])
def test_deltas_add_up_to_the_full_decoding_for_any_bytes(scheme):
    import random

    tok = tiny_tokenizer() if scheme == "byte_level" else fallback_tokenizer()
    rng = random.Random(0)
    chars = [b"a", b" ", "é".encode(), "€".encode(), "😀".encode()]
    bad = [b"\x80", b"\xff", b"\xe2", b"\xf0\x9f"]
    for _ in range(200):
        if scheme == "byte_level":
            data = b"".join(rng.choice(chars + bad) for _ in range(rng.randint(1, 12)))
            ids = byte_ids(tok, data)
        else:
            # Runs of byte pieces between word pieces. A run decodes as one: valid characters, or one U+FFFD per
            # byte once it holds a bad byte. Its bad bytes come first: valid characters already sent cannot be
            # taken back when a bad byte follows them in the same run.
            ids = []
            for _ in range(rng.randint(1, 4)):
                run = [rng.choice(bad) for _ in range(rng.randint(0, 2))] + [rng.choice(chars) for _ in range(3)]
                ids += fb_ids(tok, [*b"".join(run), rng.choice(["x", "cd"])])
        d = IncrementalDetokenizer(tok)
        deltas = [d.add(i) for i in ids]
        assert "".join(deltas) + d.flush() == tok.decode(ids, skip_special_tokens=True), ids
