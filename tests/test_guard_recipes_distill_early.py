"""recipes/distill.py refuses lengths and layer choices that the models' config.json can judge before any weights
load and before the run folder is claimed."""

from __future__ import annotations

import pytest

from core.config import ConfigError, parse_config
from core.tiny import save_tiny
from tests.helpers import forbid

TINY = ["--config", "recipes/configs/tiny.yaml"]


@pytest.fixture
def no_weights(monkeypatch):
    """Any model load fails the test: the bad input must be refused first."""
    from recipes import distill

    forbid(monkeypatch, "weights were loaded before the bad input was refused",
           (distill, "load_pair"), (distill, "load_models"))
    return distill


@pytest.mark.parametrize("argv, match", [
    (["seq_len=2048"], "seq_len 2048 exceeds the model's maximum of 1024 positions; lower seq_len"),
    (["keep_layers=0,7"], r"keep_layers \[0, 7\] out of range for a 4-layer teacher; use 0..3 \(keep_layers\)"),
])
def test_bad_lengths_and_layers_are_refused_before_any_weights_load(no_weights, tmp_path, argv, match):
    out = tmp_path / "o"
    with pytest.raises(ConfigError, match=match) as err:
        no_weights.main([*TINY, f"output_dir={out}", *argv])
    assert "\n" not in str(err.value)
    assert not out.exists()


def test_a_given_student_is_judged_from_its_own_config_json(no_weights, tmp_path):
    student = save_tiny(tmp_path / "student", max_pos=48)
    with pytest.raises(ConfigError, match="seq_len 64 exceeds the model's maximum of 48 positions"):
        no_weights.main([*TINY, f"student={student}", f"output_dir={tmp_path / 'o'}"])
    assert not (tmp_path / "o").exists()


def test_good_settings_pass_without_loading_weights(no_weights, tmp_path):
    no_weights.check_before_loading(parse_config(no_weights.DistillConfig, [*TINY, f"output_dir={tmp_path / 'o'}"]))
