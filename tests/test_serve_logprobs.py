"""Log-probabilities of generated tokens: the engine's against a plain forward, the server's OpenAI formats."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.tiny import save_tiny, tiny_tokenizer
from serve.engine import Engine
from serve.sampling import SamplingParams, TokenLogprobs, token_logprobs
from serve.server import LogprobFormat, ServerThread, create_app
from serve.text import token_bytes
from tests.test_guard_serve_stop_text import byte_ids, fallback_tokenizer, fb_ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), arch="qwen2")


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, max_batch=2, max_seq_len=128, prefill_chunk=8)


def reference(model_dir, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """``[len(out_ids), vocab]`` log-probabilities of a plain forward over prompt + output, at the output."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.double(), -1)


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=10, logprobs=5),
    SamplingParams(max_new_tokens=10, temperature=0.7, top_k=8, top_p=0.9, seed=3, logprobs=5),
], ids=["greedy", "sampled"])
def test_logprobs_are_the_models_own_distribution_whatever_the_sampling(engine, model_dir, params):
    # Two prompts of other lengths decode together (one prefilled across chunks): each row's own distribution.
    prompts = ["the quick brown fox jumps over the lazy dog again and again", "hello"]
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 10
        ref = reference(model_dir, engine.encode(prompt), out.token_ids)
        for t, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(float(ref[t, token]), abs=1e-4)
            top_values, top_ids = ref[t].topk(5)
            assert [i for i, _ in lp.top] == top_ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        if params.greedy:  # the greedy token is the most likely one, with the same log-probability
            assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in out.logprobs)


def test_logprobs_follow_the_tokens_to_a_stop_and_are_off_unless_asked(engine):
    free = engine.generate(["hello"], SamplingParams(max_new_tokens=6, logprobs=0))[0]
    assert all(lp.top == () for lp in free.logprobs)
    # The fourth token as a stop token: not among the output tokens, and no log-probability for it.
    stopped = engine.generate(["hello"], SamplingParams(max_new_tokens=6, logprobs=0,
                                                        stop_token_ids=[free.token_ids[3]]))[0]
    assert stopped.stop_token == free.token_ids[3] and stopped.token_ids == free.token_ids[:3]
    assert [lp.token_id for lp in stopped.logprobs] == stopped.token_ids
    assert [lp.logprob for lp in stopped.logprobs] == [lp.logprob for lp in free.logprobs[:3]]
    assert engine.generate(["hello"], SamplingParams(max_new_tokens=2))[0].logprobs is None


@pytest.mark.parametrize("k", [-1, 21])
def test_a_logprobs_count_out_of_range_is_refused(k):
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=k)


def test_token_logprobs_leaves_out_impossible_tokens_and_refuses_non_finite_logits():
    logits = torch.tensor([0.0, float("-inf"), 1.0, float("-inf")])
    lp = token_logprobs(logits, 0, 4)
    assert [i for i, _ in lp.top] == [2, 0]
    assert lp.logprob == pytest.approx(-math.log1p(math.e))
    with pytest.raises(FloatingPointError):
        token_logprobs(torch.tensor([0.0, float("nan")]), 0, 1)


def test_token_bytes_of_byte_level_tokens_join_into_the_text_even_inside_a_character():
    tok = tiny_tokenizer()
    data = "aé €😀 z".encode()
    ids = byte_ids(tok, data)  # one token per byte: most hold part of a character
    assert b"".join(token_bytes(tok, i) for i in ids) == data
    assert token_bytes(tok, ids[2]) == b"\xa9"  # the second byte of é


def test_token_bytes_of_byte_fallback_pieces():
    tok = fallback_tokenizer()
    ids = fb_ids(tok, ["▁ab", 0xE4, 0xB8, 0xAD, "cd"])
    assert [token_bytes(tok, i) for i in ids] == [b" ab", b"\xe4", b"\xb8", b"\xad", b"cd"]
    assert token_bytes(tok, tok.eos_token_id) == b"</s>"


# ---- the server ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(model_dir):
    engine = Engine(model_dir, max_batch=2, max_seq_len=128)
    with ServerThread(create_app(engine, max_queue=2, model_name="tiny")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def sse(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: "):] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completions_logprobs_match_the_engine_and_the_stream(client, engine):
    body = {"prompt": "the quick brown", "max_tokens": 8, "temperature": 0.8, "seed": 5, "logprobs": 3}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    mine = engine.generate(["the quick brown"], SamplingParams(max_new_tokens=8, temperature=0.8, seed=5,
                                                                logprobs=3))[0]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in mine.logprobs], abs=1e-6)
    tok = engine.tokenizer

    def name(i: int) -> str:  # a token's text, or its bytes where it holds part of a character (OpenAI's naming)
        data = token_bytes(tok, i)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    assert lp["tokens"] == [name(i) for i in mine.token_ids]
    assert lp["top_logprobs"] == [pytest.approx({name(i): v for i, v in e.top}, abs=1e-6) for e in mine.logprobs]
    assert all(len(d) == 3 for d in lp["top_logprobs"])  # distinct tokens never share a name
    # text_offset: how many characters of the completion's text come before each token's bytes (this sampled
    # text holds invalid bytes, each stretch one U+FFFD).
    data = [token_bytes(tok, i) for i in mine.token_ids]
    assert choice["text"] == b"".join(data).decode(errors="replace")
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(choice["text"])
    chunks = sse(client, "/v1/completions", body)
    *tokens, finish = chunks
    assert finish["choices"][0]["logprobs"] is None and len(tokens) == len(lp["tokens"])
    streamed = {key: [v for c in tokens for v in c["choices"][0]["logprobs"][key]] for key in lp}
    assert streamed == lp


def test_completions_format_names_partial_tokens_by_their_bytes_and_counts_text_offsets():
    tok = tiny_tokenizer()
    ids = byte_ids(tok, "aé€😀z".encode())  # one token per byte: a, C3 A9, E2 82 AC, F0 9F 98 80, z
    entries = [TokenLogprobs(i, -1.0 - n, ((i, -0.5),)) for n, i in enumerate(ids)]
    fmt = LogprobFormat(tok, chat=False)
    # Streamed one token at a time, as the server does: the offsets run on across calls.
    out = [fmt.render([e]) for e in entries]
    got = {key: [v for o in out for v in o[key]] for key in out[0]}
    assert got["tokens"] == ["a", "bytes:\\xc3", "bytes:\\xa9", "bytes:\\xe2", "bytes:\\x82", "bytes:\\xac",
                             "bytes:\\xf0", "bytes:\\x9f", "bytes:\\x98", "bytes:\\x80", "z"]
    # a | é | € | 😀 | z: a token inside a character counts the characters before that character.
    assert got["text_offset"] == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4]
    assert got["token_logprobs"] == [-1.0 - n for n in range(11)]
    assert got["top_logprobs"][1] == {"bytes:\\xc3": -0.5}
    whole = LogprobFormat(tok, chat=False).render(entries)  # the same in one call (a non-streamed reply)
    assert whole == got


def test_chat_logprobs_carry_bytes_that_join_into_the_content_and_match_the_stream(client):
    body = {"messages": [{"role": "user", "content": "héllo wörld"}], "max_tokens": 10, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 10 and choice["logprobs"]["refusal"] is None
    text = bytes(b for e in content for b in e["bytes"]).decode(errors="replace")  # the tiny model makes invalid bytes
    assert text == choice["message"]["content"]
    for e in content:  # greedy: the generated token is the most likely of its two alternatives
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert e["top_logprobs"][0]["bytes"] == e["bytes"] and e["top_logprobs"][1]["logprob"] <= e["logprob"]
    chunks = sse(client, "/v1/chat/completions", body)
    assert [e for c in chunks[:-1] for e in c["choices"][0]["logprobs"]["content"]] == content
    # Without top_logprobs: each token's own log-probability and no alternatives.
    alone = client.post("/v1/chat/completions", json={**body, "top_logprobs": None}).json()["choices"][0]
    assert [e["logprob"] for e in alone["logprobs"]["content"]] == [e["logprob"] for e in content]
    assert all(e["top_logprobs"] == [] for e in alone["logprobs"]["content"])
