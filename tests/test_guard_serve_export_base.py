"""A dense ``config.json`` written by the export is the base model's: no hybrid keys, its own sliding window."""

import json

from attention.integration import BASE_KEY
from attention.spec import CONFIG_KEY
from serve.export import sanitize_config_json


def test_a_dense_config_gets_the_base_sliding_window_back(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", "sliding_window": None,
                                CONFIG_KEY: {"window": 8}, BASE_KEY: {"sliding_window": 16}}))
    cfg = sanitize_config_json(path, None)
    assert cfg["sliding_window"] == 16 and CONFIG_KEY not in cfg and BASE_KEY not in cfg
    assert json.loads(path.read_text()) == cfg


def test_a_hybrid_config_keeps_the_base_settings_for_a_later_revert(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", "sliding_window": None, BASE_KEY: {"sliding_window": 16}}))
    cfg = sanitize_config_json(path, {"window": 8})
    assert cfg["sliding_window"] is None and cfg[BASE_KEY] == {"sliding_window": 16} and cfg[CONFIG_KEY] == {"window": 8}
