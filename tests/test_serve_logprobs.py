"""Log-probabilities of generated tokens: the engine's against a plain forward, the server's OpenAI formats."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.tiny import save_tiny, tiny_model, tiny_tokenizer
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


# ---- the prompt's own log-probabilities (completions' echo) ---------------------------------------------------


def prompt_reference(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]``: position p's log-probabilities, which score prompt token p + 1."""
    import attention

    with torch.no_grad(), attention.use_backend("sdpa"):
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)


@pytest.mark.parametrize("kind", ["dense", "hybrid", "per-head"])
def test_prompt_logprobs_score_every_prompt_token_across_chunks(kind):
    import copy

    import attention
    from attention.spec import HybridAttentionConfig

    model = tiny_model("llama", seed=4)
    ref = model
    if kind != "dense":  # a bounded cache (sinks, globals, a ring), or one with full heads beside it
        spec = HybridAttentionConfig(sink_tokens=3, window=8, global_every=5, max_globals=4,
                                     **({"full_heads": {0: [1]}, "full_layers": [1]} if kind == "per-head" else {}))
        ref = attention.retrofit(copy.deepcopy(model), spec)
        model.config.hybrid_attention = spec.to_dict()
    engine = Engine(model=model, tokenizer=tiny_tokenizer(), max_batch=2, prefill_chunk=5)
    prompt = list(range(3, 40))  # 37 tokens: eight chunks of 5, past the window
    params = SamplingParams(max_new_tokens=3, prompt_logprobs=3, ignore_eos=True)
    for _ in range(2):  # the second time the prefix cache (when on) holds the prompt: it is prefilled anyway
        out = engine.generate([prompt], params)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        want = prompt_reference(ref, prompt)
        for p, lp in enumerate(out.prompt_logprobs[1:]):
            assert lp.token_id == prompt[p + 1]
            assert lp.logprob == pytest.approx(float(want[p, prompt[p + 1]]), abs=1e-4)
            values, ids = want[p].topk(3)
            assert [i for i, _ in lp.top] == ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
    # Its output is the one a request without prompt log-probabilities gets.
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None


def test_echo_returns_the_prompt_and_scores_its_tokens_as_a_log_likelihood_client_reads_them(client, engine):
    # As a log-likelihood client sends it: context + continuation as token ids, one token generated, greedy.
    text = "the quick brown fox"
    ids = engine.encode(text)
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    want = engine.generate([ids], SamplingParams(max_new_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    assert choice["text"] == text + want.text
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in want.prompt_logprobs[1:]]
                                                     + [want.logprobs[0].logprob], abs=1e-6)
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])] and lp["text_offset"][-1] == len(text)
    # The continuation's log-likelihood and whether it is the greedy one, read the way such clients do.
    context = 2
    scored = lp["token_logprobs"][context:-1]
    greedy = all(max(top, key=top.get) == tok for tok, top in zip(lp["tokens"][context:-1],
                                                                  lp["top_logprobs"][context:-1]))
    assert sum(scored) == pytest.approx(sum(e.logprob for e in want.prompt_logprobs[context:]), abs=1e-5)
    assert greedy == all(e.top[0][0] == e.token_id for e in want.prompt_logprobs[context:])
    # Streamed: the echo comes first, in a chunk of its own, then the generated token's.
    body["stream"] = True
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["text"] == text
    streamed = {key: [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][key]]
                for key in lp}
    assert streamed == lp and "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    # Without logprobs: the text alone; on chat, echo is not a field.
    plain = client.post("/v1/completions", json={"prompt": text, "max_tokens": 2, "temperature": 0, "echo": True})
    assert plain.json()["choices"][0]["text"].startswith(text) and plain.json()["choices"][0]["logprobs"] is None
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "echo": True})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "echo"
