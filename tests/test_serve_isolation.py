"""Per-request isolation: one request failing inside the engine finishes only that request.

A failure is injected into one request (its prefill-time sampling, a decode-step sampling, its event
callback, its detokenizer) while others share the batch; the others must finish with exactly their
solo greedy output, the failed one with ``finish_reason == "error"`` and its row freed.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import serve.engine
from core.tiny import save_tiny, tiny_model, tiny_tokenizer
from serve.engine import Engine
from serve.sampling import SamplingParams, sample
from serve.server import ServerThread, create_app

PROMPTS = [[1, 5, 9, 33, 200], list(range(3, 40)), [7, 8]]
N = 12
POISON_SEED = 666


def greedy(n: int = N) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def poisoned_sampler(fail_on_call: int):
    """``sample`` that raises on the ``fail_on_call``-th call made for the poisoned request."""
    calls = [0]

    def flaky(logits, params, generator):
        if params.seed == POISON_SEED:
            calls[0] += 1
            if calls[0] == fail_on_call:
                raise RuntimeError("injected sampling failure")
        return sample(logits, params, generator)

    return flaky


@pytest.mark.parametrize("where", ["admit", "decode", "callback", "detokenize"])
def test_one_failing_request_never_fails_the_others(monkeypatch, where):
    engine = Engine(model=tiny_model("qwen2", seed=5), tokenizer=tiny_tokenizer(), max_batch=4)
    solo = [engine.generate([p], greedy())[0].token_ids for p in PROMPTS]
    if where in ("admit", "decode"):  # first call: during admission; third: in a batched decode step
        monkeypatch.setattr(serve.engine, "sample", poisoned_sampler(1 if where == "admit" else 3))
    finals: list[str] = []
    tokens = [0]

    def on_event(_delta, token, finish):
        if finish is not None:
            finals.append(finish)
            return
        tokens[0] += 1
        if where == "callback" and tokens[0] == 3:
            raise ConnectionError("injected: the client's queue is gone")

    good = [engine.submit(PROMPTS[0], greedy())]
    bad = engine.submit([9, 9, 9], SamplingParams(max_new_tokens=N, temperature=1.0, seed=POISON_SEED,
                                                  ignore_eos=True), on_event)
    good += [engine.submit(p, greedy()) for p in PROMPTS[1:]]
    if where == "detokenize":
        real_push = bad.text.push
        bad.text.push = lambda t: real_push(t) if len(bad.out_ids) < 4 else 1 / 0
    engine._run_until(good + [bad])
    assert [r.result().token_ids for r in good] == solo
    assert all(r.finish_reason == "length" for r in good)
    assert bad.finish_reason == "error" and finals == ["error"]
    assert len(bad.out_ids) < N
    assert engine.num_active == 0 and engine.num_waiting == 0
    # The freed row serves the next request exactly.
    assert engine.generate([PROMPTS[2]], greedy())[0].token_ids == solo[2]


def test_batch_wide_failure_still_fails_every_request_in_the_background_loop(monkeypatch):
    """The shared forward is not per-row: when it raises, every request in flight ends with "error"."""
    engine = Engine(model=tiny_model("qwen2", seed=5), tokenizer=tiny_tokenizer(), max_batch=4)
    finals = []

    def boom(*a, **kw):
        raise RuntimeError("injected decode failure")

    engine._decode = boom
    engine.start()
    try:
        done = threading.Event()

        def on_event(_d, _t, finish):
            if finish is not None:
                finals.append(finish)
                if len(finals) == 2:
                    done.set()

        for p in PROMPTS[:2]:
            engine.submit(p, greedy(), on_event)
        assert done.wait(30)
    finally:
        engine.stop()
    assert finals == ["error", "error"]


def test_server_answers_500_for_the_failing_request_only(tmp_path, monkeypatch):
    path = save_tiny(tmp_path, arch="qwen2")
    engine = Engine(path, max_batch=4, max_seq_len=256)
    monkeypatch.setattr(serve.engine, "sample", poisoned_sampler(5))
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    prompts = ["the quick brown", "distill the teacher", "héllo wörld"]
    with ServerThread(create_app(engine, model_name="tiny")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        solo = [c.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"] for p in prompts]
        poison = {**body, "prompt": "the lazy dog", "temperature": 1.0, "seed": POISON_SEED}
        # The cases: values that used to reach the sampler and fail the whole batch.
        bad = [{**body, "prompt": "x", "seed": 2**64}, {**body, "prompt": "x", "temperature": 1e-40},
               {**body, "prompt": "x", "temperature": 1.0, "top_p": 1e-300}]
        jobs = [{**body, "prompt": p} for p in prompts] + [poison] + bad
        with ThreadPoolExecutor(len(jobs)) as pool:
            rs = list(pool.map(lambda j: c.post("/v1/completions", json=j), jobs))
        assert [r.status_code for r in rs] == [200, 200, 200, 500, 400, 400, 400]
        assert [r.json()["choices"][0]["text"] for r in rs[:3]] == solo
        assert rs[3].json()["error"]["type"] == "server_error"
        assert [r.json()["error"]["param"] for r in rs[4:]] == ["seed", "temperature", "top_p"]
        assert c.get("/health").json()["active"] == 0


def test_engine_without_a_row_is_refused():
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        Engine(model=tiny_model("qwen2"), tokenizer=tiny_tokenizer(), max_batch=0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_failed_streamed_generation_ends_with_an_error_event(tmp_path, monkeypatch, path):
    """Not a finish chunk (``"error"`` is no OpenAI finish reason: a client would take the cut text as whole)."""
    import json

    engine = Engine(save_tiny(tmp_path, arch="qwen2"), max_batch=2, max_seq_len=256)
    monkeypatch.setattr(serve.engine, "sample", poisoned_sampler(3))
    body = {"max_tokens": 12, "temperature": 1.0, "seed": POISON_SEED, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            **({"prompt": "the lazy dog"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    with ServerThread(create_app(engine, model_name="tiny")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", path, json=body) as r:
            lines = [line[len("data: "):] for line in r.iter_lines() if line]
        assert lines[-1] == "[DONE]"
        events = [json.loads(e) for e in lines[:-1]]
        *chunks, last = events
        assert last == {"error": {"message": last["error"]["message"], "type": "server_error", "param": None,
                                  "code": "generation_failed"}}
        assert chunks and all(ch["choices"][0]["finish_reason"] is None for ch in chunks)
        assert c.get("/health").json()["active"] == 0
        # The server still serves: the sampler fails only the poisoned request's third call.
        ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200


def test_a_streamed_request_that_fails_raises_after_its_text_and_the_cli_says_so(tmp_path, monkeypatch, capsys):
    """Engine.stream used to end a failed request like a whole one, and the generate CLI exited 0 with cut text."""
    from serve import generate
    from serve.engine import GenerationError

    path = save_tiny(tmp_path, arch="qwen2")
    engine = Engine(path, max_batch=2, max_seq_len=128)
    params = SamplingParams(max_new_tokens=N, temperature=1.0, seed=POISON_SEED, ignore_eos=True)
    whole = engine.generate([PROMPTS[1]], params)[0]
    monkeypatch.setattr(serve.engine, "sample", poisoned_sampler(4))  # its fourth token fails
    deltas: list[str] = []
    with pytest.raises(GenerationError, match=r"generation failed after 3 tokens \(RuntimeError: injected") as err:
        for delta in engine.stream(PROMPTS[1], params):
            deltas.append(delta)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert whole.text.startswith("".join(deltas))  # the same seed: the text up to the failure
    assert engine.num_active == 0
    assert "".join(engine.stream(PROMPTS[2], greedy())) == engine.generate([PROMPTS[2]], greedy())[0].text

    monkeypatch.setattr(serve.engine, "sample", poisoned_sampler(2))
    rc = generate.main(["--model", str(path), "--prompt", "the lazy dog", "--temperature", "1",
                        "--seed", str(POISON_SEED), "--max-new-tokens", "6"])
    assert rc == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: generation failed after 1 tokens")


def test_a_failed_forward_in_the_synchronous_api_leaves_no_request_in_flight():
    """As in the background loop, every request in flight ends with "error"; they used to stay in their rows and
    decode on with the caller's next requests."""
    engine = Engine(model=tiny_model("qwen2", seed=5), tokenizer=tiny_tokenizer(), max_batch=4)
    solo = engine.generate([PROMPTS[2]], greedy())[0].token_ids
    real, calls = engine._decode, [0]

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected decode failure")
        return real(*a, **kw)

    engine._decode = flaky
    reqs = [engine.submit(p, greedy()) for p in PROMPTS[:2]]
    with pytest.raises(RuntimeError, match="injected decode failure"):
        engine._run_until(reqs)
    assert [r.finish_reason for r in reqs] == ["error", "error"] and all(r.error is not None for r in reqs)
    assert engine.num_active == engine.num_waiting == 0
    forwards: list[int] = []
    engine.on_forward = lambda _kind, _t0, _t1, _n, ids: forwards.extend(ids)
    assert engine.generate([PROMPTS[2]], greedy())[0].token_ids == solo and len(set(forwards)) == 1
    calls[0] = 0
    with pytest.raises(RuntimeError, match="injected decode failure"):
        list(engine.stream(PROMPTS[0], greedy()))
    assert engine.num_active == engine.num_waiting == 0


def test_a_callback_that_raises_on_the_error_event_neither_stops_the_loop_nor_the_others_errors():
    """When the shared forward failed, one request's callback raising on its error event used to escape the loop's
    handler: the engine thread died, the requests after it never got their final event, and no later one ran."""
    engine = Engine(model=tiny_model("qwen2", seed=5), tokenizer=tiny_tokenizer(), max_batch=4)
    real, calls = engine._decode, [0]

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected decode failure")
        return real(*a, **kw)

    engine._decode = flaky
    finals: list[str] = []
    done = threading.Event()

    def gone(_d, _t, finish):
        if finish is not None:
            raise ConnectionError("injected: the client is gone")

    def on_event(_d, _t, finish):
        if finish is not None:
            finals.append(finish)
            done.set()

    first = engine.submit(PROMPTS[0], greedy(), gone)  # both in the first step's decode, this one first
    engine.submit(PROMPTS[1], greedy(), on_event)
    engine.start()
    try:
        assert done.wait(30) and finals == ["error"] and first.finish_reason == "error"
        done.clear()
        engine.submit(PROMPTS[2], greedy(), on_event)
        assert done.wait(30) and finals == ["error", "length"]
    finally:
        engine.stop()
