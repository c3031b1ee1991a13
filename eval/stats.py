"""Paired bootstrap intervals and the smallest effect a sample can detect.

The gate compares a candidate with a baseline on the *same* prompts, so the unit of evidence is
the per-prompt difference ``d_i = cand_i - base_i``. Resampling prompts (not the two models
independently) keeps the pairing: prompt difficulty cancels, and the interval is much tighter
than two independent intervals would be.

Intervals are percentile bootstrap intervals of the mean: draw ``n`` prompts with replacement
``resamples`` times, take each mean, read the ``(1-c)/2`` and ``(1+c)/2`` quantiles. The draw is
seeded, so the same scores always give the same interval.

Smallest detectable drop (reported, not used by the verdict): with the bootstrap standard error
``SE`` of the mean difference, a true mean drop ``δ`` is found significant by a two-sided test at
level α with power ``1-β`` when ``δ ≥ (z_{1-α/2} + z_{1-β}) · SE``. For α = 0.05 and 80 % power
that is ``(1.960 + 0.842) · SE ≈ 2.80 · SE``. A prompt set whose detectable drop is larger than
the gate's ``max_drop`` cannot reliably tell an acceptable student from a worse one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

# Cap on resample-matrix entries built at once: 10k resamples × 2k prompts of int64 ≈ 160 MB.
_CHUNK_ENTRIES = 20_000_000


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval and standard error."""

    mean: float
    low: float
    high: float
    se: float
    confidence: float
    n: int

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def resample_indices(n: int, resamples: int, seed: int):
    """Yield ``[chunk, n]`` index arrays, ``resamples`` rows in total, from one seeded generator."""
    rng = np.random.default_rng(seed)
    rows = max(1, _CHUNK_ENTRIES // max(n, 1))
    done = 0
    while done < resamples:
        take = min(rows, resamples - done)
        yield rng.integers(0, n, size=(take, n))
        done += take


def bootstrap_means(columns: np.ndarray, resamples: int = 10_000, seed: int = 0) -> np.ndarray:
    """Means of resampled rows of ``columns`` (``[n, k]``, the same draw for every column) → ``[resamples, k]``."""
    columns = np.asarray(columns, dtype=np.float64)
    if columns.ndim == 1:
        columns = columns[:, None]
    n = columns.shape[0]
    out = [columns[idx].mean(axis=1) for idx in resample_indices(n, resamples, seed)]
    return np.concatenate(out, axis=0)


def _interval(point: float, draws: np.ndarray, confidence: float, n: int) -> Interval:
    alpha = 1.0 - confidence
    low, high = np.quantile(draws, [alpha / 2, 1 - alpha / 2])
    return Interval(mean=float(point), low=float(low), high=float(high), se=float(draws.std(ddof=1)) if
                    draws.size > 1 else 0.0, confidence=confidence, n=n)


def paired_bootstrap(candidate: np.ndarray, baseline: np.ndarray, resamples: int = 10_000, seed: int = 0,
                     confidence: float = 0.95) -> dict[str, Interval]:
    """Intervals for the candidate mean, the baseline mean and their paired difference.

    Args:
        candidate: ``[n]`` per-prompt scores of the candidate.
        baseline: ``[n]`` per-prompt scores of the baseline on the same prompts, same order.

    Returns:
        ``{"candidate", "baseline", "difference"}`` → :class:`Interval`; all three come from the
        same resampled prompt sets, so they are mutually consistent.
    """
    cand = np.asarray(candidate, dtype=np.float64)
    base = np.asarray(baseline, dtype=np.float64)
    if cand.shape != base.shape or cand.ndim != 1 or cand.size == 0:
        raise ValueError(f"paired scores must be two non-empty 1-D arrays of equal length, got {cand.shape} "
                         f"and {base.shape}")
    cols = np.stack([cand, base, cand - base], axis=1)
    draws = bootstrap_means(cols, resamples, seed)
    names = ("candidate", "baseline", "difference")
    return {name: _interval(cols[:, k].mean(), draws[:, k], confidence, cand.size) for k, name in enumerate(names)}


def ratio_bootstrap(numerator: np.ndarray, denominator: np.ndarray, resamples: int = 10_000, seed: int = 0,
                    confidence: float = 0.95) -> Interval:
    """Interval of ``sum(numerator) / sum(denominator)`` resampling units (e.g. text chunks).

    Token-weighted metrics (loss per token, bits per byte, agreement) are ratios of sums; resampling
    whole chunks keeps each chunk's tokens together.
    """
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    point = num.sum() / den.sum() if den.sum() else float("nan")
    draws = bootstrap_means(np.stack([num, den], axis=1), resamples, seed)
    ratios = draws[:, 0] / np.where(draws[:, 1] == 0, np.nan, draws[:, 1])
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return Interval(float(point), float("nan"), float("nan"), float("nan"), confidence, num.size)
    return _interval(point, ratios, confidence, num.size)


def detectable_effect(se: float, alpha: float = 0.05, power: float = 0.80) -> float:
    """Smallest true mean difference a two-sided level-``alpha`` test finds with ``power``: ``(z_{1-α/2}+z_{power})·SE``."""
    z = NormalDist()
    return (z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * se
