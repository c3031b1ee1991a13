"""The retrofit recipe driven through its real CLI on the tiny config."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import attention
from attention.spec import CONFIG_KEY, HybridAttentionConfig
from core.config import ConfigError, parse_config
from core.tiny import tiny_teacher
from recipes.retrofit import RetrofitConfig, training_window
from tests.test_recipe_distill import run_refusing

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", "recipes/configs/retrofit_tiny.yaml"]


def run(args, check=True):
    proc = subprocess.run([sys.executable, "recipes/retrofit.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("retrofit") / "tiny"
    proc = run([*TINY, f"output_dir={out}", "max_steps=4", "save_every=2"])
    return out, proc


@pytest.mark.slow
def test_final_loads_dense_and_hybrid_without_adapter_keys(tiny_run):
    out, proc = tiny_run
    final = out / "final"
    config = json.loads((final / "config.json").read_text())
    spec = HybridAttentionConfig(sink_tokens=4, window=16, global_every=32)
    saved = HybridAttentionConfig.from_dict(config[CONFIG_KEY])
    assert saved.streaming() == spec
    # Head roles (full_head_share 0.25 of 4 layers x 2 KV heads), chosen on the dense teacher and plotted.
    assert saved.full_head_count(4, 2) == 2 and saved.head_scores["method"] == "gates"
    assert (out / "heads.png").stat().st_size > 1000
    dense = AutoModelForCausalLM.from_pretrained(final)
    assert not attention.is_hybrid(dense)
    hybrid = attention.load(final)
    assert attention.is_hybrid(hybrid)
    # Merged: exactly the base model's tensors, no LoRA / peft wrapper keys left.
    keys = set(load_file(str(final / "model.safetensors")))
    assert keys == set(tiny_teacher(0).state_dict())
    assert not [k for k in keys if "lora" in k or "base_model" in k or "modules_to_save" in k]
    # The two loads share weights and differ only in attention: equal on a short input that the
    # pattern covers densely, different on a long one.
    short, long = torch.randint(3, 512, (1, 16)), torch.randint(3, 512, (1, 200))
    with torch.no_grad():
        torch.testing.assert_close(hybrid(short).logits, dense(short).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(hybrid(long).logits, dense(long).logits, atol=1e-3)
    assert "run folder" in proc.stdout and "hybrid after" in proc.stdout
    assert (out / "loss.png").stat().st_size > 1000 and (out / "config.yaml").is_file()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-4"]


@pytest.mark.slow
def test_lora_changed_attention_norms_and_embeddings_only(tiny_run):
    out, _ = tiny_run
    before = tiny_teacher(0).state_dict()
    after = load_file(str(out / "final" / "model.safetensors"))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w = f"model.layers.1.self_attn.{name}.weight"
        delta = after[w] - before[w]
        assert delta.abs().max() > 1e-5, name
        # A merged LoRA update has at most the adapter's rank (lora_r: 4 in the tiny config).
        assert torch.linalg.matrix_rank(delta, atol=1e-6) <= 4, name
    for w in ("model.layers.0.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight",
              "model.norm.weight", "model.embed_tokens.weight"):
        assert (after[w] - before[w]).abs().max() > 1e-5, w
    for w in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"):  # lora_mlp=false; untied head frozen
        torch.testing.assert_close(after[w], before[w], rtol=0, atol=0)


@pytest.mark.slow
def test_summary_reports_what_was_saved(tiny_run):
    from recipes.retrofit import heldout_blocks

    out, _ = tiny_run
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["perplexity"]) == {"128", "256"}
    for row in summary["perplexity"].values():
        for key in ("dense", "hybrid_before", "hybrid_after"):
            assert 1.0 < row[key] < 1e4, (key, row)
    assert summary["hybrid_after_ppl"] == summary["perplexity"]["128"]["hybrid_after"]
    assert summary["environment"]["packages"]["torch"] == torch.__version__  # what the run ran under
    assert [h["window"] for h in json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())
            ["history"]] == [16] * 4
    # hybrid_after is the perplexity of final/ loaded back as hybrid; dense that of the untouched model.
    cfg = parse_config(RetrofitConfig, TINY)
    from core.tiny import tiny_teacher_tokenizer
    from eval.metrics import evaluate_lm

    blocks = heldout_blocks(cfg, tiny_teacher_tokenizer(), 256)
    batches = [{"input_ids": blocks[i:i + 2]} for i in range(0, len(blocks), 2)]
    hybrid = evaluate_lm(attention.load(out / "final"), batches)[0].perplexity
    dense = evaluate_lm(tiny_teacher(0), batches)[0].perplexity
    assert hybrid == pytest.approx(summary["perplexity"]["256"]["hybrid_after"], rel=1e-4)
    assert dense == pytest.approx(summary["perplexity"]["256"]["dense"], rel=1e-4)
    # the pass-key check ran on the final model and the dense one, with its heatmap beside the run
    assert set(summary["longctx"]["hybrid"]) == set(summary["longctx"]["dense"]) == {"256"}
    assert summary["longctx"]["depths"] == [0.1, 0.3, 0.5, 0.7, 0.9]  # interior needles (longctx_depths)
    assert 0.0 <= summary["longctx"]["hybrid"]["256"] <= 1.0 and (out / "longctx.png").stat().st_size > 1000


@pytest.mark.slow
def test_refuses_to_overwrite_a_run(tiny_run):
    out, _ = tiny_run
    before = (out / "summary.json").read_text()
    proc = run([*TINY, f"output_dir={out}"], check=False)
    assert proc.returncode == 2 and "overwrite=true" in proc.stderr.strip().splitlines()[-1]
    assert (out / "summary.json").read_text() == before


@pytest.mark.slow
def test_resume_after_kill_equals_uninterrupted(tiny_run, tmp_path):
    out, _ = tiny_run  # the uninterrupted run: max_steps=4, save_every=2
    killed = tmp_path / "killed"
    proc = run([*TINY, f"output_dir={killed}", "max_steps=4", "save_every=2", "debug_exit_at_step=3"], check=False)
    assert proc.returncode == 137 and not (killed / "final").exists()
    # The head roles (gate training) are read back from the checkpoint, never chosen again: another pick would
    # go on training LoRA under another full/streaming split.
    proc = run_refusing("attention.heads:find_head_roles",
                        [*TINY, f"output_dir={killed}", "max_steps=4", "save_every=2", "resume=latest"],
                        recipe="recipes/retrofit.py", env={"OMP_NUM_THREADS": "2"})
    assert "head gates" not in proc.stderr and "choosing them again" not in proc.stdout
    a, b = (json.loads((p / "summary.json").read_text()) for p in (out, killed))
    assert b["hybrid_attention"] == a["hybrid_attention"] and a["hybrid_attention"]["full_heads"]
    assert b["final_loss"] == pytest.approx(a["final_loss"], rel=1e-5)
    for length, row in a["perplexity"].items():
        assert b["perplexity"][length] == pytest.approx(row, rel=1e-5), length
    wa, wb = (load_file(str(p / "final" / "model.safetensors")) for p in (out, killed))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6)


def test_resume_takes_the_head_roles_the_checkpoint_trained_with(tmp_path, capsys):
    """The checkpoint's config.json spec (full heads + scores) is applied as saved; one without roles (an older
    run) or of another pattern makes the recipe choose them again, with a warning."""
    import dataclasses

    from recipes.retrofit import resumed_head_roles

    step = tmp_path / "checkpoints" / "step-2"
    (step / "student").mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / "trainer_state.json").write_text("{}")
    cfg = parse_config(RetrofitConfig, [*TINY, f"output_dir={tmp_path}", "resume=latest"])
    spec = cfg.spec()
    saved = tiny_teacher(cfg.seed)
    attention.retrofit(saved, spec)
    saved.config.save_pretrained(step / "student")  # no roles
    model = tiny_teacher(cfg.seed)
    attention.retrofit(model, spec)
    assert resumed_head_roles(cfg, model, spec, main=True) is None
    assert capsys.readouterr().out.startswith("warning:")
    roles = dataclasses.replace(spec, full_heads={1: [0], 3: [1]}, head_scores={"method": "gates", "scores": [[0.5]]})
    attention.retrofit(saved, roles)
    saved.config.save_pretrained(step / "student")
    assert resumed_head_roles(cfg, model, spec, main=True) == roles
    assert getattr(model.config, CONFIG_KEY) == roles.to_dict() and capsys.readouterr().out == ""
    other = dataclasses.replace(spec, window=spec.window + 1)
    assert resumed_head_roles(cfg, model, other, main=True) is None and "warning:" in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["windw=8"], "did you mean window"),
    (["window=0"], "window must be > 0"),
    # the retrieval check's lengths come from the tokenizer and config.json, before the run folder is claimed
    (["longctx_lengths=[100]"], "longctx_lengths: length 100 is too short for a passkey prompt; use lengths >="),
    (["longctx_lengths=[256, 100000]"], "longctx_lengths up to 100000 exceed the model's maximum"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, needle):
    proc = run([*TINY, f"output_dir={tmp_path / 'o'}", *args], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and needle in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, match", [
    (["window=-3"], "window must be > 0"),
    (["sink_tokens=-1"], "sink_tokens must be >= 0"),
    (["window_policy=[[64, 8], [32, 16]]"], "bounds must strictly increase"),
    (["window_policy=[[64, 8], [64, 16], [null, 32]]"], r"bounds must strictly increase.*got \[64, 64, None\]"),
    (["window_policy=[[64, 8.5]]"], "integers with windows > 0"),
    (["window_policy=[8, 16]"], "pairs"),
    (["lora_r=0"], "lora_r must be >= 1"),
    (["eval_seq_lens=[1]"], "eval_seq_lens"),
    (["resume=latest", "overwrite=true"], "contradict"),
    (["head_score=duo"], "head_score must be one of retrieval, mass, gates"),
    (["full_head_share=1.5"], r"full_head_share must be in \[0, 1\]"),
    (["gate_steps=0"], "gate_steps must be >= 1"),
    (["gate_window=0"], "gate_window must be >= 1"),
    (["gate_context=exact"], "gate_context must be one of gated, dense"),
    (["longctx_depths=[0.5, 1.5]"], r"longctx_depths must be in \[0, 1\]"),
])
def test_config_errors_name_the_fix(argv, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_config(RetrofitConfig, [*TINY, *argv])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("context, want", [("gated", 64), ("dense", 256)])
def test_gate_samples_are_capped_at_seq_len_unless_dense_context(monkeypatch, tmp_path, context, want):
    """Dense-context gates cost a few tokens a step whatever the length: their samples may run past
    seq_len up to the model's context (here 256); exact (gated) ones stay within seq_len."""
    import types

    import attention.heads as heads
    from recipes import retrofit

    seen = {}

    def spy(model, tokenizer, spec, haystack, **kw):
        seen.update(kw)
        return spec

    monkeypatch.setattr(heads, "find_head_roles", spy)
    monkeypatch.setattr(retrofit.attention, "retrofit", lambda model, spec: model)
    monkeypatch.setattr(heads, "plot_head_scores", lambda *a, **k: None)
    cfg = parse_config(RetrofitConfig, [*TINY, "seq_len=64", "gate_sample_len=1000", f"gate_context={context}",
                                        f"output_dir={tmp_path}"])
    teacher = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=256))
    spec = HybridAttentionConfig(sink_tokens=4, window=16, global_every=32)
    assert retrofit.choose_head_roles(cfg, None, teacher, None, spec, None, main=False) is spec
    assert seen["length"] == want and seen["gate_context"] == context


def test_training_window_follows_the_served_policy():
    plain = HybridAttentionConfig(sink_tokens=4, window=16, global_every=32)
    assert training_window(plain, 128, seed=0, step=5) == (16, 128)
    spec = HybridAttentionConfig(sink_tokens=4, window=16, global_every=32,
                                 window_policy=[[64, 8], [128, 16], [512, 32], [None, 64]])
    seen = {training_window(spec, 128, seed=0, step=s) for s in range(200)}
    # Entries whose length range starts at or beyond seq_len are never served at this length.
    assert seen == {(8, 64), (16, 128)}
    # Each (window, crop) is what the policy serves for an input of exactly `crop` tokens.
    assert all(spec.window_for(n) == w for w, n in seen)
    assert training_window(spec, 100, seed=3, step=7) == training_window(spec, 100, seed=3, step=7)
    assert {training_window(spec, 100, seed=0, step=s) for s in range(200)} == {(8, 64), (16, 100)}


def test_smollm2_config_is_the_default():
    import dataclasses

    cfg = parse_config(RetrofitConfig, ["--config", "recipes/configs/retrofit_smollm2.yaml"])
    assert dataclasses.asdict(cfg) == dataclasses.asdict(RetrofitConfig())
    assert cfg.spec() == HybridAttentionConfig(sink_tokens=128, window=512, global_every=1024,
                                               window_policy=[[4096, 512], [None, 2048]])
    assert round(cfg.full_head_share * 90) == 40  # SmolLM2-135M: 30 layers x 3 KV heads


def test_checkpoint_recompute_uses_the_step_window():
    """Gradients under activation checkpointing equal plain ones for a sampled (non-default) window."""
    from recipes.retrofit import enable_gradient_checkpointing

    spec = HybridAttentionConfig(sink_tokens=2, window=16, global_every=0)
    ids = torch.randint(3, 512, (1, 64))

    def grads(window, checkpointing):
        model = attention.retrofit(tiny_teacher(0), spec).train()
        if checkpointing:
            enable_gradient_checkpointing(model, {"window": window})
            assert all(layer.gradient_checkpointing for layer in model.model.layers)  # the flag of every release
        with attention.use_window(window):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # outside the window block, as in the recipe
        return {n: p.grad.clone() for n, p in model.named_parameters() if "q_proj" in n}

    plain = grads(4, checkpointing=False)
    for n, g in grads(4, checkpointing=True).items():
        torch.testing.assert_close(g, plain[n], rtol=1e-4, atol=1e-6)
    # The window matters for these gradients, so a recompute with the spec's window would be caught.
    default = grads(16, checkpointing=False)
    assert any(not torch.allclose(default[n], plain[n], atol=1e-5) for n in plain)


def test_missing_data_and_an_output_under_a_file_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    import recipes.retrofit as retrofit

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")
    monkeypatch.setattr(retrofit, "load_models", loaded)
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    out = f"output_dir={tmp_path / 'o'}"
    for argv, match in (([f"output_dir={afile}/x"], "lies under .*afile, which is a file; choose another output_dir"),
                        ([out, f"dataset={tmp_path}/no.jsonl"], "dataset .*no.jsonl does not exist; check the path"),
                        ([out, "eval_dataset=./held-out/"], "eval_dataset ./held-out/ does not exist"),
                        ([out, "teacher=/no/such/model"], "teacher: model path /no/such/model does not exist")):
        with pytest.raises(ConfigError, match=match) as err:
            retrofit.main([*TINY, *argv])
        assert "\n" not in str(err.value)
    assert sorted(tmp_path.iterdir()) == [afile] and afile.read_text() == "not a folder"


# Runs the recipe with the closing measurements counted: eval.longctx.run_longctx (one pass-key check per model)
# and distill.training.evaluate on the merged model (one per held-out length). argv: the recipe, its arguments.
COUNTING = """import atexit, json, runpy, sys
import distill.training as training
import eval.longctx as longctx
calls = {"passkey": 0, "heldout": 0}
real_longctx, real_evaluate = longctx.run_longctx, training.evaluate
def run_longctx(*a, **k):
    calls["passkey"] += 1
    return real_longctx(*a, **k)
def evaluate(*a, **k):
    calls["heldout"] += "merged" in (k.get("progress") or "")
    return real_evaluate(*a, **k)
longctx.run_longctx, training.evaluate = run_longctx, evaluate
atexit.register(lambda: print("CALLS " + json.dumps(calls)))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
CLOSING = ("perplexity", "hybrid_after_ppl", "top1_agreement", "kl_to_dense", "longctx")


def run_counting(args):
    """``(summary, calls, stdout)`` of a tiny retrofit run whose closing measurements are counted."""
    proc = subprocess.run([sys.executable, "-c", COUNTING, "recipes/retrofit.py", *TINY, *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    calls = json.loads(proc.stdout.split("CALLS ")[-1])
    out = next(a.split("=", 1)[1] for a in args if a.startswith("output_dir="))
    return json.loads((Path(out) / "summary.json").read_text()), calls, proc.stdout


def test_closing_evaluation_is_cached_for_a_resume_and_the_dense_check_across_runs(tmp_path):
    """A run killed during its closing evaluation and resumed (here: resumed once finished, which replays the
    same merge) reads the results back instead of measuring again, and reports the same numbers; a changed
    pass-key setting measures the check again; another run on the same teacher reuses the dense check only."""
    shared = f"eval_cache_dir={tmp_path / 'shared'}"
    a = [f"output_dir={tmp_path / 'a'}", shared, "max_steps=2", "save_every=2"]
    first, calls, out = run_counting(a)
    assert calls == {"passkey": 2, "heldout": 2} and "from the cache" not in out
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "a" / "eval_cache").iterdir()) == ["heldout", "passkey"]
    assert [p.name.split("-")[1] for p in (tmp_path / "shared").iterdir()] == ["dense"]
    (tmp_path / "a" / "longctx.png").unlink()

    again, calls, out = run_counting([*a, "resume=latest"])
    assert calls == {"passkey": 0, "heldout": 0}
    assert [line.split(" from the cache")[0] for line in out.splitlines() if "from the cache" in line] == [
        "closing evaluation: heldout", "closing evaluation: passkey-hybrid", "closing evaluation: passkey-dense"]
    assert {k: again[k] for k in CLOSING} == {k: first[k] for k in CLOSING}  # exactly: the measured numbers
    assert (tmp_path / "a" / "longctx.png").stat().st_size > 1000  # the heatmap is drawn from the cached result

    more, calls, out = run_counting([*a, "resume=latest", "longctx_trials=2"])  # another check: both measured
    assert calls == {"passkey": 2, "heldout": 0} and more["longctx"]["trials"] == 2
    assert {k: more[k] for k in CLOSING if k != "longctx"} == {k: first[k] for k in CLOSING if k != "longctx"}

    other, calls, out = run_counting([f"output_dir={tmp_path / 'b'}", shared, "max_steps=2", "save_every=2",
                                      "full_head_share=0"])  # another model from the same teacher
    assert calls == {"passkey": 1, "heldout": 2} and "passkey-dense from the cache" in out
    assert other["longctx"]["dense"] == first["longctx"]["dense"]


def test_closing_cache_misses_a_changed_model_or_setting(tmp_path, monkeypatch):
    """Each key holds the measured weights and config (head roles included) and every setting of the measurement:
    a change to any of them measures again, an unchanged one reads the cache back; a torn entry is measured again."""
    import dataclasses
    import types

    from core.tiny import tiny_teacher_tokenizer
    from eval.metrics import LMStats
    from recipes import retrofit

    cfg = parse_config(RetrofitConfig, [*TINY, f"output_dir={tmp_path / 'o'}", f"eval_cache_dir={tmp_path / 's'}"])
    tokenizer, teacher = tiny_teacher_tokenizer(), tiny_teacher(0).eval()
    merged = attention.retrofit(tiny_teacher(0), cfg.spec()).eval()
    measured, logs = [], []
    real = retrofit.run_longctx

    def counted(model, *args, **kwargs):
        measured.append("hybrid" if attention.is_hybrid(model) else "dense")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(retrofit, "run_longctx", counted)
    monkeypatch.setattr(retrofit, "plot_heatmap", lambda *a, **k: None)

    def check(want):
        measured.clear()
        result = retrofit.retrieval_check(cfg, merged, teacher, tokenizer, log=logs.append)
        assert measured == want
        return result

    first = check(["hybrid", "dense"])
    assert check([]) == first and len(logs) == 2
    with torch.no_grad():
        merged.model.norm.weight[0] += 1e-3  # one weight of the final model
    check(["hybrid"])
    with torch.no_grad():
        teacher.model.embed_tokens.weight[5, 0] += 1e-3  # one weight of the dense model
    check(["dense"])
    attention.retrofit(merged, dataclasses.replace(cfg.spec(), full_heads={1: [0]}))  # other head roles
    check(["hybrid"])
    for key, value in (("longctx_trials", 2), ("longctx_depths", [0.5]), ("seed", 1), ("longctx_lengths", [200])):
        setattr(cfg, key, value)
        check(["hybrid", "dense"])
    check([])
    for entry in (tmp_path / "s").iterdir():
        entry.write_text(entry.read_text()[:-20])  # torn
    check(["dense"])

    # Held-out perplexity and agreement: keyed by both models, the blocks and the batching.
    calls = []

    def evaluate(accelerator, model, blocks, batch_size, reference=None, progress=None):
        calls.append(blocks.shape[1])
        return LMStats(nll_sum=float(blocks.shape[1]), tokens=blocks.numel(), agree=3, ref_tokens=4), None

    monkeypatch.setattr(retrofit, "evaluate", evaluate)
    accelerator = types.SimpleNamespace(num_processes=1, mixed_precision="no", device=torch.device("cpu"),
                                        is_main_process=True)
    heldout = {128: torch.arange(256).view(2, 128), 256: torch.arange(512).view(2, 256)}

    def heldout_check(want):
        calls.clear()
        result = retrofit.closing_heldout(cfg, accelerator, merged, teacher, heldout, log=logs.append)
        assert calls == want
        return result

    first = heldout_check([128, 256])
    assert heldout_check([]) == first and first["top1_agreement"] == 0.75
    with torch.no_grad():
        merged.model.layers[0].self_attn.q_proj.weight[0, 0] += 1e-3
    heldout_check([128, 256])
    heldout[256] = heldout[256] + 1  # other held-out text
    heldout_check([128, 256])
    cfg.micro_batch_size = 1
    heldout_check([128, 256])
    heldout_check([])
