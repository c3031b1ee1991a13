"""The distill recipe under each backend: ``final/`` gathered from the ZeRO-3 shards whatever the launch config says
about 16-bit saves; checkpoints that say which backend wrote them, so that a resume under another one is refused
before any model loads instead of failing in the engine's loader or at its first step; a launch config's own
gradient accumulation refused; DDP training a distillation whose terms leave some weights without a gradient."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from core.checkpoint import CheckpointError
from distill.distributed import configure_deepspeed
from distill.training import BACKENDS, BackendMismatch, check_resume_backend, checkpoint_backend
from tests.helpers import ROOT


def _accelerator(ds_config: dict | None = None, fsdp: bool = False) -> SimpleNamespace:
    plugin = None if ds_config is None else SimpleNamespace(deepspeed_config=ds_config, zero_stage=None)
    state = SimpleNamespace(deepspeed_plugin=plugin, fsdp_plugin=object() if fsdp else None)
    return SimpleNamespace(state=state, distributed_type="DistributedType.X", mixed_precision="no")


# --- fast checks ----------------------------------------------------------------------------------------------

def test_zero3_is_told_to_gather_whole_weights_on_save_and_zero2_is_left_alone():
    """accelerate leaves ``stage3_gather_16bit_weights_on_model_save`` off when a launch config omits
    ``zero3_save_16bit_model``; then ``accelerator.get_state_dict`` refuses, after the whole run has trained."""
    zero3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}
    configure_deepspeed(_accelerator(zero3), micro_batch_size=2, max_grad_norm=0.5)
    assert zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero3["train_micro_batch_size_per_gpu"] == 2 and zero3["gradient_clipping"] == 0.5
    zero2 = {"zero_optimization": {"stage": 2}}
    configure_deepspeed(_accelerator(zero2), micro_batch_size=2, max_grad_norm=1.0)
    assert zero2["zero_optimization"] == {"stage": 2}


@pytest.mark.parametrize("ds_config,fsdp,expected", [
    (None, False, "plain"),
    ({"zero_optimization": {"stage": 1}}, False, "deepspeed zero-1/2"),
    ({"zero_optimization": {"stage": 2}}, False, "deepspeed zero-1/2"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, False, "deepspeed zero-3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "nvme_path": None}}}, False,
     "deepspeed zero-3"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, False,
     "deepspeed zero-3 + optimizer offload"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, False,
     "deepspeed zero-1/2 + optimizer offload"),
    # accelerate keeps the recipe's own optimizer when told not to force DeepSpeed's CPU Adam
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False},
     False, "deepspeed zero-3"),
    (None, True, "fsdp"),
])
def test_checkpoint_backend_names_the_file_layout(ds_config, fsdp, expected):
    assert checkpoint_backend(_accelerator(ds_config, fsdp)) == expected
    assert expected in BACKENDS
    assert checkpoint_backend(SimpleNamespace(num_processes=1)) is None  # nothing to tell it by


def test_resume_under_another_backend_is_refused_naming_the_launch_config(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "backend": "deepspeed zero-3"}))
    check_resume_backend(tmp_path, "deepspeed zero-3")
    check_resume_backend(tmp_path, None)
    with pytest.raises(BackendMismatch, match=r"written under DeepSpeed ZeRO-3 but this run is launched under "
                                              r"DDP or a single process .*launch/deepspeed_zero3.yaml") as err:
        check_resume_backend(tmp_path, "plain")
    assert isinstance(err.value, CheckpointError) and "\n" not in str(err.value)
    # Its optimizer state loads under optimizer offload, whose CPU Adam then fails at the first step.
    with pytest.raises(BackendMismatch, match=r"launched under DeepSpeed ZeRO-3 with the optimizer offloaded; .*"
                                              r"launch with launch/deepspeed_zero3.yaml to resume it$"):
        check_resume_backend(tmp_path, "deepspeed zero-3 + optimizer offload")
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2}))  # written before the backend was recorded
    check_resume_backend(tmp_path, "plain")


def test_a_launch_that_sets_its_own_gradient_accumulation_is_refused_before_anything(tmp_path, monkeypatch):
    """``accelerate launch`` exports a launch config's ``gradient_accumulation_steps`` as this variable (the
    DeepSpeed section ``accelerate config`` writes holds one), and ``Accelerator`` takes it over the recipe's: a
    ZeRO-2 launch with 1 there and grad_accum=2 stepped the optimizer and the LR schedule once per micro-batch (the
    summary's deepspeed block said 1, the logged LR ran down twice as fast)."""
    from distill import training
    from distill.config import RESUME_SAFE, DistillConfig, check_sources
    from tests.helpers import forbid

    forbid(monkeypatch, "refused only after the accelerator was built", (training, "Accelerator"))
    out = tmp_path / "run"
    args = ["--config", str(ROOT / "recipes" / "configs" / "tiny.yaml"), f"output_dir={out}", "grad_accum=2"]
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    with pytest.raises(training.ConfigError) as err:
        training.start_run(DistillConfig, args, resume_safe=RESUME_SAFE, check=check_sources)
    assert str(err.value) == (
        "the launch sets gradient_accumulation_steps=1 ($ACCELERATE_GRADIENT_ACCUMULATION_STEPS, from the launch "
        "config), which would override grad_accum=2; remove gradient_accumulation_steps from the launch config (the "
        "recipe's grad_accum sets it) or set grad_accum=1")
    assert not out.exists()
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")  # the same value is no conflict
    training.check_launch_grad_accum(2)


@pytest.mark.parametrize("weights,unused", [
    (dict(kd_weight=0.0, ce_weight=0.0, focal_weight=0.0), True),  # hidden/attention terms only
    (dict(kd_weight=1.0, ce_weight=0.0, focal_weight=0.0), False),
    (dict(kd_weight=0.0, ce_weight=0.0, focal_weight=0.5), False),
    (dict(kd_weight=0.0), False),  # a config without the logits terms' weights
])
def test_ddp_looks_for_unused_weights_only_when_no_term_reaches_the_logits(weights, unused):
    from distill.training import leaves_weights_unused

    assert leaves_weights_unused(SimpleNamespace(**weights)) is unused


# --- real launches ----------------------------------------------------------------------------------------------

def _error_lines(text: str) -> set[str]:
    """The one-line errors the ranks printed (two ranks writing at once can run theirs together on one line)."""
    return {f"error: {m}" for m in re.findall(r"error: (.+?)(?=error: |\n|$)", text)}


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_final_is_the_trained_shards_and_an_offload_resume_is_refused_before_loading(tmp_path):
    """A ZeRO-3 launch config without ``zero3_save_16bit_model`` (accelerate's default: off) still ends with a
    ``final/`` whose weights are the trained ones, as DeepSpeed's own consolidation of the last checkpoint's
    per-rank shards gives them. Its checkpoint records the backend, and resuming it with the optimizer offloaded
    (launch/deepspeed_zero3_offload.yaml) stops at start with one line naming the launch config: it loaded, then
    failed at the first step inside DeepSpeed's CPU Adam (``KeyError: 'bias_correction'``). Under DDP it failed in
    the loader, after the models were built, sending the user to an older checkpoint of the same layout."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.test_distributed import EXIT_ABORT, LAUNCH, _accelerate_bin, _launch, _launch_env

    launch = yaml.safe_load((LAUNCH / "deepspeed_zero3.yaml").read_text())
    del launch["deepspeed_config"]["zero3_save_16bit_model"]
    config = tmp_path / "zero3_no_16bit_save.yaml"
    config.write_text(yaml.safe_dump(launch))
    out = tmp_path / "run"
    args = [str(ROOT / "recipes" / "distill.py"), "--config", str(ROOT / "recipes" / "configs" / "tiny.yaml"),
            f"output_dir={out}", "max_steps=2", "save_every=1", "keep_checkpoints=2", "eval_every=0", "eval_blocks=4",
            "seed=0"]
    _launch(str(config), args, cpu_ddp=False)  # LAUNCH / an absolute path is that path

    step = out / "checkpoints" / "step-2"
    assert json.loads((step / "trainer_state.json").read_text())["backend"] == "deepspeed zero-3"
    shards = get_fp32_state_dict_from_zero_checkpoint(str(step), tag="pytorch_model")
    final = load_file(str(out / "final" / "model.safetensors"))
    assert final.keys() == {k[len("student."):] for k in shards if k.startswith("student.")}
    for key, weight in final.items():
        torch.testing.assert_close(weight, shards[f"student.{key}"], rtol=0, atol=0)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 2 and torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7]])).logits).all()

    cmd = [*_accelerate_bin(), "--config_file", str(LAUNCH / "deepspeed_zero3_offload.yaml"), "--main_process_port",
           "0", "--num_processes", "2", "--mixed_precision", "no", *args, f"resume={out / 'checkpoints' / 'step-1'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_launch_env(cpu_ddp=False), capture_output=True, text=True, timeout=420)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and EXIT_ABORT not in text
    errors = _error_lines(text)
    assert errors == {f"error: checkpoint {out / 'checkpoints' / 'step-1'} was written under DeepSpeed ZeRO-3 but this run is launched under "
                      f"{BACKENDS['deepspeed zero-3 + optimizer offload'][0]}; each backend saves the model and "
                      f"optimizer in its own layout: launch with launch/deepspeed_zero3.yaml to resume it"}, text[-3000:]
    assert "threads:" not in text  # refused before the threads are set up and the models load
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert Path(out / "final" / "model.safetensors").is_file()



@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_trains_hidden_state_only_distillation_leaving_the_unreached_weights_alone(tmp_path):
    """kd, ce and focal weights 0, one hidden-state pair (student layer 0 to teacher layer 1): the head, the final
    norm and student layer 1 get no gradient. DDP stopped at the second step ("Expected to have finished reduction
    in the prior iteration"); DeepSpeed trained. Now DDP trains too, and those weights stay as derived."""
    from safetensors.torch import load_file

    from core.tiny import tiny_teacher
    from tests.test_distributed import _launch

    out = tmp_path / "run"
    _launch("cpu_ddp_2proc.yaml", [str(ROOT / "recipes" / "distill.py"), "--config",
                                   str(ROOT / "recipes" / "configs" / "tiny.yaml"), f"output_dir={out}", "max_steps=2",
                                   "save_every=0", "eval_every=0", "eval_blocks=2", "kd_weight=0", "ce_weight=0",
                                   "focal_weight=0", "attn_weight=0", "hidden_weight=1", "hidden_layers=[0:1]"],
            cpu_ddp=True)
    losses = [json.loads(line)["hidden"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(0 < x < float("inf") for x in losses)
    final, teacher = load_file(str(out / "final" / "model.safetensors")), tiny_teacher(0).state_dict()
    # keep_layers "0,3": student layer 1 is teacher layer 3; the head and the final norm are the teacher's
    for key, source in [("lm_head.weight", "lm_head.weight"), ("model.norm.weight", "model.norm.weight"),
                        ("model.layers.1.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight")]:
        assert torch.equal(final[key], teacher[source]), key
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(final[key], teacher[key])  # the matched layer trained
