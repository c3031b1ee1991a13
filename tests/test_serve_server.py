"""The HTTP server, started for real on a free loopback port with a tiny model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from core.tiny import save_tiny
from serve.engine import Engine
from serve.server import ServerThread, create_app


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: avoid OpenMP contention on busy shared cores
    path = save_tiny(tmp_path_factory.mktemp("tiny"), arch="qwen2")
    engine = Engine(path, max_batch=1, max_seq_len=256)
    with ServerThread(create_app(engine, max_queue=1, model_name="tiny")) as srv:
        yield srv
    torch.set_num_threads(n)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse_events(lines) -> list:
    """Parse an SSE body: the JSON payloads, then the literal ``[DONE]``."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_and_models(client):
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_streaming_matches_non_streaming_and_counts_tokens(client):
    body = {"prompt": "the quick brown", "max_tokens": 24, "temperature": 0}
    full = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    # As OpenAI's include_usage: every chunk has "usage": null, then one with no choices carries the usage.
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    assert usage_chunk["id"] == chunks[0]["id"] and all(c["usage"] is None for c in chunks)
    token_events = [c for c in chunks if c["choices"][0]["finish_reason"] is None]
    final = chunks[-1]
    assert len(token_events) == usage_chunk["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    assert len(chunks) == len(token_events) + 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert final["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
def test_a_stream_carries_no_usage_unless_asked(client, options):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "stream": True,
            **({} if options is None else {"stream_options": options})}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] is not None
    assert all("usage" not in c and len(c["choices"]) == 1 for c in events[:-1])


@pytest.mark.parametrize("body, message", [
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "only allowed with \"stream\": true"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "'stream_options.include_usage' must be a boolean"),
    ({"prompt": "hi", "stream": True, "stream_options": [1]}, "'stream_options' must be an object"),
])
def test_bad_stream_options_get_400(client, body, message):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_chat_completion_and_stream(client):
    body = {"messages": [{"role": "user", "content": "héllo wörld"}], "max_tokens": 12, "temperature": 0}
    full = client.post("/v1/chat/completions", json=body).json()
    msg = full["choices"][0]["message"]
    assert msg["role"] == "assistant" and full["object"] == "chat.completion"
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == msg["content"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("body, message", [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), "'temperature' must be"),
    (json.dumps({"prompt": "hi", "max_tokens": "5"}).encode(), "'max_tokens' must be an integer"),
    (json.dumps({"prompt": "hi", "stream": "yes"}).encode(), "'stream' must be a boolean"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "'max_tokens' must be in [1, "),
    (json.dumps({"prompt": "hi", "max_tokens": 10_000}).encode(), "'max_tokens' must be in [1, "),
    (json.dumps({"prompt": "the " * 400}).encode(), "shorten the prompt"),
    (json.dumps({"prompt": 42}).encode(), "'prompt' must be"),
    (json.dumps({"prompt": [1, 99999]}).encode(), "token ids must be in"),
    (json.dumps({"prompt": "hi", "n": 3}).encode(), "'n' must be in [1, 2] (this server holds 2 requests at once"),
    (json.dumps({"prompt": "hi", "n": 0}).encode(), "'n' must be in [1, 2]"),
])
def test_bad_requests_get_400_with_a_message(client, body, message):
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_chat_needs_messages(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400 and "content" in r.json()["error"]["message"]


def _metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing")


def wait_idle(client, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = client.get("/health").json()
        if h["active"] == 0 and h["queued"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the engine did not go idle")


def test_full_server_answers_503_and_disconnect_stops_generation(server, client):
    wait_idle(client)
    long = {"prompt": "the", "max_tokens": 240, "temperature": 1.0, "seed": 0, "stream": True,
            "ignore_eos": True}
    before = _metric(client, "hd_serve_generated_tokens_total")
    with httpx.Client(base_url=server.url, timeout=60) as c1, httpx.Client(base_url=server.url, timeout=60) as c2:
        s1 = c1.stream("POST", "/v1/completions", json=long)
        r1 = s1.__enter__()
        it = r1.iter_lines()
        assert next(it).startswith("data: ")  # first token: request 1 holds the only batch row
        s2 = c2.stream("POST", "/v1/completions", json=long)  # capacity 2 = 1 row + 1 queued
        r2 = s2.__enter__()
        r3 = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r3.status_code == 503 and "capacity" in r3.json()["error"]["message"]
        s2.__exit__(None, None, None)  # the queued request leaves before it starts
        s1.__exit__(None, None, None)  # the client goes away mid-generation
        assert r2.status_code == 200
    wait_idle(client)
    generated = _metric(client, "hd_serve_generated_tokens_total") - before
    assert generated < 240, "generation went on after the client disconnected"
    assert _metric(client, "hd_serve_requests_rejected_total") >= 1
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_metrics_exposition(client):
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0})
    text = client.get("/metrics").text
    for name in ["hd_serve_requests_total", "hd_serve_request_errors_total", "hd_serve_prompt_tokens_total",
                 "hd_serve_generated_tokens_total", "hd_serve_kv_cache_bytes",
                 'hd_serve_time_to_first_token_seconds_bucket{le="+Inf"}',
                 "hd_serve_inter_token_latency_seconds_count"]:
        assert name in text
    assert _metric(client, "hd_serve_kv_cache_bytes") > 0
    assert _metric(client, "hd_serve_time_to_first_token_seconds_count") >= 1


def test_request_log_says_where_each_request_spent_its_time(tmp_path):
    """--request-log: one line per finished request (streamed or not) whose id is the response's and whose
    times are ordered: tokenized <= prefill start <= first token <= first event sent <= done."""
    path = save_tiny(tmp_path / "tiny", arch="llama")
    log = tmp_path / "requests.jsonl"
    block = 4  # prefix-cache block: the 10-token prompt below spans two whole ones and a token
    engine = Engine(path, max_batch=2, max_seq_len=128, prefix_block=block)
    with ServerThread(create_app(engine, model_name="tiny", request_log=str(log))) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        with c.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as r:
            events = sse_events(r.iter_lines())
        plain = c.post("/v1/completions", json={**body, "max_tokens": 3}).json()
        c.post("/v1/completions", json={**body, "max_tokens": 0})  # a 400: never reached the engine, no line
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["id"] for x in lines] == [events[0]["id"], plain["id"]]
    streamed, whole = lines
    assert streamed["completion_tokens"] == 6 and whole["completion_tokens"] == 3
    assert streamed["prompt_tokens"] == events[-2]["usage"]["prompt_tokens"] and streamed["finish_reason"] == "length"
    order = ("tokenized_ms", "prefill_start_ms", "first_token_ms", "first_sent_ms", "done_ms")
    assert all(streamed[k] is not None for k in order)
    assert 0 <= streamed["tokenized_ms"] and all(streamed[a] <= streamed[b] for a, b in zip(order, order[1:]))
    assert whole["first_sent_ms"] is None and whole["first_token_ms"] <= whole["done_ms"]
    # The second request repeats the first's prompt: the prefix cache restored its whole blocks, leaving the
    # last token to prefill (its logits give the first new token).
    assert whole["prompt_tokens"] == 10 and streamed["cached_tokens"] == 0 and whole["cached_tokens"] == 2 * block


def test_step_log_accounts_for_every_forward_of_a_request(tmp_path):
    """--step-log: one line per engine forward on the request log's clock. A request's prefill lines add up
    to its uncached prompt tokens and begin at its prefill_start; its decode lines are one per generated
    token after the first (which its last prefill forward samples), all inside its own time span."""
    path = save_tiny(tmp_path / "tiny", arch="llama")
    log, steps = tmp_path / "requests.jsonl", tmp_path / "steps.jsonl"
    engine = Engine(path, max_batch=2, max_seq_len=128, prefill_chunk=4)
    with ServerThread(create_app(engine, model_name="tiny", request_log=str(log), step_log=str(steps))) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            sse_events(r.iter_lines())
    (req,) = [json.loads(x) for x in log.read_text().splitlines()]
    forwards = [json.loads(x) for x in steps.read_text().splitlines()]
    mine = [f for f in forwards if req["engine_id"] in f["requests"]]
    prefill = [f for f in mine if f["kind"] == "prefill"]
    decode = [f for f in mine if f["kind"] == "decode"]
    assert sum(f["tokens"] for f in prefill) == req["prompt_tokens"] - req["cached_tokens"] and len(prefill) > 1
    assert len(decode) == req["completion_tokens"] - 1 and all(f["tokens"] == 1 for f in decode)
    t0 = req["received_s"]
    assert abs((prefill[0]["start_s"] - t0) * 1000 - req["prefill_start_ms"]) < 1.0
    assert all(f["start_s"] <= f["end_s"] for f in mine)
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(mine, mine[1:]))  # one engine thread: no overlap
    assert t0 <= mine[0]["start_s"] and mine[-1]["end_s"] <= t0 + req["done_ms"] / 1000


def test_request_and_step_log_flags_refuse_an_unwritable_path(tmp_path):
    from serve.server import main

    for flag in ("--request-log", "--step-log"):
        assert main(["--model", "x", flag, str(tmp_path / "no" / "such" / "dir" / "log.jsonl")]) == 2
        assert main(["--model", "x", flag, str(tmp_path)]) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_server_cli_serves_a_hybrid_model(tmp_path):
    from attention.spec import HybridAttentionConfig
    from core.tiny import tiny_model, tiny_tokenizer

    model = tiny_model("llama")
    model.config.hybrid_attention = HybridAttentionConfig(sink_tokens=2, window=8, global_every=0).to_dict()
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve.server", "--model", str(tmp_path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.time() < deadline, "server did not start"
                time.sleep(0.2)
        assert health["hybrid"] is True
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "the quick", "max_tokens": 30, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_full_gc_pauses_are_timed_and_exposed():
    """Metrics.watch_gc times full (generation-2) collections only, and stops when unwatched."""
    import gc

    from serve.metrics import Metrics

    m = Metrics()
    m.watch_gc()
    try:
        gc.collect(0)
        gc.collect(1)
        assert m.gc_pause.count == 0
        gc.collect()
        gc.collect(2)
        assert m.gc_pause.count == 2 and m.gc_pause.sum > 0
        assert "hd_serve_gc_full_collection_seconds_count 2" in m.render()
    finally:
        m.unwatch_gc()
    gc.collect()
    assert m.gc_pause.count == 2 and m._on_gc not in gc.callbacks


def test_models_carry_created_and_can_be_retrieved(client):
    listed = client.get("/v1/models").json()["data"]
    assert len(listed) == 1
    card = listed[0]
    assert set(card) == {"id", "object", "created", "owned_by"}
    assert isinstance(card["created"], int) and 0 < card["created"] <= time.time()
    assert client.get("/v1/models/tiny").json() == card
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_chat_choices_carry_null_logprobs(client):
    """As OpenAI's: every chat choice, whole or streamed, has ``"logprobs": null``."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert list(choice) == ["index", "message", "logprobs", "finish_reason"] and choice["logprobs"] is None
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    assert chunks and all(list(c["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
                          and c["choices"][0]["logprobs"] is None for c in chunks)
    text = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).json()["choices"][0]
    assert list(text) == ["index", "text", "logprobs", "finish_reason"]
