"""The distill recipe driven through its real CLI on the tiny config."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "recipes/configs/tiny.yaml"]


def run(args, check=True, env=None):
    proc = subprocess.run([sys.executable, "recipes/distill.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


# Runs a recipe with one function replaced by one that fails if called: proves a resume reads back what the
# fresh run decided instead of deciding it again. argv: the function ("module:name"), the recipe, its arguments.
REFUSING = """import importlib, runpy, sys
module, name = sys.argv[1].split(":")
def refuse(*args, **kwargs):
    raise AssertionError(f"{module}.{name} ran again")
setattr(importlib.import_module(module), name, refuse)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_refusing(function: str, args, recipe: str = "recipes/distill.py", env=None):
    """``recipe`` run with ``args``, ``function`` ("module:name") failing the run if it is called."""
    proc = subprocess.run([sys.executable, "-c", REFUSING, function, recipe, *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "tiny"
    proc = run([*TINY, f"output_dir={out}", "max_steps=4", "save_every=2", "keep_checkpoints=1"])
    return out, proc


@pytest.mark.slow
def test_outputs_are_complete_and_deployable(tiny_run):
    out, proc = tiny_run
    summary = json.loads((out / "summary.json").read_text())
    for key in ("steps", "final_loss", "tokens_per_s", "teacher_ppl", "student_ppl_init", "student_ppl_final",
                "top1_agreement"):
        assert summary[key] is not None, key
    assert summary["steps"] == 4 and summary["num_processes"] == 1
    assert summary["environment"]["packages"]["torch"] == torch.__version__  # what the run ran under
    # issue 17: throughput over the training steps only, beside the wall time; peak memory per phase
    assert 0 < summary["loop_s"] < summary["wall_s"] and summary["threads"] >= 1
    assert summary["peak_rss_gb"]["whole"] >= summary["peak_rss_gb"]["train"] > 0
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "config.yaml").is_file()
    # keep_checkpoints=1: only the newest complete one remains, with everything resume and export need.
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-4"]
    step = out / "checkpoints" / "step-4"
    for name in ("COMPLETE", "trainer_state.json", "config.yaml", "student/config.json", "student/tokenizer.json"):
        assert (step / name).exists(), name
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 2
    keys = final_weights(out)
    assert not any("projector" in k for k in keys)
    assert (out / "final" / "tokenizer.json").is_file() and (out / "final" / "generation_config.json").is_file()
    assert "run folder" in proc.stdout and "held-out ppl" in proc.stdout


@pytest.mark.slow
def test_refuses_to_overwrite_a_run(tiny_run):
    out, _ = tiny_run
    before = (out / "summary.json").read_text()
    proc = run([*TINY, f"output_dir={out}"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error:") and "overwrite=true" in proc.stderr
    assert (out / "summary.json").read_text() == before


@pytest.mark.slow
def test_bad_input_exits_with_one_line(tmp_path):
    for args, needle in [(["max_stepz=1"], "did you mean max_steps"),
                         (["dataset=/no/such.jsonl"], "does not exist"),
                         (["seq_len=5000"], "exceeds the model's maximum"),
                         (["teacher=/no/such/model"], "does not exist"),
                         (["resume=/no/ckpt"], "does not exist")]:
        proc = run([*TINY, f"output_dir={tmp_path / 'o'}", *args], check=False)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and needle in last, (args, last)
        assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_resume_after_kill_equals_uninterrupted(tmp_path):
    common = [*TINY, "max_steps=6", "save_every=2", "eval_every=0"]
    full = tmp_path / "full"
    run([*common, f"output_dir={full}"])
    killed = tmp_path / "killed"
    proc = run([*common, f"output_dir={killed}", "debug_exit_at_step=5"], check=False)
    assert proc.returncode == 137
    assert not (killed / "final").exists()
    # A torn checkpoint left by a kill during saving must never be picked up.
    torn = killed / "checkpoints" / ".tmp-step-6"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"garbage")
    # The checkpoint records the environment it was written under; a resume under another one says what changed.
    state_file = killed / "checkpoints" / "step-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["environment"]["packages"]["torch"] == torch.__version__
    state["environment"]["packages"]["transformers"] = "0.0.1"
    state_file.write_text(json.dumps(state))
    proc = run([*common, f"output_dir={killed}", "resume=latest"])
    assert "written under another environment (transformers 0.0.1 -> " in proc.stdout
    a = json.loads((full / "summary.json").read_text())
    b = json.loads((killed / "summary.json").read_text())
    assert b["environment"] == a["environment"] and b["environment"]["packages"]["transformers"] != "0.0.1"
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-6, abs=1e-7)
    wa, wb = final_weights(full), final_weights(killed)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    assert not torn.exists()


@pytest.mark.slow
def test_pruned_student_resume_reads_the_searched_student_back(tmp_path):
    """``student_init=prune``: a resume takes the student (shape, kept units, the derived layer map) and the
    CE-only ablation's start from what the fresh run saved; the search, whose pick may differ on another
    machine, never runs again, and the run ends as an uninterrupted one does."""
    common = [*TINY, "student_init=prune", "target_ratio=0.5", "prune_search_steps=1", "prune_top_k=1",
              "prune_calib_blocks=4", "prune_eval_blocks=2", "attn_weight=0", "max_steps=4", "save_every=2",
              "eval_every=0", "compare_ce_only=true"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    run([*common, f"output_dir={full}"])
    assert run([*common, f"output_dir={killed}", "debug_exit_at_step=3"], check=False).returncode == 137
    searched = json.loads((killed / "pruned" / "config.json").read_text())
    assert (killed / "pruned" / "search.json").is_file() and searched["distill_pruning"]["kept_layers"]
    proc = run_refusing("distill.prune:search", [*common, f"output_dir={killed}", "resume=latest"])
    assert "calibrated on" not in proc.stdout and "searching the student again" not in proc.stdout
    config = json.loads((killed / "final" / "config.json").read_text())
    for key in ("distill_pruning", "distill_kept_layers", "num_hidden_layers", "hidden_size", "intermediate_size"):
        assert config[key] == searched[key], key
    a, b = (json.loads((p / "summary.json").read_text()) for p in (full, killed))
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-6, abs=1e-7)
    assert b["ce_only_ppl_final"] == pytest.approx(a["ce_only_ppl_final"], rel=1e-6)
    for sub in ("final", "ce_only/final"):
        wa, wb = (load_file(str(p / sub / "model.safetensors")) for p in (full, killed))
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_on_policy_resume_trains_on_the_rows_queued_at_the_checkpoint(tmp_path):
    """One rollout serves two on-policy steps (1 and 3); the checkpoint after step 2 holds the row step 3 needs.

    Rolled out afresh on resume (as before the queue was checkpointed), step 3 trains on another row and the
    final weights differ.
    """
    common = [*TINY, "max_steps=6", "save_every=2", "eval_every=0", "compare_ce_only=false",
              "on_policy_fraction=0.5", "gen_batch_size=1", "gen_rollout_rows=2", "gen_max_new_tokens=8",
              "gen_prompt_tokens=8"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    run([*common, f"output_dir={full}"])
    assert run([*common, f"output_dir={killed}", "debug_exit_at_step=3"], check=False).returncode == 137
    queued = json.loads((killed / "checkpoints" / "step-2" / "rank0_state.json").read_text())["queue"]
    assert len(queued) == 1 and len(queued[0][0]) == 8 and 0 < len(queued[0][1]) <= 8  # [prompt, continuation]
    run([*common, f"output_dir={killed}", "resume=latest"])
    a, b = (json.loads((p / "summary.json").read_text()) for p in (full, killed))
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-6, abs=1e-7)
    wa, wb = final_weights(full), final_weights(killed)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_grad_accum_equals_big_batch(tmp_path):
    common = [*TINY, "max_steps=2", "eval_every=0", "save_every=0", "attn_num_queries=64", "seq_len=32"]
    a, b = tmp_path / "a", tmp_path / "b"
    run([*common, f"output_dir={a}", "micro_batch_size=1", "grad_accum=8"])
    run([*common, f"output_dir={b}", "micro_batch_size=8", "grad_accum=1"])
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (a, b))
    assert sa["final_loss"] == pytest.approx(sb["final_loss"], rel=1e-5)
    wa, wb = final_weights(a), final_weights(b)
    # Adam moves every weight by ~lr = 1e-3 per step; summation-order noise stays 100x below that. Adam and
    # clipping are blind to a uniform gradient scale: test_grad_accum_scales_gradients_like_one_big_batch checks it.
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_grad_accum_scales_gradients_like_one_big_batch(tmp_path):
    """The recipe's accelerator and train_step under SGD without clipping: 4 micro-batches of 1, and one batch
    of 4, take the hand-computed step, so a wrong gradient scale (or a step per micro-batch) moves the weights
    by another amount."""
    from types import SimpleNamespace

    from accelerate.state import AcceleratorState, GradientState

    from core.tiny import tiny_model
    from distill.training import make_accelerator, train_step

    ids = torch.randint(3, 320, (4, 16), generator=torch.Generator().manual_seed(0))
    reference = tiny_model(seed=0, layers=2)  # plain SGD by hand: w - lr · ∇(mean loss over the 4 rows)
    init = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    reference(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    want = reference.state_dict()

    def one_step(micro: int, accum: int) -> dict[str, torch.Tensor]:
        acc = make_accelerator(SimpleNamespace(mixed_precision="no", grad_accum=accum, tracker="none"), tmp_path)
        model = tiny_model(seed=0, layers=2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        model, opt, sched = acc.prepare(model, opt, sched)

        def forward(rows):  # a mean over the micro-batch's tokens, as DistillModel's loss is
            return SimpleNamespace(loss=model(input_ids=rows, labels=rows).loss, terms=dict)

        train_step(acc, model, opt, sched, list(model.parameters()), ids.split(micro), forward, grad_accum=accum,
                   max_grad_norm=0.0)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    try:
        small, big = one_step(1, 4), one_step(4, 1)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert any((want[k] - init[k]).abs().max() > 1e-3 for k in want)  # the step is large next to the tolerance
    for k in want:
        torch.testing.assert_close(big[k], want[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(small[k], want[k], rtol=1e-5, atol=1e-6)


def test_an_fsdp_launch_is_refused_up_front_naming_ddp_and_deepspeed(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from core.config import ConfigError
    from recipes import distill

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` with an FSDP config exports
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="does not run under FSDP; launch with .*gpu_ddp.*ZeRO-2/3") as err:
        distill.main([*TINY, f"output_dir={out}"])
    assert "\n" not in str(err.value) and not out.exists()  # refused before the run folder is claimed
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    fsdp = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=object(), deepspeed_plugin=None), is_main_process=True)
    with pytest.raises(ConfigError, match="does not run under FSDP"):  # an Accelerator built in code
        distill.training_function(distill.DistillConfig(output_dir=str(out)), fsdp)


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_message_and_keeps_the_checkpoint(tmp_path):
    out = tmp_path / "nan"
    proc = run([*TINY, f"output_dir={out}", "max_steps=6", "save_every=1", "lr=1e30", "max_grad_norm=0",
                "eval_every=0"], check=False)
    assert proc.returncode != 0
    assert "loss became" in proc.stderr and "resume=latest" in proc.stderr
    assert (out / "checkpoints").is_dir()


@pytest.mark.slow
def test_teacher_cache_round_trip(tmp_path):
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "recipes/cache_teacher.py", "teacher=tiny-random", "seq_len=64",
                           "max_blocks=16", "topk=8", f"output_dir={cache}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["k"] == 8 and meta["bytes_per_token"] == 48 and "bytes/token" in proc.stdout
    cached = [*TINY, f"teacher_cache={cache}", "hidden_weight=0", "attn_weight=0", "max_steps=3",
              "save_every=0"]
    good = run([*cached, f"output_dir={tmp_path / 'good'}", "max_train_blocks=16"])
    summary = json.loads((tmp_path / "good" / "summary.json").read_text())
    assert summary["final_terms"]["kd"] > 0 and summary["teacher_ppl"] == pytest.approx(meta["teacher_ppl"])
    assert "Traceback" not in good.stderr
    # The cache only serves the exact packed data it was made from.
    bad = run([*cached, f"output_dir={tmp_path / 'bad'}"], check=False)
    assert bad.returncode == 2 and "other data" in bad.stderr


@pytest.mark.slow
def test_gate_at_the_end_against_the_teacher(tmp_path):
    out = tmp_path / "gated"
    proc = run([*TINY, f"output_dir={out}", "max_steps=2", "save_every=0", "gate=true", "gate_prompts=12"],
               check=False)
    summary = json.loads((out / "summary.json").read_text())
    verdict = summary["gate"]["verdict"]
    report = json.loads((out / "gate" / "report.json").read_text())
    assert report["verdict"] == verdict and "release gate" in proc.stdout
    # a CI job that trains with gate=true fails with its gate; the outputs are kept either way
    assert proc.returncode == (0 if verdict == "pass" else 1), proc.stderr[-2000:]
    if verdict != "pass":
        assert f"release gate says {verdict.upper()}" in proc.stderr.strip().splitlines()[-1]
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_tensorboard_tracker_and_gradient_checkpointing(tmp_path):
    out = tmp_path / "tb"
    run([*TINY, f"output_dir={out}", "max_steps=2", "save_every=0", "tracker=tensorboard",
         "gradient_checkpointing=true"])
    events = list(out.rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert json.loads((out / "summary.json").read_text())["student_ppl_final"] is not None


def test_source_checks_pass_what_only_loading_can_judge_and_refuse_missing_local_paths(tmp_path):
    from core.config import ConfigError
    from distill.config import DistillConfig, check_sources

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    # Built-in names, hub names (offline they can only be tried by loading) and existing paths all pass.
    for keys in ({}, {"teacher": "org/teacher", "student": "org/student", "tokenizer": "org/tok"},
                 {"teacher": "tiny-random", "student": str(model), "dataset": str(data), "eval_dataset": str(tmp_path)},
                 {"dataset": "org/hub-data", "eval_dataset": "HuggingFaceFW/fineweb-edu"},
                 {"datasets": [{"source": str(data), "weight": 2}, "builtin:stdlib-docs", "org/data"]},
                 {"teacher": "/no/teacher", "student": str(model), "teacher_cache": str(tmp_path), "hidden_weight": 0,
                  "attn_weight": 0}):  # with a cache and a student the teacher never loads
        check_sources(DistillConfig(**keys))
    for keys, says in (({"student": str(tmp_path / "nope")}, "student: model path"),
                       ({"student": str(tmp_path)}, "has no config.json"),
                       ({"dataset": "data/train.parquet"}, "dataset data/train.parquet does not exist"),
                       ({"datasets": ["org/data", {"source": "~/no/such.txt"}]}, "datasets source ~/no/such.txt"),
                       ({"dataset": None}, "no training data: set dataset= or datasets=")):
        with pytest.raises(ConfigError) as err:
            check_sources(DistillConfig(**keys))
        assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_a_kill_inside_the_ce_only_ablation_resumes_it_from_its_checkpoint(tmp_path):
    """The CE-only ablation checkpoints with the run's save_every; killed inside it (debug_exit_at_step past
    max_steps counts on into the ablation's steps), resume=latest finishes the run at once and the ablation from
    its last checkpoint, and ends as an uninterrupted run does. An ablation checkpoint written with other settings
    is not resumed: the ablation starts over, saying why."""
    import shutil
    import time

    import yaml

    common = [*TINY, "max_steps=4", "save_every=2", "eval_every=0", "compare_ce_only=true"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    run([*common, f"output_dir={full}"])
    assert run([*common, f"output_dir={killed}", "debug_exit_at_step=7"], check=False).returncode == 137
    ablation = killed / "ce_only"
    assert (killed / "checkpoints" / "step-4").is_dir()  # the run finished; its summary lacks the ablation
    assert "ce_only_ppl_final" not in json.loads((killed / "summary.json").read_text())
    assert [p.name for p in (ablation / "checkpoints").iterdir()] == ["step-2"] and not (ablation / "final").exists()
    # An ablation checkpoint with another config (here: its lr) is not resumed silently.
    stale = tmp_path / "stale"
    shutil.copytree(killed, stale)
    saved = stale / "ce_only" / "checkpoints" / "step-2" / "config.yaml"
    saved.write_text(yaml.safe_dump({**yaml.safe_load(saved.read_text()), "lr": 0.5}))

    started = time.time()
    proc = run([*common, f"output_dir={killed}", "resume=latest"])
    assert f"resumed from {ablation / 'checkpoints' / 'step-2'} at step 2" in proc.stdout
    lines = [json.loads(line) for line in (ablation / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [line["time"] < started for line in lines] == [True, True, False, False]  # only steps 3-4 trained again

    proc = run([*common, f"output_dir={stale}", "resume=latest"])
    assert "ablation: not resuming" in proc.stdout and "lr: 0.5 → 0.001" in proc.stdout
    assert "resumed from" not in proc.stdout.split("ablation:")[-1]

    a = json.loads((full / "summary.json").read_text())
    for out in (killed, stale):
        b = json.loads((out / "summary.json").read_text())
        for key in ("ce_only_ppl_final", "ce_only_top1_agreement", "ppl_ratio_vs_ce_only", "student_ppl_final"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), (out.name, key)
        wa, wb = (load_file(str(p / "ce_only" / "final" / "model.safetensors")) for p in (full, out))
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_ce_only_ablation_checkpoints_its_own_student_only(tmp_path):
    """The ablation starts from an accelerator freed of the distilled run: its checkpoints hold the CE-only
    student alone (the distilled model, optimizer and scheduler stayed registered beside it, doubling the memory
    and the checkpoints, and a resume loaded the distilled weights into the first slot). An ablation checkpoint
    written that way is not resumed: the CE-only student starts over, and ends as an uninterrupted one."""
    common = [*TINY, "max_steps=4", "save_every=2", "keep_checkpoints=2", "eval_every=0", "compare_ce_only=true"]
    out = tmp_path / "run"
    run([*common, f"output_dir={out}"])
    ablation = out / "ce_only" / "checkpoints"
    names = sorted(p.name for p in (ablation / "step-2").iterdir())
    assert "model.safetensors" in names and not [n for n in names if n.startswith(("model_1", "optimizer_1",
                                                                                   "scheduler_1"))], names
    ce, distilled = (load_file(str(p)) for p in (ablation / "step-2" / "model.safetensors",
                                                  out / "checkpoints" / "step-4" / "model.safetensors"))
    assert any(not torch.equal(ce[k], distilled[k]) for k in ce.keys() & distilled.keys())
    state = json.loads((ablation / "step-2" / "trainer_state.json").read_text())
    assert state["num_processes"] == 1 and [h["step"] for h in state["history"]] == [1, 2]
    first = json.loads((out / "summary.json").read_text())

    # A checkpoint as the older toolkit wrote it: the distilled model first, the CE-only student as model_1.
    older = ablation / "step-4"
    (older / "model.safetensors").rename(older / "model_1.safetensors")
    (older / "model.safetensors").write_bytes((out / "checkpoints" / "step-4" / "model.safetensors").read_bytes())
    proc = run([*common, f"output_dir={out}", "resume=latest"])
    assert "ablation: not resuming" in proc.stdout and "distilled student's weights" in proc.stdout
    assert "resumed from" not in proc.stdout.split("ablation:")[-1]
    again = json.loads((out / "summary.json").read_text())
    for key in ("ce_only_ppl_final", "ce_only_top1_agreement", "student_ppl_final"):
        assert again[key] == pytest.approx(first[key], rel=1e-6), key
