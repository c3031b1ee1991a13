"""recipes/retrofit.py: config checks, the training window policy and token budget, head roles shared by every
process, and the closing cache's keys."""

from __future__ import annotations

import types

import pytest
import torch

import attention
from attention.spec import HybridAttentionConfig
from core.config import ConfigError, parse_config
from core.tiny import tiny_teacher, tiny_teacher_tokenizer
from recipes.retrofit import RetrofitConfig, training_window

TINY = ["--config", "recipes/configs/retrofit_tiny.yaml"]


def test_empty_longctx_depths_is_refused_at_parse_time():
    """An empty depth list would only fail in the closing pass-key check, after the whole run trained."""
    with pytest.raises(ConfigError, match=r"longctx_depths.*longctx_lengths=\[\]") as err:
        parse_config(RetrofitConfig, [*TINY, "longctx_depths=[]"])
    assert "\n" not in str(err.value)
    # No check at all: nothing to measure, so no depths are needed.
    parse_config(RetrofitConfig, [*TINY, "longctx_depths=[]", "longctx_lengths=[]"])


def test_training_window_uses_the_whole_block_beyond_the_last_bound():
    """A policy whose last bound is a number serves its last window to every longer input too, so that entry
    trains on the whole block: cropping it to the bound would drop tokens whose mask is the same."""
    spec = HybridAttentionConfig(sink_tokens=4, window=16, global_every=32, window_policy=[[64, 8], [128, 16]])
    seen = {training_window(spec, 200, seed=0, step=s) for s in range(200)}
    assert seen == {(8, 64), (16, 200)}
    assert all(spec.window_for(n) == w for w, n in seen)
    # Within the last bound nothing changes.
    assert {training_window(spec, 100, seed=0, step=s) for s in range(200)} == {(8, 64), (16, 100)}


def _edited(module, tmp_path):
    """A copy of ``module``'s source with one more line, as after a change to that code."""
    path = tmp_path / f"{module.__name__.replace('.', '_')}.py"
    path.write_text(open(module.__file__).read() + "\n# changed\n")
    return str(path)


@pytest.mark.parametrize("module", ["attention.kernel", "attention.masks", "attention.functional",
                                    "attention.integration"])
def test_closing_cache_misses_a_changed_hybrid_attention_code(tmp_path, monkeypatch, module):
    """The hybrid model computes through the attention package: a fix there must not read results the old code
    measured (a resumed run would report them as the fixed model's). The dense check does not run that code."""
    import importlib

    from eval.metrics import LMStats
    from recipes import retrofit

    cfg = parse_config(RetrofitConfig, [*TINY, f"output_dir={tmp_path / 'o'}", f"eval_cache_dir={tmp_path / 's'}",
                                        "longctx_trials=1", "longctx_depths=[0.5]"])
    tokenizer, teacher = tiny_teacher_tokenizer(), tiny_teacher(0).eval()
    merged = attention.retrofit(tiny_teacher(0), cfg.spec()).eval()
    measured = []
    real = retrofit.run_longctx

    def counted(model, *args, **kwargs):
        measured.append("hybrid" if attention.is_hybrid(model) else "dense")
        return real(model, *args, **kwargs)

    def evaluate(accelerator, model, blocks, batch_size, reference=None, progress=None):
        measured.append(f"heldout {blocks.shape[1]}")
        return LMStats(nll_sum=float(blocks.shape[1]), tokens=blocks.numel(), agree=3, ref_tokens=4), None

    monkeypatch.setattr(retrofit, "run_longctx", counted)
    monkeypatch.setattr(retrofit, "plot_heatmap", lambda *a, **k: None)
    monkeypatch.setattr(retrofit, "evaluate", evaluate)
    accelerator = types.SimpleNamespace(num_processes=1, mixed_precision="no", device=torch.device("cpu"),
                                        is_main_process=True)
    heldout = {128: torch.arange(256).view(2, 128)}

    def closing():
        measured.clear()
        retrofit.closing_heldout(cfg, accelerator, merged, teacher, heldout, log=lambda s: None)
        retrofit.retrieval_check(cfg, merged, teacher, tokenizer, log=lambda s: None)
        return list(measured)

    assert closing() == ["heldout 128", "hybrid", "dense"]
    assert closing() == []
    monkeypatch.setattr(importlib.import_module(module), "__file__", _edited(importlib.import_module(module),
                                                                               tmp_path))
    assert closing() == ["heldout 128", "hybrid"]


@pytest.mark.parametrize("argv, fix", [
    # gate samples default to 1024 tokens, capped at seq_len (128 here): seq_len is what limits them
    (["window=100"], "raise seq_len"),
    (["seq_len=256", "gate_sample_len=64"], "raise gate_sample_len"),
    (["seq_len=256", "head_score=retrieval", "head_sample_len=64"], "raise head_sample_len"),
])
def test_head_role_samples_too_short_name_the_key_to_change(tmp_path, argv, fix):
    """The head-scoring sample length comes from gate_sample_len / head_sample_len capped at seq_len: an error
    that only says "pick a length" leaves the user to guess which of them to change."""
    import copy

    from distill.data import build_data
    from recipes.retrofit import choose_head_roles

    cfg = parse_config(RetrofitConfig, [*TINY, f"output_dir={tmp_path}", "gate_steps=1", *argv])
    tok = tiny_teacher_tokenizer()
    data = build_data(tok, dataset=cfg.dataset, seq_len=cfg.seq_len, eval_blocks=2, min_train_blocks=2,
                      progress=False)
    model = tiny_teacher(0)
    with pytest.raises(ConfigError, match=f"head roles: .*{fix}") as err:
        choose_head_roles(cfg, model, copy.deepcopy(model), tok, cfg.spec(), data.train, main=False)
    assert "\n" not in str(err.value)


def test_every_process_trains_under_the_main_process_head_roles(tmp_path, monkeypatch):
    """Each process scores the heads itself; gate training on GPUs is not bitwise reproducible, so near-tied heads
    can fall on different sides of the share on different ranks. DDP would then train one LoRA under several
    masks while final/ records only the main process's: every rank must take the main process's roles."""
    import dataclasses

    import attention.heads as heads
    from recipes import retrofit

    cfg = parse_config(RetrofitConfig, [*TINY, f"output_dir={tmp_path}"])
    spec = cfg.spec()
    mine = dataclasses.replace(spec, full_heads={0: [1]}, head_scores={"method": "gates", "scores": [[0.5]]})
    main = dataclasses.replace(spec, full_heads={0: [0]}, head_scores={"method": "gates", "scores": [[0.6]]})
    monkeypatch.setattr(heads, "find_head_roles", lambda *a, **k: mine)  # what this (non-main) rank found
    sent = []

    def broadcast(objects, from_process=0):  # the main process's objects arrive
        sent.append(list(objects))
        return [main if isinstance(o, HybridAttentionConfig) else o for o in objects]

    monkeypatch.setattr(retrofit, "broadcast_object_list", broadcast)
    model = attention.retrofit(tiny_teacher(0), spec)
    assert retrofit.choose_head_roles(cfg, model, tiny_teacher(0), None, spec, None, main=False) == main
    assert HybridAttentionConfig.from_dict(dict(model.config.hybrid_attention)) == main and sent


def test_a_token_budget_counts_the_tokens_a_window_policy_keeps(tmp_path, monkeypatch):
    """max_tokens sets max_steps so that the run trains on at least that many tokens; steps that a window policy
    crops to a shorter length train on fewer, so the budget must count the crops (summary: tokens_seen)."""
    from recipes import retrofit

    class Stop(Exception):
        pass

    seen = {}
    real = retrofit.training_function

    def spy(cfg, accelerator):
        seen["cfg"] = cfg
        return real(cfg, accelerator)

    def stop(*args, **kwargs):  # the optimizer is built after max_steps is set: nothing trains
        raise Stop

    monkeypatch.setattr(retrofit, "training_function", spy)
    monkeypatch.setattr(retrofit, "DistillModel", stop)
    with pytest.raises(Stop):
        retrofit.main([*TINY, f"output_dir={tmp_path / 'o'}", "window_policy=[[64, 8], [null, 16]]",
                       "full_head_share=0", "longctx_lengths=[]", "max_tokens=2560"])
    cfg = seen["cfg"]
    spec, batch = cfg.spec(), cfg.micro_batch_size * cfg.grad_accum
    crops = [training_window(spec, cfg.seq_len, cfg.seed, s)[1] for s in range(cfg.max_steps)]
    assert batch * sum(crops) >= 2560 > batch * sum(crops[:-1]), crops


def test_head_roles_are_scored_on_the_training_device(tmp_path, monkeypatch):
    """Head scoring / gate training runs on the dense teacher wherever it lies; left on the CPU until the optimizer
    is prepared, a GPU run would train the gates on the CPU (the README's 12 minutes instead of seconds)."""
    from accelerate import Accelerator

    import attention.heads as heads
    from recipes import retrofit

    class Stop(Exception):
        pass

    def spy(model, *args, **kwargs):
        raise Stop(next(model.parameters()).device.type)

    monkeypatch.setattr(Accelerator, "device", property(lambda self: torch.device("meta")))  # a stand-in accelerator
    monkeypatch.setattr(heads, "find_head_roles", spy)
    with pytest.raises(Stop) as where:
        retrofit.main([*TINY, f"output_dir={tmp_path / 'o'}", "longctx_lengths=[]"])
    assert where.value.args == ("meta",)
