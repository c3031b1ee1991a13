"""The release gate end to end on tiny models: verdicts, determinism, cache, exit codes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.tiny import save_tiny
from eval.bertscore import BertScore
from eval.gate import SCHEMA, GateConfig, main, run_gate
from eval.prompt_set import GateInputError, default_prompts_path

N_PROMPTS = 32
FAST = dict(max_new_tokens=8, batch_size=N_PROMPTS, resamples=2000)


def _perturb(model_dir: Path, scale: float, seed: int) -> None:
    """Add Gaussian noise to every weight, rewriting model.safetensors in place."""
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    noisy = {k: (v + scale * torch.randn(v.shape, generator=g)).contiguous() for k, v in tensors.items()}
    save_file(noisy, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    orig = save_tiny(root / "orig", seed=0)
    lines = default_prompts_path().read_text().splitlines()[:N_PROMPTS]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (root / "heldout.txt").write_text("the quick brown fox jumps over the lazy dog. " * 30 + "héllo wörld ✓\n")
    return {"root": root, "orig": Path(orig), "prompts": root / "prompts.jsonl", "scorer": BertScore()}


def _cfg(env, out: str, **kw) -> GateConfig:
    base = dict(baseline=str(env["orig"]), prompts=str(env["prompts"]), out=str(env["root"] / out),
                cache_dir=str(env["root"] / "shared-cache"), **FAST)
    base.update(kw)
    return GateConfig(**base)


def test_same_model_passes_with_zero_in_interval(env):
    cfg = _cfg(env, "self", candidate=str(env["orig"]), heldout=str(env["root"] / "heldout.txt"))
    res = run_gate(cfg, scorer=env["scorer"])
    d = res.report["bertscore"]["difference"]
    assert res.verdict == "pass" and res.exit_code == 0
    assert d["low"] <= 0.0 <= d["high"]
    assert res.report["mode"] == "drift"
    assert res.report["floor"]["new_below_count"] == 0
    lm = res.report["lm_metrics"]["metrics"]
    assert lm["top1_agreement"]["candidate"]["mean"] == pytest.approx(1.0)
    assert lm["kl"]["candidate"]["mean"] == pytest.approx(0.0, abs=1e-6)
    assert lm["bits_per_byte"]["candidate"]["mean"] == pytest.approx(lm["bits_per_byte"]["baseline"]["mean"])
    for name in ("report.json", "report.md", "scores_hist.png", "samples.jsonl"):
        assert (res.report_dir / name).is_file()
    on_disk = json.loads(res.report_json.read_text())
    assert on_disk["verdict"] == "pass" and len(on_disk["bertscore"]["settings_hash"]) == 16
    assert "## Worst 10" in res.report_md.read_text()


def test_degraded_candidate_fails_against_teacher_references(env):
    cand = env["root"] / "degraded"
    shutil.copytree(env["orig"], cand)
    _perturb(cand, 0.01, seed=1)
    # References are the original's generations: the baseline (= original) scores 1.0 on each prompt.
    cfg = _cfg(env, "degraded", candidate=str(cand), teacher=str(env["orig"]), skip_lm_metrics=True,
               max_new_below_floor=0)
    res = run_gate(cfg, scorer=env["scorer"])
    bs = res.report["bertscore"]
    assert res.report["mode"] == "teacher"
    assert bs["baseline"]["mean"] == pytest.approx(1.0)
    assert bs["difference"]["high"] < -0.02
    assert res.verdict == "fail" and res.exit_code == 1
    assert res.report["floor"]["new_below_count"] > 0
    assert len(res.report["worst"]) == 10
    assert res.report["worst"][0]["difference"] <= res.report["worst"][-1]["difference"]


def test_scores_repeat_cache_hits_and_misses_after_weight_change(env):
    cand = env["root"] / "cand"
    shutil.copytree(env["orig"], cand)
    cache = str(env["root"] / "own-cache")
    cfg = _cfg(env, "cache", candidate=str(cand), teacher=str(env["orig"]), cache_dir=cache, skip_lm_metrics=True)
    first = run_gate(cfg, scorer=env["scorer"])
    assert first.report["models"]["candidate"]["cache_misses"] == N_PROMPTS
    # Content-addressed: the baseline has the same bytes as the candidate copy, so it hits.
    assert first.report["models"]["baseline"]["cache_hits"] == N_PROMPTS
    second = run_gate(cfg, scorer=env["scorer"])
    assert second.report["models"]["candidate"]["cache_hits"] == N_PROMPTS
    assert second.report["models"]["candidate"]["cache_misses"] == 0
    rows1 = (first.report_dir / "samples.jsonl").read_text()
    assert rows1 and (second.report_dir / "samples.jsonl").read_text() == rows1
    assert first.report["bertscore"] == second.report["bertscore"]

    _perturb(cand, 1e-3, seed=2)
    third = run_gate(cfg, scorer=env["scorer"])
    assert third.report["models"]["candidate"]["cache_misses"] == N_PROMPTS
    assert third.report["models"]["candidate"]["fingerprint"] != first.report["models"]["candidate"]["fingerprint"]
    assert third.report["models"]["baseline"]["cache_hits"] == N_PROMPTS


@pytest.mark.slow
def test_cache_key_includes_generation_settings(env):
    cfg = _cfg(env, "settings", candidate=str(env["orig"]), skip_lm_metrics=True, max_new_tokens=5)
    res = run_gate(cfg, scorer=env["scorer"])
    assert res.report["models"]["candidate"]["cache_misses"] == N_PROMPTS
    again = run_gate(GateConfig(**{**cfg.__dict__, "max_new_tokens": 6}), scorer=env["scorer"])
    assert again.report["models"]["candidate"]["cache_misses"] == N_PROMPTS


def test_few_prompts_is_inconclusive_not_pass(env):
    short = env["root"] / "three.jsonl"
    short.write_text("\n".join(env["prompts"].read_text().splitlines()[:3]) + "\n")
    res = run_gate(_cfg(env, "few", candidate=str(env["orig"]), prompts=str(short), skip_lm_metrics=True),
                   scorer=env["scorer"])
    assert res.verdict == "inconclusive" and res.exit_code == 2


# -- bad input: exit code >= 3 and one line ---------------------------------------------------------


def _bad(env, tmp_path, capsys, argv: list[str]) -> tuple[int, str]:
    code = main(["--candidate", str(env["orig"]), "--baseline", str(env["orig"]), "--out", str(tmp_path / "o"),
                 *argv])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("content, needle", [
    ('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"\n', "line 2: not valid JSON"),
    ("", "is empty"),
    ('{"id": 1, "prompt": ""}\n', "non-empty string"),
    ('{"id": 1, "prompt": "a", "refrence": "x"}\n', "did you mean 'reference'"),
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "make ids unique"),
    ('{"id": 1, "prompt": "a", "reference": "r"}\n{"id": 2, "prompt": "b"}\n', "on every line or on none"),
    ('["a"]\n', "expected a JSON object"),
])
def test_malformed_prompt_file_exits_3_with_one_line(env, tmp_path, capsys, content, needle):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(content)
    code, err = _bad(env, tmp_path, capsys, ["--prompts", str(bad)])
    assert code == 3
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "o" / "report.json").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--max-drop", "2"], "max_drop"),
    (["--prompts", "/nonexistent/p.jsonl"], "does not exist"),
    (["--teacher", "/nonexistent/model"], "does not exist"),
    (["--heldout", "/nonexistent/h.txt"], "heldout"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--max-new-tokens", "many"], "invalid int value"),
    (["--scorer-layer", "9"], "scorer_layer"),
])
def test_bad_options_exit_3_with_one_line(env, tmp_path, capsys, argv, needle):
    code, err = _bad(env, tmp_path, capsys, argv)
    assert code == 3 and len(err.splitlines()) == 1 and needle in err, err


def test_missing_model_and_references_errors(env, tmp_path, capsys):
    no_config = tmp_path / "empty_model"
    no_config.mkdir()
    code = main(["--candidate", str(no_config), "--baseline", str(env["orig"]), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 3 and len(err.splitlines()) == 1 and "config.json" in err
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"id": "p001", "reference": "x"}\n')
    code, err = _bad(env, tmp_path, capsys, ["--prompts", str(env["prompts"]), "--references", str(refs)])
    assert code == 3 and "no reference for prompt id 'p002'" in err


def test_broken_weights_exit_4(env, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(env["orig"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    code, err = _bad(env, tmp_path, capsys, ["--candidate", str(broken), "--prompts", str(env["prompts"]),
                                             "--max-new-tokens", "2"])
    # argparse keeps the last --candidate
    assert code == 4 and len(err.splitlines()) == 1 and "cannot load the model" in err, err


def test_cli_subprocess_bad_input(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    proc = subprocess.run([sys.executable, "-m", "eval.gate", "--candidate", str(tmp_path), "--baseline",
                           str(tmp_path), "--prompts", str(bad), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines()[-1] == "error: p.jsonl line 2: not valid JSON; fix or remove the line"


def test_reference_mode_flags_texts_past_the_scorer_window(env):
    rows = [json.loads(line) for line in env["prompts"].read_text().splitlines()[:12]]
    for k, row in enumerate(rows):
        row["reference"] = "a long reference " * 250 if k == 0 else f"reference text number {k}"
    f = env["root"] / "with_refs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env["scorer"].batch_size = 4  # keep the 512-wide padding to the one batch holding the long text
    try:
        res = run_gate(_cfg(env, "refs", candidate=str(env["orig"]), prompts=str(f), skip_lm_metrics=True),
                       scorer=env["scorer"])
    finally:
        env["scorer"].batch_size = 64
    assert res.report["mode"] == "references"
    assert res.report["long_texts"] == [{"id": rows[0]["id"], "which": "reference", "tokens": 750}]
    assert any("exceed the scorer" in r for r in res.report["reasons"])
    assert res.verdict == "pass"  # same model: differences are exactly zero


def test_gate_generates_with_the_models_saved_hybrid_attention(tmp_path):
    """A retrofitted model is judged as it is served: hybrid, not the dense model plain loading gives."""
    import attention
    from core.tiny import tiny_model, tiny_tokenizer
    from eval.generation import GenerationSettings, generate_outputs, load_model
    from eval.prompt_set import Prompt

    model = tiny_model("llama", seed=3)
    attention.retrofit(model, attention.HybridAttentionConfig(sink_tokens=1, window=4, global_every=0))
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m", "cpu", "fp32")
    assert attention.is_hybrid(loaded)

    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    hybrid = attention.load(tmp_path / "m").eval()
    prompt = Prompt(id="p", prompt="the quick brown fox jumps over the lazy dog " * 3)
    settings = GenerationSettings(max_new_tokens=8, batch_size=1)
    got = generate_outputs(tmp_path / "m", [prompt], settings, cache_dir=None).outputs[0]

    tok = tiny_tokenizer()
    ids = torch.tensor([tok(prompt.prompt)["input_ids"]])

    def greedy(m):
        out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=0, eos_token_id=2)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()

    assert greedy(dense) != greedy(hybrid)  # the pattern matters at this length
    assert got == greedy(hybrid)


@pytest.mark.parametrize("cand_acc, verdict", [(0.5, "fail"), (0.95, "pass")])
def test_longctx_check_fails_a_candidate_that_lost_retrieval(env, monkeypatch, cand_acc, verdict):
    """--longctx loads each model as served and fails the gate when retrieval drops below the ratio."""
    import eval.gate as gate

    seen = {}

    def fake_run(model, tok, *, lengths, **kw):
        acc = cand_acc if seen.setdefault("calls", 0) == 0 else 1.0
        seen["calls"] += 1
        return {"accuracy": {"passkey": {str(n): acc for n in lengths}}}

    monkeypatch.setattr(gate, "run_longctx", fake_run)
    cfg = _cfg(env, f"longctx-{verdict}", candidate=str(env["orig"]), skip_lm_metrics=True, longctx="256,512")
    res = run_gate(cfg, scorer=env["scorer"])
    assert res.verdict == verdict and seen["calls"] == 2
    report = res.report["longctx"]
    assert report["candidate"]["accuracy"] == {"256": cand_acc, "512": cand_acc}
    assert report["candidate"]["attention"] == report["baseline"]["attention"] == "dense"
    if verdict == "fail":
        assert any("long-context retrieval at 256" in r for r in res.report["reasons"])


def test_longctx_samples_interior_depths_and_notes_lengths_the_baseline_cannot_pass(env, monkeypatch):
    """Needles at interior depths only (at 0 and 1 a streaming model finds them anyway); a length where the
    baseline finds no key cannot fail the candidate, and the report says so instead of passing it silently."""
    import eval.gate as gate
    from eval.longctx import INTERIOR_DEPTHS

    depths = []

    def fake_run(model, tok, *, lengths, **kw):
        depths.append(kw["depths"])
        return {"accuracy": {"passkey": {"256": 0.0, "512": 0.0 if len(depths) == 1 else 0.5}}}

    monkeypatch.setattr(gate, "run_longctx", fake_run)
    cfg = _cfg(env, "longctx-zero", candidate=str(env["orig"]), skip_lm_metrics=True, longctx="256,512")
    res = run_gate(cfg, scorer=env["scorer"])
    assert depths == [list(INTERIOR_DEPTHS)] * 2 and 0 not in depths[0] and 1 not in depths[0]
    assert res.report["longctx"]["depths"] == list(INTERIOR_DEPTHS)
    notes = [r for r in res.report["reasons"] if "does not tell the models apart" in r]
    assert len(notes) == 1 and "at 256" in notes[0]  # 512: the baseline finds half, the candidate none
    assert res.verdict == "fail" and any("long-context retrieval at 512: candidate 0.00" in r
                                         for r in res.report["reasons"])


def test_longctx_accuracies_measured_by_the_caller_are_judged_without_running_the_check(env, monkeypatch):
    import eval.gate as gate

    def refuse(*a, **k):
        raise AssertionError("the gate ran the pass-key check again")

    monkeypatch.setattr(gate, "run_longctx", refuse)
    measured = {"candidate": {"attention": "hybrid", "accuracy": {"256": 1.0, "512": 0.4}},
                "baseline": {"attention": "dense", "accuracy": {"256": 1.0, "512": 0.8}},
                "depths": [0.1, 0.5, 0.9], "trials": 3, "measured_by": "the retrofit's closing check"}
    cfg = _cfg(env, "longctx-measured", candidate=str(env["orig"]), skip_lm_metrics=True, longctx="256,512")
    res = run_gate(cfg, scorer=env["scorer"], longctx=measured)
    report = res.report["longctx"]
    assert report["measured_by"] == "the retrofit's closing check" and report["depths"] == [0.1, 0.5, 0.9]
    assert res.verdict == "fail" and any("retrieval at 512: candidate 0.40" in r for r in res.report["reasons"])
    with pytest.raises(GateInputError, match=r"lack lengths \[400\]"):
        run_gate(_cfg(env, "longctx-measured-2", candidate=str(env["orig"]), skip_lm_metrics=True,
                      longctx="256,400"), scorer=env["scorer"], longctx=measured)


@pytest.mark.parametrize("longctx, says", [("128", "too short for a passkey prompt; use lengths >= "),
                                           ("256,1024", "exceeds the candidate's max_position_embeddings=512")])
def test_longctx_lengths_the_models_cannot_run_exit_3_before_any_generation(env, longctx, says, capsys):
    out = env["root"] / f"bad-longctx-{longctx}"
    code = main(["--candidate", str(env["orig"]), "--baseline", str(env["orig"]), "--prompts", str(env["prompts"]),
                 "--out", str(out), "--longctx", longctx])
    err = capsys.readouterr().err
    assert code == 3 and says in err and err.count("\n") == 1
    assert not out.exists()  # nothing generated, nothing written


@pytest.mark.parametrize("text", ["just one line\n", "a copy\n\n a copy \na copy\n"])
def test_rescale_text_without_two_distinct_lines_exits_3_before_any_generation(env, text, capsys):
    path = env["root"] / "rescale.txt"
    path.write_text(text)
    out = env["root"] / "bad-rescale"
    code = main(["--candidate", str(env["orig"]), "--baseline", str(env["orig"]), "--prompts", str(env["prompts"]),
                 "--out", str(out), "--rescale", str(path)])
    err = capsys.readouterr().err
    assert code == 3 and "distinct non-empty line(s); a baseline needs at least two" in err
    assert not out.exists()


def test_lm_metric_intervals_and_the_small_set_warning_follow_the_confidence_level(env):
    """--confidence sets every interval the report shows, not only BERTScore's."""
    from eval.gate import _interval_dict, _warnings
    from eval.metrics import LMStats

    g = torch.Generator().manual_seed(0)
    stats = [LMStats(nll_sum=float(v), tokens=100) for v in 300 + 40 * torch.randn(40, generator=g)]
    widths = {}
    for conf in (0.8, 0.95):
        iv = _interval_dict(stats, "loss", _cfg(env, "conf", candidate=str(env["orig"]), confidence=conf))
        widths[conf] = iv["high"] - iv["low"]
    assert widths[0.8] < 0.75 * widths[0.95]  # z 1.28 against 1.96: about 0.65 of the width
    se, threshold = 0.01, 0.015  # 1.28·SE below the threshold, 1.96·SE above it
    assert _warnings(se, threshold, "pass", [], 0.95) and not _warnings(se, threshold, "pass", [], 0.8)


@pytest.mark.parametrize("device, says", [("tpu", "device 'tpu' is unknown"), ("cuda", "torch sees no CUDA GPU"),
                                          ("cuda:1", "torch sees no CUDA GPU")])
def test_a_device_this_machine_lacks_is_a_config_error_before_any_load(monkeypatch, device, says):
    from core.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=says):
        GateConfig(candidate="c", baseline="b", device=device)
    assert GateConfig(candidate="c", baseline="b", device="auto").generation_settings().resolved().device == "cpu"


def test_a_rerun_that_dies_leaves_no_earlier_report_and_nothing_else_is_touched(env, monkeypatch):
    """A resumed run replaces final/ and its gate crashes: the previous model's verdict must not survive in
    out (recipes/export.py would copy it into the card). Only the gate's own report files go."""
    out = env["root"] / "rerun-dies"
    gate_files = ("report.json", "report.md", "samples.jsonl", "scores_hist.png")  # what the gate writes
    out.mkdir()
    for name in gate_files:
        (out / name).write_text(json.dumps({"schema": SCHEMA, "verdict": "pass"}) if name == "report.json" else "old")
    (out / "notes.txt").write_text("mine")
    (out / "keep").mkdir()
    (out / "keep" / "report.json").write_text("not the gate's")

    def broken(*a, **k):
        raise RuntimeError("scorer crashed")

    monkeypatch.setattr(env["scorer"], "f1", broken)
    with pytest.raises(RuntimeError, match="scorer crashed"):
        run_gate(_cfg(env, "rerun-dies", candidate=str(env["orig"]), skip_lm_metrics=True), scorer=env["scorer"])
    assert not any((out / name).exists() for name in gate_files)
    assert (out / "notes.txt").read_text() == "mine" and (out / "keep" / "report.json").read_text() == "not the gate's"
    monkeypatch.undo()
    res = run_gate(_cfg(env, "rerun-dies", candidate=str(env["orig"]), skip_lm_metrics=True), scorer=env["scorer"])
    assert json.loads(res.report_json.read_text())["verdict"] == res.verdict == "pass"
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # written through temp files, none left


@pytest.mark.parametrize("theirs", [{"report.md": "my notes"}, {"report.json": '{"verdict": "mine"}', "x.txt": "x"}])
def test_report_files_no_gate_run_wrote_are_refused_not_removed(env, capsys, theirs):
    """A report.md (or report.json, samples.jsonl, scores_hist.png) of the user's own in --out was deleted."""
    out = env["root"] / f"theirs-{len(theirs)}"
    out.mkdir()
    for name, text in theirs.items():
        (out / name).write_text(text)
    with pytest.raises(GateInputError, match=r"holds report\.\w+ without a gate's report.json .*; choose another"):
        run_gate(_cfg(env, out.name, candidate=str(env["orig"]), skip_lm_metrics=True), scorer=env["scorer"])
    assert {p.name: p.read_text() for p in out.iterdir()} == theirs


def test_generation_cache_keeps_outputs_with_unicode_line_separators(tmp_path):
    """Outputs are written raw (ensure_ascii=False); a U+2028 / U+0085 a model generated must not tear its cache
    row on reading, or that prompt misses the cache on every rerun."""
    from eval.generation import GenerationCache

    rows = [{"key": "k1", "id": "a", "output": "one\u2028two\u0085three\u2029", "new_tokens": 3, "hit_limit": False},
            {"key": "k2", "id": "b", "output": "plain", "new_tokens": 1, "hit_limit": True}]
    GenerationCache(tmp_path, "f" * 64).add(rows)
    assert GenerationCache(tmp_path, "f" * 64).rows == {r["key"]: r for r in rows}


def test_heldout_metrics_of_a_baseline_with_another_tokenizer_use_its_own_tokens(tmp_path):
    """With --teacher, only the teacher's vocabulary is checked against the candidate's: a baseline with another
    tokenizer was fed the candidate's token ids, and its perplexity / bits per byte were silently wrong."""
    from core.tiny import tiny_model, tiny_tokenizer
    from eval.gate import _lm_metrics
    from eval.generation import load_model
    from eval.metrics import evaluate_text

    cand = Path(save_tiny(tmp_path / "cand", seed=0))
    base = tmp_path / "base"
    tiny_model(seed=1).save_pretrained(base)
    tiny_tokenizer(["return the number of items in a container", "a brown dog jumps"] * 5).save_pretrained(base)
    text = "Return the number of items in a container. The quick brown fox jumps over the lazy dog.\n" * 3
    (tmp_path / "heldout.txt").write_text(text)
    cfg = GateConfig(candidate=str(cand), baseline=str(base), teacher=str(cand), out=str(tmp_path / "out"),
                     heldout=str(tmp_path / "heldout.txt"), lm_seq_len=64, resamples=50, device="cpu")
    lm = _lm_metrics(cfg, {"candidate": cand, "baseline": base, "teacher": cand}, [], [])
    model, tok = load_model(base, "cpu", "fp32")
    want = evaluate_text(model, tok, text, seq_len=64)
    got = lm["metrics"]["bits_per_byte"]["baseline"]["mean"]
    assert got == pytest.approx(want.bits_per_byte, rel=1e-5)
    assert lm["metrics"]["loss"]["baseline"]["mean"] == pytest.approx(want.loss, rel=1e-5)


def test_report_md_labels_intervals_with_the_confidence_level_used(env):
    """--confidence 0.8 gives 80 % intervals; report.md must not call them 95 % intervals."""
    cfg = _cfg(env, "conf-md", candidate=str(env["orig"]), heldout=str(env["root"] / "heldout.txt"), confidence=0.8)
    md = run_gate(cfg, scorer=env["scorer"]).report_md.read_text()
    assert "95 %" not in md
    assert md.count("80 % interval") == 2  # the BERTScore table and the language-model metrics table
