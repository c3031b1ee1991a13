"""Bad input at the server's boundary: each case gets its exact status and OpenAI-style error body.

One real uvicorn server on loopback (tiny model, an API key, a small body limit) answers a table of
bad requests; the rows name the status, the error ``type``, ``param`` and ``code`` they must get. The
limits that need time or a second server (body read timeout, request deadline, huge-prompt
tokenization, disconnect, 503) and the start-up flag checks follow the table.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import torch

from core.tiny import save_tiny
from serve.engine import Engine
from serve.server import ServerThread, create_app, main

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), arch="qwen2")


@pytest.fixture(scope="module")
def server(model_dir):
    engine = Engine(model_dir, max_batch=2, max_seq_len=128)
    # Like many real templates, this one refuses a role it does not know how to render.
    engine.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
        "{% endif %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}<s>assistant: ")
    app = create_app(engine, max_queue=4, model_name="tiny", api_key=KEY, max_body_bytes=LIMIT, body_timeout=1.0)
    with ServerThread(app, head_timeout=1.0) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        yield c


def raw(text: str) -> bytes:
    return text.encode()


C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "the quick", "max_tokens": 4, "temperature": 0}
MSG = [{"role": "user", "content": "hi"}]

# (id, method, path, body (dict, or bytes sent as is), headers, status, type, param, code)
CASES = [
    ("malformed-json", "POST", C, raw('{"prompt": '), None, 400, "invalid_request_error", None, "invalid_json"),
    ("array-body", "POST", C, raw("[1, 2]"), None, 400, "invalid_request_error", None, "invalid_json"),
    ("bad-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', None, 400, "invalid_request_error", None, "invalid_json"),
    ("deep-nesting", "POST", C, raw("[" * 100_000), None, 400, "invalid_request_error", None, "invalid_json"),
    ("5000-digit-int", "POST", C, raw('{"prompt": "a", "seed": ' + "9" * 5000 + "}"), None,
     400, "invalid_request_error", None, "invalid_json"),
    # A lone surrogate in text the error quotes: the reply (UTF-8) could not be encoded, 500.
    ("model-lone-surrogate", "POST", C, raw('{"prompt": "a", "model": "\\ud800"}'), None,
     404, "invalid_request_error", "model", "model_not_found"),
    ("field-name-lone-surrogate", "POST", C, raw('{"prompt": "a", "\\ud800x": 1}'), None,
     400, "invalid_request_error", "\\ud800x", "unsupported"),
    ("prompt-missing", "POST", C, {"max_tokens": 2}, None, 400, "invalid_request_error", "prompt", "missing"),
    ("prompt-int", "POST", C, {"prompt": 42}, None, 400, "invalid_request_error", "prompt", "invalid_type"),
    ("prompt-empty", "POST", C, {"prompt": ""}, None, 400, "invalid_request_error", "prompt", "invalid_value"),
    ("prompt-empty-ids", "POST", C, {"prompt": []}, None, 400, "invalid_request_error", "prompt", "invalid_type"),
    ("prompt-bool-ids", "POST", C, {"prompt": [True]}, None, 400, "invalid_request_error", "prompt", "invalid_type"),
    ("prompt-id-out-of-vocab", "POST", C, {"prompt": [1, 99999]}, None,
     400, "invalid_request_error", "prompt", "invalid_value"),
    ("prompt-batch", "POST", C, {"prompt": ["a", "b"]}, None, 400, "invalid_request_error", "prompt", "unsupported"),
    ("prompt-beyond-context", "POST", C, {"prompt": [5] * 200}, None,
     400, "invalid_request_error", "prompt", "context_length_exceeded"),
    ("max-tokens-0", "POST", C, {**OK, "max_tokens": 0}, None, 400, "invalid_request_error", "max_tokens",
     "invalid_value"),
    ("max-tokens-beyond-context", "POST", C, {**OK, "max_tokens": 10_000}, None,
     400, "invalid_request_error", "max_tokens", "invalid_value"),
    ("max-tokens-string", "POST", C, {**OK, "max_tokens": "5"}, None,
     400, "invalid_request_error", "max_tokens", "invalid_type"),
    ("max-tokens-float", "POST", C, {**OK, "max_tokens": 5.0}, None,
     400, "invalid_request_error", "max_tokens", "invalid_type"),
    ("max-tokens-bool", "POST", C, {**OK, "max_tokens": True}, None,
     400, "invalid_request_error", "max_tokens", "invalid_type"),
    ("max-completion-tokens-negative", "POST", C, {"prompt": "a", "max_completion_tokens": -1}, None,
     400, "invalid_request_error", "max_completion_tokens", "invalid_value"),
    ("temperature-nan", "POST", C, raw('{"prompt": "a", "temperature": NaN}'), None,
     400, "invalid_request_error", "temperature", "invalid_value"),
    ("temperature-infinity", "POST", C, raw('{"prompt": "a", "temperature": Infinity}'), None,
     400, "invalid_request_error", "temperature", "invalid_value"),
    ("temperature-1e400", "POST", C, raw('{"prompt": "a", "temperature": 1e400}'), None,
     400, "invalid_request_error", "temperature", "invalid_value"),
    ("temperature-huge-int", "POST", C, {"prompt": "a", "temperature": 10**400}, None,
     400, "invalid_request_error", "temperature", "invalid_value"),
    ("temperature-tiny", "POST", C, {**OK, "temperature": 1e-40}, None,
     400, "invalid_request_error", "temperature", "invalid_value"),
    ("temperature-negative", "POST", C, {**OK, "temperature": -0.5}, None,
     400, "invalid_request_error", "temperature", "invalid_value"),
    ("temperature-above-2", "POST", C, {**OK, "temperature": 2.5}, None,
     400, "invalid_request_error", "temperature", "invalid_value"),
    ("temperature-string", "POST", C, {**OK, "temperature": "hot"}, None,
     400, "invalid_request_error", "temperature", "invalid_type"),
    ("top-p-tiny", "POST", C, {**OK, "temperature": 1.0, "top_p": 1e-300}, None,
     400, "invalid_request_error", "top_p", "invalid_value"),
    ("top-p-zero", "POST", C, {**OK, "top_p": 0}, None, 400, "invalid_request_error", "top_p", "invalid_value"),
    ("top-p-above-1", "POST", C, {**OK, "top_p": 1.5}, None, 400, "invalid_request_error", "top_p", "invalid_value"),
    ("top-p-nan", "POST", C, raw('{"prompt": "a", "top_p": NaN}'), None,
     400, "invalid_request_error", "top_p", "invalid_value"),
    ("top-k-negative", "POST", C, {**OK, "top_k": -1}, None, 400, "invalid_request_error", "top_k", "invalid_value"),
    ("top-k-float", "POST", C, {**OK, "top_k": 1.5}, None, 400, "invalid_request_error", "top_k", "invalid_type"),
    ("seed-2**64", "POST", C, {**OK, "seed": 2**64}, None, 400, "invalid_request_error", "seed", "invalid_value"),
    ("seed-negative", "POST", C, {**OK, "seed": -1}, None, 400, "invalid_request_error", "seed", "invalid_value"),
    ("seed-1e30", "POST", C, {**OK, "seed": 1e30}, None, 400, "invalid_request_error", "seed", "invalid_type"),
    ("seed-fraction", "POST", C, {**OK, "seed": 1.5}, None, 400, "invalid_request_error", "seed", "invalid_type"),
    ("n-beyond-capacity", "POST", C, {**OK, "n": 7}, None, 400, "invalid_request_error", "n", "invalid_value"),
    ("n-float", "POST", C, {**OK, "n": 2.0}, None, 400, "invalid_request_error", "n", "invalid_type"),
    ("n-0", "POST", C, {**OK, "n": 0}, None, 400, "invalid_request_error", "n", "invalid_value"),
    ("stop-int", "POST", C, {**OK, "stop": 5}, None, 400, "invalid_request_error", "stop", "invalid_value"),
    ("stop-empty-string", "POST", C, {**OK, "stop": [""]}, None, 400, "invalid_request_error", "stop", "invalid_value"),
    ("stop-five", "POST", C, {**OK, "stop": list("abcde")}, None, 400, "invalid_request_error", "stop",
     "invalid_value"),
    ("stop-too-long", "POST", C, {**OK, "stop": ["x" * 1000]}, None, 400, "invalid_request_error", "stop",
     "invalid_value"),
    ("stream-string", "POST", C, {**OK, "stream": "yes"}, None, 400, "invalid_request_error", "stream",
     "invalid_type"),
    ("ignore-eos-int", "POST", C, {**OK, "ignore_eos": 1}, None, 400, "invalid_request_error", "ignore_eos",
     "invalid_type"),
    ("unknown-model", "POST", C, {**OK, "model": "gpt-4"}, None, 404, "invalid_request_error", "model",
     "model_not_found"),
    ("model-int", "POST", C, {**OK, "model": 5}, None, 400, "invalid_request_error", "model", "invalid_type"),
    ("presence-penalty-out-of-range", "POST", C, {**OK, "presence_penalty": 2.5}, None,
     400, "invalid_request_error", "presence_penalty", "invalid_value"),
    ("frequency-penalty-string", "POST", CHAT, {"messages": MSG, "frequency_penalty": "high"}, None,
     400, "invalid_request_error", "frequency_penalty", "invalid_type"),
    ("repetition-penalty-zero", "POST", C, {**OK, "repetition_penalty": 0}, None,
     400, "invalid_request_error", "repetition_penalty", "invalid_value"),
    ("logit-bias-list", "POST", C, {**OK, "logit_bias": [[5, 10]]}, None,
     400, "invalid_request_error", "logit_bias", "invalid_type"),
    ("logit-bias-beyond-vocab", "POST", C, {**OK, "logit_bias": {"99999999": 10}}, None,
     400, "invalid_request_error", "logit_bias", "invalid_value"),
    ("logit-bias-key-not-an-id", "POST", CHAT, {"messages": MSG, "logit_bias": {"-5": 10}}, None,
     400, "invalid_request_error", "logit_bias", "invalid_value"),
    ("logit-bias-huge-key", "POST", C, {**OK, "logit_bias": {"9" * 5000: 1}}, None,
     400, "invalid_request_error", "logit_bias", "invalid_value"),
    ("logit-bias-out-of-range", "POST", C, {**OK, "logit_bias": {"5": 101}}, None,
     400, "invalid_request_error", "logit_bias", "invalid_value"),
    ("logit-bias-string-value", "POST", C, {**OK, "logit_bias": {"5": "ban"}}, None,
     400, "invalid_request_error", "logit_bias", "invalid_value"),
    ("logit-bias-too-many", "POST", C, {**OK, "logit_bias": {str(i): 1 for i in range(301)}}, None,
     400, "invalid_request_error", "logit_bias", "invalid_value"),
    ("logprobs-too-many", "POST", C, {**OK, "logprobs": 21}, None, 400, "invalid_request_error", "logprobs",
     "invalid_value"),
    ("logprobs-bool", "POST", C, {**OK, "logprobs": True}, None, 400, "invalid_request_error", "logprobs",
     "invalid_type"),
    ("chat-logprobs-int", "POST", CHAT, {"messages": MSG, "logprobs": 0}, None, 400, "invalid_request_error",
     "logprobs", "invalid_type"),
    ("chat-top-logprobs-alone", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, None, 400,
     "invalid_request_error", "top_logprobs", "invalid_value"),
    ("chat-top-logprobs-too-many", "POST", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, None, 400,
     "invalid_request_error", "top_logprobs", "invalid_value"),
    ("echo-string", "POST", C, {**OK, "echo": "yes"}, None, 400, "invalid_request_error", "echo", "invalid_type"),
    ("best-of", "POST", C, {**OK, "best_of": 2}, None, 400, "invalid_request_error", "best_of", "unsupported"),
    ("chat-messages-missing", "POST", CHAT, {"max_tokens": 2}, None,
     400, "invalid_request_error", "messages", "invalid_value"),
    ("chat-messages-empty", "POST", CHAT, {"messages": []}, None,
     400, "invalid_request_error", "messages", "invalid_value"),
    ("chat-message-string", "POST", CHAT, {"messages": ["hi"]}, None,
     400, "invalid_request_error", "messages[0]", "invalid_type"),
    ("chat-role-unknown", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, None,
     400, "invalid_request_error", "messages[0].role", "invalid_value"),
    ("chat-content-missing", "POST", CHAT, {"messages": [{"role": "user"}]}, None,
     400, "invalid_request_error", "messages[0].content", "invalid_type"),
    ("chat-content-int", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, None,
     400, "invalid_request_error", "messages[0].content", "invalid_type"),
    ("chat-image-part", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}, None,
     400, "invalid_request_error", "messages[0].content[1]", "unsupported"),
    ("chat-part-text-int", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     None, 400, "invalid_request_error", "messages[0].content[0].text", "invalid_type"),
    ("chat-template-refuses", "POST", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, None,
     400, "invalid_request_error", "messages", "invalid_value"),
    ("chat-max-tokens-negative", "POST", CHAT, {"messages": MSG, "max_tokens": -5}, None,
     400, "invalid_request_error", "max_tokens", "invalid_value"),
    ("chat-seed-overflow", "POST", CHAT, {"messages": MSG, "seed": 18446744073709551616}, None,
     400, "invalid_request_error", "seed", "invalid_value"),
    ("no-api-key", "POST", C, OK, {"Authorization": ""}, 401, "invalid_request_error", None, "invalid_api_key"),
    ("wrong-api-key", "POST", C, OK, {"Authorization": "Bearer nope"}, 401, "invalid_request_error", None,
     "invalid_api_key"),
    ("basic-auth", "POST", C, OK, {"Authorization": f"Basic {KEY}"}, 401, "invalid_request_error", None,
     "invalid_api_key"),
    ("models-no-key", "GET", "/v1/models", None, {"Authorization": ""}, 401, "invalid_request_error", None,
     "invalid_api_key"),
    ("metrics-no-key", "GET", "/metrics", None, {"Authorization": ""}, 401, "invalid_request_error", None,
     "invalid_api_key"),
    ("unknown-route", "GET", "/v1/nothing", None, None, 404, "invalid_request_error", None, "not_found"),
    ("wrong-method", "GET", C, None, None, 405, "invalid_request_error", None, "method_not_allowed"),
    ("body-over-limit", "POST", C, {"prompt": "a", "junk": "x" * (LIMIT + 10)}, None,
     413, "invalid_request_error", None, "request_too_large"),
]


@pytest.mark.parametrize("name, method, path, body, headers, status, kind, param, code", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input_gets_its_exact_error(client, name, method, path, body, headers, status, kind, param, code):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body} if body is not None else {}
    if headers:
        kw["headers"] = {**kw.get("headers", {}), **headers}
    r = client.request(method, path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (kind, param, code)
    assert err["message"] and "\n" not in err["message"] and "Traceback" not in err["message"]
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"


def test_the_server_still_serves_after_the_table(client):
    """None of the bad requests above left a row taken or the engine broken."""
    for r in [client.post(C, json=OK), client.post(CHAT, json={"messages": MSG, "max_tokens": 3, "temperature": 0})]:
        assert r.status_code == 200, r.text
    h = client.get("/health").json()
    assert h["active"] == 0 and h["queued"] == 0


def test_chunked_body_over_the_limit_gets_413(client):
    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for _ in range(LIMIT // 4096 + 8):
            yield b"x" * 4096

    r = client.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_health_needs_no_key_and_names_no_path(server, model_dir):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "tiny"
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert str(model_dir) not in json.dumps([h, models])


def test_content_parts_equal_plain_content(client):
    body = {"max_tokens": 8, "temperature": 0, "model": "tiny"}
    plain = client.post(CHAT, json={**body, "messages": [{"role": "user", "content": "héllo wörld"}]})
    parts = client.post(CHAT, json={**body, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "héllo wörld"}]}]})
    assert plain.status_code == parts.status_code == 200
    assert parts.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert parts.json()["model"] == "tiny"


def test_chat_without_a_chat_template_gets_400_naming_completions(model_dir):
    engine = Engine(model_dir, max_batch=1, max_seq_len=64)
    engine.tokenizer.chat_template = None  # a base model's tokenizer
    with ServerThread(create_app(engine, model_name="tiny")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for stream in (False, True):
            r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2, "stream": stream})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "messages", "unsupported")
            assert "no chat template" in err["message"] and "/v1/completions" in err["message"]
        assert c.post(C, json=OK).status_code == 200  # the way the error names


def test_a_body_that_never_finishes_gets_408_and_is_closed(server):
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        t0 = time.perf_counter()
        data = b""
        while chunk := s.recv(4096):  # the server closes the connection after answering
            data += chunk
        waited = time.perf_counter() - t0
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert json.loads(payload)["error"]["code"] == "body_timeout"
    assert 0.9 < waited < 10


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "one-header-byte-at-a-time"])
def test_a_head_that_never_finishes_is_closed(server, trickle):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        t0 = time.perf_counter()
        closed = False
        for i in range(len(head) if trickle else 1):
            time.sleep(0.05)
            try:
                if trickle:
                    s.sendall(head[i:i + 1])
                elif s.recv(1) == b"":  # blocks until the server closes (or the 10 s socket timeout)
                    closed = True
                    break
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        if trickle and not closed:
            closed = s.recv(1) == b""
        waited = time.perf_counter() - t0
    assert closed and 0.9 < waited < 5, waited


def test_health_stays_responsive_while_a_huge_prompt_is_tokenized(model_dir):
    engine = Engine(model_dir, max_batch=1, max_seq_len=128)
    app = create_app(engine, model_name="tiny", max_body_bytes=8 * 2**20)
    prompt = "the quick brown fox héllo " * 80_000  # 2.2 MB of text, about a million tokens
    with ServerThread(app) as srv:
        result = {}

        def big():
            result["r"] = httpx.post(srv.url + C, json={"prompt": prompt, "max_tokens": 1}, timeout=120)

        t = threading.Thread(target=big)
        t.start()
        answered = 0
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            while t.is_alive():
                if c.get("/health").status_code == 200:
                    answered += 1
                time.sleep(0.05)
        t.join()
    r = result["r"]
    # Tokenized in full (seconds), then refused: far beyond the 128-token context.
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # Were tokenization on the event loop, no /health could be answered while it ran.
    assert answered >= 5, answered


class SlowDecode:
    """Wraps the engine's decode step with a sleep so a request runs long enough to interrupt."""

    def __init__(self, engine: Engine, seconds: float) -> None:
        self.inner, self.seconds = engine._decode, seconds
        engine._decode = self

    def __call__(self, *a, **kw):
        time.sleep(self.seconds)
        return self.inner(*a, **kw)


@pytest.fixture(scope="module")
def slow_server(model_dir):
    engine = Engine(model_dir, max_batch=1, max_seq_len=512)
    SlowDecode(engine, 0.02)  # >= 20 ms a token: 300 tokens take >= 6 s
    app = create_app(engine, max_queue=0, model_name="tiny", request_timeout=1.5)
    with ServerThread(app) as srv:
        yield srv


def _generated(c: httpx.Client) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("hd_serve_generated_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no generated_tokens_total")


def _wait_idle(c: httpx.Client, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        h = c.get("/health").json()
        if h["active"] == 0 and h["queued"] == 0:
            return time.perf_counter() - t0
        time.sleep(0.02)
    raise AssertionError("the engine did not go idle")


LONG = {"prompt": "the", "max_tokens": 300, "temperature": 0, "ignore_eos": True}


def test_non_streaming_disconnect_frees_the_row(slow_server):
    with httpx.Client(base_url=slow_server.url, timeout=60) as c:
        _wait_idle(c, 30)
        before = _generated(c)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.3 s and closes the connection
            httpx.post(slow_server.url + C, json=LONG, timeout=httpx.Timeout(60, read=0.3))
        assert _wait_idle(c, 1.0) < 1.0  # well before the 1.5 s deadline, let alone 300 tokens
        assert _generated(c) - before < 100


def test_request_deadline_gives_504_and_an_error_event(slow_server):
    with httpx.Client(base_url=slow_server.url, timeout=60) as c:
        _wait_idle(c, 30)
        r = c.post(C, json=LONG)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        _wait_idle(c, 1.0)
        with c.stream("POST", C, json={**LONG, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "request_timeout"
        _wait_idle(c, 1.0)


def test_503_carries_retry_after(slow_server):
    with httpx.Client(base_url=slow_server.url, timeout=60) as c, httpx.Client(base_url=slow_server.url) as c2:
        _wait_idle(c, 30)
        with c2.stream("POST", C, json={**LONG, "stream": True}) as s:
            next(s.iter_lines())  # the only row (max_queue=0) is taken
            r = c.post(C, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_busy"
        _wait_idle(c, 5)


@pytest.mark.parametrize("flags, fragment", [
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--max-seq-len", "1"], "--max-seq-len must be >= 2"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-body-bytes", "10"], "--max-body-bytes must be >= 1024"),
    (["--request-timeout", "nan"], "--request-timeout must be a positive number"),
    (["--body-timeout", "0"], "--body-timeout must be a positive number"),
    (["--api-key", " "], "--api-key (or $HYBRID_DISTILL_API_KEY) is empty"),
    (["--served-model-name", ""], "--served-model-name is empty"),
    (["--prefill-step-ms", "-5"], "--prefill-step-ms must be >= 0"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--overtake-tokens", "-1"], "--overtake-tokens must be >= 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--malloc-arena-max", "-1"], "--malloc-arena-max must be >= 0"),
    (["--mmap-threshold-kb", "40000"], "--mmap-threshold-kb must be in [0, 32768]"),
    (["--max-batch", "x"], "invalid int value"),
])
def test_bad_server_flags_fail_before_loading_the_model(capsys, tmp_path, flags, fragment):
    # The model path does not exist: an error about the flag proves nothing was loaded first.
    assert main(["--model", str(tmp_path / "missing"), *flags]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and err.startswith("error: ")


@pytest.mark.parametrize("entry", ["server", "generate"])
@pytest.mark.parametrize("device, fragment", [("gpu", "device 'gpu' is unknown; use auto, cpu, cuda or cuda:N"),
                                              ("cuda", "torch sees no CUDA GPU"), ("cuda:0", "torch sees no CUDA GPU")])
def test_a_device_this_machine_lacks_fails_before_loading_the_model(capsys, monkeypatch, tmp_path, entry, device,
                                                                     fragment):
    from serve import generate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch, whatever this machine has
    argv = ["--model", str(tmp_path / "missing"), "--device", device]
    assert (main(argv) if entry == "server" else generate.main([*argv, "--prompt", "x"])) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and err.startswith("error: --device")


def _no_engine(*_a, **_k):
    raise ValueError("the engine was built")


@pytest.mark.parametrize("entry", ["server", "generate"])
@pytest.mark.parametrize("source", ["dir", "demo-cache"])
def test_max_seq_len_beyond_the_models_positions_fails_before_loading_the_model(capsys, monkeypatch, tmp_path,
                                                                               model_dir, entry, source):
    """--max-seq-len past max_position_embeddings (512 for the tiny model) is a flag error read from the config
    alone: the server used to start, report healthy, then fail every request on a KV cache sized for it."""
    import serve.engine
    from serve import generate

    monkeypatch.setattr(serve.engine, "Engine", _no_engine)  # serve.generate imports it from here when it runs
    monkeypatch.setattr("serve.server.Engine", _no_engine)
    monkeypatch.setattr(serve.engine, "load_causal_lm", _no_engine)
    model = model_dir
    if source == "demo-cache":  # the demo teacher's name, its converted cache present
        monkeypatch.setenv("HYBRID_DISTILL_CACHE", str(tmp_path))
        import shutil

        shutil.copytree(model_dir, tmp_path / "smollm2-135m-instruct")
        model = "smollm2-135m-instruct"

    def run(n: int) -> tuple[int, str]:
        argv = ["--model", str(model), "--max-seq-len", str(n)]
        rc = main(argv) if entry == "server" else generate.main([*argv, "--prompt", "x"])
        return rc, capsys.readouterr().err

    rc, err = run(513)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: --max-seq-len 513 exceeds the model's max_position_embeddings=512; use at most 512")
    assert run(512) == (2, "error: the engine was built\n")  # the limit itself passes the check


def test_a_failed_warmup_ends_the_server_before_the_port_opens(capsys, monkeypatch, model_dir):
    """A warm-up request that fails (here: the KV cache cannot be allocated) is one error line and exit 1,
    not "warm-up: 1.4 s" followed by a healthy port that fails every request."""
    import gc

    import serve.model
    import serve.server

    def no_memory(*_a, **_k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 184320000000 bytes")

    def no_port(*_a, **_k):
        raise AssertionError("the port opened")

    monkeypatch.setattr(serve.model.DecoderModel, "new_cache", no_memory)
    monkeypatch.setattr("uvicorn.run", no_port)
    monkeypatch.setattr(serve.server, "tune_heap", lambda **_k: None)  # this process's heap settings stay
    threads = torch.get_num_threads()
    try:
        assert main(["--model", str(model_dir), "--max-batch", "2", "--prefix-cache-mb", "0"]) == 1
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if "error" in line]  # (transformers' load bar is there too)
    assert "warm-up:" not in out.out and len(errors) == 1
    assert errors[0].startswith("error: warm-up: a 16-token request failed (RuntimeError: DefaultCPUAllocator")
    assert errors[0].endswith("lower --max-batch or --max-seq-len")


def _help_entries(text: str) -> dict[str, str]:
    """``--help`` text → {first flag: its whole entry, whitespace collapsed}."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = ""
        if flag is not None:
            entries[flag] = " ".join((entries[flag] + " " + line).split())
    return entries


@pytest.mark.parametrize("entry, flag, default", [("server", "--port", "8000"), ("server", "--host", "127.0.0.1"),
                                                   ("server", "--max-batch", "8"),
                                                   ("server", "--prefill-chunk", "128"),
                                                   ("generate", "--max-new-tokens", "128"),
                                                   ("generate", "--temperature", "0.0")])
def test_help_shows_each_default_once(capsys, entry, flag, default):
    from serve import generate

    if entry == "server":
        assert main(["--help"]) == 0
    else:
        with pytest.raises(SystemExit) as stop:
            generate.main(["--help"])
        assert stop.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    assert f"(default: {default})" in entries[flag]
    for name, text in entries.items():
        assert text.count("default") <= 1 and "(default: None)" not in text, name


# OpenAI fields that change the output but are not implemented, and per-endpoint meanings: each refused with
# 400 naming it, never dropped silently. (path, body, param)
REFUSED = [
    ("chat-modalities-audio", CHAT, {"messages": MSG, "modalities": ["text", "audio"]}, "modalities"),
    ("chat-audio", CHAT, {"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat-prediction", CHAT, {"messages": MSG, "prediction": {"type": "content", "content": "hi"}}, "prediction"),
    ("chat-web-search", CHAT, {"messages": MSG, "web_search_options": {}}, "web_search_options"),
    ("chat-tool-choice-required", CHAT, {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ("chat-tool-choice-named", CHAT, {"messages": MSG, "tool_choice": {"type": "function", "function": {
        "name": "f"}}}, "tool_choice"),
    ("chat-reasoning-effort", CHAT, {"messages": MSG, "reasoning_effort": "low"}, "reasoning_effort"),
    ("unknown-field", C, {**OK, "min_p": 0.1}, "min_p"),
    ("chat-field-on-completions", C, {**OK, "top_logprobs": 2}, "top_logprobs"),
    ("completions-field-on-chat", CHAT, {"messages": MSG, "echo": False}, "echo"),
    ("both-max-tokens-differ", C, {**OK, "max_tokens": 3, "max_completion_tokens": 10}, "max_completion_tokens"),
    ("chat-both-max-tokens-differ", CHAT, {"messages": MSG, "max_tokens": 3, "max_completion_tokens": 4},
     "max_completion_tokens"),
]


@pytest.mark.parametrize("name, path, body, param", REFUSED, ids=[c[0] for c in REFUSED])
def test_fields_that_would_change_the_output_are_refused(client, name, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert err["code"] == ("invalid_value" if "max-tokens" in name else "unsupported")
    assert param.split(".")[-1] in err["message"]


def test_a_message_name_must_be_a_string(client):
    r = client.post(CHAT, json={"messages": [{"role": "user", "content": "hi", "name": 7}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("messages[0].name", "invalid_type")


# Neutral values, and fields that cannot change the output: accepted. (path, body)
ACCEPTED = [
    ("chat-logprobs-false", CHAT, {"logprobs": False, "top_logprobs": 0}),
    ("chat-logprobs-null", CHAT, {"logprobs": None}),
    ("completions-logprobs-null", C, {"logprobs": None}),
    ("chat-top-logprobs-null", CHAT, {"logprobs": False, "top_logprobs": None}),
    ("chat-modalities-text", CHAT, {"modalities": ["text"]}),
    ("chat-tool-choice-none", CHAT, {"tool_choice": "none", "tools": []}),
    ("chat-tool-choice-auto", CHAT, {"tool_choice": "auto"}),
    ("chat-harmless", CHAT, {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                             "parallel_tool_calls": True}),
    ("completions-user", C, {"user": "u1"}),
    ("both-max-tokens-equal", C, {"max_tokens": 3, "max_completion_tokens": 3}),
    ("message-name-null", CHAT, {"messages": [{"role": "user", "content": "hi", "name": None}]}),
    ("message-name", CHAT, {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}),  # LangChain sends it
]


@pytest.mark.parametrize("name, path, extra", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_neutral_and_harmless_fields_are_accepted(client, name, path, extra):
    base = OK if path == C else {"messages": MSG, "max_tokens": 3, "temperature": 0}
    r = client.post(path, json={**base, **extra})
    assert r.status_code == 200, r.text


def _two_chats(model_dir, messages: list[list[dict]]) -> tuple[list[list[int]], list, Engine]:
    """Send each messages list as one greedy chat request: (the prompt ids the engine saw, responses, engine)."""
    engine = Engine(model_dir, max_batch=1, max_seq_len=128)
    seen: list[list[int]] = []
    encode = engine.encode
    engine.encode = lambda *a: seen.append(encode(*a)) or seen[-1]
    with ServerThread(create_app(engine, model_name="tiny")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        answers = [c.post(CHAT, json={"messages": m, "max_tokens": 4, "temperature": 0}) for m in messages]
    assert [r.status_code for r in answers] == [200] * len(messages)
    return seen, answers, engine


def test_a_message_name_reaches_the_model_as_the_same_prompt_without_it(model_dir):
    """Agent frameworks name every message; chat templates drop names, so the prompt is the nameless one."""
    seen, answers, _ = _two_chats(model_dir, [[{"role": "user", "content": "hi", **extra}]
                                              for extra in ({"name": "bob"}, {})])
    assert len(seen) == 2 and seen[0] == seen[1]
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]


def test_developer_role_is_templated_as_system(model_dir):
    """OpenAI's ``developer`` is the ``system`` role renamed: the template must see ``system``."""
    seen, answers, engine = _two_chats(model_dir, [[{"role": role, "content": "be terse"}, *MSG]
                                                   for role in ("developer", "system")])
    assert len(seen) == 2 and seen[0] == seen[1]
    text = engine.tokenizer.decode(seen[0])
    assert "system" in text and "developer" not in text
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]


def test_retrieving_a_model(client):
    card = client.get("/v1/models/tiny")
    assert card.status_code == 200, card.text
    assert card.json() == client.get("/v1/models").json()["data"][0]
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert client.get("/v1/models/tiny", headers={"Authorization": ""}).status_code == 401
