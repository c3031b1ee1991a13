"""Penalties against repeating (presence, frequency, repetition) and logit bias: against naive loops and a plain
forward."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.tiny import save_tiny
from serve.engine import Engine
from serve.sampling import REPETITION_PENALTY_RANGE, Penalties, SamplingParams, sample
from serve.server import ServerThread, create_app


def naive_penalties(logits: list[float], prompt: list[int], output: list[int], presence: float, frequency: float,
                    repetition: float, bias: dict[int, float] | None = None) -> list[float]:
    """One token at a time: CTRL's repetition penalty over prompt and output, then OpenAI's two over the output,
    then the logit bias."""
    out = []
    for tok, x in enumerate(logits):
        if repetition != 1 and (tok in prompt or tok in output):
            x = x / repetition if x > 0 else x * repetition
        n = output.count(tok)
        x -= frequency * n + (presence if n else 0.0)
        x += (bias or {}).get(tok, 0.0)
        out.append(x)
    return out


@pytest.mark.parametrize("presence, frequency, repetition, bias", [
    (0.7, 0.0, 1.0, None), (0.0, 0.5, 1.0, None), (0.0, 0.0, 1.3, None), (0.0, 0.0, 0.8, None),
    (-0.5, 1.5, 1.2, None), (0.0, 0.0, 1.0, {3: -100.0, 4: 2.5, 49: 100}), (0.4, 1.0, 1.3, {7: -3.0, 0: 1.0}),
])
def test_penalties_equal_a_naive_loop(presence, frequency, repetition, bias):
    g = torch.Generator().manual_seed(0)
    vocab, prompt = 50, [3, 7, 7, 11]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
                            logit_bias=bias)
    assert params.penalized
    pen = Penalties(params, prompt)
    output: list[int] = []
    for _ in range(12):
        logits = torch.randn(vocab, generator=g) * 3
        got = pen(logits)
        want = naive_penalties(logits.tolist(), prompt, output, presence, frequency, repetition, bias)
        assert got.tolist() == pytest.approx(want, abs=1e-5)
        token = int(torch.randint(0, 15, (), generator=g))  # from a few ids, so that tokens repeat
        pen.add(token)
        output.append(token)


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"presence_penalty": float("nan")},
                                    {"repetition_penalty": 0}, {"repetition_penalty": float("inf")}])
def test_penalties_out_of_range_are_refused(kwargs):
    with pytest.raises(ValueError, match="penalty must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bias, match", [({5: 100.5}, "values must be in"), ({5: float("nan")}, "values must be in"),
                                         ({-1: 1.0}, "keys must be token ids"), ({"5": 1.0}, "keys must be token ids"),
                                         ({i: 1.0 for i in range(301)}, "at most 300")])
def test_logit_bias_out_of_range_is_refused(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)
    assert not SamplingParams(logit_bias={}).penalized  # an empty bias changes nothing


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), arch="llama")


def reference_generate(model_dir, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    """Decode without a cache: a full forward per token, naive penalties, the engine's own sampler and seeding;
    also each chosen token's log-probability under the unpenalized logits."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = None
    if not params.greedy:
        gen = torch.Generator().manual_seed(params.seed)
    out: list[int] = []
    logprobs: list[float] = []
    for _ in range(params.max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1]
        pen = torch.tensor(naive_penalties(logits.tolist(), prompt_ids, out, params.presence_penalty,
                                           params.frequency_penalty, params.repetition_penalty, params.logit_bias))
        token = sample(pen, params, gen)
        logprobs.append(float(torch.log_softmax(logits.double(), -1)[token]))
        out.append(token)
    return out, logprobs


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=16, frequency_penalty=1.5, ignore_eos=True, logprobs=0),
    SamplingParams(max_new_tokens=16, repetition_penalty=1.5, presence_penalty=0.5, ignore_eos=True, logprobs=0),
    SamplingParams(max_new_tokens=16, temperature=0.5, top_k=20, seed=1, frequency_penalty=2.0,
                   repetition_penalty=3.0, ignore_eos=True, logprobs=0),
    SamplingParams(max_new_tokens=16, logit_bias={i: 4.0 for i in range(40, 90)} | {i: -100 for i in range(20)},
                   ignore_eos=True, logprobs=0),
    SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, logit_bias={i: 3.0 for i in range(40, 90)},
                   frequency_penalty=0.5, ignore_eos=True, logprobs=0),
], ids=["greedy-frequency", "greedy-repetition-presence", "sampled", "greedy-bias", "sampled-bias-frequency"])
def test_engine_output_with_penalties_equals_a_cacheless_reference(model_dir, params):
    engine = Engine(model_dir, max_batch=2, max_seq_len=128)
    prompt = "the quick brown fox"
    ids = engine.encode(prompt)
    # Beside an unpenalized greedy row: each row keeps its own counts, and the other row is unchanged.
    plain = SamplingParams(max_new_tokens=16, ignore_eos=True)
    got, other = engine.generate([prompt, "hello hello"], [params, plain])
    want, want_logprobs = reference_generate(model_dir, ids, params)
    assert got.token_ids == want
    # Log-probabilities stay the model's own: the penalties choose the token, they do not change its report.
    assert [lp.logprob for lp in got.logprobs] == pytest.approx(want_logprobs, abs=1e-4)
    assert other.token_ids == engine.generate(["hello hello"], plain)[0].token_ids
    # The penalties change the output of this prompt (else this test would not see them).
    assert got.token_ids != engine.generate([prompt], SamplingParams(
        max_new_tokens=16, temperature=params.temperature, top_k=params.top_k, seed=params.seed,
        ignore_eos=True))[0].token_ids


def test_logit_bias_bans_and_forces_tokens_and_names_ids_beyond_the_vocabulary(model_dir):
    engine = Engine(model_dir, max_batch=2, max_seq_len=128)
    prompt = "the quick brown fox"
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    banned = engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                      logit_bias=dict.fromkeys(plain, -100)))[0].token_ids
    assert not set(banned) & set(plain)
    forced = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, seed=0, ignore_eos=True,
                                                      logit_bias={17: 100}))[0].token_ids
    assert forced == [17] * 6
    vocab = engine.model.config.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias names token {vocab} but the model's vocabulary has {vocab}"):
        engine.generate([prompt], SamplingParams(max_new_tokens=4, logit_bias={3: 1.0, vocab: 1.0}))


def test_server_passes_the_penalties_and_the_bias_to_the_engine(model_dir):
    engine = Engine(model_dir, max_batch=1, max_seq_len=128)
    body = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "frequency_penalty": 1.5, "presence_penalty": 0.3, "repetition_penalty": 1.2,
            "logit_bias": {"40": 6, "41": 2.5, "7": -100}}
    want = engine.generate(["the quick brown fox"], SamplingParams(
        max_new_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.3, repetition_penalty=1.2,
        logit_bias={40: 6.0, 41: 2.5, 7: -100.0}))[0]
    unbiased = engine.generate(["the quick brown fox"], SamplingParams(
        max_new_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.3, repetition_penalty=1.2))[0]
    plain = engine.generate(["the quick brown fox"], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert len({want.text, unbiased.text, plain.text}) == 3  # (else the bias or the penalties would go unseen here)
    with ServerThread(create_app(engine, max_queue=1, model_name="tiny")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        got = c.post("/v1/completions", json=body).json()
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True, "logit_bias": {"17": 100}})
        neutral = c.post("/v1/completions", json={**body, "frequency_penalty": 0, "presence_penalty": 0.0,
                                                  "repetition_penalty": 1, "logit_bias": {}})
    assert got["choices"][0]["text"] == want.text and got["usage"]["completion_tokens"] == 12
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode(
        [17] * 6, skip_special_tokens=True)
    assert neutral.status_code == 200 and neutral.json()["choices"][0]["text"] == plain.text


def test_repetition_penalty_is_refused_where_fp32_logits_overflow_and_is_exact_at_its_bounds(model_dir):
    """A tiny or huge penalty used to pass the checks, then overflow (a positive logit to inf, a zero one times inf
    to NaN): a sampled request failed with 500. Refused now; at the range's bounds the logits are a naive loop's."""
    lo, hi = REPETITION_PENALTY_RANGE
    for rp in (lo / 10, hi * 10):
        with pytest.raises(ValueError, match="repetition_penalty must be in"):
            SamplingParams(repetition_penalty=rp)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 30
    logits[[3, 7]] = 0.0  # zero logits: times an infinite penalty, NaN
    prompt = [3, 7, 11, 20, 21]
    for rp in (lo, hi):
        got = Penalties(SamplingParams(repetition_penalty=rp), prompt)(logits)
        assert torch.isfinite(got).all()
        assert got.tolist() == pytest.approx(naive_penalties(logits.tolist(), prompt, [], 0.0, 0.0, rp), rel=1e-6)
    engine = Engine(model_dir, max_batch=2, max_seq_len=64)
    body = {"prompt": "the quick brown fox", "max_tokens": 4, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    with ServerThread(create_app(engine, model_name="tiny")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        for rp in (1e-40, 1e39):
            r = c.post("/v1/completions", json={**body, "repetition_penalty": rp})
            assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
            assert "must be a finite number in [0.001, 1000.0]" in r.json()["error"]["message"]
        for rp in (lo, hi):
            r = c.post("/v1/completions", json={**body, "repetition_penalty": rp})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_generate_cli_takes_penalties_and_refuses_bad_ones_before_loading(model_dir, capsys, monkeypatch):
    from serve import generate

    argv = ["--model", str(model_dir), "--prompt", "the quick brown fox", "--max-new-tokens", "12"]
    assert generate.main([*argv, "--repetition-penalty", "2", "--frequency-penalty", "1.5"]) == 0
    want = Engine(model_dir, max_batch=1).generate(["the quick brown fox"], SamplingParams(
        max_new_tokens=12, repetition_penalty=2.0, frequency_penalty=1.5))[0].text
    assert capsys.readouterr().out == want + "\n"
    import serve.engine

    monkeypatch.setattr(serve.engine, "Engine", None)  # a model load would fail on this
    assert generate.main([*argv, "--frequency-penalty", "3"]) == 2
    assert "frequency_penalty must be in [-2, 2]" in capsys.readouterr().err
