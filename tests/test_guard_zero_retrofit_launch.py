"""recipes/retrofit.py under a launch it does not run under: one line naming the DDP configs, before any weights
load and before the run folder is claimed.

Under ``accelerate launch --config_file launch/gpu_fsdp.yaml`` on CPUs the processes start apart
(``DistributedType.NO`` with ``num_processes`` 2): the retrofit used to run, each rank training its own copy on its
half of the data, and ``final/`` held rank 0's model alone (held-out perplexity 518.1 where the DDP run of the same
config reaches 503.0).
"""

from __future__ import annotations

import pytest

import core.models
from core.config import ConfigError
from tests.helpers import forbid

TINY = ["--config", "recipes/configs/retrofit_tiny.yaml"]


@pytest.fixture
def no_weights(monkeypatch):
    from recipes import retrofit

    forbid(monkeypatch, "weights were loaded before the launch was refused", (retrofit, "load_models"),
           (retrofit, "tiny_teacher"), (retrofit, "load_causal_lm"), (core.models, "load_causal_lm"))
    return retrofit


@pytest.mark.parametrize("env, backend", [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")])
def test_retrofit_refuses_fsdp_and_deepspeed_launches(no_weights, tmp_path, monkeypatch, env, backend):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setenv(env, "true")  # what `accelerate launch --config_file <that config>` exports to every rank
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        no_weights.main([*TINY, f"output_dir={out}"])
    assert str(err.value) == (f"retrofit.py trains small LoRA adapters with DDP, not {backend}: launch it with "
                              "launch/gpu_ddp.yaml (CPU: launch/cpu_ddp_2proc.yaml)")
    assert not out.exists()
