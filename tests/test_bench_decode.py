"""bench/decode.py: decode tokens/s counts only the tokens made in the window it divides by."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("bench_decode", Path(__file__).resolve().parents[1] / "bench" / "decode.py")
decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(decode)


def test_decode_rate_leaves_out_tokens_made_before_the_last_row_starts():
    """Row 0 finished its prefill at t = 0 and decoded 1-3 alone; row 1's first token came at 3. From 3 to
    6: row 0 makes 4 and 5, row 1 makes 4, 5 and 6, so 5 tokens in 3 s (not 2 rows x 5 tokens in 3 s)."""
    start, rate = decode.decode_rate([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0, 6.0]])
    assert start == 3.0
    assert rate == pytest.approx(5 / 3)


def test_decode_rate_of_rows_that_start_together_counts_every_token_after_the_first():
    assert decode.decode_rate([[1.0, 2.0, 3.0, 5.0]]) == (1.0, pytest.approx(3 / 4))
    assert decode.decode_rate([[1.0, 2.0, 3.0], [1.0, 2.5, 3.0]]) == (1.0, pytest.approx(4 / 2))
