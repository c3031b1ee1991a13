"""recipes/cache_teacher.py refuses a block longer than the teacher's context, and a top-k wider than its
vocabulary, before the teacher's weights load and before anything is written."""

from __future__ import annotations

import sys

import pytest

from core.config import ConfigError
from core.tiny import save_tiny
from tests.helpers import forbid


@pytest.fixture
def no_weights(monkeypatch):
    import recipes.cache_teacher as cache_teacher

    forbid(monkeypatch, "the teacher was loaded before the bad input was refused",
           *((cache_teacher, name) for name in ("load_teacher", "tiny_teacher", "load_causal_lm")))
    return cache_teacher


@pytest.mark.parametrize("argv, match", [
    (["seq_len=2048"], "seq_len 2048 exceeds the teacher's maximum of 1024 positions; lower seq_len"),
    (["topk=600"], r"topk 600 exceeds the vocabulary \(512\); lower topk"),
])
def test_refused_before_the_teacher_loads(no_weights, tmp_path, monkeypatch, argv, match):
    out = tmp_path / "cache"
    monkeypatch.setattr(sys, "argv", ["cache_teacher.py", "teacher=tiny-random", f"output_dir={out}", *argv])
    with pytest.raises(ConfigError, match=match) as err:
        no_weights.main()
    assert "\n" not in str(err.value)
    assert sorted(tmp_path.iterdir()) == []  # neither the cache nor its unfinished folder


def test_a_local_teacher_is_judged_from_its_config_json(no_weights, tmp_path, monkeypatch):
    teacher = save_tiny(tmp_path / "teacher", max_pos=96)
    monkeypatch.setattr(sys, "argv", ["cache_teacher.py", f"teacher={teacher}", "seq_len=128",
                                      f"output_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError, match="seq_len 128 exceeds the teacher's maximum of 96 positions"):
        no_weights.main()
    assert not (tmp_path / "cache").exists() and not (tmp_path / ".cache.partial").exists()
