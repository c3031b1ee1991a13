"""Structured output (serve/structured.py): the grammar's mask against a brute-force one, the engine's constrained
decode against a cacheless one, and response_format through the server."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from core.tiny import save_tiny
from serve.engine import Engine
from serve.sampling import SamplingParams, sample
from serve.server import ServerThread, create_app
from serve.structured import Grammar, GrammarError, Grammars

pytest.importorskip("llguidance")  # the serve extra installs it; CI always has it

# A person: a short name and an age below 100 (bounded, so a random tiny model finishes within the budget).
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
PATTERN = r"[0-9]{3}-[a-z]{2}"


def check_person(text: str) -> None:
    """``text`` is JSON that satisfies :data:`SCHEMA` (checked by hand, as a schema validator would)."""
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "pet"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 99
    assert obj["pet"] in ("cat", "dog")
    assert text == json.dumps(obj, ensure_ascii=False) or text == json.dumps(obj)  # compact: ", " and ": " only


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), arch="llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, max_batch=3, max_seq_len=256)


def pattern_prefix(text: str) -> bool:
    """Whether ``text`` can still grow into a whole match of :data:`PATTERN` (brute force, by position)."""
    if len(text) > 6:
        return False
    return all(c.isascii() and (c.isdigit() if i < 3 else c == "-" if i == 3 else c.islower())
               for i, c in enumerate(text))


def test_the_mask_is_every_token_that_keeps_the_text_on_the_pattern(engine):
    """At each step the allowed tokens are exactly those after which the decoded text is still a prefix of a
    match, and the stop token exactly where the text is whole."""
    tok = engine.tokenizer
    vocab = engine.model.config.vocab_size
    special = set(tok.all_special_ids)
    constraint = engine.grammars.constraint(Grammar.regex(PATTERN))
    out: list[int] = []
    g = torch.Generator().manual_seed(0)
    for _ in range(7):
        allowed = constraint.allowed()
        text = tok.decode(out)
        want = {t for t in range(len(tok)) if t not in special and pattern_prefix(tok.decode(out + [t]))
                and tok.decode(out + [t]) != text}
        got = set(allowed.nonzero().flatten().tolist())
        assert got - engine.stop_ids == want
        assert (engine.stop_ids <= got) == (len(text) == 6) and not allowed[len(tok):vocab].any()
        if constraint.done or not want:
            break
        choices = sorted(want)
        token = choices[int(torch.randint(len(choices), (), generator=g))]
        constraint.consume(token)
        out.append(token)
    assert re.fullmatch(PATTERN, tok.decode(out)) and constraint.done


def reference_decode(model_dir, engine, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """A full forward per token (no cache), masked by a matcher of its own, the engine's sampler and seeding."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    constraint = Grammars(engine.tokenizer, engine.model.config.vocab_size, engine.stop_ids).constraint(params.grammar)
    gen = None if params.greedy else torch.Generator().manual_seed(params.seed)
    out: list[int] = []
    for _ in range(params.max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + out])).logits[0, -1]
        token = sample(constraint(logits), params, gen)
        if token in engine.stop_ids:
            break
        constraint.consume(token)
        out.append(token)
        if constraint.done:
            break
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=80, grammar=Grammar.json_schema(SCHEMA)),
    SamplingParams(max_new_tokens=80, temperature=1.0, seed=5, grammar=Grammar.json_schema(SCHEMA)),
    SamplingParams(max_new_tokens=20, temperature=0.7, seed=2, frequency_penalty=1.0, grammar=Grammar.regex(PATTERN)),
], ids=["greedy-schema", "sampled-schema", "sampled-penalized-regex"])
def test_constrained_output_equals_a_cacheless_reference_and_matches(model_dir, engine, params):
    prompt = "the quick brown fox"
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True)
    # Beside an unconstrained row, which stays as it is alone.
    got, other = engine.generate([prompt, "hello there"], [params, plain])
    assert got.token_ids == reference_decode(model_dir, engine, engine.encode(prompt), params)
    assert got.finish_reason == "stop"
    if params.grammar.kind == "regex":
        assert re.fullmatch(PATTERN, got.text)
    else:
        check_person(got.text)
    assert other.token_ids == engine.generate(["hello there"], plain)[0].token_ids
    # The grammar is what shaped it: the same request without one says something else.
    assert got.token_ids != engine.generate([prompt], SamplingParams(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed))[0].token_ids


def test_any_json_object_and_a_cut_output(engine):
    done, = engine.generate(["the quick brown fox"], SamplingParams(max_new_tokens=200, temperature=1.0, seed=0,
                                                                    grammar=Grammar.json_object()))
    assert done.finish_reason == "stop" and isinstance(json.loads(done.text), dict)
    cut, = engine.generate(["the quick brown fox"], SamplingParams(max_new_tokens=3, grammar=Grammar.json_schema(SCHEMA)))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith('{"')


@pytest.mark.parametrize("grammar, match", [
    (Grammar.json_schema({"type": "objecto"}), "the JSON schema cannot be used: .*objecto"),
    (Grammar.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "the JSON schema cannot be used"),
    (Grammar.regex("[0-9"), "the regular expression cannot be used"),
    (Grammar.json_schema('["a list"]'), r"the JSON schema is not a JSON object \(Expecting object schema"),
    # Objects its reader refuses: they were called "not a JSON object" too.
    (Grammar.json_schema({"enum": ["\ud800"]}), r"the JSON schema cannot be read \(unexpected end of hex escape"),
    (Grammar.json_schema('{"items": ' * 300 + "{}" + "}" * 300), r"the JSON schema cannot be read \(recursion limit"),
])
def test_a_grammar_that_does_not_compile_is_refused_at_submit_in_one_line(engine, grammar, match):
    with pytest.raises(GrammarError, match=match) as err:
        engine.submit(engine.encode("hi"), SamplingParams(max_new_tokens=4, grammar=grammar))
    assert "\n" not in str(err.value) and engine.num_waiting == 0


def test_without_llguidance_a_grammar_names_the_install(model_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if not installed: importing it raises ImportError
    fresh = Engine(model_dir, max_batch=1, max_seq_len=64)
    with pytest.raises(GrammarError, match=r'structured output needs llguidance: pip install -e "\.\[serve\]"'):
        fresh.submit(fresh.encode("hi"), SamplingParams(max_new_tokens=4, grammar=Grammar.json_object()))
    assert fresh.generate(["hi"], SamplingParams(max_new_tokens=2))[0].token_ids  # the rest still serves


def test_grammar_kinds_are_checked():
    with pytest.raises(ValueError, match="grammar kind must be one of"):
        Grammar("lark", "start: 'a'")
    with pytest.raises(ValueError, match="needs its pattern"):
        Grammar.regex("")


def test_server_response_format_json_schema_and_json_object(model_dir, monkeypatch):
    engine = Engine(model_dir, max_batch=2, max_seq_len=256)
    msg = [{"role": "user", "content": "who are you?"}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    compiled_on, source = [], Grammar.source  # a grammar's source is made only when it is compiled
    monkeypatch.setattr(Grammar, "source", lambda g: compiled_on.append(threading.current_thread().name) or source(g))
    with ServerThread(create_app(engine, model_name="tiny")) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        chat = c.post("/v1/chat/completions", json={"messages": msg, "max_tokens": 80, "temperature": 0,
                                                    "response_format": schema_format})
        with c.stream("POST", "/v1/chat/completions", json={"messages": msg, "max_tokens": 80, "temperature": 0,
                                                            "response_format": schema_format, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        completion = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 200,
                                                     "temperature": 1, "seed": 3,
                                                     "response_format": {"type": "json_object"}})
        text = c.post("/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 5, "temperature": 0,
                                               "response_format": {"type": "text"}})
        bad = [c.post("/v1/chat/completions", json={"messages": msg, "response_format": rf}) for rf in (
            "json", {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 5}},
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objecto"}}})]
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["message"]["content"]
    check_person(content)
    assert chat.json()["choices"][0]["finish_reason"] == "stop"
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == content
    assert completion.status_code == 200 and isinstance(json.loads(completion.json()["choices"][0]["text"]), dict)
    assert text.status_code == 200
    assert [r.status_code for r in bad] == [400] * 5
    assert [r.json()["error"]["param"] for r in bad] == ["response_format"] * 5
    assert "objecto" in bad[-1].json()["error"]["message"]
    # Each grammar is compiled in the tokenizing thread, never on the event loop (the engine then finds it
    # compiled): the schema, any object and the refused one.
    assert len(compiled_on) == 3 and all(name.startswith("tokenize") for name in compiled_on), compiled_on


def test_generate_cli_answers_in_the_format_and_refuses_a_bad_one_before_loading(model_dir, tmp_path, capsys,
                                                                                  monkeypatch):
    from serve import generate

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    argv = ["--model", str(model_dir), "--prompt", "the quick brown fox", "--max-new-tokens", "80"]
    assert generate.main([*argv, "--json-schema", str(schema)]) == 0
    check_person(capsys.readouterr().out.strip())
    assert generate.main([*argv, "--regex", PATTERN, "--temperature", "1", "--seed", "4"]) == 0
    assert re.fullmatch(PATTERN, capsys.readouterr().out.strip())
    import serve.engine

    monkeypatch.setattr(serve.engine, "Engine", None)  # a model load would fail on this
    for flags, message in [(["--json-schema", '{"type": "objecto"}'], "the JSON schema cannot be used"),
                           (["--json-schema", "{not json"], "--json-schema is not JSON"),
                           (["--json-schema", str(tmp_path / "missing.json")], "pass a schema file or the schema"),
                           (["--regex", "[0-9"], "the regular expression cannot be used")]:
        assert generate.main([*argv, *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("own", [{}, {"ignore_eos": True}, {"stop_token_ids": [5]}], ids=["plain", "ignore-eos", "own-stops"])
def test_the_grammar_s_end_is_a_stop_even_for_a_request_with_stops_of_its_own(engine, own):
    """Where the grammar may end, the engine's stop token ends the request and is not recorded as output, also
    when the request ignores EOS or names stop tokens of its own (it was recorded as a token of the output)."""
    stop, = engine.stop_ids
    # Greedy, the stop token biased up: one letter (the pattern needs one), then the stop wherever it is allowed.
    params = SamplingParams(max_new_tokens=20, logit_bias={stop: 100.0}, grammar=Grammar.regex("[a-z]{1,12}"), **own)
    got, = engine.generate(["the quick brown fox"], params)
    assert (got.finish_reason, got.stop_token) == ("stop", stop)
    assert stop not in got.token_ids and len(got.token_ids) == 1 and re.fullmatch("[a-z]", got.text)


def test_a_stop_token_the_request_names_ends_it_where_the_grammar_would_go_on(engine):
    """A request's own stop token that the grammar allows mid-output stops it there, as the client asked."""
    letter, = engine.encode("q")
    params = SamplingParams(max_new_tokens=20, logit_bias={letter: 100.0}, stop_token_ids=[letter],
                            grammar=Grammar.regex("[a-z]{2,12}"))
    got, = engine.generate(["the quick brown fox"], params)
    assert (got.finish_reason, got.stop_token, got.token_ids) == ("stop", letter, [])
