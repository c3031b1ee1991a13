"""eval.longctx: needle prompts, exact-match scoring against greedy generation, the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

import attention
from core.tiny import tiny_teacher
from core.tiny import tiny_teacher_tokenizer as tiny_tokenizer
from eval import longctx


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("kind", longctx.KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_sample_fits_length_and_hides_the_key_at_depth(tok, kind, depth):
    s = longctx.build_sample(tok, kind, 400, depth, random.Random(0))
    assert 400 - 40 < len(s.ids) <= 400
    text = tok.decode(s.ids)
    assert text.count(s.key) == 2 + (kind == "passkey")  # needle (twice for passkey), answer
    assert tok.decode(s.ids[-s.answer_len:]).strip() == s.key
    assert tok.decode(s.ids[s.needle_pos:s.needle_pos + 12]).lstrip().startswith("The pass key")
    rel = s.needle_pos / len(s.ids)
    assert abs(rel - depth) < 0.2  # the asked-for needle sits near its depth (the tail is the question)
    if kind == "multikey":
        assert text.count("door is") == longctx.MULTI_NEEDLES + 1
    with pytest.raises(longctx.LongCtxError, match="too short"):
        longctx.build_sample(tok, kind, 30, depth, random.Random(0))


def test_score_matches_greedy_generation(tok):
    model = tiny_teacher(0).eval()
    rng = random.Random(3)
    for depth in (0.2, 0.8):
        s = longctx.build_sample(tok, "passkey", 200, depth, rng)
        found, pred = longctx.score_sample(model, s)
        prompt = torch.tensor([s.ids[:-s.answer_len]])
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=s.answer_len, do_sample=False, pad_token_id=0)
        greedy = out[0, prompt.shape[1]:].tolist()
        assert json.loads(pred)[0] == greedy[0]
        assert found == (greedy == s.ids[-s.answer_len:])


def test_found_when_logits_point_at_the_answer(tok):
    s = longctx.build_sample(tok, "passkey", 200, 0.5, random.Random(1))
    ids = list(s.ids)  # what the oracle predicts: the original answer

    class Oracle(torch.nn.Module):
        config = type("C", (), {"max_position_embeddings": 1024})()

        def forward(self, input_ids, logits_to_keep, use_cache):
            n = input_ids.shape[1] + 1
            logits = torch.zeros(1, logits_to_keep, 600)
            gold = torch.tensor(ids[n - logits_to_keep:n])
            logits[0, torch.arange(logits_to_keep), gold] = 1.0
            return type("O", (), {"logits": logits})()

    assert longctx.score_sample(Oracle(), s)[0]
    s.ids[-1] = (s.ids[-1] + 1) % 500  # a wrong last digit is a miss
    assert not longctx.score_sample(Oracle(), s)[0]


def test_cli_writes_heatmap_and_json_and_loads_hybrid(tmp_path, tok, capsys):
    model = tiny_teacher(0)
    dense_dir, hybrid_dir = tmp_path / "dense", tmp_path / "hybrid"
    model.save_pretrained(dense_dir)
    tok.save_pretrained(dense_dir)
    attention.retrofit(model, attention.HybridAttentionConfig(sink_tokens=4, window=24, global_every=0,
                                                              full_heads={1: [0]}))
    model.save_pretrained(hybrid_dir)
    tok.save_pretrained(hybrid_dir)
    for d, want in ((dense_dir, "dense"), (hybrid_dir, "hybrid")):
        rc = longctx.main(["--model", str(d), "--lengths", "300,400", "--depths", "2", "--trials", "1",
                           "--kinds", "passkey,multikey", "--out", str(tmp_path / want)])
        assert rc == 0
        last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert last["attention"] == want and set(last["accuracy"]) == {"passkey", "multikey"}
        assert set(last["accuracy"]["passkey"]) == {"300", "400"}
        assert (tmp_path / want / "longctx.png").stat().st_size > 1000
        saved = json.loads((tmp_path / want / "longctx.json").read_text())
        assert len(saved["samples"]) == 2 * 2 * 2
    rc = longctx.main(["--model", str(dense_dir), "--lengths", "4096"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the weight-loading progress bar
    assert rc == 3 and err.startswith("error: ") and "max_position_embeddings=1024" in err


def test_depths_are_a_count_or_explicit_fractions():
    assert longctx.depths_for("3") == [0.0, 0.5, 1.0]
    assert longctx.depths_for(1) == [0.5]
    assert longctx.depths_for("0.25,0.75") == [0.25, 0.75]
    for bad in ("0", "1.5,0.2", "x,y", "many"):
        with pytest.raises(longctx.LongCtxError, match="depths"):
            longctx.depths_for(bad)


@pytest.mark.parametrize("hybrid", [False, True])
def test_greedy_continuation_through_the_cache_equals_recompute(tok, hybrid):
    model = tiny_teacher(0).eval()
    if hybrid:  # per-head roles: the cached decode runs full heads dense and the rest block-sparse
        attention.retrofit(model, attention.HybridAttentionConfig(sink_tokens=4, window=24, global_every=0,
                                                                  full_heads={0: [0]}))
    s = longctx.build_sample(tok, "passkey", 200, 0.3, random.Random(5))
    prompt = s.ids[:-s.answer_len]
    got = longctx.greedy_continuation(model, prompt, 6)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    assert got == ids[len(prompt):]


def test_first_number_scoring_needs_the_key_as_the_first_whole_number(tok, monkeypatch):
    s = longctx.build_sample(tok, "passkey", 200, 0.5, random.Random(1))
    model = tiny_teacher(0).eval()
    for text, found in [(f" {s.key}. Remember", True), (f" the {s.key} is", True), (f" {s.key}7", False),
                        (f" 1 {s.key}", False), (" the pass key", False)]:
        monkeypatch.setattr(longctx, "greedy_continuation", lambda *a, text=text: tok(text)["input_ids"])
        assert longctx.score_sample(model, s, scoring="first_number", tokenizer=tok)[0] == found, text
    with pytest.raises(longctx.LongCtxError, match="tokenizer"):
        longctx.score_sample(model, s, scoring="first_number")


def test_cache_keyword_follows_the_installed_transformers():
    """cache_kwargs / returned_cache: ``cache`` where the forward takes it, ``past_key_values`` (earlier 5.x) where not;
    the wrong name would vanish into ``**kwargs`` and decode without the cache."""
    from transformers.utils import ModelOutput

    from core.models import cache_kwargs, returned_cache

    class Earlier(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return ModelOutput(logits=input_ids, past_key_values=past_key_values)

    class Later(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return ModelOutput(logits=input_ids, cache=cache)

    for model, name in ((Earlier(), "past_key_values"), (Later(), "cache")):
        kw = cache_kwargs(model, "kv")
        assert kw == {name: "kv"}
        assert returned_cache(model(torch.zeros(1), **kw)) == "kv"


def test_device_defaults_to_auto_and_a_bad_one_is_one_line(monkeypatch, capsys):
    from core.models import resolve_device

    args = longctx.build_parser().parse_args(["--model", "m"])
    assert args.device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(args.device) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert "(default: auto)" in longctx.build_parser().format_help()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for bad, says in (("tpu", "unknown"), ("cuda", "no CUDA GPU")):
        # The device is checked before the model loads: "m" is never looked up.
        assert longctx.main(["--model", "m", "--device", bad]) == 3
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err


def test_bad_flags_and_an_unwritable_out_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import core.models

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")
    for module, name in ((longctx, "load_for_eval"), (longctx, "load_causal_lm"), (longctx, "load_tokenizer"),
                         (core.models, "load_causal_lm")):
        monkeypatch.setattr(module, name, loaded)
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    for flags, says in ((["--depths", "1.5"], "depths must be fractions in [0, 1]"),
                        (["--depths", "0"], "--depths must be >= 1"),
                        (["--trials", "0"], "--trials must be >= 1, got 0"),
                        (["--scoring", "foo"], "unknown --scoring 'foo'; use one of exact, first_number"),
                        (["--out", str(afile / "sub")], f"lies under {afile}, which is a file; choose another --out"),
                        (["--out", str(afile)], "is a file, not a folder; choose another --out")):
        capsys.readouterr()
        assert longctx.main(["--model", "m", "--lengths", "300", *flags]) == 3, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, (flags, err)
    assert afile.read_text() == "not a folder" and sorted(tmp_path.iterdir()) == [afile]


def test_cells_are_accuracies_even_when_a_length_or_depth_repeats(tok, monkeypatch):
    """A cell is the share of its samples found: a repeated length or depth must not push it above 1."""
    monkeypatch.setattr(longctx, "score_sample", lambda *a, **k: (True, "[]"))
    model = type("M", (), {"config": type("C", (), {"max_position_embeddings": 1024})()})()
    res = longctx.run_longctx(model, tok, lengths=[300, 300, 400], depths="0.5,0.5,0.75", trials=2,
                              kinds=("passkey",), progress=False)
    assert res["accuracy"]["passkey"] == {"300": 1.0, "400": 1.0}
    for length in ("300", "400"):
        assert res["cells"]["passkey"][length] == {"0.500": 1.0, "0.750": 1.0}


def test_accuracies_match_a_naive_count_and_trials_use_distinct_keys(tok, monkeypatch):
    """Each cell's accuracy is the share of its own samples found (a naive recount over the saved rows), and the
    trials of a cell are different prompts with different keys, the key being the answer each row names."""
    from collections import defaultdict

    built = []

    def score(model, sample, *args):  # found for some keys only: the counts must follow the samples
        built.append(sample)
        return int(sample.key) % 3 == 0, "[]"

    monkeypatch.setattr(longctx, "score_sample", score)
    model = type("M", (), {"config": type("C", (), {"max_position_embeddings": 1024})()})()
    res = longctx.run_longctx(model, tok, lengths=[300, 500], depths="0.1,0.5,0.9", trials=4,
                              kinds=("passkey", "multikey"), progress=False)
    cells = defaultdict(list)
    for s, row in zip(built, res["samples"], strict=True):
        assert row["key"] == s.key == tok.decode(s.ids[-s.answer_len:]).strip() and row["tokens"] <= row["length"]
        cells[row["kind"], row["length"], row["depth"]].append(row)
    assert len(cells) == 2 * 2 * 3
    for (kind, length, depth), rows in cells.items():
        assert sorted(r["trial"] for r in rows) == [0, 1, 2, 3] and len({r["key"] for r in rows}) == 4
        assert res["cells"][kind][str(length)][f"{depth:.3f}"] == sum(int(r["key"]) % 3 == 0 for r in rows) / 4
    for kind in ("passkey", "multikey"):
        for length in (300, 500):
            rows = [r for (k, n, _), rs in cells.items() if (k, n) == (kind, length) for r in rs]
            assert res["accuracy"][kind][str(length)] == sum(int(r["key"]) % 3 == 0 for r in rows) / len(rows)
