"""eval's bad input: one line, the right exit code, before any model loads or generates."""

from __future__ import annotations

import json

import pytest

from eval.gate import main


def _model_dirs(tmp_path):
    """Two folders that pass the gate's input check (config.json) but could never load: nothing may load them."""
    for role in ("cand", "base"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text("{}")
    return ["--candidate", str(tmp_path / "cand"), "--baseline", str(tmp_path / "base")]


def _tiny_hybrid(path, max_pos: int):
    import attention
    from core.tiny import tiny_model, tiny_tokenizer

    model = tiny_model("llama", max_pos=max_pos)
    attention.retrofit(model, attention.HybridAttentionConfig(sink_tokens=1, window=4, global_every=0))
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_rescale_prompts_with_one_distinct_prompt_text_exits_3_before_any_generation(tmp_path, capsys):
    """The prompts are the rescale baseline's texts: copies of one text give it no unrelated pair (it raised a
    ValueError after every generation, exit 5 with a traceback)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(["Same", " same "])))
    out = tmp_path / "out"
    code = main([*_model_dirs(tmp_path), "--prompts", str(prompts), "--out", str(out), "--rescale", "prompts"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("\n") == 1 and "rescale=prompts needs at least two different prompt texts" in err
    assert not out.exists()



def test_rescale_text_whose_lines_differ_only_in_case_exits_3_before_any_generation(tmp_path, capsys):
    """The scorer is uncased: such lines are one text to it, and a baseline of them rescaled every score into the
    millions (a garbage verdict) instead of being refused."""
    text = tmp_path / "rescale.txt"
    text.write_text("Hello world.\nhello  world.\n")
    out = tmp_path / "out"
    code = main([*_model_dirs(tmp_path), "--out", str(out), "--rescale", str(text)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("\n") == 1 and "has 1 distinct non-empty line(s)" in err and not out.exists()

def test_a_prompt_past_a_models_positions_exits_3_before_any_generation(tmp_path, capsys, monkeypatch):
    """A hybrid model refuses a sequence past max_position_embeddings in the middle of generate: that was exit 5
    with a traceback, after the models before it had generated."""
    import eval.generation as generation

    _tiny_hybrid(tmp_path / "m", max_pos=64)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "short", "prompt": "the quick brown fox"}) + "\n"
                       + json.dumps({"id": "long", "prompt": "the quick brown fox " * 40}) + "\n")
    monkeypatch.setattr(generation, "load_causal_lm", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    out = tmp_path / "out"
    capsys.readouterr()  # the save's progress bar
    code = main(["--candidate", str(tmp_path / "m"), "--baseline", str(tmp_path / "m"), "--prompts", str(prompts),
                 "--out", str(out), "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("\n") == 1 and "prompt 'long' is" in err and "max_position_embeddings=64" in err
    assert not out.exists()


def test_lm_seq_len_past_a_models_positions_exits_3_before_any_generation(tmp_path, capsys, monkeypatch):
    """The LM metrics' windows are lm_seq_len tokens: past a hybrid model's positions that raised after every
    generation and the scoring (exit 5, traceback)."""
    import eval.generation as generation

    m = _tiny_hybrid(tmp_path / "m", max_pos=64)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"fox {i}", "reference": "the lazy dog " * 20}) + "\n"
                               for i in range(2)))
    monkeypatch.setattr(generation, "load_causal_lm", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    out = tmp_path / "out"
    capsys.readouterr()  # the save's progress bar
    argv = ["--candidate", str(m), "--baseline", str(m), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "4", "--lm-seq-len", "128"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("\n") == 1 and "lm_seq_len=128 exceeds the candidate's max_position_embeddings=64" in err
    assert not out.exists()
    assert main([*argv[:-2], "--lm-seq-len", "64", "--out", str(tmp_path / "o2")]) == 4  # past the check: the load


@pytest.mark.parametrize("flags, says", [
    (["--retrofit", '{"window": 0}'], "--retrofit needs 'default' or a JSON object of hybrid attention keys (window "
                                      "must be > 0"),
    (["--retrofit", "{window: 4}"], "--retrofit needs 'default' or a JSON object"),
    (["--retrofit", "[4]"], "(got list)"),
    (["--retrofit", '{"full_layers": [5]}'], "--retrofit: hybrid attention head roles name layer(s) [5] but the model "
                                             "has 2 layers"),
    (["--lengths", "300"], "length 300 exceeds the model's max_position_embeddings=64; drop it from --lengths"),
])
def test_longctx_refuses_a_bad_retrofit_spec_or_length_before_the_model_loads(tmp_path, monkeypatch, capsys, flags,
                                                                             says):
    """The --retrofit spec and the model's positions are known from the command line and config.json: they were
    checked only after the weights loaded."""
    import eval.longctx as longctx
    from core.tiny import save_tiny

    save_tiny(tmp_path / "m", max_pos=64)

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")
    monkeypatch.setattr(longctx, "load_for_eval", loaded)
    capsys.readouterr()
    assert longctx.main(["--model", str(tmp_path / "m"), "--lengths", "64", *flags]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err


def test_prompt_and_reference_files_saved_with_a_byte_order_mark_load(tmp_path):
    """Windows editors start UTF-8 files with a BOM: line 1 was 'not valid JSON' though it was."""
    from eval.prompt_set import load_prompts, load_references

    prompts, refs = tmp_path / "prompts.jsonl", tmp_path / "refs.jsonl"
    prompts.write_text('\ufeff{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "yo"}\n', encoding="utf-8")
    refs.write_text('\ufeff{"id": "a", "reference": "x"}\n{"id": "b", "reference": "y"}\n', encoding="utf-8")
    loaded = load_prompts(prompts)
    assert [p.id for p in loaded] == ["a", "b"] and load_references(refs, loaded) == ["x", "y"]


def test_a_config_json_that_is_no_object_is_a_load_error_not_a_traceback(tmp_path, capsys):
    """--longctx read max_position_embeddings with dict.get from whatever config.json held: a list raised
    AttributeError, exit 5 with a traceback."""
    argv = _model_dirs(tmp_path)
    (tmp_path / "cand" / "config.json").write_text("[]")
    code = main([*argv, "--out", str(tmp_path / "out"), "--longctx", "2048"])
    err = capsys.readouterr().err
    assert code == 4, err
    assert err.count("\n") == 1 and "cannot load the tokenizer" in err


def test_the_long_context_check_runs_on_the_gates_device(tmp_path, monkeypatch):
    """--device placed the generations only: the pass-key check loaded each model on the CPU and ran there."""
    import eval.gate as gate
    import eval.generation as generation

    moved, ran = [], []

    class Model:
        def to(self, device):
            moved.append(device)
            return self

    monkeypatch.setattr(gate, "load_for_eval", lambda path: (Model(), None, "dense"))
    monkeypatch.setattr(gate, "run_longctx", lambda model, tok, *, lengths, device="cpu", **kw: ran.append(device) or
                        {"accuracy": {"passkey": {str(n): 1.0 for n in lengths}}})
    cfg = gate.GateConfig(candidate="c", baseline="b", out=str(tmp_path / "out"), longctx="256", device="cpu")
    monkeypatch.setattr(generation, "resolve_device", lambda name: name)  # a GPU this machine lacks
    cfg.device = "cuda:1"
    gate._longctx_check(cfg, {"candidate": tmp_path, "baseline": tmp_path})
    assert moved == ran == ["cuda:1", "cuda:1"]


def test_a_longctx_length_too_short_for_the_baselines_tokens_exits_3_before_any_generation(tmp_path, capsys):
    """A pass-key prompt's size depends on the tokenizer: only the candidate's was checked, so a length the
    baseline's tokens cannot hold failed in the check itself, after every generation and the scoring."""
    from core.tiny import tiny_tokenizer
    from eval.longctx import FILLER, INTRO

    argv = _model_dirs(tmp_path)
    needle = " The pass key is 71432. Remember it. 71432 is the pass key. What is the pass key?"
    tiny_tokenizer([INTRO, *FILLER, needle] * 5, vocab_size=400).save_pretrained(tmp_path / "cand")  # few tokens
    tiny_tokenizer(vocab_size=260).save_pretrained(tmp_path / "base")  # about one token per byte
    out = tmp_path / "out"
    code = main([*argv, "--out", str(out), "--longctx", "128"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("\n") == 1 and "longctx (baseline's tokenizer): length 128 is too short" in err
    assert not out.exists()


@pytest.mark.parametrize("stored, says", [({"sink_tokens": 1, "window": 0, "global_every": 0}, "window must be > 0"),
                                          ({"full_layers": [5]}, "name layer(s) [5] but the model has 2 layers")])
def test_longctx_refuses_a_broken_stored_spec_before_the_model_loads(tmp_path, monkeypatch, capsys, stored, says):
    """A model loads hybrid when its config.json carries a spec: one that cannot run failed after the weights loaded."""
    import eval.longctx as longctx
    from core.tiny import save_tiny

    save_tiny(tmp_path / "m", max_pos=256)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "hybrid_attention": stored}))
    monkeypatch.setattr(longctx, "load_for_eval", lambda *a, **k: pytest.fail("the model was loaded"))
    capsys.readouterr()
    assert longctx.main(["--model", str(tmp_path / "m"), "--lengths", "256"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'm'}/config.json (or pass --dense): " in err and says in err


def test_a_baseline_whose_stored_spec_cannot_run_exits_4_before_any_generation(tmp_path, capsys, monkeypatch):
    """A model loads hybrid with the spec its config.json carries: a broken one failed when the baseline loaded,
    after the candidate's generations."""
    import eval.generation as generation
    from core.tiny import save_tiny

    for role in ("cand", "base"):
        save_tiny(tmp_path / role, max_pos=256)
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    (tmp_path / "base" / "config.json").write_text(json.dumps({**config, "hybrid_attention": {"full_layers": [9]}}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "the quick brown fox"}) + "\n")
    monkeypatch.setattr(generation, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    capsys.readouterr()
    code = main(["--candidate", str(tmp_path / "cand"), "--baseline", str(tmp_path / "base"), "--prompts",
                 str(prompts), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 4, err
    assert err.count("\n") == 1 and "the baseline cannot load hybrid: " in err and "layer(s) [9]" in err
    assert not (tmp_path / "out").exists()
