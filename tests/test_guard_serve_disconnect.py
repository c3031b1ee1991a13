"""Clients that leave: every way a request can end gives its row and its place in the queue back."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from core.tiny import tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.server import create_app


@pytest.fixture
def app():
    engine = Engine(model=tiny_model("llama", seed=2), tokenizer=tiny_tokenizer(), max_batch=2, max_seq_len=256)
    app = create_app(engine, max_queue=1, model_name="tiny")
    submitted = []
    aengine = app.state.engine
    submit = aengine.submit

    def recording(*args, **kwargs):
        out = submit(*args, **kwargs)
        submitted.append(out[0])
        return out

    aengine.submit = recording
    app.state.submitted = submitted
    yield app
    engine.stop()


def scope(path: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


async def call_and_leave(app, path: str, body: dict) -> list[dict]:
    """One request through the ASGI app whose client disconnects as soon as its body is read; what was sent."""
    raw = json.dumps(body).encode()
    inbox = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(0)  # a real socket write: other tasks (the disconnect listener) run meanwhile
        sent.append(message)

    await app(scope(path, raw), receive, send)
    return sent


async def settle(app) -> None:
    """Wait (bounded) for the engine to finish every request it was given, the event loop running (the engine
    hands its events to it)."""
    deadline = time.monotonic() + 60
    while not all(r.done for r in app.state.submitted):
        assert time.monotonic() < deadline, "a request never finished"
        await asyncio.sleep(0.01)


async def then_settle(app, *calls) -> list:
    """Await ``calls`` (coroutines) together, then :func:`settle`; their results."""
    out = await asyncio.gather(*calls)
    await settle(app)
    return out


def idle(app) -> dict:
    engine = app.state.engine.engine
    return {"active": engine.num_active, "waiting": engine.num_waiting, "in_flight": app.state.engine.in_flight,
            "rows": sum(r is not None for r in engine._rows)}


IDLE = {"active": 0, "waiting": 0, "in_flight": 0, "rows": 0}


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                              "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 200, "ignore_eos": True}),
])
def test_a_client_that_leaves_before_the_first_event_cancels_its_request(app, path, body):
    torch.set_num_threads(1)
    asyncio.run(then_settle(app, call_and_leave(app, path, body)))
    (req,) = app.state.submitted
    # Without the cancel it generated all 200 tokens for no one, holding its row.
    assert req.finish_reason == "cancelled" and len(req.out_ids) < 200
    assert idle(app) == IDLE
