"""Export from a checkpoint whose weight files cannot be read back: one line naming the fix, nothing written.

A kill or a full disk while ``accelerator.save_state`` runs leaves a ZeRO folder without one rank's shard, a shard
cut short, or a ``latest`` that names no folder; a copied run can hold a truncated ``model.safetensors``. The
loaders' own errors (deepspeed's zero_to_fp32, safetensors, torch) are tracebacks that say nothing of what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.tiny import tiny_model, tiny_tokenizer
from recipes.export import ExportConfig, export
from serve import export as ex

REPO = Path(__file__).resolve().parent.parent


def _student_dir(model, path: Path) -> None:
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def _zero_checkpoint(ckpt: Path, model) -> Path:
    """The layout accelerate's ``save_state`` gives a ZeRO-2 run of two ranks, with every shard file cut short."""
    shards = ckpt / "pytorch_model"
    shards.mkdir(parents=True)
    (ckpt / "latest").write_text("pytorch_model")
    (shards / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut short by a kill")
    for rank in range(2):
        (shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"PK\x03\x04 cut short")
    _student_dir(model, ckpt / "student")
    return ckpt


def _refused(source: Path, out: Path, match: str) -> str:
    with pytest.raises(ex.SourceError, match=match) as info:
        export(ExportConfig(source=str(source), output_dir=str(out)))
    message = str(info.value)
    assert "\n" not in message and "incomplete or damaged" in message
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))  # nothing half-written beside it
    return message


def test_zero_checkpoint_with_torn_shards_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    ckpt = _zero_checkpoint(tmp_path / "run" / "checkpoints" / "step-2", tiny_model(seed=1))
    assert ex.resolve_source(ckpt).kind == "deepspeed"
    message = _refused(ckpt, tmp_path / "export", "DeepSpeed ZeRO checkpoint")
    assert "checkpoints/step-N or the run's final/" in message


def test_zero_checkpoint_whose_latest_names_no_folder_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    ckpt = _zero_checkpoint(tmp_path / "run" / "checkpoints" / "step-2", tiny_model(seed=1))
    (ckpt / "latest").write_text("global_step9")  # a save killed between writing `latest` and its folder
    _refused(ckpt, tmp_path / "export", "FileNotFoundError")


def test_truncated_checkpoint_safetensors_is_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tiny_model(seed=2)
    ckpt = tmp_path / "run" / "checkpoints" / "step-3"
    ckpt.mkdir(parents=True)
    save_file({f"student.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    _student_dir(model, ckpt / "student")
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.truncate(4000)
    assert ex.resolve_source(ckpt).kind == "checkpoint"
    _refused(ckpt, tmp_path / "export", "training checkpoint")


def test_truncated_model_dir_is_one_line_from_the_cli(tmp_path: Path) -> None:
    model = tiny_model(seed=3)
    final = tmp_path / "run" / "final"
    model.save_pretrained(final)
    tiny_tokenizer().save_pretrained(final)
    with open(final / "model.safetensors", "r+b") as f:
        f.truncate(4000)
    _refused(final, tmp_path / "export", "model directory")
    out = tmp_path / "cli-export"
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "export.py"), f"source={final}",
                           f"output_dir={out}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: model directory {final} cannot be read (SafetensorError") and "checkpoint=latest" in last
    assert not out.exists()


def test_export_of_a_checkpoint_saved_for_training_decodes_with_its_kv_cache(tmp_path: Path) -> None:
    """The retrofit saves the model's config into checkpoints/step-N/student/ as it trains it: with ``use_cache``
    off and no generation_config.json. An export of such a checkpoint wrote ``use_cache: false`` into both
    config.json and generation_config.json, and HF generate() on it ran without a KV cache, every new token
    re-running the whole prefix (the run's own final/ decodes with the cache)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = tiny_model(seed=4)
    model.config.use_cache = False  # as recipes/retrofit.py (and distill.py) train it
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    ckpt.mkdir(parents=True)
    save_file({f"student.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    _student_dir(model, ckpt / "student")
    assert not (ckpt / "student" / "generation_config.json").exists()
    out = tmp_path / "export"
    export(ExportConfig(source=str(ckpt), output_dir=str(out)))

    served = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert served.config.use_cache and served.generation_config.use_cache is not False
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        generated = served.generate(prompt, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert generated.past_key_values is not None  # decoded with the cache
    # The weights are the checkpoint's, whatever the flag: the same logits as the model trained.
    with torch.no_grad():
        torch.testing.assert_close(served(prompt).logits, model(prompt).logits, rtol=0, atol=1e-6)

@pytest.mark.distributed
@pytest.mark.slow
def test_export_of_a_two_rank_zero3_checkpoint_equals_the_runs_final(tmp_path: Path) -> None:
    """A real ZeRO-3 distill run on two processes: its checkpoint holds each rank's partition of the parameters and
    optimizer states; the export reassembles them into exactly the weights the run saved in final/. The same
    checkpoint without one rank's shard (a kill while it was written) is refused in one line."""
    import shutil

    from safetensors.torch import load_file

    from tests.test_distributed import _launch

    pytest.importorskip("deepspeed")
    run = tmp_path / "run"
    _launch("deepspeed_zero3.yaml", [str(REPO / "recipes" / "distill.py"), "--config",
                                     str(REPO / "recipes" / "configs" / "tiny.yaml"), f"output_dir={run}",
                                     "max_steps=2", "save_every=2", "eval_every=0", "eval_blocks=2"], cpu_ddp=False)
    ckpt = run / "checkpoints" / "step-2"
    shards = sorted((ckpt / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))
    assert len(shards) == 2 and not (ckpt / "model.safetensors").exists()
    result = export(ExportConfig(source=str(run), checkpoint="latest", output_dir=str(tmp_path / "export")))
    assert result.source.kind == "deepspeed"
    exported, final = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "export", run / "final"))
    assert sorted(exported) == sorted(final)
    for key, value in final.items():
        assert torch.equal(exported[key], value), key

    torn = tmp_path / "torn" / "checkpoints" / "step-2"
    shutil.copytree(ckpt, torn)
    (torn / "pytorch_model" / shards[1].name).unlink()
    message = _refused(torn, tmp_path / "torn-export", "DeepSpeed ZeRO checkpoint")
    assert "Expected 2 of '*_optim_states.pt'" in message
