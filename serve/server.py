"""OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m serve.server --model DIR --host 127.0.0.1 --port 8000 [--max-batch 8] [--max-queue 32]
        [--api-key KEY] [--served-model-name NAME] [--max-body-bytes N] [--request-timeout S]

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` gives server-sent
events: one event per generated token, a final event with ``finish_reason``, with ``"stream_options":
{"include_usage": true}`` one more with ``"choices": []`` and ``usage``, then ``data: [DONE]``),
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics`` (Prometheus text). ``n``
choices are ``n`` requests of the engine's, each taking a place (a seed makes choice i sample with seed + i);
streamed, their chunks interleave, each naming its choice's ``index``, and ``[DONE]`` follows the last. A
generation that fails inside the engine gets 500 ``generation_failed``; when streaming, an error event
``{"error": {...}}`` then ``[DONE]`` (never a finish chunk, so a client cannot take the cut text as whole).

Why Starlette + uvicorn: the whole server is a handful of routes and one streaming response, so a thin
ASGI toolkit is enough; Starlette is the maintained core FastAPI itself is built on, its
``StreamingResponse`` watches for client disconnects (we stop that request's generation), and uvicorn is
the standard production ASGI server. The model runs in one background engine thread (torch releases the
GIL in its kernels); the event loop only parses requests and forwards token events, so a slow client
never stalls the batch, and prompts are tokenized in a worker thread so a huge one cannot stall it
either. Each HTTP connection gets ``TCP_NODELAY`` so a small SSE event leaves at once instead of waiting
for Nagle's algorithm to batch it with the next.

Every request field is checked at the boundary: a bad one gets 400 with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}`` before anything reaches the engine. Fields are an
allowlist per endpoint (``IMPLEMENTED``, ``NEUTRAL``, ``IGNORED``): an unknown field, or an OpenAI field this
server does not implement (``best_of``, ``suffix``, ``tools``, ``tool_choice`` ``"required"``,
``audio``, ``modalities`` beyond ``["text"]``, ``prediction``, ...) at anything but its neutral value gets 400
naming it (code ``unsupported``). Log-probabilities (completions' ``logprobs: k``, chat's ``logprobs: true`` with
``top_logprobs: k``, ``k`` at most 20) are the model's own distribution's: temperature 1, before penalties, top-k
and top-p (as vLLM reports them by default), in OpenAI's formats; streamed, each token's chunk carries its own.
Completions' ``echo`` puts the prompt before each choice's text (streamed: a chunk of its own before the first
token's), and with ``logprobs`` the prompt tokens' too (the first one's null: nothing predicts it), so a client can
score a text by its log-likelihood. ``logit_bias`` (``{"token id": bias}``, each in [-100, 100], at most 300) is
added to the logits each token is chosen from, greedy included; the log-probabilities stay the model's.
``response_format`` (both endpoints) asks for structured output: ``{"type": "json_object"}`` any JSON object,
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` JSON that matches the schema
(:mod:`serve.structured`; a schema its compiler refuses gets 400). The reply is whole unless ``max_tokens`` cuts it
(``finish_reason`` ``"length"``). Accepted and ignored, because none can change the output: ``user``, ``metadata``,
``store``, ``service_tier``, ``parallel_tool_calls``, ``safety_identifier``, ``prompt_cache_key``. Chat
messages: ``developer`` is templated as ``system``; a message ``name`` (a string) is accepted and not shown to the
model, as chat templates drop it. ``max_tokens`` and
``max_completion_tokens`` may both be sent only with one value. Limits: bodies
over ``--max-body-bytes`` get 413, a body that does not arrive within ``--body-timeout`` 408 (a request
head that does not: the connection is closed), a request not finished within ``--request-timeout`` 504
(an error event when streaming). A client that disconnects cancels its request, streaming or not. With ``--api-key`` (or ``HYBRID_DISTILL_API_KEY``) every route but
``/health`` needs ``Authorization: Bearer <key>``.

Admission: at most ``max_batch`` requests decode together and ``max_queue`` more wait (requests still being
tokenized count); beyond that the server answers 503 (with ``Retry-After``) at once, before parsing and
tokenizing the body, rather than letting latency grow without bound.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import concurrent.futures
import contextlib
import dataclasses
import gc
import hmac
import json
import math
import os
import socket
import sys
import threading
import time
import typing
import uuid
from pathlib import Path
from typing import Any

import h11
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from serve.engine import Engine, HelpFormatter, Request, WarmupError, device_problem, max_seq_len_problem
from serve.heap import tune_heap
from serve.metrics import Metrics, RequestLog, StepLog
from serve.sampling import (
    MAX_BIASED_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
    TokenLogprobs,
)
from serve.structured import Grammar, GrammarError
from serve.text import token_bytes

API_KEY_ENV = "HYBRID_DISTILL_API_KEY"
# 2 MiB: a 128k-token prompt as text (~4 bytes a token) or as JSON token ids (~7) fits with room to spare.
DEFAULT_MAX_BODY_BYTES = 2 * 2**20
DEFAULT_REQUEST_TIMEOUT = 600.0
DEFAULT_BODY_TIMEOUT = 30.0


class NoDelayH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with ``TCP_NODELAY`` on every connection and a deadline for request heads.

    uvicorn closes idle keep-alive connections but waits forever for a request head that never completes
    (a connection opened and left silent, or headers sent a byte at a time); such a connection is closed
    once it has waited ``head_timeout`` seconds for one head. Bodies have their own deadline in the app.
    """

    head_timeout: float = DEFAULT_BODY_TIMEOUT

    @classmethod
    def with_head_timeout(cls, seconds: float) -> type[NoDelayH11Protocol]:
        return type(cls.__name__, (cls,), {"head_timeout": seconds})

    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
        self._head_since: float | None = self.loop.time()  # waiting for a request head since
        self._head_timer = self.loop.call_later(self.head_timeout / 4, self._check_head)

    def data_received(self, data: bytes) -> None:
        if self._head_since is None and self.conn.their_state is h11.IDLE:
            self._head_since = self.loop.time()  # the next request's head begins
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete
            self._head_since = None

    def _check_head(self) -> None:
        if self.transport.is_closing():
            return
        if (self._head_since is not None and self.conn.their_state is h11.IDLE
                and self.loop.time() - self._head_since >= self.head_timeout):
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()
            return
        self._head_timer = self.loop.call_later(self.head_timeout / 4, self._check_head)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)


def _utf8(text: str) -> str:
    """``text`` with each lone UTF-16 surrogate (JSON's ``\\ud800`` can carry one) written as its escape: a reply
    is UTF-8, which cannot hold one."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """A client-visible error: answered with ``status`` and an OpenAI-style ``{"error": {...}}`` body. The message
    and param may quote the client's own text (a field's name, a model's), lone surrogates and all."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message, param = _utf8(message), None if param is None else _utf8(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload(), status_code=self.status, headers=self.headers)


class BadRequest(APIError):
    """400: a field is missing, of the wrong type, or out of range (``param`` names it)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(400, message, param=param, code=code)


# Answered before (or instead of) reading the whole body: close the connection so an unread body
# cannot be taken for the next request.
_CLOSE = {"Connection": "close"}
_UINT64_MAX = 2**64 - 1
_INT32_MAX = 2**31 - 1
MAX_STOP_CHARS = 512
ROLES = ("system", "developer", "user", "assistant", "tool")
# Every request field this server knows, per endpoint; any other field gets 400, as OpenAI's own API does, so
# a client that relies on one hears about it instead of silently getting something else.
# Implemented (each checked in check_common, _sampling, _logprobs, _completion_prompt or _chat_messages); top_k,
# ignore_eos and repetition_penalty are extensions (vLLM's names). The prompt and log-probability fields differ per
# endpoint (OWN).
IMPLEMENTED = ("model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
               "top_k", "n", "seed", "stop", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "logit_bias", "response_format")
# Accepted and ignored: none of them can change what is generated.
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
           "prompt_cache_key")
# Not implemented: accepted only when null or at the neutral value listed (an empty tuple: only null).
NEUTRAL = {
    "completions": {"best_of": (1,), "suffix": ("",)},
    "chat": {"tools": ([],), "functions": ([],),
             "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "modalities": (["text"],),
             "audio": (), "prediction": (), "web_search_options": (),
             "reasoning_effort": (), "verbosity": ()},
}
# One endpoint's own: completions' ``logprobs`` is a count (0: the generated token's alone) and ``echo`` returns the
# prompt too; chat's ``logprobs`` is a boolean, the count is ``top_logprobs``.
OWN = {"completions": ("prompt", "logprobs", "echo"), "chat": ("messages", "logprobs", "top_logprobs")}
KNOWN = {endpoint: frozenset(OWN[endpoint] + IMPLEMENTED + IGNORED) | NEUTRAL[endpoint].keys() for endpoint in OWN}


def _type_name(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be a boolean, got {_type_name(v)}", key, "invalid_type")
    return v


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int, hint: str = "") -> int | None:
    """An integer field in ``[lo, hi]`` (JSON booleans and floats such as ``1e30`` are refused)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"'{key}' must be an integer, got {_type_name(v)}", key, "invalid_type")
    if not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be in [{lo}, {hi}]{hint}, got {v}", key)
    return v


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, hint: str = "") -> float:
    """A finite number in ``[lo, hi]`` (Python's JSON reader accepts NaN and Infinity: refused here)."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{key}' must be a number, got {_type_name(v)}", key, "invalid_type")
    try:
        v = float(v)
    except OverflowError:  # an integer beyond float range
        v = math.inf
    if not (math.isfinite(v) and lo <= v <= hi):
        raise BadRequest(f"'{key}' must be a finite number in [{lo}, {hi}]{hint}, got {v}", key)
    return v


def _unicode(text: str, param: str) -> str:
    """``text`` when it is valid Unicode; JSON's ``\\ud800`` escapes can carry a lone UTF-16 surrogate, which no
    tokenizer can encode and no generated text can contain."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"'{param}' holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), which "
                         "is not a character; send valid Unicode text", param) from None
    return text


def _check_fields(body: dict[str, Any], endpoint: str) -> None:
    """Refuse a field this server does not know, or an unimplemented one at a value other than its neutral one."""
    for key in body:
        if key not in KNOWN[endpoint]:
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            raise BadRequest(f"unrecognized request field '{key[:100]}' for {path}; this server does not implement "
                             "it, leave it out", key[:100], "unsupported")
    for key, neutral in NEUTRAL[endpoint].items():
        v = body.get(key)
        if v is not None and not any(type(v) is type(n) and v == n for n in neutral):
            raise BadRequest(f"'{key}' is not supported by this server; leave it out", key, "unsupported")


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per generated token the request asks log-probabilities for (None: none at all)."""
    if not chat:
        return _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if not _bool(body, "logprobs", False):
        if top:
            raise BadRequest("'top_logprobs' needs \"logprobs\": true; set it or leave 'top_logprobs' out",
                             "top_logprobs")
        return None
    return top or 0


def _logit_bias(body: dict[str, Any], vocab: int) -> dict[int, float] | None:
    """``logit_bias``: an object of token ids (JSON keys, so strings of digits) in [0, ``vocab``) to biases in
    [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise BadRequest(f"'logit_bias' must be an object of token ids to numbers, got {_type_name(bias)}",
                         "logit_bias", "invalid_type")
    if len(bias) > MAX_BIASED_TOKENS:
        raise BadRequest(f"'logit_bias' may hold at most {MAX_BIASED_TOKENS} tokens, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12 and int(key) < vocab):
            raise BadRequest(f"'logit_bias' keys must be token ids in [0, {vocab}), got {key[:40]!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # (NaN fails the range)
            raise BadRequest(f"'logit_bias' values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got "
                             f"{str(value)[:40]} for token {key}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _response_format(body: dict[str, Any]) -> Grammar | None:
    """``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (JSON that matches the schema)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise BadRequest(f"'response_format' must be an object, got {_type_name(rf)}", "response_format",
                         "invalid_type")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
            raise BadRequest("'response_format' of type json_schema needs \"json_schema\": {\"name\": ..., \"schema\": "
                             "{...}} with the schema an object", "response_format")
        return Grammar.json_schema(spec["schema"])
    raise BadRequest(f"'response_format' type must be text, json_object or json_schema, got {str(kind)[:40]!r}",
                     "response_format")


def _sampling(body: dict[str, Any], n_prompt: int, max_seq_len: int, default_max: int | None, chat: bool,
              vocab: int) -> SamplingParams:
    """The request's sampling fields, each checked; ``default_max`` caps ``max_tokens`` when it is absent;
    ``vocab`` bounds ``logit_bias``'s token ids."""
    room = max_seq_len - n_prompt
    if room < 1:
        raise BadRequest(f"the prompt has {n_prompt} tokens but the model context is {max_seq_len}; "
                         "shorten the prompt", "messages" if "messages" in body else "prompt", "context_length_exceeded")
    key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    both = body.get("max_tokens"), body.get("max_completion_tokens")
    if None not in both and not (type(both[0]) is type(both[1]) and both[0] == both[1]):
        raise BadRequest("'max_tokens' and 'max_completion_tokens' are both set and differ; send one of them",
                         "max_completion_tokens")
    max_tokens = _int(body, key, None, 1, room, f" for this prompt of {n_prompt} tokens (context {max_seq_len})")
    if max_tokens is None:
        max_tokens = min(default_max or room, room)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise BadRequest(f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE}, 2], got {temperature}",
                         "temperature")
    top_p = _number(body, "top_p", 1.0, MIN_TOP_P, 1.0, " (use temperature 0 for greedy)")
    top_k = _int(body, "top_k", 0, 0, _INT32_MAX, " (0 = off)")
    seed = _int(body, "seed", None, 0, _UINT64_MAX)
    penalties = {key: _number(body, key, 0.0, -MAX_PENALTY, MAX_PENALTY, " (0 = off)")
                 for key in ("presence_penalty", "frequency_penalty")}
    repetition = _number(body, "repetition_penalty", 1.0, *REPETITION_PENALTY_RANGE, " (1 = off)")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= 4
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise BadRequest(f"'stop' must be a non-empty string or a list of at most 4, each of 1 to {MAX_STOP_CHARS} "
                         "characters", "stop")
    for s in stop:
        _unicode(s, "stop")
    logprobs = _logprobs(body, chat)
    echo = not chat and _bool(body, "echo", False)
    return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=seed, stop=tuple(stop), ignore_eos=_bool(body, "ignore_eos", False),
                          logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                          repetition_penalty=repetition, logit_bias=_logit_bias(body, vocab),
                          grammar=_response_format(body), **penalties)


def _completion_prompt(body: dict[str, Any], vocab: int) -> str | list[int]:
    """The prompt as text (to tokenize) or token ids; a one-element batch is unwrapped."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one: what OpenAI clients send for a single prompt list
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty; send at least one character", "prompt")
        return _unicode(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab for t in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("one prompt per request; send several requests instead", "prompt", "unsupported")
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt",
                     "invalid_type" if prompt is not None else "missing")


def _chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``messages`` as ``[{role, content}]`` with string content (text parts joined by newlines).

    ``developer`` is OpenAI's newer name for ``system``: it reaches the chat template as ``system`` (templates
    know only that one, and some add a default system prompt when they do not see it). A message ``name`` is
    accepted and dropped, as chat templates drop it: agent frameworks send one on every message.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with 'role' and 'content'", where, "invalid_type")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", where + ".role")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise BadRequest(f"{where}.name must be a string, got {_type_name(m['name'])}", where + ".name",
                             "invalid_type")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                pwhere = f"{where}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                    raise BadRequest(f"{pwhere}: only text content parts ({{\"type\": \"text\", \"text\": ...}}) "
                                     f"are supported, got {kind!r}", pwhere, "unsupported")
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"{pwhere}.text must be a string", pwhere + ".text", "invalid_type")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string or a list of text parts, got {_type_name(content)}",
                             where + ".content", "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": _unicode(content, where + ".content")})
    return out


class AuthGuard:
    """ASGI middleware: every path but ``/health`` needs ``Authorization: Bearer <api key>`` (401 otherwise)."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            # compare_digest: the time taken says nothing about how much of the key matched.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                err = APIError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer", **_CLOSE})
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AtCapacity(Exception):
    """Every batch row and queue place is taken (answered 503 with ``Retry-After``)."""


class AsyncEngine:
    """Bridges the engine thread and the event loop: bounded admission, per-request event queues, metrics."""

    def __init__(self, engine: Engine, max_queue: int = 32) -> None:
        self.engine = engine
        self.capacity = engine.max_batch + max_queue
        self.in_flight = 0
        self._lock = threading.Lock()
        self.metrics = Metrics()
        m = self.metrics
        m.gauge("active_requests", "Requests decoding now.", lambda: engine.num_active)
        m.gauge("queued_requests", "Requests waiting for a batch slot.", lambda: engine.num_waiting)
        m.gauge("kv_cache_bytes", "Bytes of preallocated KV cache.",
                lambda: engine.cache.nbytes() if engine.cache is not None else 0)
        m.gauge("kv_cache_rows_used_ratio", "Fraction of KV cache rows holding a live request.",
                lambda: engine.num_active / engine.max_batch)
        m.gauge("overtakes", "Short prompts prefilled between the layers of another forward, since start.",
                lambda: engine.overtakes)
        if engine.prefix_cache is not None:  # serve.prefix_cache: bytes / budget / hits / evictions
            for name, (help_, fn) in engine.prefix_cache.gauges().items():
                m.gauge(name, help_, fn)
        m.watch_gc()
        engine.start()

    def reserve(self, count: int = 1) -> None:
        """Take ``count`` places (one per choice) for a request about to be parsed and tokenized, all or none;
        raises :class:`AtCapacity` when the server is too full. A place is its choice's until it finishes
        (:meth:`submit` with ``reserved=True``), or until :meth:`release` when it never reaches the engine."""
        with self._lock:
            if self.in_flight + count > self.capacity:
                raise AtCapacity
            self.in_flight += count

    def release(self, count: int = 1) -> None:
        """Give back places :meth:`reserve` took for choices that did not reach the engine."""
        with self._lock:
            self.in_flight -= count

    def submit(self, prompt_ids: list[int], params: SamplingParams, reserved: bool = False,
               queue: asyncio.Queue | None = None, index: int = 0) -> tuple[Request, asyncio.Queue]:
        """Queue a request in the place ``reserve()`` took (``reserved``) or in one taken now (raises
        :class:`AtCapacity` when the server is full). A reserved place stays the caller's to release if the
        engine refuses the request. Its events go to ``queue`` (a new one by default) as ``(index, delta, token,
        finish)``: the choices of one reply share a queue and tell their events apart by ``index``."""
        if not reserved:
            self.reserve()
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue() if queue is None else queue
        arrival = time.perf_counter()
        last = [arrival]
        metrics = self.metrics

        def on_event(delta: str, token: int | None, finish: str | None) -> None:
            # Runs on the engine thread: time-stamp here, then hand the event to the event loop.
            now = time.perf_counter()
            if token is not None:
                if last[0] == arrival:
                    metrics.observe_ttft(now - arrival)
                else:
                    metrics.observe_token_latency(now - last[0])
                last[0] = now
                metrics.inc("generated_tokens_total")
            else:
                with self._lock:
                    self.in_flight -= 1
                if finish == "error":
                    metrics.inc("request_errors_total")
            loop.call_soon_threadsafe(queue.put_nowait, (index, delta, token, finish))

        try:
            req = self.engine.submit(prompt_ids, params, on_event)
        except BaseException:
            if not reserved:
                self.release()
            raise
        self.metrics.inc("prompt_tokens_total", len(prompt_ids))
        return req, queue


class OpenAIRoutes:
    """The OpenAI-compatible routes over one :class:`AsyncEngine`, with the server's limits.

    A request goes through four steps, each a method: read the body (:meth:`read_body`, size and time
    limits; :meth:`parse_json`), check it (:meth:`check_common`, :func:`_sampling`), tokenize off the event loop
    (:meth:`tokenize`), then answer as a stream (:meth:`stream`) or one JSON body (:meth:`complete`).
    """

    def __init__(self, engine: Engine, aengine: AsyncEngine, *, model_name: str, max_body_bytes: int,
                 request_timeout: float, body_timeout: float, request_log: RequestLog | None = None) -> None:
        self.engine, self.aengine = engine, aengine
        self.request_log = request_log
        self.model_name = model_name
        self.started = int(time.time())  # /v1/models' "created"
        self.max_body_bytes, self.request_timeout, self.body_timeout = max_body_bytes, request_timeout, body_timeout
        self.vocab = engine.model.config.vocab_size
        # One worker: tokenizing off the event loop keeps /health and streams responsive during a huge
        # prompt (the fast tokenizer releases the GIL), and one thread never shares the tokenizer's
        # mutable state with another encode.
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    # ---- the steps of a request ------------------------------------------------------------------
    @staticmethod
    def parse_json(raw: bytes) -> dict[str, Any]:
        """The body as a JSON object (400 ``invalid_json`` otherwise)."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, 5000-digit integers, nesting
            raise BadRequest(f"malformed JSON body: {str(e)[:200]}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object", None, "invalid_json")
        return body

    async def read_body(self, request: HTTPRequest) -> bytes:
        """The whole body, within ``--max-body-bytes`` (413) and ``--body-timeout`` (408)."""
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, "the Content-Length header is not a number", headers=_CLOSE)
            if int(length) > limit:
                raise APIError(413, f"the request body has {int(length)} bytes; the limit is {limit} "
                               "(server flag --max-body-bytes)", code="request_too_large", headers=_CLOSE)
        chunks: list[bytes] = []
        size = 0

        async def receive_all() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"the request body exceeds the limit of {limit} bytes "
                                   "(server flag --max-body-bytes)", code="request_too_large", headers=_CLOSE)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(receive_all(), self.body_timeout)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                           code="body_timeout", headers=_CLOSE) from None
        return b"".join(chunks)

    def check_common(self, body: dict[str, Any], chat: bool) -> None:
        _check_fields(body, "chat" if chat else "completions")
        _bool(body, "stream", False)
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"'model' must be a string, got {_type_name(name)}", "model", "invalid_type")
        if name is not None and name != self.model_name:
            raise APIError(404, f"model '{name[:100]}' is not served here; this server serves '{self.model_name}' "
                           "(GET /v1/models)", param="model", code="model_not_found")
        options = body.get("stream_options")
        if options is not None:
            if not isinstance(options, dict):
                raise BadRequest("'stream_options' must be an object", "stream_options", "invalid_type")
            if not body.get("stream"):  # as OpenAI: options for a stream that will not be sent are a client bug
                raise BadRequest("'stream_options' is only allowed with \"stream\": true; leave it out",
                                 "stream_options")
            include = options.get("include_usage")
            if include is not None and not isinstance(include, bool):
                raise BadRequest(f"'stream_options.include_usage' must be a boolean, got {_type_name(include)}",
                                 "stream_options.include_usage", "invalid_type")
        # Each choice is a request of its own in the engine: more than the server can ever hold would wait forever.
        _int(body, "n", 1, 1, self.aengine.capacity, f" (this server holds {self.aengine.capacity} requests at once: "
             "--max-batch + --max-queue)")

    async def tokenize(self, body: dict[str, Any], chat: bool, prompt: str | list[int] | None) -> list[int]:
        """The prompt's token ids: chat messages through the template, or completions' ``prompt`` as
        :func:`_completion_prompt` parsed it (None for chat)."""
        loop = asyncio.get_running_loop()
        if chat:
            messages = _chat_messages(body)
            # A base model's tokenizer: transformers would raise a plain ValueError, answered 500.
            if not getattr(self.engine.tokenizer, "chat_template", None):
                raise BadRequest("this model's tokenizer has no chat template, so it cannot take chat messages; "
                                 "send a plain prompt to /v1/completions", "messages", "unsupported")
            try:
                return await loop.run_in_executor(self.tokenize_pool, self.engine.encode, messages, True)
            except Exception as e:
                # A template that refuses these messages (a system role, the role order) raises a jinja2
                # error: the client's to fix. Matched by module: jinja2 is transformers' optional dependency.
                if type(e).__module__.split(".")[0] != "jinja2":
                    raise
                raise BadRequest(f"the model's chat template rejected these messages: {e}", "messages") from None
        if isinstance(prompt, list):
            return prompt
        return await loop.run_in_executor(self.tokenize_pool, self.engine.encode, prompt)

    async def generate(self, request: HTTPRequest, chat: bool) -> Response:
        try:
            return await self._generate(request, chat)
        except Exception:  # our bug: answered 500 by _server_error, and counted as the error answer it is
            self.aengine.metrics.inc("request_errors_total")
            raise

    async def _generate(self, request: HTTPRequest, chat: bool) -> Response:
        received = time.perf_counter()
        aengine = self.aengine
        aengine.metrics.inc("requests_total")
        deadline = asyncio.get_running_loop().time() + self.request_timeout
        try:
            raw = await self.read_body(request)
        except APIError as e:
            aengine.metrics.inc("request_errors_total")
            return e.response()
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            # A place before the body is parsed and tokenized: a full server refuses at once, and requests being
            # tokenized hold places too, so a burst cannot pile up in the tokenizer's queue. (After the body is
            # read: a client trickling its body holds no place meanwhile.)
            aengine.reserve()
        except AtCapacity:
            aengine.metrics.inc("request_errors_total")
            aengine.metrics.inc("requests_rejected_total")
            return APIError(503, f"server at capacity ({aengine.capacity} requests in flight); retry later",
                            type="server_busy", code="server_busy", headers={"Retry-After": "1"}).response()
        reserved, reqs, queue = 1, [], asyncio.Queue()
        try:
            body = self.parse_json(raw)
            self.check_common(body, chat)
            n = body.get("n") or 1
            if n > 1:  # a place per choice, all before tokenizing
                aengine.reserve(n - 1)
                reserved = n
            prompt = None if chat else _completion_prompt(body, self.vocab)
            prompt_ids = await self.tokenize(body, chat, prompt)
            echo = None
            if not chat and _bool(body, "echo", False):  # the prompt as sent, or as its token ids decode
                echo = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(
                    prompt_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            try:
                params = _sampling(body, len(prompt_ids), self.engine.max_seq_len, None if chat else 16, chat,
                                   self.vocab)
                if params.grammar is not None:  # compiled in the worker thread: the event loop never waits on it
                    await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self.engine.grammars.check,
                                                                     params.grammar)
                for i in range(n):
                    # With a seed the whole reply repeats: choice i samples with seed + i.
                    seed = None if params.seed is None else (params.seed + i) % (_UINT64_MAX + 1)
                    reqs.append(aengine.submit(prompt_ids, dataclasses.replace(params, seed=seed), reserved=True,
                                               queue=queue, index=i)[0])
            except ValueError as e:
                for req in reqs:
                    self.engine.cancel(req)
                # the engine's or the sampler's own limits, or a schema the grammar compiler refuses
                raise BadRequest(str(e), "response_format" if isinstance(e, GrammarError) else None) from None
        except AtCapacity:
            aengine.metrics.inc("request_errors_total")
            aengine.metrics.inc("requests_rejected_total")
            return APIError(503, f"server at capacity ({aengine.capacity} requests in flight) for {n} choices; retry "
                            "later", type="server_busy", code="server_busy", headers={"Retry-After": "1"}).response()
        except APIError as e:
            aengine.metrics.inc("request_errors_total")
            return e.response()
        finally:
            if reserved > len(reqs):  # places of choices that never reached the engine
                aengine.release(reserved - len(reqs))
        reply = _Reply(self, reqs, queue, prompt_ids, chat, deadline, received, echo)
        if not body.get("stream"):
            return await reply.complete(request)
        return reply.stream(include_usage=bool((body.get("stream_options") or {}).get("include_usage")))

    # ---- small routes ------------------------------------------------------------------------------
    async def completions(self, request: HTTPRequest) -> Response:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self.generate(request, chat=True)

    async def health(self, _: HTTPRequest) -> Response:
        engine = self.engine
        return JSONResponse({"status": "ok", "model": self.model_name, "hybrid": engine.spec is not None,
                             "active": engine.num_active, "queued": engine.num_waiting})

    async def metrics(self, _: HTTPRequest) -> Response:
        return PlainTextResponse(self.aengine.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "hybrid-distill"}

    async def models(self, _: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        name = request.path_params["model"]
        if name != self.model_name:
            return APIError(404, f"model '{name[:100]}' is not served here; this server serves '{self.model_name}' "
                            "(GET /v1/models)", param="model", code="model_not_found").response()
        return JSONResponse(self.model_card())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]


class LogprobFormat:
    """Generated tokens' log-probabilities in OpenAI's formats, one request's tokens in order (streamed chunks
    call :meth:`render` with a token each): chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
    completions' parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (text -> logprob) and
    ``text_offset`` (the characters of the completion's text before each token's bytes)."""

    def __init__(self, tokenizer, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.special = set(getattr(tokenizer, "all_special_ids", ()))  # named, but not in the text
        self.text_offset = 0  # of the next token
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # the text the tokens so far make

    def token(self, token_id: int) -> tuple[str, bytes]:
        """A token's text and its UTF-8 bytes; a token that holds part of a character is named by its bytes, as
        OpenAI does (``bytes:\\xe2\\x80``), so that two such tokens never share a name."""
        data = token_bytes(self.tokenizer, token_id)
        try:
            return data.decode("utf-8"), data
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data

    def render(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        if self.chat:
            def item(token_id: int, logprob: float) -> dict[str, Any]:
                text, data = self.token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(data)}
            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]}
                                for e in entries], "refusal": None}
        return self.render_tokens([e.token_id for e in entries], entries)

    def render_tokens(self, ids: list[int], entries: list[TokenLogprobs | None]) -> dict[str, Any]:
        """Completions' lists for tokens ``ids``; an entry of None (an echoed prompt's first token) is null."""
        tokens, offsets = [], []
        for i in ids:
            text, data = self.token(i)
            tokens.append(text)
            offsets.append(self.text_offset)
            if i not in self.special:
                self.text_offset += len(self.decoder.decode(data))
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {self.token(i)[0]: v for i, v in e.top} for e in entries],
                "text_offset": offsets}


class _Reply:
    """The answer to one admitted request, its ``n`` choices each a request of the engine's: an SSE stream or one
    JSON body, within the deadline."""

    def __init__(self, api: OpenAIRoutes, reqs: list[Request], queue: asyncio.Queue, prompt_ids: list[int], chat: bool,
                 deadline: float, received: float, echo: str | None = None) -> None:
        self.api, self.reqs, self.queue, self.chat, self.deadline = api, reqs, queue, chat, deadline
        self.prompt_ids, self.n_prompt = prompt_ids, len(prompt_ids)
        self.echo = echo  # completions' echo: the prompt text each choice starts with
        self.received = received  # perf_counter when the handler started
        self.first_sent: float | None = None
        self.closed = False  # close() has run
        # Per choice: token events streamed so far (the next one's log-probabilities are reqs[i].logprobs[this]),
        # and the formatter that numbers its text offsets.
        self.tokens_sent = [0] * len(reqs)
        self.logprobs = [LogprobFormat(api.engine.tokenizer, chat) for _ in reqs]
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.obj = "chat.completion" if chat else "text_completion"
        self.timeout_error = APIError(504, f"the request did not finish within {api.request_timeout:g} s (server "
                                      "flag --request-timeout); lower max_tokens or retry later",
                                      type="timeout_error", code="request_timeout")
        self.generation_error = APIError(500, "generation failed for this request; see the server log",
                                         type="server_error", code="generation_failed")

    def log(self) -> None:
        """Append each choice's timings to the server's request log, if it keeps one (serve.metrics.RequestLog)."""
        log = self.api.request_log
        if log is None:
            return
        t0, done = self.received, time.perf_counter()
        ms = lambda t: None if t is None else round((t - t0) * 1000, 2)  # noqa: E731
        for i, req in enumerate(self.reqs):
            log.write({"id": self.rid, **({"choice": i} if len(self.reqs) > 1 else {}), "engine_id": req.id,
                       "received_s": round(t0, 6), "prompt_tokens": self.n_prompt, "cached_tokens": req.cached_tokens,
                       "completion_tokens": len(req.out_ids), "finish_reason": req.finish_reason,
                       "tokenized_ms": ms(req.arrival), "prefill_start_ms": ms(req.prefill_start),
                       "first_token_ms": ms(req.first_token_at), "first_sent_ms": ms(self.first_sent),
                       "done_ms": ms(done)})

    def usage(self) -> dict[str, int]:
        """The prompt counted once, as OpenAI does, and every choice's tokens."""
        n = sum(len(req.out_ids) for req in self.reqs)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n, "total_tokens": self.n_prompt + n}

    def choice(self, index: int, text: str, finish: str | None, first: bool = False,
               logprobs: list[TokenLogprobs] | None = None) -> dict[str, Any]:
        lp = None if logprobs is None else self.logprobs[index].render(logprobs)
        if self.chat:
            delta: dict[str, str] = {"content": text}
            if first:
                delta["role"] = "assistant"
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    def echoed(self, index: int) -> dict[str, Any]:
        """Choice ``index``'s echo of the prompt: its text, and its tokens' log-probabilities when asked for."""
        req = self.reqs[index]
        lp = None if req.prompt_logprobs is None else self.logprobs[index].render_tokens(self.prompt_ids,
                                                                                      req.prompt_logprobs)
        return {"index": index, "text": self.echo, "logprobs": lp, "finish_reason": None}

    def next_logprobs(self, index: int, token: int | None) -> list[TokenLogprobs] | None:
        """The log-probabilities a streamed event carries: its token's, when the request asked for them."""
        req = self.reqs[index]
        if token is None or req.logprobs is None:
            return None
        self.tokens_sent[index] += 1
        return req.logprobs[self.tokens_sent[index] - 1:self.tokens_sent[index]]

    def cancel(self) -> None:
        """Stop every choice still generating."""
        for req in self.reqs:
            if not req.done:
                self.api.engine.cancel(req)

    async def next_event(self) -> tuple[int, str, int | None, str | None] | None:
        """The engine's next event ``(choice, delta, token, finish)``, or None once the deadline has passed (the
        choices are then cancelled)."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(self.queue.get(), max(self.deadline - loop.time(), 0.001))
        except asyncio.TimeoutError:
            self.cancel()
            self.api.aengine.metrics.inc("request_errors_total")
            return None

    def stream(self, include_usage: bool = False) -> StreamingResponse:
        """Server-sent events: one chunk per token of a choice, each choice's finish chunk, then ``[DONE]`` once every
        choice has finished. ``include_usage`` (OpenAI's ``stream_options``): every chunk has ``"usage": null`` and
        one more, ``"choices": []`` with the usage, comes before ``[DONE]``. A choice that fails ends the stream
        (an error event, the others cancelled)."""
        head = {"id": self.rid, "object": self.obj + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.api.model_name}

        async def events():
            first = [True] * len(self.reqs)
            running = len(self.reqs)
            try:
                while True:
                    event = await self.next_event()
                    if event is None:
                        yield f"data: {json.dumps(self.timeout_error.payload())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    index, delta, token, finish = event
                    if finish == "error":  # as the non-streaming 500: an error event, never a normal-looking finish
                        self.cancel()
                        yield f"data: {json.dumps(self.generation_error.payload())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    if first[index] and self.echo is not None:  # the prompt, before the choice's first token
                        echo = {**head, "choices": [self.echoed(index)], **({"usage": None} if include_usage else {})}
                        yield f"data: {json.dumps(echo)}\n\n"
                    chunk = {**head, "choices": [self.choice(index, delta, finish, first[index],
                                                             self.next_logprobs(index, token))]}
                    if include_usage:
                        chunk["usage"] = None
                    first[index] = False
                    if self.first_sent is None:
                        self.first_sent = time.perf_counter()
                    yield f"data: {json.dumps(chunk)}\n\n"
                    running -= finish is not None
                    if not running:
                        if include_usage:
                            yield f"data: {json.dumps({**head, 'choices': [], 'usage': self.usage()})}\n\n"
                        yield "data: [DONE]\n\n"
                        return
            finally:
                self.close()

        return _EventStream(events(), self.close, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def close(self) -> None:
        """The stream has ended, however it did (once per reply): a choice still generating is for a client that
        went away, so it is cancelled and its row freed; the request log gets its lines."""
        if self.closed:
            return
        self.closed = True
        self.cancel()
        self.log()

    async def complete(self, request: HTTPRequest) -> Response:
        async def watch_disconnect() -> None:
            # The body is read, so the next ASGI message is the client leaving (or our response ending).
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        parts: list[list[str]] = [[] for _ in self.reqs]
        finishes: list[str | None] = [None] * len(self.reqs)
        try:
            while None in finishes:
                event = await self.next_event()
                if event is None:
                    return self.timeout_error.response()
                index, delta, _token, finish = event
                parts[index].append(delta)
                finishes[index] = finish
                if finish == "error":
                    self.cancel()
                    return self.generation_error.response()
        finally:
            watcher.cancel()
            self.log()
        if "cancelled" in finishes:  # only a disconnected client cancels a non-streaming request
            return Response(status_code=499)
        choices = []
        for i, (req, finish) in enumerate(zip(self.reqs, finishes)):
            text = "".join(parts[i])
            msg = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            prompt = None if self.echo is None else self.echoed(i)  # (first: the text offsets run on from it)
            lp = None if req.logprobs is None else self.logprobs[i].render(req.logprobs)
            if prompt is not None:  # the prompt first, its tokens' log-probabilities before the output's
                msg["text"] = prompt["text"] + text
                if lp is not None:
                    lp = {key: prompt["logprobs"][key] + lp[key] for key in lp}
            choices.append({"index": i, **msg, "logprobs": lp, "finish_reason": finish})
        return JSONResponse({"id": self.rid, "object": self.obj, "created": self.created,
                             "model": self.api.model_name, "choices": choices, "usage": self.usage()})


class _EventStream(StreamingResponse):
    """A server-sent event stream that calls ``on_close`` when the response ends, however it ends.

    The body generator's own cleanup is not enough: a client that disconnects before the first event ends
    the response before the generator ever starts, so its ``finally`` never runs, and the request would go on
    generating for no one, holding its row, to its last token.
    """

    def __init__(self, content: typing.AsyncIterator[str], on_close: typing.Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _http_error(_: HTTPRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()


async def _server_error(_: HTTPRequest, exc: Exception) -> Response:
    # Our bug: uvicorn still logs the traceback; the client gets the same error shape as always.
    return APIError(500, "internal server error; see the server log", type="server_error").response()


def create_app(engine: Engine, *, max_queue: int = 32, model_name: str = "hybrid-distill",
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               request_timeout: float = DEFAULT_REQUEST_TIMEOUT, body_timeout: float = DEFAULT_BODY_TIMEOUT,
               request_log: str | None = None, step_log: str | None = None) -> Starlette:
    """The ASGI app; starts the engine's background thread.

    ``api_key``: required as a bearer token on every route but ``/health``. ``max_body_bytes``: larger
    bodies get 413. ``body_timeout``: seconds to receive the whole body (408 after). ``request_timeout``:
    seconds from arrival to the last token (504, or an error event when streaming, after). ``request_log``:
    a JSONL file that gets one line per finished request with where its time went (:class:`RequestLog`).
    ``step_log``: a JSONL file that gets one line per engine forward (:class:`StepLog`).
    """
    log = RequestLog(request_log) if request_log else None
    steps = StepLog(step_log) if step_log else None
    if steps is not None:
        engine.on_forward = steps.forward
    aengine = AsyncEngine(engine, max_queue=max_queue)
    api = OpenAIRoutes(engine, aengine, model_name=model_name, max_body_bytes=max_body_bytes,
                       request_timeout=request_timeout, body_timeout=body_timeout, request_log=log)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.stop()
        aengine.metrics.unwatch_gc()
        api.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if log is not None:
            log.close()
        if steps is not None:
            steps.close()

    middleware = [Middleware(AuthGuard, api_key=api_key)] if api_key else []
    app = Starlette(routes=api.routes(), middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error}, lifespan=lifespan)
    app.state.engine = aengine
    return app


class ServerThread:
    """uvicorn on a free loopback port in a daemon thread (tests and benchmarks)."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0,
                 head_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, http=NoDelayH11Protocol.with_head_timeout(head_timeout), log_level="warning",
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start within 30 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line naming the fix, exit code 2 (argparse would print the whole usage first)."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"error: {message}; see python -m serve.server --help", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m serve.server", description="OpenAI-compatible server.",
                formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (or smollm2-135m-instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: any free port)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (>= 1)")
    p.add_argument("--max-queue", type=int, default=32, help="requests waiting beyond the batch before 503")
    p.add_argument("--max-seq-len", type=int, default=None, help="context limit, at most the model's max_position_embeddings (unset: the model's)")
    p.add_argument("--device", default=None, help="auto / cpu / cuda / cuda:N (unset: cuda when available)")
    p.add_argument("--served-model-name", "--name", dest="served_model_name", default=None,
                   help="model name in responses and /v1/models (unset: the model directory's name)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (unset: ${API_KEY_ENV}, if set)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help="seconds from arrival to the last token (504 after)")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT,
                   help="seconds to receive a request's head (the connection is closed after) or its body (408)")
    p.add_argument("--prefix-cache-mb", type=float, default=256, help="prompt-prefix KV cache budget (0: off)")
    p.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt tokens per prefill forward; a prompt that arrives mid-step waits for at most one")
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="prompt tokens prefilled per engine step, between decode steps (unset: the larger of 512 "
                        "and --prefill-chunk)")
    p.add_argument("--overtake-tokens", type=int, default=None,
                   help="a prompt of at most this many tokens is prefilled between the layers of the forward in "
                        "flight instead of after it (unset: one prefill forward, --prefill-chunk + a quarter; "
                        "0: off)")
    p.add_argument("--prefill-step-ms", type=float, default=0,
                   help="while requests decode, size each step's prefill to about this many ms by the measured "
                        "prefill speed (CPU; 0: always --prefill-budget tokens)")
    p.add_argument("--request-log", default=None, metavar="FILE",
                   help="append one JSON line per finished request: its id, token counts and where its time went "
                        "(tokenized, prefill start, first token, first event sent, done; ms from arrival)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of the engine's forwards (unset: torch's, i.e. $OMP_NUM_THREADS or the cores)")
    p.add_argument("--malloc-arena-max", type=int, default=2,
                   help="CPU, glibc: cap the C heap's arenas (0: glibc's own limit, up to 8 per core); fewer arenas "
                        "keep RSS flat under varied traffic (serve.heap)")
    p.add_argument("--mmap-threshold-kb", type=int, default=1024,
                   help="CPU, glibc: C heap blocks of at least this many KiB are mmapped, so freed activations "
                        "go back to the OS (0: glibc's own sliding threshold; serve.heap)")
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="append one JSON line per engine forward (prefill chunk or decode step: its start and end "
                        "on the request log's clock, tokens, request ids), to see what a waiting request waited for")
    return p


def check_flags(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the flags, as a sentence naming the fix; None when all are usable."""
    if args.max_batch < 1:
        return f"--max-batch must be >= 1, got {args.max_batch}"
    if args.threads is not None and args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    if args.malloc_arena_max < 0:
        return f"--malloc-arena-max must be >= 0 (0: glibc's default), got {args.malloc_arena_max}"
    if not 0 <= args.mmap_threshold_kb <= 32 * 1024:
        return f"--mmap-threshold-kb must be in [0, 32768] (0: glibc's default), got {args.mmap_threshold_kb}"
    if args.max_queue < 0:
        return f"--max-queue must be >= 0, got {args.max_queue}"
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    if args.max_body_bytes < 1024:
        return f"--max-body-bytes must be >= 1024, got {args.max_body_bytes}"
    for flag in ("request_timeout", "body_timeout"):
        v = getattr(args, flag)
        if not (math.isfinite(v) and v > 0):
            return f"--{flag.replace('_', '-')} must be a positive number of seconds, got {v}"
    for flag in ("request_log", "step_log"):
        path = getattr(args, flag)
        if path is None:
            continue
        parent = Path(path).expanduser().absolute().parent
        if Path(path).is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
            return f"--{flag.replace('_', '-')} {path}: not a writable file path; give a file in an existing directory"
    if args.api_key is not None and not args.api_key.strip():
        return f"--api-key (or ${API_KEY_ENV}) is empty; give a key or leave it unset"
    if args.served_model_name is not None and not args.served_model_name.strip():
        return "--served-model-name is empty; give a name or leave it unset"
    if not (math.isfinite(args.prefix_cache_mb) and args.prefix_cache_mb >= 0):
        return f"--prefix-cache-mb must be >= 0 (0 turns the prefix cache off), got {args.prefix_cache_mb}"
    if args.prefill_chunk < 1:
        return f"--prefill-chunk must be >= 1 prompt tokens per forward, got {args.prefill_chunk}"
    if args.prefill_budget is not None and args.prefill_budget < 1:
        return f"--prefill-budget must be >= 1 prompt tokens per step, got {args.prefill_budget}"
    if args.overtake_tokens is not None and args.overtake_tokens < 0:
        return f"--overtake-tokens must be >= 0 prompt tokens (0: off), got {args.overtake_tokens}"
    if not (math.isfinite(args.prefill_step_ms) and args.prefill_step_ms >= 0):
        return f"--prefill-step-ms must be >= 0 (0: a fixed --prefill-budget), got {args.prefill_step_ms}"
    # Last: the context limit against the model's positions reads its config (no weights).
    return device_problem(args.device) or max_seq_len_problem(args.model, args.max_seq_len)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a bad flag (2, message already printed)
        return int(stop.code or 0)
    if args.api_key is None:  # read here, not as the flag's default: --help would print the key
        args.api_key = os.environ.get(API_KEY_ENV)
    problem = check_flags(args)
    if problem:  # before loading anything: a bad flag costs no model load
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # First, before the engine's, the tokenizer's and the HTTP threads exist: arenas made before the cap stay.
    tune_heap(arena_max=args.malloc_arena_max or None, mmap_threshold=args.mmap_threshold_kb * 1024 or None)
    import torch
    import uvicorn

    from core.models import resolve_model_path

    # Every forward runs on the engine's thread, with the threads asked for; this thread loads the model on
    # one, so that it never owns an OpenMP worker pool (serve.engine.Engine, ``threads``: that would cost
    # the engine's forwards ~1.7x on a 2-core machine).
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = resolve_model_path(args.model)
        engine = Engine(path, device=args.device, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                        prefix_cache_bytes=int(args.prefix_cache_mb * 2**20), prefill_chunk=args.prefill_chunk,
                        prefill_budget=args.prefill_budget, prefill_step_s=args.prefill_step_ms / 1000 or None,
                        threads=threads, overtake_tokens=args.overtake_tokens)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Everything loaded so far (torch, transformers, the model: ~400K tracked objects) lives as long as the
    # server: move it out of the collector's reach, so a full collection walks only what serving allocates
    # (a few ms instead of a few hundred with every thread stopped). Done before the app exists, so
    # hd_serve_gc_full_collection_seconds counts only collections while serving.
    gc.collect()
    gc.freeze()
    # The directory's name, never its path: responses must not reveal the server's filesystem.
    name = args.served_model_name or Path(path).resolve().name or "model"
    app = create_app(engine, max_queue=args.max_queue, model_name=name, api_key=args.api_key,
                     max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
                     body_timeout=args.body_timeout, request_log=args.request_log, step_log=args.step_log)
    # Before the port opens (so /health says ready only after): the whole cache, and one short generation.
    try:
        warm_s = engine.warmup()
    except WarmupError as e:  # every request would fail the same way: never report ready
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"warm-up: {warm_s:.1f} s (KV cache for {engine.max_batch} rows, linear kernels for every "
          "chunk length, first calls)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, http=NoDelayH11Protocol.with_head_timeout(args.body_timeout),
                log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
