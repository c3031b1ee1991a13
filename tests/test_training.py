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


# --------------------------------------------------------------------------------------------
# The records a run keeps while it runs: metrics.jsonl (one line per step) and loss.png, redrawn at each held-out
# evaluation, each checkpoint and before a divergence stops the run.
# --------------------------------------------------------------------------------------------

def _distill(args: list[str], check: bool = True):
    import subprocess
    import sys

    from tests.helpers import ROOT, child_env

    proc = subprocess.run([sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml", *args],
                          cwd=ROOT, capture_output=True, text=True, env=child_env(), timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _history(out, step: int) -> list[dict]:
    return json.loads((out / "checkpoints" / f"step-{step}" / "trainer_state.json").read_text())["history"]


def _is_png(path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_a_run_writes_one_metrics_line_per_step_matching_the_losses_it_logged(tmp_path):
    out = tmp_path / "run"
    _distill([f"output_dir={out}", "max_steps=4", "save_every=2", "eval_every=2"])
    lines, history = _metrics(out), _history(out, 4)
    assert [line["step"] for line in lines] == [1, 2, 3, 4] == [h["step"] for h in history]
    for line, h in zip(lines, history):
        assert {k: line[k] for k in h} == h  # lr and every loss term, exactly as the run booked them
        assert line["tokens"] == 2 * 1 * 64  # micro_batch_size × grad_accum × seq_len, one process
        assert line["step_s"] > 0 and line["tokens_per_s"] == pytest.approx(line["tokens"] / line["step_s"])
        assert line["time"] > 1.6e9
    assert {"loss", "kd", "ce", "lr"} <= set(lines[-1])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] == lines[-1]["loss"]
    assert _is_png(out / "loss.png") and not list(out.glob(".loss.png.*"))  # no temp name left behind


@pytest.mark.slow
def test_a_run_that_diverges_leaves_its_loss_curve_and_its_metrics(tmp_path):
    """No checkpoint and no evaluation during the loop: the plot on disk is the one drawn at the divergence."""
    out = tmp_path / "nan"
    proc = _distill([f"output_dir={out}", "max_steps=6", "save_every=0", "eval_every=0", "lr=1e30",
                     "max_grad_norm=0"], check=False)
    assert proc.returncode != 0 and "loss became" in proc.stderr
    assert not (out / "summary.json").exists()  # it did stop before the end
    lines = _metrics(out)
    *good, bad = lines
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert bad["diverged"] is True and bad["loss"] is None  # strict JSON: the non-finite loss as null
    assert f"at step {bad['step']}" in proc.stderr
    assert all(isinstance(line["loss"], float) and "diverged" not in line for line in good)
    assert _is_png(out / "loss.png")


@pytest.mark.slow
def test_a_resumed_run_has_each_step_once_in_its_metrics(tmp_path):
    """Killed after step 5 with its last checkpoint at step 4: the resume drops the line of step 5 (it runs
    again), keeps those of steps 1-4 as written, and the file ends with each of steps 1-6 once."""
    out = tmp_path / "killed"
    common = [f"output_dir={out}", "max_steps=6", "save_every=2", "eval_every=3"]
    proc = _distill([*common, "debug_exit_at_step=5"], check=False)
    assert proc.returncode == 137
    before = _metrics(out)
    assert [line["step"] for line in before] == [1, 2, 3, 4, 5]
    assert _is_png(out / "loss.png")  # drawn mid-run (evaluation at step 3, checkpoints at 2 and 4)
    with open(out / "metrics.jsonl", "a") as f:  # a kill in the middle of a write
        f.write('{"step": 6, "lo')
    _distill([*common, "resume=latest"])
    after = _metrics(out)
    assert [line["step"] for line in after] == [1, 2, 3, 4, 5, 6]
    assert after[:4] == before[:4]  # the checkpoint's steps keep their lines, timings included
    assert after[4]["time"] > before[4]["time"]  # step 5 is the resumed run's, not the killed one's
    for line, h in zip(after, _history(out, 6)):
        assert {k: line[k] for k in h} == h


def _bare_run(tmp_path, history=(), max_steps=5):
    """A :class:`distill.training.Run` on the main process of a fake accelerator (no model, no data)."""
    cfg = SimpleNamespace(output_dir=str(tmp_path), max_steps=max_steps, tracker="none", log_every=1,
                          teacher="tiny", resume=None)
    run = training.Run(cfg, _MainProcess(), tracker_project="test", progress="test")
    run.state.history = [dict(h) for h in history]
    run.state.step = len(history)
    return run


def test_a_resume_keeps_the_metrics_of_the_checkpoints_steps_and_drops_those_after_it(tmp_path):
    history = [{"step": s, "lr": 1e-3, "loss": 4.0 - s / 10} for s in (1, 2, 3, 4)]
    written = [{**history[0], "time": 1.0}, {**history[1], "time": 2.0},
               {**history[2], "loss": 9.9, "time": 3.0},  # another run's step 3 (one resumed from an older step)
               {"step": 5, "lr": 1e-3, "loss": 3.4, "time": 5.0}, {"step": 6, "lr": 1e-3, "loss": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in written) + '{"step": 7, "lo')
    run = _bare_run(tmp_path, history)
    run.resume_metrics()
    # step 4's line was lost (the file's tail never reached the disk): written again from the checkpoint
    assert _metrics(tmp_path) == [written[0], written[1], history[2], history[3]]
    _bare_run(tmp_path).resume_metrics()  # a fresh run starts an empty file
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_loss_png_is_redrawn_at_each_evaluation_and_before_a_divergence_stops_the_run(tmp_path, monkeypatch):
    import distill.plots
    from core.checkpoint import TrainingDiverged

    drawn = []
    monkeypatch.setattr(distill.plots, "plot_training", lambda history, evals, path, title="", diverged_at=None:
                        drawn.append((len(history), len(evals), diverged_at, path.name)))
    run = _bare_run(tmp_path)
    run.state.evals.append({"step": 0, "perplexity": 9.0})  # at init: drawn with the first new one
    run.resume_metrics()
    with pytest.raises(TrainingDiverged):
        for step in run.steps():
            loss = float("nan") if step == 3 else 2.0
            run.record(step, {"loss": loss, "kd": loss}, 1e-3, tokens=8)
            if step == 1:
                run.state.evals.append({"step": 2, "perplexity": 8.0})
    assert drawn == [(2, 2, None, "loss.png"), (3, 2, 4, "loss.png")]
    lines = _metrics(tmp_path)
    assert [(line["step"], line["loss"], line.get("diverged")) for line in lines] == [
        (1, 2.0, None), (2, 2.0, None), (3, 2.0, None), (4, None, True)]


# --------------------------------------------------------------------------------------------
# Distributed runs: the process group's timeout, the barrier before the gate, resuming on another world size.
# --------------------------------------------------------------------------------------------

def _handlers(monkeypatch, cuda: bool, world: int) -> list:
    """The kwargs handlers :func:`distill.training.make_accelerator` gives accelerate (no process group starts)."""
    seen = {}

    class FakeAccelerator:
        from accelerate.utils import DistributedType

        num_processes = world
        distributed_type = DistributedType.MULTI_GPU if world > 1 else DistributedType.NO

        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(training, "Accelerator", FakeAccelerator)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    training.make_accelerator(SimpleNamespace(mixed_precision="no", grad_accum=1, tracker="none"), "out")
    return seen["kwargs_handlers"]


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_every_process_group_waits_hours_at_a_barrier_not_nccls_ten_minutes(monkeypatch, cuda, world):
    """Rank 0 alone may prepare a corpus or run a long check while the others wait: NCCL's default of 10 minutes
    would abort them. Every backend gets the toolkit's timeout (3 hours; $HYBRID_DISTILL_DIST_TIMEOUT)."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    from core.config import ConfigError

    ENV = "HYBRID_DISTILL_DIST_TIMEOUT"
    monkeypatch.delenv(ENV, raising=False)
    (handler,) = [h for h in _handlers(monkeypatch, cuda, world) if isinstance(h, InitProcessGroupKwargs)]
    kwargs = handler.to_kwargs()  # what accelerate passes to init_process_group (values differing from its defaults)
    assert kwargs["timeout"] == timedelta(hours=3)
    if world > 1 and not cuda:
        assert kwargs["backend"] == "gloo"
    else:
        assert "backend" not in kwargs  # accelerate's own choice (NCCL on GPUs)

    monkeypatch.setenv(ENV, "7200")
    (handler,) = _handlers(monkeypatch, cuda, world)
    assert handler.to_kwargs()["timeout"] == timedelta(hours=2)
    for bad in ("soon", "0", "-5", "inf"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ConfigError) as err:
            _handlers(monkeypatch, cuda, world)
        assert ENV in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("main", [True, False])
def test_the_ranks_meet_before_the_gate_so_none_waits_for_it(tmp_path, monkeypatch, main):
    events = []

    class Rank:
        is_main_process = main

        def wait_for_everyone(self) -> None:
            events.append("barrier")

    def gate(cfg, out, summary):
        events.append("gate")
        return {"verdict": "pass", "exit_code": 0, "report": "gate/report.md"}

    monkeypatch.setattr(training, "gate_against_teacher", gate)
    training.finish_run(SimpleNamespace(gate=True), Rank(), tmp_path, {"loss": 1.0}, lambda s, out: events.append("print"))
    assert events == (["barrier", "gate", "print"] if main else ["barrier"])
    assert (tmp_path / "summary.json").is_file() == main


@pytest.mark.slow
def test_a_resume_keeps_the_global_batch_and_may_change_the_number_of_processes(tmp_path, monkeypatch):
    """The data order and a token budget's step count follow the global batch (micro_batch_size × grad_accum ×
    processes): a resume that changes it is refused before any model loads, naming a split that keeps it. The
    number of processes may change with the global batch kept, where the checkpoint holds the whole optimizer
    state (one process or DDP), not where it is saved per process (DeepSpeed). An older checkpoint, without the
    record, resumes unchecked."""
    from core.config import ConfigError
    from distill.config import RESUME_SAFE, DistillConfig, check_sources
    from tests.helpers import ROOT

    out = tmp_path / "run"
    _distill([f"output_dir={out}", "max_steps=2", "save_every=2", "eval_every=0"])
    state_path = out / "checkpoints" / "step-2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    assert state["num_processes"] == 1 and state["global_batch"] == 2  # micro_batch_size 2 × grad_accum 1 × 1
    assert state["backend"] == "plain"

    def start(world: int, *extra: str):
        monkeypatch.setattr(training, "make_accelerator", lambda cfg, out: SimpleNamespace(
            num_processes=world, is_main_process=True, wait_for_everyone=lambda: None))
        monkeypatch.setattr(training, "setup_threads", lambda *args: None)
        return training.start_run(DistillConfig, ["--config", str(ROOT / "recipes/configs/tiny.yaml"),
                                                  f"output_dir={out}", "resume=latest", "max_steps=4", *extra],
                                  resume_safe=RESUME_SAFE, check=check_sources)

    def refused(world: int, *extra: str) -> str:
        with pytest.raises(ConfigError) as err:
            start(world, *extra)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert ("trained on 2 blocks per step but this run takes 4; the data order and step count depend on it: set "
            "micro_batch_size=1 grad_accum=1 (micro_batch_size × grad_accum × 2 processes = 2)") in refused(2)
    assert "set micro_batch_size=2 grad_accum=1 (micro_batch_size × grad_accum × 1 process = 2)" in refused(
        1, "grad_accum=2")
    assert "launch with a number of processes that divides 2" in refused(4, "micro_batch_size=1")
    start(2, "micro_batch_size=1")  # two processes taking one block each: the same data order
    start(1, "micro_batch_size=1", "grad_accum=2")  # one process, two micro-batches of one block

    state_path.write_text(json.dumps({**state, "backend": "deepspeed zero-3"}))
    assert ("written by 1 process but this run has 2, and DeepSpeed ZeRO-3 saves the optimizer state per process: "
            "launch with 1 process (accelerate launch --num_processes 1) to resume it") in refused(
        2, "micro_batch_size=1")
    start(1)  # the same world size passes whatever the backend (check_resume_backend checks that)

    older = {k: v for k, v in state.items() if k not in ("num_processes", "global_batch", "backend")}
    state_path.write_text(json.dumps(older))  # a checkpoint from before the record: accepted
    start(2)
    state_path.write_text(json.dumps(state))

    proc = _distill([f"output_dir={out}", "resume=latest", "max_steps=4", "save_every=2", "eval_every=0"])
    assert f"resumed from {out / 'checkpoints' / 'step-2'} at step 2" in proc.stdout
    assert "note: the checkpoint was written by" not in proc.stdout
    assert json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())["num_processes"] == 1


def test_the_fix_for_a_changed_global_batch_keeps_each_process_micro_batch_when_it_can():
    fix = training._global_batch_fix
    assert fix(8, 2, 2) == "set micro_batch_size=2 grad_accum=2 (micro_batch_size × grad_accum × 2 processes = 8)"
    assert fix(8, 2, 3).startswith("set micro_batch_size=2 grad_accum=2")  # 3 does not divide 4 blocks per process
    assert fix(12, 1, 5).startswith("set micro_batch_size=4 grad_accum=3")
    assert fix(6, 4, 1).startswith("launch with a number of processes that divides 6")


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard"])
def test_a_tracker_whose_package_is_missing_is_refused_naming_the_extra(monkeypatch, tracker):
    """accelerate only warns when a tracker's package is missing, and the run then logs nowhere and exits 0."""
    monkeypatch.setitem(training.TRACKER_AVAILABLE, tracker, lambda: False)
    monkeypatch.setattr(training, "Accelerator", lambda **kwargs: pytest.fail("refused before accelerate starts"))
    with pytest.raises(training.ConfigError, match=rf'pip install -e "\.\[{tracker}\]"'):
        training.make_accelerator(SimpleNamespace(mixed_precision="no", grad_accum=1, tracker=tracker), "out")


def test_an_installed_tracker_reaches_accelerate(monkeypatch):
    seen = {}
    monkeypatch.setitem(training.TRACKER_AVAILABLE, "wandb", lambda: True)
    monkeypatch.setattr(training, "Accelerator", lambda **kwargs: seen.update(kwargs) or SimpleNamespace(num_processes=1))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    training.make_accelerator(SimpleNamespace(mixed_precision="no", grad_accum=1, tracker="wandb"), "out")
    assert seen["log_with"] == "wandb"


def test_a_divergence_after_resuming_an_older_step_names_a_checkpoint_before_it(tmp_path):
    """After resume=step-2 the abandoned step-6 is still on disk: resume=latest would go back past the divergence."""
    from core.checkpoint import COMPLETE, TrainingDiverged, checkpoint_root

    for n in (2, 6):
        folder = checkpoint_root(tmp_path) / f"step-{n}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
        (folder / COMPLETE).write_text("")
    run = _bare_run(tmp_path)
    run.resume_metrics()
    with pytest.raises(TrainingDiverged) as err:
        run.record(3, {"loss": float("nan"), "kd": float("nan")}, 1e-3, tokens=8)
    msg = str(err.value)
    assert "step-2" in msg and "step-6" not in msg and "resume=latest" not in msg
    assert f"resume={checkpoint_root(tmp_path) / 'step-2'}" in msg


def test_a_run_puts_back_final_that_a_kill_inside_its_replacement_left_aside(tmp_path, monkeypatch):
    """Killed between replace_dir's renames while writing ``final/``, a run left its previous model only under
    ``.old-final-<hex>``: the next start (the resume) puts it back, so a rerun's save replaces it as usual and
    nothing is orphaned."""
    monkeypatch.setattr(training, "save_config", lambda cfg, path: None)
    aside = tmp_path / ".old-final-0a1b2c3d"
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    (aside / "model.safetensors").write_bytes(b"weights")
    _bare_run(tmp_path).begin()
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == b"weights" and not aside.exists()


@pytest.mark.parametrize("processes, kind, refused", [(1, "NO", True), (2, "NO", True), (2, "MULTI_CPU", False)])
def test_processes_launched_apart_are_refused(monkeypatch, tmp_path, processes, kind, refused):
    """Several processes launched (WORLD_SIZE 2) that accelerate does not join: counted as one (a multi-GPU launch
    on CPUs without ACCELERATE_USE_CPU) or as two with no backend (an FSDP launch on CPUs). Each would train its own
    copy on its share of the data. Joined (MULTI_CPU) they run."""
    from accelerate.utils import DistributedType

    from core.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    monkeypatch.setattr(training, "Accelerator", lambda **kw: SimpleNamespace(
        num_processes=processes, distributed_type=DistributedType[kind]))
    cfg = SimpleNamespace(mixed_precision="no", grad_accum=1, tracker="none")
    if refused:
        with pytest.raises(ConfigError, match="runs them apart"):
            training.make_accelerator(cfg, tmp_path)
    else:
        assert training.make_accelerator(cfg, tmp_path).num_processes == 2


def test_save_hf_dir_writes_an_inference_config_and_leaves_training_as_it_was(tmp_path):
    """Training runs with the KV cache off; final/ is for inference, so its config has it on, and the live model
    goes on training with it off."""
    from core.tiny import tiny_model, tiny_tokenizer

    model = tiny_model(layers=1)
    model.config.use_cache = False
    training.save_hf_dir(_MainProcess(), model, tiny_tokenizer(), tmp_path / "final")
    assert json.loads((tmp_path / "final" / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False
