"""distill.training: the LR schedule past its end, and the loss a weighted step reports."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch


def test_the_schedule_warms_up_decays_and_stays_at_its_floor_past_max_steps():
    from distill.training import warmup_cosine

    f = warmup_cosine(4, 20, 0.1)
    assert [f(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    for s in range(4, 21):
        progress = (s - 4) / 16
        assert f(s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    # A run resumed with more steps than planned, or a last partial step, must not climb back up the cosine.
    assert [f(s) for s in (20, 21, 28, 36, 100)] == pytest.approx([0.1] * 5)


def test_a_weighted_step_reports_the_weighted_mean_of_its_micro_batch_terms(tmp_path):
    """``weights`` scale each micro-batch in the gradient and in the reported terms alike."""
    from accelerate.state import AcceleratorState, GradientState

    from distill.training import make_accelerator, train_step

    try:
        acc = make_accelerator(SimpleNamespace(mixed_precision="no", grad_accum=3, tracker="none"), tmp_path)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        model, opt, sched = acc.prepare(model, opt, sched)
        losses, weights = [0.5, 2.0, 4.0], [1.5, 0.25, 1.25]

        def forward(i):
            loss = model(torch.zeros(1, 2)).sum() * 0 + losses[i]
            return SimpleNamespace(loss=loss, terms=lambda: {"kd": 2 * losses[i]})

        got = train_step(acc, model, opt, sched, list(model.parameters()), range(3), forward, grad_accum=3,
                         max_grad_norm=0.0, weights=weights)
        plain = train_step(acc, model, opt, sched, list(model.parameters()), range(3), forward, grad_accum=3,
                           max_grad_norm=0.0)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    want = sum(w * x for w, x in zip(weights, losses)) / 3
    assert got["loss"] == pytest.approx(want) and got["kd"] == pytest.approx(2 * want)
    assert plain["loss"] == pytest.approx(sum(losses) / 3)
