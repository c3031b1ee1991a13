"""The HTTP server under inputs and failures its happy paths never see: every error answered, and counted."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
import torch

from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.server import ServerThread, create_app


@pytest.fixture(scope="module")
def server():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(model=tiny_model("llama", seed=4), tokenizer=tiny_tokenizer(), max_batch=2, max_seq_len=128)
    app = create_app(engine, max_queue=1, model_name="tiny")
    with ServerThread(app) as srv:
        srv.app = app
        yield srv
    torch.set_num_threads(n)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def counter(client: httpx.Client, name: str) -> int:
    """A counter's value, read on a connection of its own (a 500 closes the one it was answered on)."""
    text = httpx.get(client.base_url.join("/metrics"), timeout=60).text
    return int(re.search(rf"^hd_serve_{name} (\d+)$", text, re.M).group(1))


# JSON's \ud800 escape decodes to a lone surrogate: a str no tokenizer can encode (sent as raw JSON text).
SURROGATE = [
    ("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udc80b"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}], '
     '"max_tokens": 2}', "messages[0].content"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop": ["ok", "\\udfff"]}', "stop"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATE)
def test_a_lone_surrogate_gets_400_naming_the_field_and_is_counted(client, path, raw, param):
    errors = counter(client, "request_errors_total")
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"] and "valid Unicode" in err["message"]
    assert counter(client, "request_errors_total") == errors + 1
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_an_unexpected_failure_is_answered_500_and_counted(server, client, monkeypatch):
    engine = server.app.state.engine.engine

    def broken(*_a, **_k):
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(engine, "encode", broken)
    requests, errors = counter(client, "requests_total"), counter(client, "request_errors_total")
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert counter(client, "requests_total") == requests + 1
    assert counter(client, "request_errors_total") == errors + 1
    assert server.app.state.engine.in_flight == 0


def test_a_full_server_refuses_before_tokenizing(server, client, monkeypatch):
    aengine = server.app.state.engine
    engine = aengine.engine
    encode, calls = engine.encode, []
    monkeypatch.setattr(engine, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    # Hold the engine's loop between two steps, so every admitted request stays in flight until released.
    paused, resume = threading.Event(), threading.Event()
    hold = threading.Thread(target=engine._on_loop, args=(lambda: paused.set() or resume.wait(),))
    hold.start()
    paused.wait()
    answers: list[int] = []
    senders = [threading.Thread(target=lambda: answers.append(
        httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code))
        for _ in range(aengine.capacity)]
    try:
        for t in senders:
            t.start()
        deadline = time.monotonic() + 60
        while engine.num_waiting < aengine.capacity:  # every place taken by a request the engine holds
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tokenized, rejected = len(calls), counter(client, "requests_rejected_total")
        for _ in range(3):
            r = client.post("/v1/completions", json={"prompt": "the quick brown fox " * 2000, "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert len(calls) == tokenized  # the refused bodies were read but never tokenized
        assert counter(client, "requests_rejected_total") == rejected + 3
    finally:
        resume.set()
        hold.join()
        for t in senders:
            t.join()
    assert answers == [200] * aengine.capacity and aengine.in_flight == 0
