"""eval's bad input: one line, the right exit code, before any model loads or generates."""

from __future__ import annotations

import json

from eval.gate import main


def _model_dirs(tmp_path):
    """Two folders that pass the gate's input check (config.json) but could never load: nothing may load them."""
    for role in ("cand", "base"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text("{}")
    return ["--candidate", str(tmp_path / "cand"), "--baseline", str(tmp_path / "base")]


def test_rescale_prompts_with_one_distinct_prompt_text_exits_3_before_any_generation(tmp_path, capsys):
    """The prompts are the rescale baseline's texts: copies of one text give it no unrelated pair (it raised a
    ValueError after every generation, exit 5 with a traceback)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(["same", " same "])))
    out = tmp_path / "out"
    code = main([*_model_dirs(tmp_path), "--prompts", str(prompts), "--out", str(out), "--rescale", "prompts"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("\n") == 1 and "rescale=prompts needs at least two different prompt texts" in err
    assert not out.exists()
