"""Several choices per request (``n``): each an engine request of its own, streamed interleaved by index."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from core.tiny import save_tiny
from serve.engine import Engine
from serve.sampling import SamplingParams
from serve.server import ServerThread, create_app


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("tiny"), arch="qwen2")
    engine = Engine(path, max_batch=2, max_seq_len=128)
    reference = Engine(path, max_batch=1, max_seq_len=128)
    with ServerThread(create_app(engine, max_queue=1, model_name="tiny")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client, srv, reference


def events(client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        out = [line[len("data: "):] for line in r.iter_lines() if line]
    assert out[-1] == "[DONE]"
    return [json.loads(e) for e in out[:-1]]


def test_each_choice_samples_with_its_own_seed_and_usage_counts_them_all(setup):
    client, _, reference = setup
    body = {"prompt": "the quick brown", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}
    reply = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    want = [reference.generate(["the quick brown"], SamplingParams(max_new_tokens=8, temperature=1.0, seed=7 + i,
                                                                   ignore_eos=True))[0].text for i in range(3)]
    assert [c["text"] for c in reply["choices"]] == want
    assert len(set(want)) > 1  # the seeds differ, so do the choices
    assert reply["usage"] == {"prompt_tokens": reply["usage"]["prompt_tokens"], "completion_tokens": 24,
                              "total_tokens": reply["usage"]["prompt_tokens"] + 24}
    again = client.post("/v1/completions", json=body).json()  # a seed makes the whole reply repeat
    assert [c["text"] for c in again["choices"]] == want


def test_a_stream_of_choices_adds_up_to_the_whole_reply(setup):
    client, _, _ = setup
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.9, "seed": 1, "n": 3,
            "logprobs": True, "top_logprobs": 1, "stream_options": {"include_usage": True}}
    whole = client.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "stream_options"}).json()
    chunks = events(client, "/v1/chat/completions", body)
    *chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert mine[0]["delta"]["role"] == "assistant" and all("role" not in m["delta"] for m in mine[1:])
        assert "".join(m["delta"]["content"] for m in mine) == choice["message"]["content"]
        assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        streamed = [e for m in mine if m["logprobs"] for e in m["logprobs"]["content"]]
        assert streamed == choice["logprobs"]["content"]


def test_choices_take_a_place_each_and_give_them_back(setup):
    client, srv, _ = setup
    # Capacity 3 (2 rows + 1 queued): a long stream holds one place, so 3 choices do not fit and 2 do.
    long = {"prompt": "the", "max_tokens": 100, "temperature": 1.0, "seed": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json=long) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            busy = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3})
            assert busy.status_code == 503 and "for 3 choices" in busy.json()["error"]["message"]
            fits = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2, "temperature": 0})
            assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
    # Every place comes back once the requests are done (refused, finished, or cut off by a client that left):
    # the stream's cancellation lands on the engine's next step, so the full-capacity request may wait for it.
    for _ in range(100):
        three = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3, "temperature": 0})
        if three.status_code != 503:
            break
        time.sleep(0.05)
    assert three.status_code == 200, three.text
    texts = [c["text"] for c in three.json()["choices"]]
    assert texts == [texts[0]] * 3  # greedy: the same choice three times, as OpenAI gives
