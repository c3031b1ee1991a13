"""distill/training.py's end of a run: the release gate's verdict decides the exit code, and a retrofit's
gate judges the pass-key retrieval its closing check measured."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

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
