"""Teacher placement per backend, and real 2-process launches through `accelerate launch --config_file`.

The launch tests start actual process groups on the CPU (gloo): plain DDP from
``launch/cpu_ddp_2proc.yaml`` and DeepSpeed ZeRO-3 from ``launch/deepspeed_zero3.yaml`` (overridden
to 2 processes without mixed precision). DeepSpeed compiles a shared-memory communication op on first
use (~30-60 s); ``TORCH_EXTENSIONS_DIR`` points at the session cache from ``conftest.py`` so the
compile happens once per test session.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core.tiny import tiny_model
from distill.distributed import (
    gather_params,
    is_zero3,
    prepare_teacher,
    teacher_deepspeed_config,
    unwrap_teacher,
    zero_stage,
)
from tests.helpers import ROOT, child_env

LAUNCH = ROOT / "launch"


# --- fast checks without launching ------------------------------------------------------------------

def _fake_accelerator(mixed_precision: str = "no", ds_config: dict | None = None):
    plugin = None if ds_config is None else SimpleNamespace(deepspeed_config=ds_config, zero_stage=None)
    state = SimpleNamespace(deepspeed_plugin=plugin, fsdp_plugin=None)
    return SimpleNamespace(state=state, mixed_precision=mixed_precision, device=torch.device("cpu"))


def test_teacher_deepspeed_config_is_inference_only():
    training = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": None},
                              "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 1e4},
        "bf16": {"enabled": True},
    }
    acc = _fake_accelerator("bf16", training)
    assert is_zero3(acc) and zero_stage(acc) == 3
    cfg = teacher_deepspeed_config(acc)
    assert cfg["train_micro_batch_size_per_gpu"] == 1  # "auto" is not resolved yet when the teacher is placed
    assert "optimizer" not in cfg and "scheduler" not in cfg and "gradient_clipping" not in cfg
    assert "offload_optimizer" not in cfg["zero_optimization"]
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 1e4
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}

    training["train_micro_batch_size_per_gpu"] = 4
    training["zero_optimization"] = {"stage": 3}
    cfg = teacher_deepspeed_config(_fake_accelerator("no", training))
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and "offload_param" not in cfg["zero_optimization"]
    assert cfg["bf16"] == {"enabled": False}
    with pytest.raises(ValueError, match="DeepSpeed"):
        teacher_deepspeed_config(_fake_accelerator())


@pytest.mark.parametrize("mp,dtype", [("no", torch.float32), ("bf16", torch.bfloat16)])
def test_prepare_teacher_without_sharding_freezes_and_casts(mp, dtype):
    teacher = tiny_model().train()
    out = prepare_teacher(_fake_accelerator(mp), teacher)
    assert out is teacher and not out.training
    assert all(not p.requires_grad and p.dtype == dtype for p in out.parameters())
    assert unwrap_teacher(out) is teacher


def test_prepare_teacher_under_zero2_is_replicated():
    acc = _fake_accelerator("bf16", {"zero_optimization": {"stage": 2}})
    assert not is_zero3(acc) and zero_stage(acc) == 2
    out = prepare_teacher(acc, tiny_model())
    assert type(out).__name__ == "LlamaForCausalLM" and next(out.parameters()).dtype == torch.bfloat16


def test_gather_params_is_a_noop_on_plain_tensors():
    model = tiny_model()
    with gather_params(model.lm_head.weight):
        assert model.lm_head.weight.shape == (320, 64)
    with gather_params(model):
        pass


def test_replica_refresh_gathers_in_order_and_never_more_than_the_largest_weight_at_once():
    from distill.distributed import _gather_chunks, gathered_replica

    model = tiny_model()
    named = list(model.named_parameters())
    chunks = list(_gather_chunks(named))
    assert [n for chunk in chunks for n, _ in chunk] == [n for n, _ in named]  # every rank joins in this order
    largest = max(p.numel() for _, p in named)
    assert all(sum(p.numel() for _, p in chunk) <= largest for chunk in chunks)
    assert 1 < len(chunks) < len(named)  # small weights share a gather
    replica = gathered_replica(model)
    for (name, p), (_, q) in zip(named, replica.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert torch.equal(gathered_replica(model, replica).lm_head.weight, model.lm_head.weight)


# --- the launch plumbing, with a minimal training script of our own ----------------------------------

# Builds teacher/student after the Accelerator exists (so ZeRO-3's zero.Init partitions them while
# they are created), trains 3 steps of KD, and reports what each rank saw.
PROBE = textwrap.dedent('''
    import json, os, sys
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.environ["PROBE_ROOT"])
    from distill.distributed import gather_params, is_zero3, prepare_teacher, unwrap_teacher
    from core.tiny import tiny_config

    out = sys.argv[1]
    acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    if acc.state.deepspeed_plugin is not None:  # no dataloader goes through prepare()
        acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_config(tiny_config(layers=2, hidden=64))
    teacher = AutoModelForCausalLM.from_config(tiny_config(layers=3, hidden=96))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    student, opt = acc.prepare(student, opt)
    teacher = prepare_teacher(acc, teacher)
    gen = torch.Generator().manual_seed(acc.process_index)
    for _ in range(3):
        ids = torch.randint(3, 320, (2, 16), generator=gen)
        with torch.no_grad():
            t_logits = teacher(input_ids=ids).logits
        s_logits = student(input_ids=ids).logits
        loss = F.kl_div(F.log_softmax(s_logits.float(), -1), F.log_softmax(t_logits.float(), -1),
                        log_target=True, reduction="batchmean")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    bare = unwrap_teacher(teacher)
    # ZeRO-3 keeps each rank's slice in `ds_tensor` (small params are also kept whole after a forward:
    # stage3_param_persistence_threshold), so count slices, not the visible tensors.
    shard = sum(p.ds_tensor.numel() for p in bare.parameters()) if is_zero3(acc) else None
    total = sum(getattr(p, "ds_numel", p.numel()) for p in bare.parameters())
    with gather_params(bare.lm_head.weight):
        gathered = list(bare.lm_head.weight.shape)
        head_sum = float(bare.lm_head.weight.double().sum())
    state = acc.get_state_dict(student)  # collective under ZeRO-3: every rank calls it
    if acc.is_main_process:
        acc.unwrap_model(student).save_pretrained(os.path.join(out, "final"), state_dict=state)
    # each rank's student weights after training: identical if gradients were all-reduced
    digests = [None] * acc.num_processes
    torch.distributed.all_gather_object(digests, float(sum(p.detach().double().sum()
                                        for p in acc.unwrap_model(student).parameters())))
    report = dict(world=acc.num_processes, distributed_type=str(acc.distributed_type), zero3=is_zero3(acc),
                  teacher_type=type(teacher).__name__, teacher_shard=shard, teacher_total=total,
                  n_teacher_params=len(list(bare.parameters())), teacher_gathered=gathered,
                  teacher_head_sum=head_sum, local_param_sums=digests)
    with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(report, f)
    # Leave together: a rank tearing gloo down while its peer still works can abort at exit.
    acc.wait_for_everyone()
    acc.end_training()
''')


def _accelerate_bin() -> list[str]:
    exe = Path(sys.executable).with_name("accelerate")
    return [str(exe), "launch"] if exe.exists() else [sys.executable, "-m", "accelerate.commands.launch"]


def _launch_env(cpu_ddp: bool) -> dict[str, str]:
    env = child_env(OMP_NUM_THREADS="1", PROBE_ROOT=str(ROOT))  # OMP: two ranks share the cores
    # MULTI_GPU + use_cpu in the YAML is not enough: accelerate's multi-GPU launcher does not export the
    # YAML's use_cpu, and without it the ranks fall back to unconnected single processes.
    # For DeepSpeed it must NOT be set: accelerate turns DeepSpeed off when asked for the CPU.
    if cpu_ddp:
        env["ACCELERATE_USE_CPU"] = "true"
    else:
        env.pop("ACCELERATE_USE_CPU", None)
    return env


# What a rank prints when it aborts at interpreter exit, after its work and the process group are finished:
# seen about once in twenty full-suite runs on a loaded 2-core machine, never twice in a row.
EXIT_ABORT = "terminate called without an active exception"


def _launch(config: str, script: list[str], cpu_ddp: bool, timeout: int = 420,
            rerun_exit_abort: bool = False) -> subprocess.CompletedProcess:
    """Launch ``script`` on two processes; assert it exits 0.

    ``rerun_exit_abort``: a run whose only failure is :data:`EXIT_ABORT` is run once more (only for scripts
    that can rerun into the same folder); a second failure of any kind fails the test.
    """
    cmd = [*_accelerate_bin(), "--config_file", str(LAUNCH / config), "--main_process_port", "0"]
    if not cpu_ddp:
        cmd += ["--num_processes", "2", "--mixed_precision", "no"]  # bf16 is slow on CPUs
    proc = subprocess.run(cmd + script, cwd=ROOT, env=_launch_env(cpu_ddp), capture_output=True, text=True,
                          timeout=timeout)
    if rerun_exit_abort and proc.returncode != 0 and EXIT_ABORT in proc.stdout + proc.stderr:
        warnings.warn(f"a rank aborted at exit ({EXIT_ABORT!r}); running once more", stacklevel=2)
        proc = subprocess.run(cmd + script, cwd=ROOT, env=_launch_env(cpu_ddp), capture_output=True, text=True,
                              timeout=timeout)
    assert proc.returncode == 0, f"launch failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc


def _reports(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check_final(final: Path) -> None:
    from transformers import AutoModelForCausalLM

    from core.models import returned_cache

    model = AutoModelForCausalLM.from_pretrained(final)
    out = model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    assert out.logits.shape[-1] == model.config.vocab_size and torch.isfinite(out.logits).all()
    # saved for inference: training's use_cache=False would make a forward return no KV cache
    assert model.config.use_cache and returned_cache(out) is not None


def _check_schedule(out: Path) -> None:
    """One LR-schedule step per optimizer step, whatever the world size (not one per rank)."""
    import yaml

    from distill.training import warmup_cosine

    cfg = yaml.safe_load((out / "config.yaml").read_text())
    last = max((out / "checkpoints").iterdir(), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((last / "trainer_state.json").read_text())["history"]
    f = warmup_cosine(cfg["warmup_steps"], cfg["max_steps"], cfg["min_lr_ratio"])
    assert [h["step"] for h in history] == list(range(1, cfg["max_steps"] + 1))
    # the lr logged after step s is the one step s + 1 trains with: lr * f(s)
    assert [h["lr"] for h in history] == pytest.approx([cfg["lr"] * f(h["step"]) for h in history])


@pytest.mark.distributed
@pytest.mark.slow
def test_probe_cpu_ddp_two_processes(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    _launch("cpu_ddp_2proc.yaml", [str(script), str(tmp_path)], cpu_ddp=True, rerun_exit_abort=True)
    r0, r1 = _reports(tmp_path)
    assert r0["world"] == r1["world"] == 2 and r0["distributed_type"] == "DistributedType.MULTI_CPU"
    assert r0["teacher_type"] == "LlamaForCausalLM" and not r0["zero3"]
    assert r0["teacher_shard"] is None and r0["teacher_gathered"] == [320, 96]  # replicated
    # different data per rank, same weights after 3 steps: gradients were all-reduced
    assert r0["local_param_sums"][0] == pytest.approx(r0["local_param_sums"][1], rel=1e-6)
    _check_final(tmp_path / "final")


@pytest.mark.distributed
@pytest.mark.slow
def test_probe_deepspeed_zero3_two_processes(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    _launch("deepspeed_zero3.yaml", [str(script), str(tmp_path)], cpu_ddp=False, rerun_exit_abort=True)
    r0, r1 = _reports(tmp_path)
    assert r0["world"] == 2 and r0["distributed_type"] == "DistributedType.DEEPSPEED" and r0["zero3"]
    assert r0["teacher_type"] == "DeepSpeedEngine"
    # the teacher is partitioned (no full copy outside a gather) and whole inside one, on both ranks
    for r in (r0, r1):  # each rank holds half the teacher, up to padding to a multiple of the world size
        assert r["teacher_total"] <= 2 * r["teacher_shard"] <= r["teacher_total"] + r["n_teacher_params"]
    assert r0["teacher_gathered"] == r1["teacher_gathered"] == [320, 96]
    assert r0["teacher_head_sum"] == pytest.approx(r1["teacher_head_sum"])
    _check_final(tmp_path / "final")


# --- the real recipe ---------------------------------------------------------------------------------

RECIPE = ROOT / "recipes" / "distill.py"
TINY = ROOT / "recipes" / "configs" / "tiny.yaml"
needs_recipe = pytest.mark.skipif(not (RECIPE.exists() and TINY.exists()),
                                  reason="recipes/distill.py and recipes/configs/tiny.yaml not present")


def _run_recipe(config: str, out: Path, cpu_ddp: bool, *extra: str, harness: Path | None = None) -> dict:
    """The recipe on two processes (through ``harness``, a script that runs the script after it, when given)."""
    _launch(config, [*([str(harness)] if harness else []), str(RECIPE), "--config", str(TINY), f"output_dir={out}",
                     "max_steps=3", "save_every=2", "seed=0", *extra], cpu_ddp=cpu_ddp)
    _check_final(out / "final")
    _check_schedule(out)
    assert (out / "checkpoints" / "step-2").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2
    return summary


@needs_recipe
@pytest.mark.distributed
@pytest.mark.slow
def test_recipe_cpu_ddp_two_processes_and_its_resume_on_one(tmp_path):
    """Then the step-2 checkpoint resumed on one process with grad_accum 2 (the same 4 blocks per step, the same
    data order; a node lost): the last step gives the two-process run's weights, up to the order of sums."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    summary = _run_recipe("cpu_ddp_2proc.yaml", out, cpu_ddp=True)
    assert "deepspeed" not in summary
    two = load_file(out / "final" / "model.safetensors")
    proc = subprocess.run([sys.executable, str(RECIPE), "--config", str(TINY), f"output_dir={out}", "max_steps=3",
                           "save_every=2", "seed=0", "grad_accum=2", f"resume={out / 'checkpoints' / 'step-2'}"],
                          cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "written by 2 processes and this run has 1, with the same 4 blocks per step" in proc.stdout
    one = load_file(out / "final" / "model.safetensors")
    assert one.keys() == two.keys()
    for name in two:
        torch.testing.assert_close(one[name], two[name], rtol=1e-4, atol=1e-5, msg=name)
    # (the last step did move the weights: the comparison is not of two copies of the checkpoint)
    step2 = {k.removeprefix("student."): v for k, v in
             load_file(out / "checkpoints" / "step-2" / "model.safetensors").items() if k.startswith("student.")}
    assert step2.keys() == one.keys() and any(not torch.allclose(step2[k], one[k], rtol=1e-4, atol=1e-5) for k in one)


@needs_recipe
@pytest.mark.distributed
@pytest.mark.slow
def test_recipe_deepspeed_zero3_two_processes(tmp_path):
    """ZeRO-3 with half the micro-batches on-policy: the engine decodes from a replica of the sharded student.

    Five held-out blocks give one rank two eval batches and the other one: it hung before the filler batches.
    """
    harness = tmp_path / "replica_check.py"
    harness.write_text(REPLICA_CHECK)
    summary = _run_recipe("deepspeed_zero3.yaml", tmp_path / "run", False, "on_policy_fraction=0.5",
                          "gen_prompt_tokens=8", "gen_max_new_tokens=8", "max_grad_norm=0.5",
                          "eval_blocks=5",  # 3 + 2 blocks, batches of 2: the ranks' evals must still match
                          harness=harness)
    assert summary["on_policy"]["rollout_tokens"] > 0
    for rank in range(2):
        seen = json.loads((tmp_path / f"replica{rank}.json").read_text())
        # Step 2's rollout (0-based step 1; fraction 0.5) decodes after step 1's update: from exactly those weights.
        assert [r["step"] for r in seen["rollouts"]] == [1]
        assert all(r["max_diff"] == 0.0 for r in seen["rollouts"]), seen
        # Each refresh gathers a few weights at a time, never the whole student beside its replica.
        assert 0 < seen["largest_gather"] <= seen["largest_param"] < seen["total"], seen
    # The engine clips at the recipe's max_grad_norm, not at the launch YAML's gradient_clipping (1.0).
    assert summary["deepspeed"] == {"zero_stage": 3, "gradient_clipping": 0.5, "gradient_accumulation_steps": 1,
                                    "train_micro_batch_size_per_gpu": 2}


# Runs the recipe after it and records, per rank, what the on-policy engine decodes from under ZeRO-3: after each
# rollout, the largest difference between its replica and the live weights (DeepSpeed's own gather of the fp32
# partitions); and the most elements a replica refresh gathers at once, beside the largest parameter and the total.
REPLICA_CHECK = textwrap.dedent('''
    import json, os, runpy, sys
    import distill.distributed as dist
    import distill.on_policy as on_policy

    seen = {"rollouts": [], "largest_gather": 0, "largest_param": 0, "total": 0}
    refreshing = [False]
    real_gather, real_replica, real_generate = dist.gather_params, on_policy.gathered_replica, on_policy.Rollouts.generate

    def gather(params):
        if refreshing[0]:  # a list of parameters there
            params = list(params)
            seen["largest_gather"] = max(seen["largest_gather"], sum(int(p.ds_numel) for p in params))
        return real_gather(params)

    def replica(model, *args, **kwargs):
        sizes = [int(p.ds_numel) for p in model.parameters()]
        seen["largest_param"], seen["total"] = max(sizes), sum(sizes)
        refreshing[0] = True
        try:
            return real_replica(model, *args, **kwargs)
        finally:
            refreshing[0] = False

    def generate(self, prompts, params, step=None, with_stop=True):
        from deepspeed.utils import safe_get_full_fp32_param

        out = real_generate(self, prompts, params, step, with_stop)
        diffs = [float((safe_get_full_fp32_param(p) - q).abs().max())
                 for p, q in zip(self.student.parameters(), self.replica.parameters(), strict=True)]
        seen["rollouts"].append({"step": step, "max_diff": max(diffs)})
        return out

    dist.gather_params, on_policy.gathered_replica, on_policy.Rollouts.generate = gather, replica, generate
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    run_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("output_dir="))
    with open(os.path.join(os.path.dirname(os.path.abspath(run_dir)), f"replica{os.environ['RANK']}.json"), "w") as f:
        json.dump(seen, f)
''')


RETROFIT = ROOT / "recipes" / "retrofit.py"
RETROFIT_TINY = ROOT / "recipes" / "configs" / "retrofit_tiny.yaml"


@pytest.mark.distributed
@pytest.mark.slow
def test_retrofit_cpu_ddp_two_processes(tmp_path):
    """The retrofit shares the checkpoint barriers: both ranks write, one renames, nothing torn."""
    import attention

    out = tmp_path / "run"
    _launch("cpu_ddp_2proc.yaml", [str(RETROFIT), "--config", str(RETROFIT_TINY), f"output_dir={out}",
                                   "max_steps=3", "save_every=2", "eval_blocks=2", "eval_seq_lens=[]"],
            cpu_ddp=True)
    _check_final(out / "final")
    _check_schedule(out)
    assert attention.is_hybrid(attention.load(out / "final"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3"]  # keep_checkpoints=1
    assert (out / "checkpoints" / "step-3" / "COMPLETE").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 3


@needs_recipe
@pytest.mark.distributed
@pytest.mark.slow
def test_recipe_deepspeed_zero2_ce_only_ablation_trains(tmp_path):
    """The CE-only ablation under DeepSpeed gets an engine of its own: with the distilled run's engine still tied
    to the accelerator, accelerator.backward stepped that one and the ablation's student never trained."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    summary = _run_recipe("deepspeed_zero2.yaml", out, False, "compare_ce_only=true", "eval_every=0")
    assert summary["deepspeed"]["zero_stage"] == 2
    assert summary["ce_only_ppl_final"] < summary["student_ppl_init"]
    assert summary["ce_only_ppl_final"] != pytest.approx(summary["student_ppl_final"], rel=1e-6)
    history = json.loads((out / "ce_only" / "checkpoints" / "step-3" / "trainer_state.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3] and history[-1]["ce"] < history[0]["ce"]
    second = ("pytorch_model_1", "model_1", "optimizer_1", "scheduler_1")  # a second model's state beside its own
    assert [p.name for p in (out / "ce_only" / "checkpoints" / "step-2").iterdir() if p.name.startswith(second)] == []
    # keep_layers "0,3": the student starts as the teacher's layers 0 and 3; the CE-only one moved away from them
    from core.tiny import tiny_teacher

    ce, teacher = load_file(str(out / "ce_only" / "final" / "model.safetensors")), tiny_teacher(0).state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    assert ce[key].shape == teacher[key].shape and not torch.allclose(ce[key], teacher[key])


@pytest.mark.distributed
@pytest.mark.slow
def test_retrofit_prepares_each_extra_heldout_length_once(tmp_path):
    """The extra held-out lengths (eval_seq_lens) are prepared by the main process while the others wait, then
    mapped from the cache: with a fresh data cache each length is tokenized and packed once, not once per rank."""
    out = tmp_path / "run"
    proc = _launch("cpu_ddp_2proc.yaml", [str(RETROFIT), "--config", str(RETROFIT_TINY), f"output_dir={out}",
                                          f"data_cache={tmp_path / 'data'}", "max_steps=1", "save_every=0",
                                          "eval_every=0", "eval_blocks=2", "eval_seq_lens=[256]",
                                          "longctx_lengths=[]", "full_head_share=0"], cpu_ddp=True)
    lines = (proc.stdout + proc.stderr).replace("\r", "\n").splitlines()
    packed = [line for line in lines if line.startswith("pack builtin:stdlib-docs") and "100%" in line]
    assert len(packed) == 2, packed  # seq_len 128 and 256, each once
    assert len(list((tmp_path / "data").glob("*/meta.json"))) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and set(summary["perplexity"]) == {"128", "256"}
