"""eval.gate's command line: non-finite and out-of-range numbers fail before any work, one line, exit 3.

The ranges are GateConfig's own (core.config.field), so the CLI and the Python API refuse the same values.
"""

from __future__ import annotations

import pytest

from eval.gate import main


@pytest.mark.parametrize("flag, value, needle", [
    ("--floor", "nan", "floor must be a finite number in [-1, 1], got nan"),
    ("--floor", "inf", "floor must be a finite number in [-1, 1], got inf"),
    ("--floor", "1.5", "floor must be in [-1, 1], got 1.5"),
    ("--max-drop", "nan", "max_drop must be a finite number"),
    ("--max-drift", "1e999", "max_drift must be a finite number"),
    ("--confidence", "NaN", "confidence must be a finite number"),
    ("--temperature", "0", "temperature must be > 0, got 0"),
    ("--temperature", "-inf", "temperature must be a finite number"),
    ("--top-p", "1.5", "top_p must be in (0, 1], got 1.5"),
    ("--top-p", "0", "top_p must be in (0, 1], got 0"),
    ("--seed", "-1", "seed must be in [0, 18446744073709551615], got -1"),
    ("--seed", "18446744073709551616", "seed must be in [0, 18446744073709551615]"),
    ("--seed", "1.5", "argument --seed: invalid int value: '1.5'"),
    ("--floor", "abc", "argument --floor: invalid float value: 'abc'"),
])
def test_bad_numbers_exit_3_with_one_line_before_any_work(tmp_path, capsys, flag, value, needle):
    # Models that do not exist: an error naming the number proves it was checked before anything loaded.
    out = tmp_path / "o"
    code = main(["--candidate", str(tmp_path / "c"), "--baseline", str(tmp_path / "b"), "--out", str(out),
                 f"{flag}={value}"])
    err = capsys.readouterr().err.strip()
    assert code == 3, err
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


@pytest.mark.parametrize("under, says", [("", "is a file, not a folder"), ("sub", "which is a file")])
def test_an_out_that_cannot_be_a_folder_exits_3_with_one_line_before_any_load(tmp_path, capsys, monkeypatch,
                                                                            under, says):
    import eval.gate as gate
    from core.tiny import save_tiny

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before --out was checked")

    monkeypatch.setattr(gate, "generate_outputs", refuse)
    monkeypatch.setattr(gate, "load_model", refuse)
    model = save_tiny(tmp_path / "m")  # real models: only --out is wrong
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = afile / under if under else afile
    capsys.readouterr()  # save_tiny's progress bars
    code = main(["--candidate", str(model), "--baseline", str(model), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 3, err
    assert len(err.splitlines()) == 1 and f"--out {out}" in err and says in err and "choose another --out" in err
    assert afile.read_text() == "x"


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "0.7"], "temperature=0.7 only apply with do_sample (greedy decoding by default); add --do-sample"),
    (["--top-p", "0.9", "--temperature", "0.5"], "temperature=0.5 and top_p=0.9 only apply with do_sample"),
])
def test_sampling_settings_without_sampling_exit_3_before_any_work(tmp_path, capsys, flags, says):
    """Greedy decoding reads neither: they were accepted and silently ignored (the report still said greedy)."""
    out = tmp_path / "o"
    code = main(["--candidate", str(tmp_path / "c"), "--baseline", str(tmp_path / "b"), "--out", str(out), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 3 and len(err.splitlines()) == 1 and says in err, err
    assert not out.exists()
    main(["--candidate", str(tmp_path / "c"), "--baseline", str(tmp_path / "b"), "--out", str(out), *flags,
          "--do-sample"])
    assert "do_sample" not in capsys.readouterr().err  # accepted: the missing models are what fails now


@pytest.mark.parametrize("flags, says", [
    (["--longctx-trials", "5"], "longctx_trials only apply to the long-context check, which runs with longctx=LENGTHS"),
    (["--longctx-min-ratio", "0.5"], "longctx_min_ratio only apply to the long-context check"),
    (["--heldout", "text.txt", "--skip-lm-metrics"], "heldout only apply to the language-model metrics, which skip_lm_metrics turns off"),
    (["--lm-seq-len", "256", "--skip-lm-metrics"], "lm_seq_len only apply to the language-model metrics"),
])
def test_settings_of_a_check_that_does_not_run_exit_3_before_any_work(tmp_path, capsys, flags, says):
    """--skip-lm-metrics turns off what --heldout and --lm-seq-len set, and without --longctx there is no check for
    --longctx-trials / --longctx-min-ratio: what they asked for was silently missing from the report."""
    out = tmp_path / "o"
    code = main(["--candidate", str(tmp_path / "c"), "--baseline", str(tmp_path / "b"), "--out", str(out), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 3 and len(err.splitlines()) == 1 and says in err, err
    assert not out.exists()


@pytest.mark.parametrize("flags, says", [
    (["--max-drop", "0.05"], "max_drop=0.05 is not read in drift mode (no references, no teacher), whose threshold is "
                             "max_drift; pass --max-drift instead, or give --teacher / --references"),
    (["--max-drift", "0.2", "--teacher", "t"], "max_drift=0.2 is not read in teacher mode, whose threshold is "
                                               "max_drop; pass --max-drop instead"),
])
def test_the_threshold_the_mode_does_not_read_exits_3_before_any_work(tmp_path, capsys, flags, says):
    """Drift mode judges by max_drift, the others by max_drop: the other one, given, was silently ignored (a gate
    the caller meant to hold to 0.05 ran at 0.10)."""
    out = tmp_path / "o"
    code = main(["--candidate", str(tmp_path / "c"), "--baseline", str(tmp_path / "b"), "--out", str(out), *flags])
    err = capsys.readouterr().err.strip()
    assert code == 3 and len(err.splitlines()) == 1 and says in err, err
    assert not out.exists()
    # the threshold of the mode is accepted: what fails next is the missing model
    main(["--candidate", str(tmp_path / "c"), "--baseline", str(tmp_path / "b"), "--out", str(out), "--teacher", "t",
          "--max-drop", "0.05"])
    assert "is not read" not in capsys.readouterr().err
