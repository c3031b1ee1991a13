"""recipes/distill.py and recipes/cache_teacher.py: bad input is refused in one line, before any model loads and
before an existing run or cache is touched."""

from __future__ import annotations

import json
import re
import sys

import pytest

from core.config import ConfigError, parse_config
from core.rundir import MARKER
from core.tiny import save_tiny
from distill.data import parse_sources
from tests.helpers import forbid, write_text_corpus

TINY = ["--config", "recipes/configs/tiny.yaml"]
CACHED = ["hidden_weight=0", "attn_weight=0"]


@pytest.fixture
def distill(monkeypatch):
    """recipes/distill.py, with any model load failing the test: the bad input must be refused first."""
    from recipes import distill

    forbid(monkeypatch, "weights were loaded before the bad input was refused",
           (distill, "load_pair"), (distill, "load_models"))
    return distill


def _old_run(path):
    """A finished run of ours in ``path``, which ``overwrite=true`` would replace."""
    path.mkdir()
    (path / MARKER).write_text("")
    (path / "summary.json").write_text("{}")
    (path / "final").mkdir()
    return path


@pytest.mark.parametrize("meta, argv, match", [
    (None, [], "is not a teacher cache"),
    ({"mode": "topk", "seq_len": 128, "fingerprint": "0"}, [],
     "holds blocks of 128 tokens but the run uses seq_len=64; set seq_len=128"),
    ({"mode": "sampled", "seq_len": 64, "temperature": 1.0, "fingerprint": "0"}, [], "set temperature=1.0"),
    ({"mode": "topk", "seq_len": 64, "fingerprint": "0"}, ["kd_kind=reverse_kl"], "set kd_kind=forward_kl"),
    ('{"mode": "topk", "seq_len": 6', [], "meta.json is not a teacher cache's metadata .*; rewrite the cache"),
    ([], [], "meta.json is not a teacher cache's metadata .*; rewrite the cache"),
])
def test_a_bad_teacher_cache_is_refused_before_an_old_run_is_replaced(distill, tmp_path, meta, argv, match):
    cache = tmp_path / "cache"
    cache.mkdir()
    if meta is not None:  # text: a torn meta.json
        (cache / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    out = _old_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=match) as err:
        distill.main([*TINY, *CACHED, *argv, f"teacher_cache={cache}", f"output_dir={out}", "overwrite=true"])
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "summary.json", "final"])


@pytest.fixture
def cache_teacher(monkeypatch):
    """recipes/cache_teacher.py, with a teacher load failing the test."""
    import recipes.cache_teacher as cache_teacher

    forbid(monkeypatch, "the teacher was loaded before the bad input was refused",
           *((cache_teacher, name) for name in ("load_teacher", "tiny_teacher", "load_causal_lm")))
    return cache_teacher


@pytest.mark.parametrize("where, overwrite, match", [
    ("notes", True, "is a file, not a folder"),  # overwrite=true moved the user's file aside for the cache
    ("notes/cache", False, "lies under .*notes, which is a file"),
])
def test_cache_teacher_refuses_an_output_dir_that_is_or_lies_under_a_file(cache_teacher, tmp_path, monkeypatch,
                                                                          where, overwrite, match):
    (tmp_path / "notes").write_text("mine")
    monkeypatch.setattr(sys, "argv", ["cache_teacher.py", "teacher=tiny-random", f"output_dir={tmp_path / where}",
                                      f"overwrite={overwrite}"])
    with pytest.raises(ConfigError, match=match) as err:
        cache_teacher.main()
    assert "\n" not in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["notes"] and (tmp_path / "notes").read_text() == "mine"


@pytest.mark.parametrize("key", ["student", "teacher_cache", "dataset"])
def test_overwrite_refuses_to_remove_an_input_that_lies_inside_the_old_run(distill, tmp_path, key):
    out = _old_run(tmp_path / "run")
    inputs = {"student": save_tiny(out / "final"), "teacher_cache": out / "cache", "dataset": out / "train.txt"}
    (out / "cache").mkdir()
    (out / "cache" / "meta.json").write_text(json.dumps({"mode": "topk", "seq_len": 64, "fingerprint": "0"}))
    write_text_corpus(out / "train.txt")
    keep = sorted(p.relative_to(out) for p in out.rglob("*"))
    argv = [f"{key}={inputs[key]}", *(CACHED if key == "teacher_cache" else [])]
    with pytest.raises(ConfigError, match=f"{key} .* lies inside output_dir .*; move it out") as err:
        distill.main([*TINY, *argv, f"output_dir={out}", "overwrite=true"])
    assert "\n" not in str(err.value)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == keep


class _Loaded(Exception):
    """What the CE-only ablation loaded, raised out of the recipe."""


def test_the_ce_only_ablation_of_a_cached_run_never_loads_the_teacher(tmp_path, monkeypatch):
    """A cache exists because the teacher does not fit beside the student (or is not on this machine): the
    ablation that follows the distilled run must not load it either (it failed after the whole run, or ran out of
    memory)."""
    from recipes import distill

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "meta.json").write_text(json.dumps({"mode": "topk", "seq_len": 64, "fingerprint": "0"}))

    def training_function(cfg, accelerator, known_init=None):
        if known_init is None:  # the distilled run
            return {"teacher_ppl": 1.0, "student_ppl_init": 2.0, "top1_agreement_init": 0.0}
        raise _Loaded(distill.load_models(cfg))

    monkeypatch.setattr(distill, "training_function", training_function)
    with pytest.raises(_Loaded) as loaded:
        distill.main([*TINY, *CACHED, "teacher=/no/such/teacher", f"student={save_tiny(tmp_path / 'student')}",
                      f"teacher_cache={cache}", "compare_ce_only=true", f"output_dir={tmp_path / 'run'}"])
    teacher, student, _ = loaded.value.args[0]
    assert teacher is None and student is not None


@pytest.mark.parametrize("argv, match", [
    (["prune_axes=depth,mlpp"], r"unknown prune axes \['mlpp'\]; use a comma list of depth, mlp, heads, hidden"),
    (["streaming=true"], "student_init=prune calibrates on prepared blocks.*set streaming=false"),
])
def test_a_pruning_search_that_cannot_run_is_refused_before_the_teacher_loads(distill, tmp_path, argv, match):
    out = _old_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=match) as err:
        distill.main([*TINY, "student_init=prune", *argv, f"output_dir={out}", "overwrite=true"])
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "summary.json", "final"])


@pytest.mark.parametrize("argv, match", [
    (["hidden_layers=[1-3]"], r"cannot read layer pair '1-3'; use 's:t', 'relative' or 'derived' \(hidden_layers\)"),
    (["attn_layers=[1:9]"], r"teacher layer 9 is out of range for a 4-layer teacher; use 0..3 .*\(attn_layers\)"),
    (["keep_layers=0,3", "hidden_layers=[2:3]"], r"student layer 2 is out of range for a 2-layer student"),
    (["student=OTHER"], "teacher vocab_size 512 != student vocab_size 320"),
    (["student=DERIVED", "attn_layers=[3:0]"], r"student layer 3 is out of range for a 2-layer student"),
])
def test_a_pairing_that_cannot_work_is_refused_before_any_weights_load(distill, tmp_path, argv, match):
    from core.tiny import tiny_teacher, tiny_teacher_tokenizer
    from distill.student import derive_student

    derived = derive_student(tiny_teacher(0), "0,3")
    derived.save_pretrained(tmp_path / "derived")
    tiny_teacher_tokenizer().save_pretrained(tmp_path / "derived")
    paths = {"student=OTHER": f"student={save_tiny(tmp_path / 'other')}", "student=DERIVED": f"student={tmp_path / 'derived'}"}
    argv = [paths.get(a, a) for a in argv]
    out = _old_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=match) as err:
        distill.main([*TINY, *argv, f"output_dir={out}", "overwrite=true"])
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "summary.json", "final"])


def test_a_given_student_does_not_hide_a_teacher_with_a_shorter_context(distill, tmp_path):
    teacher, student = save_tiny(tmp_path / "teacher", max_pos=48), save_tiny(tmp_path / "student", max_pos=1024)
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="seq_len 64 exceeds the teacher's maximum of 48 positions; lower seq_len"):
        distill.main([*TINY, f"teacher={teacher}", f"student={student}", "hidden_layers=[relative]",
                      "attn_layers=[1:1]", f"output_dir={out}"])
    assert not out.exists()


def _chat(path, records: int, reply: bool):
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i} " * 12}]
                                          + ([{"role": "assistant", "content": f"answer {i} " * 12}] if reply else [])})
                              for i in range(records)) + "\n")
    return str(path)


def test_chat_data_without_an_assistant_reply_is_refused_not_trained_on(tmp_path):
    """completion_only scores assistant tokens only: without any, a run trained on nothing (loss 0, perplexity NaN)
    and then failed drawing loss.png."""
    from core.tiny import tiny_teacher_tokenizer
    from distill.data import DataError, build_data

    tok = tiny_teacher_tokenizer()
    args = dict(seq_len=32, eval_blocks=4, data_cache=str(tmp_path / "cache"), progress=False)
    with pytest.raises(DataError, match="has no assistant reply to train on.*set completion_only=false") as err:
        build_data(tok, dataset=_chat(tmp_path / "users.jsonl", 60, reply=False), **args)
    assert "\n" not in str(err.value)
    good = _chat(tmp_path / "chat.jsonl", 60, reply=True)
    with pytest.raises(DataError, match="the held-out text .* has no assistant reply to score"):
        build_data(tok, dataset=good, eval_dataset=_chat(tmp_path / "held.jsonl", 20, reply=False), **args)
    assert build_data(tok, dataset=good, **args).train.shape[0] > 0
    build_data(tok, dataset=str(tmp_path / "users.jsonl"), completion_only=False, **args)  # every token a target


@pytest.mark.parametrize("value, match", [
    ("{source: a.txt}", r"datasets must be a list of entries, got \{'source': 'a.txt'\}"),  # was a source 'source'
    ('[{source: a.txt, streaming: "false"}]', "streaming of 'a.txt' must be true or false, got 'false'"),  # streamed
    ("[{source: a.txt, weight: .inf}, b.txt]", "weight of 'a.txt' is inf; weights must be finite"),
    ("[{source: a.txt, split: 3}]", "split of 'a.txt' must be text, got 3"),
])
def test_a_datasets_entry_of_the_wrong_type_is_refused_not_misread(value, match):
    from core.config import parse_config
    from distill.config import DistillConfig

    with pytest.raises(ConfigError, match=match) as err:
        parse_config(DistillConfig, [f"datasets={value}"])
    assert "\n" not in str(err.value)
    cfg = parse_config(DistillConfig, ["datasets=[{source: a.txt, streaming: true, split: train}, b.txt]"])
    assert [s.streaming for s in parse_sources(cfg.datasets)] == [True, False]


@pytest.mark.parametrize("keep", ["3-", "0,a", "[0, 3]"])
def test_an_unreadable_keep_layers_names_its_format(distill, tmp_path, keep):
    with pytest.raises(ConfigError, match=r"cannot read .*; write a count \('10'\) or indices and ranges") as err:
        distill.main([*TINY, f"keep_layers={keep}", f"output_dir={tmp_path / 'run'}"])
    assert "\n" not in str(err.value) and "invalid literal" not in str(err.value)


@pytest.mark.parametrize("arg, match", [
    ("dataset={tmp}/no.jsonl", "dataset {tmp}/no.jsonl does not exist; check the path"),
    ("eval_dataset=./no-such-held-out.txt", "eval_dataset ./no-such-held-out.txt does not exist; check the path"),
    ("teacher={tmp}/no-teacher", "teacher: model path {tmp}/no-teacher does not exist; check the path"),
    ("tokenizer={tmp}/no-tok", "tokenizer: model path {tmp}/no-tok does not exist; check the path"),
])
def test_cache_teacher_refuses_a_missing_source_before_claiming_its_unfinished_folder(cache_teacher, tmp_path,
                                                                                      monkeypatch, arg, match):
    """It claimed .NAME.partial first, and the corrected rerun was refused: 'holds an unfinished cache with other
    settings'."""
    monkeypatch.setattr(sys, "argv", ["cache_teacher.py", "teacher=tiny-random", arg.format(tmp=tmp_path),
                                      f"output_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError, match=re.escape(match.format(tmp=tmp_path))) as err:
        cache_teacher.main()
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_cache_teacher_starts_over_an_unfinished_folder_that_holds_no_shard(tmp_path):
    """A run that failed before its first shard (text_field=body on records without it) left its settings there:
    the rerun with text_field fixed was refused until overwrite=true. One that holds a shard still refuses."""
    from recipes.cache_teacher import CacheTeacherConfig, claim_work, shard_name

    work = tmp_path / ".cache.partial"
    claim_work(CacheTeacherConfig(text_field="body"), work)
    assert claim_work(CacheTeacherConfig(text_field="text"), work) == 0
    assert "text_field: text" in (work / "config.yaml").read_text()
    (work / shard_name(0)).write_bytes(b"")
    with pytest.raises(ConfigError, match=r"holds an unfinished cache with other settings \(topk: 32 → 8\)"):
        claim_work(CacheTeacherConfig(topk=8), work)
    assert (work / shard_name(0)).is_file()


def test_gate_true_needs_the_teacher_that_a_cached_run_never_loads(distill, tmp_path):
    """With a cache and a student the teacher never loads, so its path went unchecked, and gate=true failed on it
    after the whole run, before summary.json had the verdict."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "meta.json").write_text(json.dumps({"mode": "topk", "seq_len": 64, "fingerprint": "0"}))
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"teacher \(gate=true compares the student with it\): model path "
                                          r".*no-teacher does not exist") as err:
        distill.main([*TINY, *CACHED, f"teacher={tmp_path / 'no-teacher'}", f"student={save_tiny(tmp_path / 's')}",
                      f"teacher_cache={cache}", "gate=true", f"output_dir={out}"])
    assert "\n" not in str(err.value) and not out.exists()


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_loading(distill, tmp_path):
    """Its ids past the vocabulary failed the first forward: IndexError (a device-side assert on a GPU)."""
    teacher = save_tiny(tmp_path / "teacher")  # 320 rows; the tiny-random tokenizer has 512 tokens
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="the tokenizer has 512 tokens but the teacher's vocabulary has 320; set "
                                          "tokenizer=") as err:
        distill.main([*TINY, f"teacher={teacher}", "keep_layers=0,1", "hidden_layers=[relative]", "attn_layers=[1:1]",
                      "tokenizer=tiny-random", f"output_dir={out}"])
    assert "\n" not in str(err.value) and not out.exists()


def test_cache_teacher_refuses_a_tokenizer_larger_than_the_teachers_vocabulary(cache_teacher, tmp_path, monkeypatch):
    teacher = save_tiny(tmp_path / "teacher")  # 320 rows; the tiny-random tokenizer has 512 tokens
    monkeypatch.setattr(sys, "argv", ["cache_teacher.py", f"teacher={teacher}", "tokenizer=tiny-random",
                                      f"output_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError, match="the tokenizer has 512 tokens but the teacher's vocabulary has 320"):
        cache_teacher.main()
    assert not (tmp_path / "cache").exists() and not (tmp_path / ".cache.partial").exists()


def test_prune_cli_refuses_a_seq_len_beyond_the_models_context(tmp_path, monkeypatch, capsys):
    from distill import prune

    forbid(monkeypatch, "the model was loaded before the bad input was refused", (prune, "load_causal_lm"),
           (prune, "calibration_data"))
    model = save_tiny(tmp_path / "model", max_pos=48)
    assert prune.main(["--model", str(model), "--target-ratio", "0.5", "--seq-len", "64",
                       "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: --seq-len 64 exceeds the model's maximum of 48 positions; lower --seq-len"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["streaming=true"], ["datasets=[{source: a.txt, streaming: true}, b.txt]",
                                                          "streaming=true"]])
def test_max_train_blocks_is_refused_where_every_source_is_streamed(argv):
    """A stream ignored the cap: the run read past it, and nothing said so."""
    from core.config import parse_config
    from distill.config import DistillConfig

    with pytest.raises(ConfigError, match="max_train_blocks caps prepared data, and a stream has no blocks to cap"):
        parse_config(DistillConfig, [*argv, "max_train_blocks=4"])
    parse_config(DistillConfig, ["datasets=[{source: a.txt, streaming: true}, b.txt]", "max_train_blocks=4"])
    parse_config(DistillConfig, ["streaming=true"])


@pytest.mark.parametrize("dataset", ["builtin:stdlib-docs", "TEXT"])
def test_chat_prompts_from_data_without_chat_are_refused_before_any_model_loads(distill, tmp_path, dataset):
    """The refusal came after both models loaded and the run folder was claimed."""
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "the fox jumps over the lazy dog"}\n')
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"has no chat records \('messages'\); use gen_prompts=prefix") as err:
        distill.main([*TINY, "on_policy_fraction=0.5", "gen_prompts=chat", "gen_prompt_tokens=16",
                      "gen_max_new_tokens=16", f"dataset={text if dataset == 'TEXT' else dataset}", f"output_dir={out}"])
    assert "\n" not in str(err.value) and not out.exists()


def test_the_early_chat_check_passes_what_may_hold_chat(tmp_path):
    from distill.data.text import SourceSpec
    from distill.on_policy import check_prompt_sources

    chat = _chat(tmp_path / "chat.jsonl", 2, reply=True)
    check_prompt_sources([SourceSpec("builtin:stdlib-docs"), SourceSpec(chat)])
    check_prompt_sources([SourceSpec("org/some-hub-chat-set")])  # judged once read, after the models load


@pytest.mark.parametrize("meta, match", [
    ({"vocab_size": 320}, "was written for a vocabulary of 320 tokens but the student has 512"),
    ({"vocab_size": 512, "tokenizer_fingerprint": "0123"}, "was written with another tokenizer"),
])
def test_a_cache_of_another_vocabulary_or_tokenizer_is_refused_before_any_model_loads(distill, tmp_path, meta, match):
    """Refused only once both models had loaded and the data was built (and hashed)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "meta.json").write_text(json.dumps({"mode": "topk", "seq_len": 64, "fingerprint": "0", **meta}))
    out = _old_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=match) as err:
        distill.main([*TINY, *CACHED, f"teacher_cache={cache}", f"output_dir={out}", "overwrite=true"])
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "summary.json", "final"])


@pytest.mark.parametrize("where, match", [("afile", "is a file, not a folder"), ("afile/data", "lies under .*afile, "
                                                                                                 "which is a file")])
def test_a_data_cache_that_is_or_lies_under_a_file_is_refused_before_any_model_loads(distill, tmp_path, where, match):
    """It failed after both models loaded, preparing the data: a FileExistsError or NotADirectoryError traceback."""
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ConfigError, match=f"data_cache .* {match}; choose another data_cache") as err:
        distill.main([*TINY, f"data_cache={tmp_path / where}", f"output_dir={tmp_path / 'run'}"])
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_data_prepare_refuses_a_data_cache_that_is_a_file(tmp_path):
    from distill.data.__main__ import main

    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ConfigError, match="data_cache .*afile is a file, not a folder; choose another data_cache"):
        main(["prepare", "teacher=tiny-random", f"data_cache={tmp_path / 'afile'}"])
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_token_budget_below_one_step_is_refused(distill, tmp_path):
    """max_tokens=100 with 128 tokens per step trained a whole step; at scale, far past the budget."""
    with pytest.raises(ConfigError, match=r"max_tokens 100 is less than one optimizer step of 128 tokens "
                                          r"\(micro_batch_size × grad_accum × 1 process\(es\) × seq_len\)") as err:
        distill.main([*TINY, "max_tokens=100", f"output_dir={tmp_path / 'run'}"])
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
    from core.config import parse_config

    distill.check_before_loading(parse_config(distill.DistillConfig, [*TINY, "max_tokens=128"]))


def test_max_train_blocks_below_one_step_is_refused_before_any_model_loads(distill, tmp_path):
    """The data refused it only after both models loaded ("gives 1 training blocks ... but the run needs 2")."""
    with pytest.raises(ConfigError, match=r"max_train_blocks 1 leaves at most 1 training blocks but one step takes 2 "):
        distill.main([*TINY, "max_train_blocks=1", f"output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_hidden_weight_without_hidden_layers_is_refused_not_a_silent_zero():
    from core.config import parse_config
    from distill.config import DistillConfig

    with pytest.raises(ConfigError, match=r"hidden_weight > 0 needs hidden_layers, e.g. hidden_layers=\[relative\]"):
        parse_config(DistillConfig, ["hidden_layers=[]"])
    assert parse_config(DistillConfig, ["hidden_layers=[]", "hidden_weight=0"]).hidden_layers == []


def test_gate_prompts_the_gate_cannot_use_as_asked_are_refused_at_parse_time():
    """Past the bundled set the gate silently ran on all of its prompts; below the gate's min_prompts the run trained
    to the end and then exited 1, its verdict inconclusive whatever the model."""
    from core.config import parse_config
    from distill.config import DistillConfig
    from eval.gate import GateConfig
    from eval.prompt_set import default_prompts_path, load_prompts

    n, least = len(load_prompts(default_prompts_path())), GateConfig.__dataclass_fields__["min_prompts"].default
    for argv, match in (([f"gate_prompts={n + 1}"], f"gate_prompts={n + 1} exceeds the {n} prompts of the bundled "
                                                   f"set; use at most {n}"),
                        (["gate=true", f"gate_prompts={least - 1}"], f"gate_prompts={least - 1} is below the gate's "
                                                                     f"min_prompts={least}: .*; use at least {least}")):
        with pytest.raises(ConfigError, match=match) as err:
            parse_config(DistillConfig, [*TINY, *argv])
        assert "\n" not in str(err.value)
    for argv in (["gate=true", f"gate_prompts={n}"], ["gate=true", f"gate_prompts={least}"], ["gate_prompts=1"]):
        parse_config(DistillConfig, [*TINY, *argv])  # the bounds, and no gate to decide on too few


@pytest.mark.parametrize("short", ["teacher", "cached teacher", "student"])
def test_a_gate_whose_metric_windows_outrun_the_models_is_refused_before_any_weights_load(distill, tmp_path,
                                                                                          monkeypatch, short):
    """The closing gate scores the final student and the teacher on 512-token windows: past a smaller model's
    positions it raised after the whole training, before summary.json was written. A cached run never loads its
    teacher, but its gate does."""
    import core.models

    forbid(monkeypatch, "weights were loaded before the bad input was refused", (core.models, "load_causal_lm"))
    teacher = save_tiny(tmp_path / "teacher", max_pos=1024 if short == "student" else 384)
    student = save_tiny(tmp_path / "student", max_pos=384 if short == "student" else 1024)
    argv = ["keep_layers=0,1", "hidden_layers=[relative]", "attn_layers=[1:1]"]
    if short == "student":
        argv.append(f"student={student}")
    elif short == "cached teacher":
        cache = tmp_path / "cache"
        cache.mkdir()
        (cache / "meta.json").write_text(json.dumps({"mode": "topk", "seq_len": 64, "fingerprint": "0"}))
        argv = [*CACHED, f"teacher_cache={cache}", f"student={student}"]
    argv = [*TINY, f"teacher={teacher}", *argv]
    out = tmp_path / "run"
    role = short.split()[-1]
    with pytest.raises(ConfigError, match=f"gate=true scores the final model on 512-token windows, past the {role}'s "
                                          "maximum of 384 positions; set gate=false and run python -m eval.gate "
                                          "--lm-seq-len 384 on final/") as err:
        distill.main([*argv, "gate=true", f"output_dir={out}"])
    assert "\n" not in str(err.value) and not out.exists()
    from core.config import parse_config

    distill.check_before_loading(parse_config(distill.DistillConfig, [*argv, "gate=false"]))  # no gate


@pytest.mark.parametrize("error, code", [
    ("GateInputError", 3), ("ScorerMissingError", 4), ("LongCtxError", 3)])
def test_a_gate_that_cannot_run_after_the_training_keeps_the_run_and_says_why_in_one_line(distill, tmp_path,
                                                                                          monkeypatch, capsys,
                                                                                          error, code):
    """A gate input error (a prompt file, the offline scorer, a long-context setting) from the closing gate escaped
    as a traceback, and summary.json was never written; it ends in one line with the code ``eval.gate`` gives it."""
    import distill.training as training
    from core.config import run_cli
    from eval.bertscore import ScorerMissingError
    from eval.longctx import LongCtxError
    from eval.prompt_set import GateInputError

    raised = {"GateInputError": GateInputError, "ScorerMissingError": ScorerMissingError,
              "LongCtxError": LongCtxError}[error]

    out = tmp_path / "run"

    def training_function(cfg, accelerator, known_init=None):  # the trained run: final/ and its figures
        (out / "final").mkdir()
        (out / "final" / "model.safetensors").write_text("weights")
        return {"steps": 6, "final_dir": str(out / "final"), "teacher_ppl": 9.0, "student_ppl_init": 20.0,
                "student_ppl_final": 12.0, "top1_agreement": 0.5, "top1_agreement_init": 0.1, "tokens_per_s": 1.0}

    def run_gate(cfg, longctx=None):
        raise raised("lm_seq_len=512 exceeds the candidate's max_position_embeddings=384; lower --lm-seq-len")

    monkeypatch.setattr(distill, "training_function", training_function)
    monkeypatch.setattr(training, "run_gate", run_gate)
    monkeypatch.setattr(training, "teacher_dir", lambda cfg, out: out / "teacher")  # not the tiny teacher's files
    with pytest.raises(SystemExit) as stop:
        run_cli(lambda: distill.main([*TINY, "gate=true", "gate_prompts=10", f"output_dir={out}"]))
    assert stop.value.code == code  # broken gate input, as python -m eval.gate exits
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.match(r"error: the release gate could not run: lm_seq_len=512 exceeds .*; the run's "
                                        r"outputs are kept \(summary.json, final/\)", err)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["student_ppl_final"] == 12.0 and summary["gate"]["verdict"] == "error"
    assert summary["gate"]["error"].startswith("lm_seq_len=512 exceeds")
    assert (out / "final" / "model.safetensors").read_text() == "weights"


@pytest.mark.parametrize("argv, match", [
    (["seq_len=2048"], "seq_len 2048 exceeds the model's maximum of 1024 positions; lower seq_len"),
    (["keep_layers=0,7"], r"keep_layers \[0, 7\] out of range for a 4-layer teacher; use 0..3 \(keep_layers\)"),
])
def test_bad_lengths_and_layers_are_refused_before_any_weights_load(distill, tmp_path, argv, match):
    out = tmp_path / "o"
    with pytest.raises(ConfigError, match=match) as err:
        distill.main([*TINY, f"output_dir={out}", *argv])
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_a_given_student_is_judged_from_its_own_config_json(distill, tmp_path):
    student = save_tiny(tmp_path / "student", max_pos=48)
    with pytest.raises(ConfigError, match="seq_len 64 exceeds the model's maximum of 48 positions"):
        distill.main([*TINY, f"student={student}", f"output_dir={tmp_path / 'o'}"])
    assert not (tmp_path / "o").exists()


def test_good_settings_pass_without_loading_weights(distill, tmp_path):
    distill.check_before_loading(parse_config(distill.DistillConfig, [*TINY, f"output_dir={tmp_path / 'o'}"]))
