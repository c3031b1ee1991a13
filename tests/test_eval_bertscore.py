"""The offline BERTScore wrapper against bert_score's own functional API, and its exact rules."""

from __future__ import annotations

import numpy as np
import pytest

from eval.bertscore import MAX_TOKENS, BertScore, build_rescale_baseline, scorer_model_dir

CANDS = ["the cat sat on the mat", "water boils at one hundred degrees", "a train left the station late",
         "plants need light to grow"]
REFS = ["a cat was sitting on the mat", "at sea level water boils at 100 c", "the bus arrived early",
        "compilers translate source code"]


@pytest.fixture(scope="module")
def scorer():
    return BertScore()


def test_matches_bert_score_functional_api(scorer):
    from bert_score import score

    p, r, f = score(CANDS, REFS, model_type=str(scorer_model_dir()), num_layers=6, use_fast_tokenizer=True,
                    device="cpu")
    ours = scorer.score_prf(CANDS, REFS)
    np.testing.assert_allclose(ours, np.stack([p.numpy(), r.numpy(), f.numpy()], 1), atol=1e-5)
    # related pairs score above unrelated ones: the layer choice separates them
    assert ours[0, 2] > ours[3, 2] and ours[1, 2] > ours[3, 2]


def test_exact_rules_for_identical_and_empty(scorer):
    f = scorer.f1(["same text here", "", "", "something"], ["same text here", "", "nonempty", " "])
    assert f.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_long_texts_are_counted_past_the_window(scorer):
    counts = scorer.token_counts(["word " * 600, "short one"])
    assert counts[0] > MAX_TOKENS and counts[1] == 2


def test_settings_hash_tracks_every_choice(scorer):
    h = scorer.settings_hash()
    assert scorer.settings()["layer"] == 6 and scorer.settings()["rescale"] is None
    texts = CANDS + REFS
    scorer.set_baseline_from_texts(texts, source="test", pairs=50)
    try:
        assert scorer.settings_hash() != h
        b = np.asarray(scorer.baseline)
        rescaled = scorer.score_prf(CANDS, REFS)
        scorer.baseline = None
        raw = scorer.score_prf(CANDS, REFS)
        np.testing.assert_allclose(rescaled, (raw - b) / (1 - b), rtol=1e-12)
    finally:
        scorer.baseline = scorer.baseline_source = None
    assert scorer.settings_hash() == h
    other = BertScore(layer=5)
    assert other.settings_hash() != h


def test_rescale_baseline_pairs_unrelated_texts(scorer):
    b1 = build_rescale_baseline(scorer, CANDS + REFS, pairs=40, seed=0)
    b2 = build_rescale_baseline(scorer, CANDS + REFS, pairs=40, seed=0)
    assert b1 == b2 and all(0 < v < 1 for v in b1)  # never pairs a text with itself (that would be 1.0)
    for texts in (["only one"], ["the same text", " the same text ", "the same text"]):
        with pytest.raises(ValueError, match="two distinct texts"):
            build_rescale_baseline(scorer, texts)


def test_rescale_texts_that_differ_only_in_case_or_spacing_are_one_text(scorer):
    """The encoder is uncased: "Hello world." and "hello  world." are copies to it, so a baseline of them alone was
    1.0000001 and rescaled scores came out in the millions instead of an error."""
    with pytest.raises(ValueError, match="two distinct texts"):
        build_rescale_baseline(scorer, ["Hello world.", "hello  world.", " HELLO world. "])
    b = build_rescale_baseline(scorer, ["Hello world.", "hello world.", "plants need light to grow"], pairs=20)
    assert all(0 < v < 1 for v in b)
