"""eval.gate's command line: non-finite and out-of-range numbers fail at parse time, one line, exit 3."""

from __future__ import annotations

import pytest

from eval.gate import main


@pytest.mark.parametrize("flag, value, needle", [
    ("--floor", "nan", "'nan' is not a finite number"),
    ("--floor", "inf", "'inf' is not a finite number"),
    ("--floor", "1.5", "must be in [-1.0, 1.0], got 1.5"),
    ("--max-drop", "nan", "'nan' is not a finite number"),
    ("--max-drift", "1e999", "not a finite number"),
    ("--confidence", "NaN", "not a finite number"),
    ("--temperature", "0", "must be > 0.0, got 0.0"),
    ("--temperature", "-inf", "not a finite number"),
    ("--top-p", "1.5", "must be in (0.0, 1.0], got 1.5"),
    ("--top-p", "0", "must be in (0.0, 1.0], got 0.0"),
    ("--seed", "-1", "must be in [0, 18446744073709551615], got -1"),
    ("--seed", "18446744073709551616", "must be in [0, 18446744073709551615]"),
    ("--seed", "1.5", "invalid int value: '1.5'"),
    ("--floor", "abc", "invalid float value: 'abc'"),
])
def test_bad_numbers_exit_3_with_one_line_before_any_work(tmp_path, capsys, flag, value, needle):
    # Models that do not exist: a parse error proves nothing was loaded or written first.
    out = tmp_path / "o"
    code = main(["--candidate", str(tmp_path / "c"), "--baseline", str(tmp_path / "b"), "--out", str(out),
                 f"{flag}={value}"])
    err = capsys.readouterr().err.strip()
    assert code == 3, err
    assert len(err.splitlines()) == 1 and needle in err and flag in err, err
    assert not out.exists()
