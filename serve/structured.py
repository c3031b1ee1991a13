"""Structured output: a grammar that decides which tokens a request may sample next.

A request that must answer in a format (a JSON object, one that matches a JSON schema, a regular expression) gets
a :class:`Grammar` in its :class:`~serve.sampling.SamplingParams`. At each token the engine sets the logits of every
token the grammar cannot take next to -inf before the token is chosen (greedy, sampled, after the penalties and the
logit bias), feeds the chosen token to the grammar, and ends the request with ``"stop"`` when the grammar can take
nothing more. A stop token is allowed exactly where the grammar may end, and ends the request there (also one that
ignores EOS or names stop tokens of its own), so the output is whole unless ``max_new_tokens`` cuts it
(``"length"``, as for any request) or a stop the request named comes first. Log-probabilities stay the model's own.

Why llguidance: the token-level matching of a grammar against a byte-level BPE vocabulary (a token may hold part of
a JSON string, a closing quote and a comma at once) is the hard part, and it is what llguidance does, in Rust (the
mask and its logits take ~0.15 ms a token on the demo model here, `bench/structured.py`); it is a structured-output
backend of vLLM and llama.cpp, a small wheel with no dependencies. This file only compiles requests' grammars, keeps one matcher per request and turns its bitmask into
logits. JSON is compact by default (``", "`` and ``": "`` between items, no other whitespace): a free-whitespace
grammar lets a small model spend its whole budget on newlines before the first key.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

KINDS = ("json_schema", "json_object", "regex")
# The JSON the grammars produce: one space after each separator and none elsewhere (see the module docstring).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that cannot be compiled (a malformed schema, an unsupported keyword, a bad pattern)."""


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a request's output must match. ``kind``: ``"json_schema"`` (``value``: the schema, JSON text),
    ``"json_object"`` (any JSON object; ``value`` empty) or ``"regex"`` (``value``: the pattern, matched whole)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.value:
            raise ValueError(f"a {self.kind} grammar needs its {'schema' if self.kind == 'json_schema' else 'pattern'}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    def source(self) -> str:
        """The grammar in llguidance's form."""
        LLMatcher = _llguidance().LLMatcher
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        schema = self.value if self.kind == "json_schema" else '{"type": "object"}'
        try:
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:  # not a JSON object, or an object its reader refuses (a lone surrogate, deep nesting)
            what = "cannot be read" if schema.lstrip().startswith("{") else "is not a JSON object"
            raise GrammarError(f"the JSON schema {what} ({e})") from None

    def validate(self) -> None:
        """Raise :class:`GrammarError` (one line) if the grammar does not compile, without a tokenizer (so before a
        model loads); :meth:`Grammars.check` compiles it against the vocabulary too."""
        _refuse(self, _llguidance().LLMatcher.validate_grammar(self.source(), None))


def _refuse(grammar: Grammar, error: str) -> None:
    """Raise llguidance's ``error`` about ``grammar`` as a one-line :class:`GrammarError` (nothing when empty)."""
    if error:
        what = {"json_schema": "the JSON schema", "regex": "the regular expression"}.get(grammar.kind, "the grammar")
        raise GrammarError(f"{what} cannot be used: {' '.join(error.split())[:300]}")


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise GrammarError('structured output needs llguidance: pip install -e ".[serve]"') from None
    return llguidance


class Grammars:
    """One engine's grammar compiler: the tokenizer in llguidance's form (built at the first grammar), the check of
    a request's grammar and the matcher each request gets.

    ``vocab``: the model's logits width (may exceed the tokenizer's); ``stop_ids``: the tokens that end a request,
    allowed wherever the grammar may end.
    """

    def __init__(self, tokenizer, vocab: int, stop_ids: set[int]) -> None:
        self.hf_tokenizer, self.vocab, self.stop_ids = tokenizer, vocab, sorted(stop_ids)
        self._tokenizer = None
        # grammar -> a compiled matcher at its start, copied for each request (compiling takes milliseconds for an
        # ordinary schema and far longer for a huge one; a copy is cheap). At most 256, the first compiled dropped
        # first.
        self._compiled: dict[Grammar, Any] = {}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            llg = _llguidance()
            try:
                self._tokenizer = llg.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab,
                                                        eos_token=self.stop_ids or None)
            except ValueError as e:
                raise GrammarError(f"structured output needs a fast tokenizer ({e})") from None
        return self._tokenizer

    def check(self, grammar: Grammar) -> None:
        """Compile ``grammar`` against the vocabulary, once (a server calls this off its event loop); one that does
        not compile raises :class:`GrammarError` (one line)."""
        self._matcher(grammar)

    def _matcher(self, grammar: Grammar):
        matcher = self._compiled.get(grammar)
        if matcher is None:
            # Compiled once: a grammar that does not compile leaves the matcher in its error state (it never raises).
            matcher = _llguidance().LLMatcher(self.tokenizer, grammar.source(), log_level=0)
            _refuse(grammar, matcher.get_error() if matcher.is_error() else "")
            if len(self._compiled) >= 256:
                self._compiled.pop(next(iter(self._compiled)), None)
            self._compiled[grammar] = matcher
        return matcher

    def constraint(self, grammar: Grammar) -> Constraint:
        """A fresh matcher for one request: a copy of the compiled one."""
        return Constraint(self._matcher(grammar).deep_copy(), self.vocab, frozenset(self.stop_ids))


class Constraint:
    """One request's place in its grammar: which tokens it may take next (:meth:`__call__`) and the tokens it took."""

    def __init__(self, matcher, vocab: int, end_ids: frozenset[int]) -> None:
        # end_ids: the engine's stop tokens, which the grammar allows where it may end; one chosen there ends the
        # request even when the request ignores EOS or names stop tokens of its own (nothing else may follow).
        self.matcher, self.vocab, self.end_ids = matcher, vocab, end_ids
        self._words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """``[vocab]`` bool: the tokens the grammar can take next (a stop token where it may end)."""
        self.matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        self._raise_if_error()
        return ((self._words[:, None] >> self._bits) & 1).bool().flatten()[: self.vocab]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``[vocab]`` logits with every token the grammar cannot take next at -inf (a new fp32 tensor)."""
        allowed = self.allowed().to(logits.device)
        return logits.float().masked_fill(~allowed, float("-inf"))

    def consume(self, token: int) -> None:
        """Advance past a chosen token (one the mask allowed)."""
        self.matcher.consume_token(token)
        self._raise_if_error()

    @property
    def done(self) -> bool:
        """Whether the grammar can take nothing more: the output is whole."""
        return self.matcher.is_stopped()

    def _raise_if_error(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"the grammar refused the output: {self.matcher.get_error()}")
