"""Paired bootstrap against a naive loop, coverage, and the detectable-effect formula."""

from __future__ import annotations

import numpy as np
import pytest

from eval.stats import bootstrap_means, detectable_effect, paired_bootstrap, ratio_bootstrap, resample_indices


def _naive_means(x: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(resamples):
        idx = rng.integers(0, len(x), size=len(x))
        out.append(sum(x[i] for i in idx) / len(x))
    return np.array(out)


def test_vectorized_bootstrap_matches_naive_loop_draw_for_draw():
    x = np.random.default_rng(3).normal(size=17)
    # One draw of the same shape from the same seed gives the same indices as the loop (row-major).
    fast = bootstrap_means(x, resamples=200, seed=5)[:, 0]
    rng = np.random.default_rng(5)
    idx = rng.integers(0, 17, size=(200, 17))
    naive = np.array([x[row].mean() for row in idx])
    np.testing.assert_allclose(fast, naive, rtol=1e-12)
    # and the distribution agrees with an independent naive loop
    loop = _naive_means(x, 4000, seed=11)
    big = bootstrap_means(x, 4000, seed=11)[:, 0]
    assert abs(loop.std() - big.std()) < 0.1 * loop.std()


def test_chunked_indices_cover_all_resamples(monkeypatch):
    import eval.stats as st

    monkeypatch.setattr(st, "_CHUNK_ENTRIES", 50)
    chunks = list(resample_indices(10, 23, seed=0))
    assert len(chunks) > 1
    # one stream of draws across the chunks, not the same draws again per chunk (a reseeded generator)
    np.testing.assert_array_equal(np.concatenate(chunks), np.random.default_rng(0).integers(0, 10, size=(23, 10)))


def test_paired_interval_identical_scores_is_zero_and_deterministic():
    s = np.random.default_rng(0).uniform(size=50)
    a = paired_bootstrap(s, s.copy(), resamples=1000, seed=1)
    assert a["difference"].mean == 0 and a["difference"].low == 0 and a["difference"].high == 0
    b = paired_bootstrap(s, s.copy(), resamples=1000, seed=1)
    assert a == b
    assert a["candidate"].contains(s.mean())


def test_pairing_tightens_the_interval():
    rng = np.random.default_rng(0)
    difficulty = rng.uniform(0.3, 0.95, size=200)
    base = difficulty + rng.normal(0, 0.01, 200)
    cand = difficulty - 0.01 + rng.normal(0, 0.01, 200)
    iv = paired_bootstrap(cand, base, resamples=2000, seed=0)
    d = iv["difference"]
    assert d.high < 0 and d.contains(-0.01)
    assert d.se < 0.2 * iv["candidate"].se  # prompt difficulty cancels in the paired difference


def test_coverage_is_near_nominal():
    rng = np.random.default_rng(42)
    hits = 0
    trials = 200
    for t in range(trials):
        x = rng.normal(0.1, 1.0, size=60)
        iv = paired_bootstrap(x, np.zeros_like(x), resamples=1000, seed=t)["difference"]
        hits += iv.contains(0.1)
    assert 0.88 <= hits / trials <= 0.99


def test_ratio_bootstrap_point_is_ratio_of_sums():
    num = np.array([1.0, 2.0, 3.0, 10.0])
    den = np.array([1.0, 1.0, 1.0, 7.0])
    iv = ratio_bootstrap(num, den, resamples=500, seed=0)
    assert iv.mean == pytest.approx(16 / 10)
    assert iv.low <= iv.mean <= iv.high


def test_detectable_effect_formula():
    assert detectable_effect(1.0) == pytest.approx(1.959964 + 0.841621, rel=1e-5)
    assert detectable_effect(0.01) == pytest.approx(0.028016, rel=1e-4)
    with pytest.raises(ValueError):
        paired_bootstrap(np.ones(3), np.ones(4))
