"""bench/distill_step.py: both variants run in every round, the order alternating, so load drift falls on both."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "bench_distill_step", Path(__file__).resolve().parents[1] / "bench" / "distill_step.py")
distill_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(distill_step)


def drifting_machine(monkeypatch: pytest.MonkeyPatch, slowdown: float) -> list[str]:
    """Stub workers on a machine that slows by ``slowdown`` per run; ours is truly 2x naive, 0.25x its peak."""
    calls: list[str] = []
    rate = {"naive": 100.0, "ours": 200.0}
    peak = {"naive": 800.0, "ours": 200.0}

    def fake(variant: str, seq: int, batch: int, steps: int, threads: int) -> dict:
        tps = rate[variant] / (1 + slowdown * len(calls))
        calls.append(variant)
        return {"variant": variant, "tokens_per_s": tps, "step_s": batch * seq / tps, "peak_rss_mb": peak[variant]}

    monkeypatch.setattr(distill_step, "run_worker", fake)
    return calls


def test_rounds_run_both_variants_with_the_order_swapped(monkeypatch):
    calls = drifting_machine(monkeypatch, 0.0)
    result = distill_step.compare(4, seq=16, batch=1, steps=1, threads=1)
    rounds = [calls[i:i + 2] for i in range(0, len(calls), 2)]
    assert rounds == [["naive", "ours"], ["ours", "naive"], ["naive", "ours"], ["ours", "naive"]]
    assert len(result["speedup_rounds"]) == 4
    assert result["speedup"] == pytest.approx(2.0) and result["rss_ratio"] == pytest.approx(0.25)


def test_ratio_survives_a_machine_that_slows_down(monkeypatch):
    """10 % slower per run: one run of each back to back reads 1.82x; swapped rounds recover the true 2x."""
    drifting_machine(monkeypatch, 0.1)
    result = distill_step.compare(4, seq=16, batch=1, steps=1, threads=1)
    assert result["speedup"] == pytest.approx(2.0, rel=0.03)
    # The median per variant, then the ratio: the JSON's speedup is that arithmetic, nothing else.
    med = {v: distill_step.median([r["tokens_per_s"] for r in result[v]["rounds"]]) for v in ("ours", "naive")}
    assert result["speedup"] == pytest.approx(med["ours"] / med["naive"])
    assert result["ours"]["tokens_per_s"] == pytest.approx(med["ours"])


def test_json_keys_and_bad_repeats(monkeypatch, capsys):
    import json

    drifting_machine(monkeypatch, 0.0)
    result = distill_step.main(["--repeats", "2", "--seq", "16", "--steps", "1", "--threads", "1"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("speedup", "speedup_rounds", "rss_ratio", "ours", "naive", "seq", "batch", "repeats"):
        assert key in last
    assert last["speedup"] == pytest.approx(result["speedup"])
    with pytest.raises(SystemExit, match="at least 1"):
        distill_step.main(["--repeats", "0"])
