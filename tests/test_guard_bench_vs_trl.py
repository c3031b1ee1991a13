"""bench/vs_trl.py: both sides run in every round, the order alternating, and the ratio is of the medians."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("bench_vs_trl", Path(__file__).resolve().parents[1] / "bench" / "vs_trl.py")
vs_trl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs_trl)


def drifting_sides(monkeypatch: pytest.MonkeyPatch, slowdown: float) -> list[str]:
    """Stub runs on a machine that slows by ``slowdown`` per run; ours is truly 1.5x TRL's tokens/s."""
    calls: list[str] = []

    def side(name: str, rate: float, rss: float):
        def run(over: dict, threads: int, out: Path) -> dict:
            tps = rate / (1 + slowdown * len(calls))
            calls.append(name)
            return {"tokens_per_s": tps, "loop_s": 1000 / tps, "final_loss": 0.5, "losses": [0.7, 0.5],
                    "rss_train_gb": rss, "rss_whole_gb": rss + 0.1, "threads": threads}
        return run

    monkeypatch.setattr(vs_trl, "run_ours", side("ours", 150.0, 0.4))
    monkeypatch.setattr(vs_trl, "run_trl", side("trl", 100.0, 0.8))
    return calls


def test_a_side_on_another_thread_count_is_refused(monkeypatch, tmp_path):
    """Each side reports the threads it trained on; one that differs from the count asked for stops the bench."""
    drifting_sides(monkeypatch, 0.0)
    real = vs_trl.run_trl
    monkeypatch.setattr(vs_trl, "run_trl", lambda over, threads, out: {**real(over, threads, out), "threads": 2 * threads})
    with pytest.raises(SystemExit, match="trl ran on 2 threads, not the 1 asked for"):
        vs_trl.compare("tiny", {}, 1, tmp_path, 2)


def test_rounds_swap_which_side_runs_first(monkeypatch, tmp_path):
    calls = drifting_sides(monkeypatch, 0.0)
    r = vs_trl.compare("tiny", {}, 1, tmp_path, 4)
    assert [calls[i:i + 2] for i in range(0, 8, 2)] == [["ours", "trl"], ["trl", "ours"]] * 2
    assert r["speedup_rounds"] == pytest.approx([1.5] * 4)
    assert r["ours"]["rss_whole_gb"] == pytest.approx(0.5) and r["trl"]["rss_train_gb"] == pytest.approx(0.8)


def test_ratio_of_medians_survives_a_machine_that_slows_down(monkeypatch, tmp_path):
    """10 % slower per run: ours-then-TRL once reads 1.36x; swapped rounds recover the true 1.5x."""
    drifting_sides(monkeypatch, 0.1)
    r = vs_trl.compare("tiny", {}, 1, tmp_path, 4)
    speedup = r["ours"]["tokens_per_s"] / r["trl"]["tokens_per_s"]
    assert speedup == pytest.approx(1.5, rel=0.03)
    assert r["ours"]["tokens_per_s"] == pytest.approx(vs_trl.median(r["ours"]["tokens_per_s_rounds"]))


def test_both_sides_run_fp32_on_the_cpu_whatever_the_machine(monkeypatch, tmp_path):
    """TRL's side is pinned to the CPU; the recipe must not take a GPU (and bf16) where one exists."""
    import json
    import subprocess

    seen: list[tuple[list[str], dict]] = []

    def fake_run(cmd, cwd=None, capture_output=False, text=False, env=None, **kw):
        seen.append((cmd, env))
        if "--worker" in cmd:  # the TRL side prints its row
            return subprocess.CompletedProcess(cmd, 0, json.dumps({"tokens_per_s": 1.0}) + "\n", "")
        over = dict(a.split("=", 1) for a in cmd[2:] if "=" in a)
        out = Path(over["output_dir"])
        (out / "checkpoints" / "step-2").mkdir(parents=True)
        (out / "summary.json").write_text(json.dumps({"tokens_per_s": 1.0, "loop_s": 1.0, "final_loss": 0.5,
                                                      "peak_rss_gb": {"train": 0.1, "whole": 0.2}, "threads": 1}))
        (out / "checkpoints" / "step-2" / "trainer_state.json").write_text(json.dumps({"history": [{"loss": 0.5}]}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(vs_trl.subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    over = vs_trl.shape_overrides("tiny", 2, tmp_path)
    vs_trl.run_ours(over, 1, tmp_path / "ours")
    cmd, env = seen[0]
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert "mixed_precision=no" in cmd
    vs_trl.run_trl(over, 1, tmp_path / "trl")
    cmd, env = seen[1]
    assert "--worker" in cmd and env["CUDA_VISIBLE_DEVICES"] == ""
    assert json.loads(cmd[cmd.index("--worker") + 1])["over"]["mixed_precision"] == "no"
