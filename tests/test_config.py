import dataclasses
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, parse_config, save_config
from recipes.distill import DistillConfig

CONFIGS = sorted(Path("recipes/configs").glob("*.yaml"))


def test_overrides_and_types():
    cfg = parse_config(DistillConfig, ["max_steps=3", "lr=1e-3", "gradient_checkpointing=true",
                                       "hidden_layers=[15:20, 3:4]", "student=", "output_dir=/tmp/x"])
    assert cfg.max_steps == 3 and cfg.lr == 1e-3 and cfg.gradient_checkpointing is True
    assert cfg.hidden_layers == ["15:20", "3:4"] and cfg.student is None


@pytest.mark.parametrize("argv, match", [
    (["max_stepz=3"], "did you mean max_steps"),
    (["max_steps=abc"], "expects int"),
    (["max_steps=0"], "max_steps must be >= 1"),
    (["kd_kind=bogus"], "kd_kind"),
    (["resume=latest", "overwrite=true"], "contradict"),
    (["--config", "nope.yaml"], "does not exist"),
    (["positional"], "key=value"),
])
def test_bad_input_is_one_line(argv, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_config(DistillConfig, argv)
    assert "\n" not in str(err.value)


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("max_steps: 2\nlearning_rate: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'learning_rate'"):
        parse_config(DistillConfig, ["--config", str(p)])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_opens_with_its_command(path):
    first = path.read_text().splitlines()[:6]
    assert any(line.startswith("#") and "recipes/" in line for line in first), "config must open with its command"
    data = yaml.safe_load(path.read_text())
    recipe = "retrofit" if "retrofit" in path.name else "export" if "export" in path.name else \
        "cache_teacher" if "cache_teacher" in path.name else "distill"
    module = __import__(f"recipes.{recipe}", fromlist=["x"])
    cls = next(v for k, v in vars(module).items() if k.endswith("Config") and dataclasses.is_dataclass(v)
               and v.__module__ == module.__name__)
    cfg = parse_config(cls, ["--config", str(path)])
    assert set(data) <= {f.name for f in dataclasses.fields(cfg)}


def test_demo_config_is_the_default():
    cfg = parse_config(DistillConfig, ["--config", "recipes/configs/smollm2_demo.yaml"])
    default = DistillConfig()
    assert dataclasses.asdict(cfg) == dataclasses.asdict(default)


def test_saved_config_round_trips(tmp_path):
    cfg = parse_config(DistillConfig, ["max_steps=7", "attn_layers=[1:2]", "attn_weight=0.1"])
    save_config(cfg, tmp_path / "c.yaml")
    again = parse_config(DistillConfig, ["--config", str(tmp_path / "c.yaml")])
    assert again == cfg
