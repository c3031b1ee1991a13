"""core.config against naive references: a saved config loads back equal with ``--config``."""

import pytest

from core.config import parse_config, save_config
from distill.config import DistillConfig


@pytest.mark.parametrize("text", ["1e3", "3E-4", "0o17", "007", "15:20", "yes"])
def test_a_saved_text_value_that_looks_like_a_number_loads_back_as_text(tmp_path, text):
    cfg = parse_config(DistillConfig, [f"tokenizer={text}", f"output_dir={tmp_path / 'run'}"])
    save_config(cfg, tmp_path / "config.yaml")
    again = parse_config(DistillConfig, ["--config", str(tmp_path / "config.yaml")])
    assert again.tokenizer == text
    assert again == cfg
