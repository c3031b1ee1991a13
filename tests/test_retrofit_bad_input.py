"""recipes/retrofit.py's bad input: one line naming the fix, at parse time (before the run folder or a model)."""

from __future__ import annotations

import pytest
import torch

from attention import HybridAttentionConfig
from core.config import ConfigError, parse_config
from recipes.retrofit import RetrofitConfig

TINY = ["--config", "recipes/configs/retrofit_tiny.yaml"]


def test_a_window_the_policy_never_serves_is_refused():
    """With a window_policy the policy picks the window at every length (training and serving): a window= outside
    it was accepted and silently unused (the default policy made window=... on the command line a no-op)."""
    with pytest.raises(ConfigError, match=r"window=32 is never used: window_policy sets the window at every length "
                                          r"\(\[8, 16\]\); set window to one of those, or window_policy=null") as err:
        parse_config(RetrofitConfig, [*TINY, "window=32", "window_policy=[[64, 8], [null, 16]]"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="window=1024 is never used"):
        parse_config(RetrofitConfig, ["window=1024"])  # the built-in default policy
    parse_config(RetrofitConfig, [*TINY, "window=8", "window_policy=[[64, 8], [null, 16]]"])
    parse_config(RetrofitConfig, [*TINY, "window=32", "window_policy=null"])


def test_a_policy_entry_for_one_token_inputs_is_refused():
    """A step that draws the bound-1 entry trains on a 1-token crop of each block: no target, loss 0, and the
    optimizer still stepped (on Adam's momentum) and the schedule went on."""
    from recipes.retrofit import training_window

    argv = [*TINY, "window=8", "window_policy=[[1, 8], [null, 16]]"]
    with pytest.raises(ConfigError, match=r"starts with bound 1: its steps train on 1-token crops.*bounds at 2") as err:
        parse_config(RetrofitConfig, argv)
    assert "\n" not in str(err.value)
    spec = HybridAttentionConfig(sink_tokens=4, window=8, global_every=32, window_policy=[[1, 8], [None, 16]])
    assert (8, 1) in {training_window(spec, 128, 0, step) for step in range(20)}  # what it would have trained on
    parse_config(RetrofitConfig, [*TINY, "window=8", "window_policy=[[2, 8], [null, 16]]"])


def test_more_gate_prompts_than_the_bundled_set_holds_is_refused():
    """The gate takes the first gate_prompts of the bundled set: asking for more ran on all of them, silently fewer."""
    from eval.prompt_set import default_prompts_path, load_prompts

    n = len(load_prompts(default_prompts_path()))
    with pytest.raises(ConfigError, match=f"gate_prompts={n + 1} exceeds the {n} prompts of the bundled set; use at "
                                          f"most {n}") as err:
        parse_config(RetrofitConfig, [*TINY, "gate=true", f"gate_prompts={n + 1}"])
    assert "\n" not in str(err.value)
    parse_config(RetrofitConfig, [*TINY, "gate=true", f"gate_prompts={n}"])


def test_fewer_gate_prompts_than_the_gate_decides_on_is_refused():
    """Below the gate's min_prompts its verdict is inconclusive whatever the model: the run trained to the end and
    then exited 1."""
    from eval.gate import GateConfig

    least = GateConfig.__dataclass_fields__["min_prompts"].default
    with pytest.raises(ConfigError, match=f"gate_prompts={least - 1} is below the gate's min_prompts={least}"):
        parse_config(RetrofitConfig, [*TINY, "gate=true", f"gate_prompts={least - 1}"])
    parse_config(RetrofitConfig, [*TINY, "gate=true", f"gate_prompts={least}"])
    parse_config(RetrofitConfig, [*TINY, f"gate_prompts={least - 1}"])  # no gate: nothing decides on them


@pytest.mark.parametrize("argv", [["head_score=retrieval"], ["full_head_share=0"]])
def test_a_gate_window_no_gates_train_under_is_refused(argv):
    """gate_window is the window the learned gates train under: without gate training it was silently ignored."""
    with pytest.raises(ConfigError, match=r"gate_window=8 is never used: gates train only with head_score=gates and "
                                          r"full_head_share > 0 .*drop it \(gate_window=null\)") as err:
        parse_config(RetrofitConfig, [*TINY, "gate_window=8", *argv])
    assert "\n" not in str(err.value)
    parse_config(RetrofitConfig, [*TINY, "gate_window=8"])  # the tiny config learns gates


def test_a_gate_whose_metric_windows_outrun_the_model_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    """The closing gate scores the final model on 512-token windows: past a smaller model's positions it raised after
    the whole training, before summary.json was written."""
    import core.models
    from core.tiny import save_tiny
    from recipes import retrofit
    from tests.helpers import forbid

    forbid(monkeypatch, "weights were loaded before the bad input was refused", (retrofit, "load_models"),
           (retrofit, "load_causal_lm"), (core.models, "load_causal_lm"))
    model = save_tiny(tmp_path / "model", max_pos=384)
    argv = [*TINY, f"teacher={model}", "eval_seq_lens=[]", "longctx_lengths=[]", "full_head_share=0"]
    with pytest.raises(ConfigError, match="gate=true scores the final model on 512-token windows, past the model's "
                                          "maximum of 384 positions; set gate=false and run python -m eval.gate "
                                          "--lm-seq-len 384 on final/") as err:
        retrofit.main([*argv, "gate=true", f"output_dir={tmp_path / 'o'}"])
    assert "\n" not in str(err.value) and not (tmp_path / "o").exists()
    retrofit.check_before_loading(parse_config(RetrofitConfig, [*argv, f"output_dir={tmp_path / 'o'}"]))  # no gate


@pytest.mark.parametrize("argv, dense", [
    (["window=1020"], True), (["window=1019"], False),  # sinks 4: key 4 leaves query 1023's window at 1019
    (["sink_tokens=1000", "window=24"], True),
    (["window=600", "window_policy=[[512, 600], [null, 1024]]"], True),
    (["window=16", "window_policy=[[512, 16], [null, 1024]]"], False),
])
def test_a_pattern_dense_at_every_length_the_model_takes_is_refused(tmp_path, argv, dense):
    """sink_tokens + window covering the model's whole context makes the hybrid model the dense one at every length:
    the retrofit trained and shipped it as hybrid, changing nothing."""
    from attention.masks import hybrid_mask
    from recipes.retrofit import check_before_loading

    cfg = parse_config(RetrofitConfig, [*TINY, *argv, "full_head_share=0", f"output_dir={tmp_path / 'o'}"])
    spec = cfg.spec()
    # the naive reference at every policy bound and at the model's 1024 positions
    lengths = [min(1024, b or 1024) for b, _ in spec.window_policy or [(None, 0)]]
    assert all(hybrid_mask(n, spec).equal(torch.ones(n, n, dtype=torch.bool).tril()) for n in lengths) == dense
    if dense:
        with pytest.raises(ConfigError, match="cover the model's whole context of 1024 positions at every length: "
                                              "the hybrid pattern would be dense attention") as err:
            check_before_loading(cfg)
        assert "\n" not in str(err.value)
    else:
        check_before_loading(cfg)


@pytest.mark.parametrize("stored", ["sinks and a window", ["sink", 4], {"window": 0}])
def test_a_checkpoint_spec_that_is_no_valid_object_chooses_the_roles_again(tmp_path, monkeypatch, capsys, stored):
    """Resume reads the head roles from the checkpoint's student/config.json: a spec there that is a string raised
    dict()'s ValueError (a traceback) where any other unreadable spec chose the roles again, with a warning."""
    from recipes import retrofit

    monkeypatch.setattr(retrofit.ckpt, "resolve_resume", lambda resume, out: tmp_path / "step-2")
    monkeypatch.setattr(retrofit.ckpt, "model_config", lambda path: {"hybrid_attention": stored})
    cfg = parse_config(RetrofitConfig, [*TINY, "resume=latest", f"output_dir={tmp_path}"])
    assert retrofit.resumed_head_roles(cfg, None, cfg.spec(), True) is None
    assert "holds no head roles for this spec" in capsys.readouterr().out
