"""Export: every kind of source becomes a plain HF directory that reproduces the source model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import ConfigError, parse_config
from core.tiny import save_tiny, tiny_model, tiny_tokenizer
from recipes.export import ExportConfig, export
from serve import export as ex
from tests.helpers import ROOT

REPO = Path(__file__).resolve().parent.parent
HYBRID = {"sink_tokens": 4, "window": 8, "global_every": 16, "max_globals": 2}
SUMMARY = {"steps": 7, "final_loss": 1.2345, "tokens_per_s": 812.5, "teacher_ppl": 11.5,
           "student_ppl_init": 40.25, "student_ppl_final": 17.75, "top1_agreement": 0.6125,
           "loss_weights": {"kd_weight": 1.0, "ce_weight": 0.5}, "final_dir": "/somewhere/run/final",
           "environment": {"python": "3.11.7", "platform": "Linux-x", "hybrid_distill": "0.1.0", "commit": "abc123",
                           "packages": {"torch": "2.13.0", "transformers": "5.25.0", "deepspeed": None},
                           "device": "cpu", "cuda": None}}
GATE = {"verdict": "pass", "bertscore_f1": 0.9137, "threshold": 0.9, "prompts": 24}
GATE_MD = "# Release gate\n\nverdict: PASS — BERTScore F1 0.9137 >= 0.9 on 24 prompts\n"
RUN_CONFIG = {"teacher": "models/teacher", "student": "models/student", "dataset": "data/tiny.txt",
              "seq_len": 64, "max_steps": 7, "lr": 3e-4}


def ids(n: int = 12, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (batch, n), generator=g)


@torch.no_grad()
def logits(model, x: torch.Tensor | None = None) -> torch.Tensor:
    return model(ids() if x is None else x).logits.float()


def load(path: Path, **kw):
    return AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


def run_export(source: Path, out: Path, **kw) -> object:
    return export(ExportConfig(source=str(source), output_dir=str(out), **kw))


def weight_keys(out: Path) -> set[str]:
    keys: set[str] = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            keys |= set(fh.keys())
    return keys


def write_student_dir(model, path: Path) -> None:
    """What the training recipe puts under checkpoints/step-N/student/: config + tokenizer, no weights."""
    path.mkdir(parents=True)
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def make_checkpoint(ckpt: Path, model, step: int, drop: tuple[str, ...] = ()) -> None:
    """A training checkpoint: teacher–student state dict (student.* + projectors.*), student/, bookkeeping."""
    ckpt.mkdir(parents=True)
    state = {f"student.{k}": v.clone().contiguous() for k, v in model.state_dict().items() if k not in drop}
    state["projectors.h1.weight"] = torch.randn(96, 64)
    state["projectors.h2.weight"] = torch.randn(96, 64)
    save_file(state, str(ckpt / "model.safetensors"))
    (ckpt / "optimizer.bin").write_bytes(b"not a real optimizer state")
    (ckpt / "random_states_0.pkl").write_bytes(b"ignored")
    write_student_dir(model, ckpt / "student")
    (ckpt / "config.yaml").write_text(yaml.safe_dump(RUN_CONFIG))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    (ckpt / "COMPLETE").write_text("")


@pytest.fixture
def run_dir(tmp_path: Path) -> tuple[Path, dict[int, torch.nn.Module]]:
    """A finished run: final/ (seed 0) and checkpoints step-3 (seed 3) and step-7 (seed 7), records."""
    run = tmp_path / "run"
    run.mkdir()
    save_tiny(run / "final", seed=0)
    models = {0: tiny_model(seed=0)}
    for step in (3, 7):
        models[step] = tiny_model(seed=step)
        make_checkpoint(run / "checkpoints" / f"step-{step}", models[step], step)
    (run / "checkpoints" / ".tmp-step-9").mkdir()  # an interrupted save is not a checkpoint
    (run / "checkpoints" / "step-8").mkdir()  # nor is a torn copy without COMPLETE
    (run / "config.yaml").write_text(yaml.safe_dump(RUN_CONFIG))
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    (run / "gate").mkdir()
    (run / "gate" / "report.json").write_text(json.dumps(GATE))
    (run / "gate" / "report.md").write_text(GATE_MD)
    (run / "loss.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    return run, models


# --------------------------------------------------------------------------------------------
# Sources → identical model
# --------------------------------------------------------------------------------------------


def test_final_dir_roundtrip_fp32_is_exact(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final", seed=1)
    out = tmp_path / "export"
    res = run_export(src, out)
    exported, source = load(out), load(src)
    for (k, a), (k2, b) in zip(source.state_dict().items(), exported.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    torch.testing.assert_close(logits(exported), logits(source), atol=1e-6, rtol=0)
    assert res.dtype == torch.float32 and res.hybrid is None and res.params == source.num_parameters()
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and tok.encode("the quick fox") == tiny_tokenizer().encode("the quick fox")
    assert (out / "generation_config.json").is_file()
    assert oct((out / "model.safetensors").stat().st_mode & 0o444) == oct(0o444)  # readable by all


def test_checkpoint_strips_projectors_and_matches_student(run_dir) -> None:
    run, models = run_dir
    ckpt = run / "checkpoints" / "step-3"
    out = run.parent / "export"
    res = run_export(ckpt, out)
    keys = weight_keys(out)
    assert keys == set(models[3].state_dict()), keys ^ set(models[3].state_dict())
    assert not any("projector" in k or k.startswith("student.") for k in keys)
    torch.testing.assert_close(logits(load(out)), logits(models[3]), atol=1e-6, rtol=0)
    assert res.source.kind == "checkpoint" and res.source.step == 3 and res.source.run_dir == run
    assert AutoTokenizer.from_pretrained(str(out)).chat_template


def test_checkpoint_with_tied_embeddings_dropped_alias(tmp_path: Path) -> None:
    # safetensors savers keep one name of a tied pair; either one must be enough.
    model = tiny_model(seed=4, tie_word_embeddings=True)
    for dropped in ("lm_head.weight", "model.embed_tokens.weight"):
        ckpt = tmp_path / f"ckpt-{dropped}"
        make_checkpoint(ckpt, model, 1, drop=(dropped,))
        out = tmp_path / f"out-{dropped}"
        run_export(ckpt, out)
        torch.testing.assert_close(logits(load(out)), logits(model), atol=1e-6, rtol=0)


def test_run_dir_picks_final_latest_or_step(run_dir) -> None:
    run, models = run_dir
    assert ex.resolve_source(run).path == run / "final"
    assert ex.resolve_source(run, "latest").path == run / "checkpoints" / "step-7"
    assert ex.resolve_source(run, "3").step == 3
    out = run.parent / "latest"
    run_export(run, out, checkpoint="latest")
    torch.testing.assert_close(logits(load(out)), logits(models[7]), atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match=r"no checkpoints/step-5; pick checkpoint= from: final, 3, 7"):
        ex.resolve_source(run, "5")
    with pytest.raises(ConfigError, match="only applies when source is a run directory"):
        ex.resolve_source(run / "final", "latest")


def test_bf16_export_is_close_and_stored_bf16(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final", seed=2)
    out = tmp_path / "bf16"
    res = run_export(src, out, dtype="bf16")
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16" and res.dtype == torch.bfloat16
    exported = load(out, dtype=torch.float32)
    ref = logits(load(src))
    got = logits(exported)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert (got - ref).abs().max() > 0  # it really was rounded
    # dtype=auto keeps what the source stores
    out2 = tmp_path / "auto"
    assert run_export(out, out2, dtype="auto").dtype == torch.bfloat16


def test_lora_adapter_is_merged(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base_dir = save_tiny(tmp_path / "base", seed=5)
    cfg = json.loads((base_dir / "config.json").read_text())
    (base_dir / "config.json").write_text(json.dumps({**cfg, "hybrid_attention": HYBRID}))  # a retrofit base
    peft_model = get_peft_model(load(base_dir), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                           target_modules=["q_proj", "v_proj", "down_proj"]))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    ref = logits(peft_model)
    assert (ref - logits(load(base_dir))).abs().max() > 1e-3  # the adapter changes the model

    out = tmp_path / "merged"
    res = run_export(adapter, out)
    merged = load(out)
    torch.testing.assert_close(logits(merged), ref, atol=1e-5, rtol=0)
    assert not any("lora" in k for k in weight_keys(out)) and res.params == merged.num_parameters()
    assert json.loads((out / "config.json").read_text())["hybrid_attention"] == HYBRID

    # The recorded base path is wrong once the base moves: base= overrides it.
    moved = tmp_path / "moved-base"
    base_dir.rename(moved)
    with pytest.raises(ConfigError, match="pass base=PATH"):
        run_export(adapter, tmp_path / "x")
    run_export(adapter, tmp_path / "merged2", base=str(moved))
    torch.testing.assert_close(logits(load(tmp_path / "merged2")), ref, atol=1e-5, rtol=0)


def test_overwrite_never_replaces_the_base_an_adapter_records(tmp_path: Path) -> None:
    """The usual LoRA export names no base=: the adapter's base_model_name_or_path is protected all the same."""
    from peft import LoraConfig, get_peft_model

    base_dir = save_tiny(tmp_path / "base")
    get_peft_model(load(base_dir), LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(base_dir)
    (base_dir / "notes.txt").write_text("mine")
    (base_dir / "export.json").write_text("{}")  # as if an earlier export: only the base check protects it now
    weights = (base_dir / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match=re.escape(f"contains the source {base_dir.resolve()}; choose another output_dir")):
        run_export(tmp_path / "adapter", base_dir, overwrite=True)
    assert (base_dir / "notes.txt").read_text() == "mine"
    assert (base_dir / "model.safetensors").read_bytes() == weights


def test_hybrid_spec_preserved_and_plain_load_works(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final", seed=6)
    cfg = json.loads((src / "config.json").read_text())
    cfg["hybrid_attention"] = HYBRID
    cfg["attn_implementation"] = "hybrid_sparse"  # registered only inside a training process
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "hybrid"
    res = run_export(src, out)
    written = json.loads((out / "config.json").read_text())
    assert written["hybrid_attention"] == HYBRID and res.hybrid == HYBRID
    assert "attn_implementation" not in written
    exported = load(out)  # plain, default attention: would raise on an unregistered name
    assert exported.config.hybrid_attention == HYBRID
    torch.testing.assert_close(logits(exported), logits(tiny_model(seed=6)), atol=1e-5, rtol=0)
    assert "Hybrid sparse attention" in (out / "README.md").read_text()
    assert "4 sink tokens, a 8-token sliding window, a global token every 16" in (out / "README.md").read_text()


def test_the_model_card_names_the_windows_a_window_policy_serves(tmp_path: Path) -> None:
    """With a window_policy the spec's own window is never served: the card named it as the window."""
    src = save_tiny(tmp_path / "final", seed=6)
    cfg = json.loads((src / "config.json").read_text())
    cfg["hybrid_attention"] = {**HYBRID, "window_policy": [[32, 8], [None, 16]]}
    (src / "config.json").write_text(json.dumps(cfg))
    run_export(src, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "a sliding window set by the input's length (8 tokens up to a length of 32, 16 beyond)" in card
    assert "8-token sliding window" not in card



def test_the_summary_names_the_windows_a_window_policy_serves(tmp_path: Path) -> None:
    """With a window_policy the spec's own window is never served: the summary printed it as the window."""
    from recipes.export import ExportResult

    hybrid = {**HYBRID, "window": 512, "window_policy": [[4096, 512], [None, 2048]]}
    res = ExportResult(tmp_path, 0, torch.float32, 0, hybrid, 1, ex.Source("hf", tmp_path, tmp_path))
    assert "window 512 up to 4096, 2048 beyond," in res.summary()
    res.hybrid = {**HYBRID, "window": 64}
    assert "window 64," in res.summary()

def test_sharding_writes_an_index(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final", seed=8)
    out = tmp_path / "sharded"
    res = run_export(src, out, max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and res.shards == len(shards)
    assert all(os.path.getsize(out / s) <= 150_000 for s in shards)
    torch.testing.assert_close(logits(load(out)), logits(load(src)), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------


def test_model_card_has_config_data_metrics_and_gate(run_dir) -> None:
    run, _ = run_dir
    out = run.parent / "export"
    run_export(run, out)
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers")
    assert "| student_ppl_final | 17.75 |" in card and "| top1_agreement | 0.6125 |" in card
    assert "**Verdict: PASS**" in card and "| bertscore_f1 | 0.9137 |" in card
    assert "BERTScore F1 0.9137 >= 0.9 on 24 prompts" in card  # report.md embedded
    assert "| dataset | data/tiny.txt |" in card and "| lr |" not in card  # data table only data keys
    assert "lr: 0.0003" in card  # full config below
    assert "models/teacher" in card and "![training loss](loss.png)" in card
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert "not on this" not in card
    assert "| loss_weights.ce_weight | 0.5 |" in card and "/somewhere" not in card
    # The run's environment is a section of its own, not a measured number; uninstalled packages are left out.
    versions = card.split("## Framework versions")[1].split("## Usage")[0]
    assert "| transformers | 5.25.0 |" in versions and "| torch | 2.13.0 |" in versions and "| python | 3.11.7 |" in versions
    assert "deepspeed" not in versions and "environment." not in card

    # A mid-run checkpoint says the numbers belong to the final model.
    out3 = run.parent / "step3"
    run_export(run, out3, checkpoint="3")
    card3 = (out3 / "README.md").read_text()
    assert card3.count("final model (step 7), not on this export (step 3)") == 2  # metrics and gate
    assert "Exported from the training checkpoint run/checkpoints/step-3 (step 3)" in card3
    assert str(run.parent) not in card3  # no local paths in a card meant to be published


def test_model_card_without_run_records(tmp_path: Path) -> None:
    out = tmp_path / "export"
    run_export(save_tiny(tmp_path / "final"), out)
    card = (out / "README.md").read_text()
    assert "No metrics recorded" in card and "has not been run" in card and "Dense attention" in card


# --------------------------------------------------------------------------------------------
# Safety: overwrite, atomicity, bad input
# --------------------------------------------------------------------------------------------


def test_overwrite_refused_then_allowed(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final")
    out = tmp_path / "export"
    run_export(src, out)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="already exists; pass overwrite=true"):
        run_export(src, out, dtype="bf16")
    assert (out / "model.safetensors").read_bytes() == before
    run_export(src, out, dtype="bf16", overwrite=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "final"]  # no leftovers
    with pytest.raises(ConfigError, match="contains the source"):  # an export of ours, re-exported onto itself
        run_export(out, out, overwrite=True)


def test_failure_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save_tiny(tmp_path / "final")
    out = tmp_path / "export"

    def broken(out_dir: Path, *a, **k) -> None:
        assert (Path(out_dir) / "model.safetensors").is_file()  # weights already written
        raise OSError("disk full")

    monkeypatch.setattr(ex, "write_card", broken)
    with pytest.raises(OSError, match="disk full"):
        run_export(src, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]

    # With overwrite, a failed replacement keeps the previous export intact.
    monkeypatch.undo()
    run_export(src, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(ex, "write_card", broken)
    with pytest.raises(OSError):
        run_export(src, out, dtype="bf16", overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "final"]


def test_bad_sources_name_the_fix(tmp_path: Path, run_dir) -> None:
    run, models = run_dir
    with pytest.raises(ConfigError, match="does not exist"):
        ex.resolve_source(tmp_path / "missing")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    with pytest.raises(ConfigError, match="not a known kind of source; point source= at a run directory"):
        ex.resolve_source(tmp_path / "junk")
    ckpt = run / "checkpoints" / "step-3"
    (ckpt / "student" / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no student/config.json; copy the student's config.json"):
        ex.resolve_source(ckpt)
    # A checkpoint that lacks some student weights must not be exported with random ones.
    partial = tmp_path / "partial"
    make_checkpoint(partial, models[0], 1, drop=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ConfigError, match=r"lacks 1 student weights \(e.g. model.layers.1.mlp.up_proj.weight\)"):
        run_export(partial, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    # Config validation.
    for bad, msg in [("dtype=int8", "use fp32, bf16, fp16 or auto"), ("max_shard_size=lots", "500MB"),
                     ("checkpoint=best", "use auto, final, latest or a step")]:
        with pytest.raises(ConfigError, match=msg):
            parse_config(ExportConfig, ["source=a", "output_dir=b", bad])



def test_base_for_a_source_that_is_no_lora_adapter_is_refused_before_the_load(run_dir, tmp_path, monkeypatch) -> None:
    """base= names what a LoRA adapter merges into: for any other source it was silently ignored, and the export
    was the source's own weights, not the merge the caller asked for."""
    run, _ = run_dir
    other = save_tiny(tmp_path / "other-base", seed=5)
    monkeypatch.setattr(ex, "load_student", lambda *a, **k: pytest.fail("the source was loaded"))
    with pytest.raises(ConfigError, match=r"base= only applies when source is a LoRA adapter .*, not a model "
                                          r"directory .*final; drop base=") as err:
        run_export(run, tmp_path / "out", base=str(other))
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, says", [
    (["quant_gate_prompts=mine.jsonl"], "quant_gate_prompts only applies to a quantized export's gate, which "
                                        "quantize=none does not run; drop it or pass quantize=int8 (or w8a8)"),
    (["quant_max_drop=0.05", "quant_gate_backend=transformers"], "quant_max_drop, quant_gate_backend only apply"),
    (["quantize=int8", "quant_gate=false", "quant_gate_teacher=teacher/"], "which quant_gate=false does not run; "
                                                                          "drop it or pass quant_gate=true"),
])
def test_quantization_settings_nothing_reads_are_refused(argv, says) -> None:
    """A gate setting without the gate (no quantize=, or quant_gate=false) was accepted and silently ignored."""
    with pytest.raises(ConfigError) as err:
        parse_config(ExportConfig, ["source=a", "output_dir=b", *argv])
    assert says in str(err.value) and "\n" not in str(err.value)
    parse_config(ExportConfig, ["source=a", "output_dir=b", "quant_gate=false"])  # turning off what is off: fine
    parse_config(ExportConfig, ["source=a", "output_dir=b", "quant_gate_teacher=none"])  # asks for no teacher

def test_deepspeed_checkpoint_goes_through_zero_to_fp32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed")
    import deepspeed.utils.zero_to_fp32 as z2f

    model = tiny_model(seed=9)
    ckpt = tmp_path / "checkpoints" / "step-2"
    (ckpt / "pytorch_model").mkdir(parents=True)
    (ckpt / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (ckpt / "latest").write_text("pytorch_model")
    write_student_dir(model, ckpt / "student")
    calls = []

    def fake(checkpoint_dir, tag=None, **kw):
        calls.append((checkpoint_dir, tag))
        state = {f"module.student.{k}": v.clone() for k, v in model.state_dict().items()}
        state["module.projectors.h1.weight"] = torch.zeros(3, 3)
        return state

    monkeypatch.setattr(z2f, "get_fp32_state_dict_from_zero_checkpoint", fake)
    src = ex.resolve_source(ckpt)
    assert src.kind == "deepspeed" and src.step == 2
    out = tmp_path / "export"
    run_export(ckpt, out)
    assert calls == [(str(ckpt), None)]
    torch.testing.assert_close(logits(load(out)), logits(model), atol=1e-6, rtol=0)


def test_shipped_export_configs_parse() -> None:
    configs = sorted((REPO / "recipes" / "configs").glob("export_*.yaml"))
    assert configs
    for path in configs:
        assert path.read_text().startswith("# python recipes/export.py --config")
        cfg = parse_config(ExportConfig, ["--config", str(path)])
        assert cfg.dtype in ("fp32", "bf16", "fp16", "auto") and not cfg.overwrite


def test_student_state_dict_stripping() -> None:
    t = torch.zeros(1)
    state = {"student.model.x": t, "_orig_mod.student.lm_head.weight": t, "projectors.p.weight": t,
             "teacher.model.x": t}
    assert set(ex.student_state_dict(state)) == {"model.x", "lm_head.weight"}
    assert set(ex.student_state_dict({"module.model.x": t})) == {"model.x"}  # a bare student


# --------------------------------------------------------------------------------------------
# The real CLI
# --------------------------------------------------------------------------------------------


def test_cli_exports_a_run_and_rejects_bad_input(run_dir) -> None:
    run, models = run_dir
    out = run.parent / "cli-export"
    env = {**os.environ, "PYTHONPATH": ""}  # the recipe must find the package by itself
    cmd = [sys.executable, str(REPO / "recipes" / "export.py"), f"source={run}", f"output_dir={out}",
           "checkpoint=latest", "max_shard_size=200KB", "threads=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"-> {out}" in proc.stdout and "fp32" in proc.stdout and "dense attention" in proc.stdout
    torch.testing.assert_close(logits(load(out)), logits(models[7]), atol=1e-6, rtol=0)

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run.parent, timeout=300)
    assert again.returncode == 2
    lines = again.stderr.strip().splitlines()
    assert lines[-1] == f"error: output_dir {out} already exists; pass overwrite=true to replace it or choose " \
                        "another output_dir"
    assert "Traceback" not in again.stderr


_ZERO_SAVE = """
import os, sys, torch, deepspeed, deepspeed.comm.torch
from core.tiny import tiny_model
ckpt, stage = sys.argv[1], int(sys.argv[2])

class TeacherStudent(torch.nn.Module):  # the shape of the training module: student + projectors
    def __init__(self):
        super().__init__()
        self.student = tiny_model(seed=10)
        self.projectors = torch.nn.ModuleDict({"h1": torch.nn.Linear(64, 96, bias=False)})

module = TeacherStudent()
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
# One CPU process needs no shared-memory collectives; skipping the op saves a C++ build per test run.
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")
engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
engine.save_checkpoint(ckpt, "pytorch_model")
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_real_zero_checkpoint(tmp_path: Path, stage: int) -> None:
    pytest.importorskip("deepspeed")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = tmp_path / "checkpoints" / "step-1"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _ZERO_SAVE, str(ckpt), str(stage)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "latest").is_file() and not (ckpt / "model.safetensors").exists()
    model = tiny_model(seed=10)
    write_student_dir(model, ckpt / "student")
    out = tmp_path / "export"
    res = run_export(ckpt, out)
    assert res.source.kind == "deepspeed"
    assert weight_keys(out) == set(model.state_dict())
    torch.testing.assert_close(logits(load(out)), logits(model), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_exports_a_real_distill_run(tmp_path: Path) -> None:
    """The training recipe's own outputs: its checkpoint (pytorch_model.bin) and final/ export identically."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "recipes/distill.py", "--config", "recipes/configs/tiny.yaml",
                           f"output_dir={run}", "max_steps=2", "save_every=2"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from_ckpt = run_export(run, tmp_path / "from-ckpt", checkpoint="latest")
    from_final = run_export(run, tmp_path / "from-final")
    assert from_ckpt.source.kind == "checkpoint" and from_final.source.path == run / "final"
    a, b = load(tmp_path / "from-ckpt"), load(tmp_path / "from-final")
    for (k, x), (k2, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert k == k2 and torch.equal(x, y), k
    x = torch.randint(3, a.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(a, x), logits(load(run / "final"), x), atol=1e-6, rtol=0)
    card = (tmp_path / "from-final" / "README.md").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert f"| steps | {summary['steps']} |" in card and "student_ppl_final" in card
    assert "builtin:stdlib-docs" in card  # the data table


@pytest.mark.parametrize("gate, code", [(None, 0), ({"verdict": "pass"}, 0), ({"verdict": "fail"}, 1),
                                        ({"verdict": "inconclusive"}, 1)])
def test_the_cli_exits_1_when_the_quantization_gate_does_not_pass(tmp_path, capsys, gate, code):
    """A CI job that exports with quantize= fails with its gate; the export stays for inspection."""
    from recipes.export import ExportResult, gate_exit_code

    if gate is not None:
        (tmp_path / "quantization_gate.json").write_text(json.dumps(gate))
    result = ExportResult(tmp_path, 0, torch.float32, 0, None, 1, None)
    assert gate_exit_code(result) == code
    err = capsys.readouterr().err
    assert ("quantization gate says" in err) == (code == 1)


def test_retrofit_checkpoint_with_lora_in_place_is_folded(tmp_path: Path) -> None:
    """recipes/retrofit.py applies LoRA in place inside the teacher–student module, so its checkpoints hold
    ``student.…q_proj.base_layer.weight`` / ``lora_A.default`` / ``lora_B.default``: export folds them with the
    run's lora_alpha into the plain weights, as the run's own merge_and_unload does."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model(seed=4)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, bias="none",
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    run = tmp_path / "retrofit"
    ckpt = run / "checkpoints" / "step-5"
    make_checkpoint(ckpt, model, 5)  # model: the base the adapters were injected into, as DistillModel holds it
    assert any(k.endswith("q_proj.base_layer.weight") for k in weight_keys(ckpt))
    assert any(k.endswith("q_proj.lora_A.default.weight") for k in weight_keys(ckpt))
    (run / "config.yaml").write_text(yaml.safe_dump({**RUN_CONFIG, "lora_r": 4, "lora_alpha": 12.0}))
    x = ids()
    ref = logits(peft_model.merge_and_unload(), x)
    assert (ref - logits(tiny_model(seed=4), x)).abs().max() > 1e-3  # the adapters change the model

    res = run_export(run, tmp_path / "export")
    exported = load(tmp_path / "export")
    torch.testing.assert_close(logits(exported, x), ref, atol=1e-5, rtol=0)
    assert weight_keys(tmp_path / "export") == set(tiny_model(seed=4).state_dict())
    assert res.source.kind == "checkpoint" and "with a merged LoRA adapter" in (tmp_path / "export" / "README.md").read_text()

    # No recorded lora_alpha: a one-line error naming the fix, not a guess.
    (run / "config.yaml").write_text(yaml.safe_dump(RUN_CONFIG))
    with pytest.raises(ConfigError, match=r"holds LoRA weights .* add 'lora_alpha: VALUE'"):
        run_export(run, tmp_path / "export2")
    assert not (tmp_path / "export2").exists()


def test_card_size_row_says_what_it_measured(run_dir) -> None:
    """The size is taken before README.md and loss.png exist, so the card says it counts the model's files."""
    run, _ = run_dir
    out = run.parent / "export"
    run_export(run, out)
    card = (out / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith(f"| {ex.SIZE_ROW} |"))
    added = {"README.md", "loss.png", "export.json"}  # written after the card is rendered
    model_files = sum(f.stat().st_size for f in out.iterdir() if f.name not in added)
    assert row == f"| {ex.SIZE_ROW} | {ex.human_bytes(model_files)} |"
    assert (out / "loss.png").is_file() and ex.human_bytes(model_files) != ex.human_bytes(ex.dir_size(out))
    assert "weights, config, tokenizer" in ex.SIZE_ROW


def test_an_export_removes_what_a_killed_export_to_the_same_output_left_and_nothing_else(tmp_path: Path) -> None:
    """A SIGKILL runs no cleanup: each killed export leaves a full model copy or two in hidden folders beside
    its output. The next export to that output removes them; other outputs' and unrelated hidden folders stay."""
    src = save_tiny(tmp_path / "final")
    ours = [".export.partial-a1b2c3d_", ".export.unquantized-zz9_x0yq"]
    theirs = [".other.partial-a1b2c3d_", ".export.partial-mine", ".export.mine", ".cache", ".export.quant-gate-cache"]
    for name in ours + theirs:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / ".export.partial-zzzzzzzz").write_text("a file, not a folder of ours")
    run_export(src, tmp_path / "export")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["export", "final", ".export.partial-zzzzzzzz", *theirs]), left
    assert all((tmp_path / name / "model.safetensors").read_bytes() == b"x" * 1000 for name in theirs)


def test_an_export_killed_between_its_two_renames_gets_its_previous_export_back(tmp_path: Path) -> None:
    src = save_tiny(tmp_path / "final")
    out = tmp_path / "export"
    run_export(src, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    out.rename(tmp_path / ".export.old-0123abcd")  # the old export moved aside, the new one not yet renamed
    (tmp_path / ".export.partial-k1ll3d_x").mkdir()
    with pytest.raises(ConfigError, match="already exists; pass overwrite=true"):  # it is back, so not replaced
        run_export(src, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "final"]


def test_a_second_export_to_the_same_output_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    """A concurrent export would take the running one's temp folder for a killed export's leftovers."""
    src = save_tiny(tmp_path / "final")
    out = tmp_path / "export"
    running = tmp_path / ".export.partial-r7nn1ng_"  # the first export's half-written model
    running.mkdir()
    (running / "model.safetensors").write_bytes(b"x" * 100)
    code = ("import sys, time; from serve.export import export_lock\n"
            "with export_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ex.ExportBusy, match=f"another export to {out} is running \\(pid {holder.pid}"):
            run_export(src, out)
        assert (running / "model.safetensors").read_bytes() == b"x" * 100 and not out.exists()
    finally:
        holder.kill()
        holder.wait()
    # A killed holder leaves its lock file but no lock: the next export goes ahead, and removes both.
    assert (tmp_path / ".export.export.lock").is_file()
    run_export(src, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "final"]


def test_the_card_leaves_out_a_gate_report_about_another_model(tmp_path: Path) -> None:
    """A resumed run replaced final/ and its gate died: gate/report.json still holds the previous model's verdict.
    The card shows a report only when the model it recorded (eval.gate's candidate fingerprint) is final/."""
    from eval.fingerprint import directory_fingerprint

    run = tmp_path / "run"
    final = Path(save_tiny(run / "final", seed=0))
    (run / "gate").mkdir()
    report = {"verdict": "pass", "models": {"candidate": {"fingerprint": directory_fingerprint(final)}},
              "cache_dir": str(run / "gate" / "cache")}
    (run / "gate" / "report.json").write_text(json.dumps(report))
    (run / "gate" / "report.md").write_text("# Release gate: **PASS**\n")
    (run / "summary.json").write_text(json.dumps({"steps": 7, "gate": {"verdict": "pass", "exit_code": 0}}))
    run_export(run, tmp_path / "same")
    card = (tmp_path / "same" / "README.md").read_text()
    assert "**Verdict: PASS**" in card and "# Release gate: **PASS**" in card and "| gate.verdict | pass |" in card

    save_tiny(final, seed=1)  # the rerun's model; its gate never finished
    run_export(run, tmp_path / "changed")
    card = (tmp_path / "changed" / "README.md").read_text()
    assert "Verdict" not in card and "**PASS**" not in card and "gate.verdict" not in card
    assert "judged another model than the run's final/ now holds" in card


@pytest.mark.parametrize("under", ["", "x"])
def test_an_output_dir_under_a_file_is_one_line_and_exit_2_before_the_load(tmp_path, capsys, monkeypatch, under):
    from core.config import run_cli
    from recipes.export import main

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before output_dir was checked")

    monkeypatch.setattr(ex, "load_student", refuse)
    src = save_tiny(tmp_path / "final")
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = afile / under if under else afile
    capsys.readouterr()  # save_tiny's progress bars
    with pytest.raises(SystemExit) as stop:
        run_cli(lambda: main([f"source={src}", f"output_dir={out}"]))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: output_dir {out}") and "choose another" in err
    assert afile.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "final"]
