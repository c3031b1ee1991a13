"""The sampler at its limits: tiny temperatures and nuclei never produce NaN or an empty distribution."""

from __future__ import annotations

import math

import pytest
import torch

from serve.sampling import MIN_TEMPERATURE, MIN_TOP_P, SamplingParams, sample


def test_shifted_scaling_equals_the_naive_distribution():
    """Subtracting the max before dividing by T changes nothing but the overflow."""
    logits = torch.randn(50) * 4
    params = SamplingParams(temperature=0.7, seed=0)
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample(logits, params, gen) for _ in range(4000)])
    empirical = torch.bincount(draws, minlength=50).float() / len(draws)
    torch.testing.assert_close(empirical, torch.softmax(logits / 0.7, -1), atol=0.03, rtol=0)


@pytest.mark.parametrize("temperature, top_p", [(MIN_TEMPERATURE, 1.0), (1.0, MIN_TOP_P), (MIN_TEMPERATURE, MIN_TOP_P),
                                                (1e-40, 1.0), (1.0, 1e-300)])
def test_extreme_settings_pick_the_top_token(temperature, top_p):
    """Also below the validated limits (set after construction): x / 1e-40 overflows, 1e-300 is 0 in fp32."""
    logits = torch.tensor([30.0, 29.0, -50.0, -1e4])
    params = SamplingParams(temperature=1.0, seed=1)
    params.temperature, params.top_p = temperature, top_p
    gen = torch.Generator().manual_seed(1)
    assert {sample(logits, params, gen) for _ in range(50)} == {0}


def test_non_finite_logits_raise_instead_of_sampling_garbage():
    with pytest.raises(FloatingPointError):
        sample(torch.tensor([0.0, math.nan]), SamplingParams(temperature=1.0), torch.Generator())


@pytest.mark.parametrize("kw, needle", [
    ({"temperature": 1e-40}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1e-300}, "top_p"), ({"top_p": math.nan}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"), ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_sampling_params_refuse_what_the_sampler_cannot_do(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)
