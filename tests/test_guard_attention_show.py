"""``python -m attention.show`` answers bad input with one line, not a traceback, and writes nothing."""

from __future__ import annotations

import pytest

from attention.show import main


@pytest.mark.parametrize("config, args, says", [
    ("{bad", [], "is not valid JSON"),
    ('{"hybrid_attention": [1, 2]}', [], "must be an object of spec keys"),
    (None, ["--block", "-3"], "--block must be >= 1"),
    (None, ["--block", "0"], "--block must be >= 1"),
])
def test_bad_model_config_or_block_is_one_line(tmp_path, capsys, config, args, says):
    argv = ["--seq", "64", "--out", str(tmp_path / "mask.png"), *args]
    if config is not None:
        (tmp_path / "config.json").write_text(config)
        argv += ["--model", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err
    assert not (tmp_path / "mask.png").exists()


@pytest.mark.parametrize("model", ["missing", "empty"])
def test_a_model_without_config_json_names_the_fix(tmp_path, capsys, model):
    """It printed the bare OSError ("[Errno 2] No such file or directory: .../config.json")."""
    (tmp_path / "empty").mkdir()
    assert main(["--model", str(tmp_path / model), "--out", str(tmp_path / "mask.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path / model} has no config.json; point --model at a saved model directory or pass " \
                  "--sink/--window"
    assert not (tmp_path / "mask.png").exists()
