"""distill/training.py's end of a run: the release gate's verdict decides the exit code, and a retrofit's
gate judges the pass-key retrieval its closing check measured."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import distill.training as training
from core.tiny import TINY


class _MainProcess:
    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass


@pytest.mark.parametrize("verdict, code", [("pass", None), ("fail", 1), ("inconclusive", 1)])
def test_a_gate_that_does_not_pass_ends_the_run_with_exit_1_after_writing_everything(tmp_path, monkeypatch, capsys,
                                                                                     verdict, code):
    monkeypatch.setattr(training, "gate_against_teacher",
                        lambda cfg, out, summary: {"verdict": verdict, "exit_code": 0, "report": "gate/report.md"})
    printed = []
    cfg = SimpleNamespace(gate=True)
    if code is None:
        training.finish_run(cfg, _MainProcess(), tmp_path, {"loss": 1.0}, lambda s, out: printed.append(s))
    else:
        with pytest.raises(SystemExit) as stop:
            training.finish_run(cfg, _MainProcess(), tmp_path, {"loss": 1.0}, lambda s, out: printed.append(s))
        assert stop.value.code == code
        assert f"release gate says {verdict.upper()}" in capsys.readouterr().err
    assert json.loads((tmp_path / "summary.json").read_text())["gate"]["verdict"] == verdict
    assert printed and printed[0]["gate"]["verdict"] == verdict


def test_a_retrofit_gate_judges_the_retrieval_its_closing_check_measured(tmp_path, monkeypatch):
    seen = {}

    def fake_gate(cfg, longctx=None):
        seen["cfg"], seen["longctx"] = cfg, longctx
        return SimpleNamespace(verdict="fail", exit_code=1, report_md=tmp_path / "gate" / "report.md")

    monkeypatch.setattr(training, "run_gate", fake_gate)
    summary = {"longctx": {"hybrid": {"256": 0.4, "512": 0.2}, "dense": {"256": 1.0, "512": 0.8},
                           "depths": [0.1, 0.5, 0.9], "trials": 3}}
    cfg = SimpleNamespace(teacher=TINY, seed=0, gate_prompts=100, longctx_lengths=[256, 512])
    out = training.gate_against_teacher(cfg, tmp_path, summary)
    assert out["verdict"] == "fail"
    assert seen["cfg"].longctx == "256,512" and seen["cfg"].longctx_trials == 3
    assert seen["longctx"]["candidate"]["accuracy"] == {"256": 0.4, "512": 0.2}
    assert seen["longctx"]["baseline"]["accuracy"] == {"256": 1.0, "512": 0.8}
    # distill (no retrieval check) gates on the prompts alone
    training.gate_against_teacher(SimpleNamespace(teacher=TINY, seed=0, gate_prompts=100), tmp_path, {"loss": 1})
    assert seen["cfg"].longctx is None and seen["longctx"] is None


def test_token_weights_make_equal_counts_exactly_one_and_skip_uncounted_micro_batches():
    from distill.training import target_count, token_weights

    acc = SimpleNamespace(device="cpu", reduce=lambda t, reduction: t)  # one process
    assert token_weights(acc, [15, 15, 15]) == [1.0, 1.0, 1.0]
    assert token_weights(acc, [10, 30, None]) == [0.5, 1.5, 1.0]
    assert token_weights(acc, [0, 0]) == [0.0, 0.0]  # no targets at all: nothing to weigh, no division by 0
    mask = torch.tensor([[True, False, True, True], [False, False, False, True]])
    assert target_count(mask, (2, 4)) == 3 and target_count(None, (2, 4)) == 6


def test_with_token_weights_a_step_over_masked_micro_batches_is_the_token_mean_of_the_whole_batch(tmp_path):
    """Completion-only masks leave micro-batches with different numbers of targets: the recipe's accelerator and
    train_step under SGD, 4 micro-batches of 1 row weighted by their targets, take the step of one batch's
    token mean; unweighted (a mean of micro-batch means) they do not."""
    from accelerate.state import AcceleratorState, GradientState

    from core.tiny import tiny_model
    from distill.training import make_accelerator, target_count, token_weights, train_step

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 320, (4, 16), generator=g)
    mask = torch.zeros(4, 16, dtype=torch.bool)
    for row, start in enumerate((2, 9, 13, 5)):  # assistant turns of 14, 7, 3 and 11 tokens
        mask[row, start:] = True
    labels = ids.masked_fill(~mask, -100)
    reference = tiny_model(seed=0, layers=2)
    reference(input_ids=ids, labels=labels).loss.backward()  # HF: a mean over the batch's non-ignored targets
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    want = reference.state_dict()

    def one_step(weighted: bool) -> dict[str, torch.Tensor]:
        acc = make_accelerator(SimpleNamespace(mixed_precision="no", grad_accum=4, tracker="none"), tmp_path)
        model = tiny_model(seed=0, layers=2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        model, opt, sched = acc.prepare(model, opt, sched)
        micro = list(zip(ids.split(1), labels.split(1), mask.split(1)))
        weights = token_weights(acc, [target_count(m, tuple(x.shape)) for x, _, m in micro]) if weighted else None

        def forward(batch):
            x, y, _ = batch
            return SimpleNamespace(loss=model(input_ids=x, labels=y).loss, terms=dict)

        train_step(acc, model, opt, sched, list(model.parameters()), micro, forward, grad_accum=4, max_grad_norm=0.0,
                   weights=weights)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    try:
        weighted, plain = one_step(True), one_step(False)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    for k in want:
        torch.testing.assert_close(weighted[k], want[k], rtol=1e-5, atol=1e-6)
    assert any((plain[k] - want[k]).abs().max() > 1e-4 for k in want)  # the bug this guards against is visible
