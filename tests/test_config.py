import dataclasses
import math
import types
import typing
from pathlib import Path

import pytest
import yaml

from core.config import (
    ABSENT,
    ConfigError,
    build_config,
    check_fields,
    check_resume_config,
    check_values,
    config_changes,
    field,
    parse_config,
    range_text,
    save_config,
)
from distill.config import DistillConfig
from eval.gate import GateConfig
from recipes import distill, retrofit
from recipes.cache_teacher import CacheTeacherConfig
from recipes.export import ExportConfig
from recipes.retrofit import RetrofitConfig

CONFIGS = sorted(Path("recipes/configs").glob("*.yaml"))


def test_overrides_and_types():
    cfg = parse_config(DistillConfig, ["max_steps=3", "lr=1e-3", "gradient_checkpointing=true",
                                       "hidden_layers=[15:20, 3:4]", "student=", "output_dir=/tmp/x"])
    assert cfg.max_steps == 3 and cfg.lr == 1e-3 and cfg.gradient_checkpointing is True
    assert cfg.hidden_layers == ["15:20", "3:4"] and cfg.student is None


@pytest.mark.parametrize("argv, match", [
    (["max_stepz=3"], "did you mean max_steps"),
    (["max_steps=abc"], "expects int"),
    (["max_steps=0"], "max_steps must be >= 1, got 0"),
    (["lr=nan"], "lr must be a finite number > 0, got nan"),
    (["min_lr_ratio=-5"], r"min_lr_ratio must be in \[0, 1\], got -5"),
    (["tracker=tb"], "tracker must be one of none, tensorboard, wandb, got 'tb'"),
    (["kd_kind=bogus"], "kd_kind"),
    (["resume=latest", "overwrite=true"], "contradict"),
    (["--config", "nope.yaml"], "does not exist"),
    (["positional"], "key=value"),
])
def test_bad_input_is_one_line(argv, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_config(DistillConfig, argv)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("typed, want", [("output_dir=007", "007"), ("output_dir=1e3", "1e3"),
                                         ("output_dir=0x10", "0x10"), ("teacher=no", "no"), ("teacher=true", "true")])
def test_a_text_key_keeps_the_text_as_typed(typed, want):
    key = typed.split("=")[0]
    assert getattr(parse_config(DistillConfig, [typed]), key) == want
    assert parse_config(DistillConfig, ["tokenizer=none"]).tokenizer is None  # optional text: none still unsets


@pytest.mark.parametrize("line, got", [("output_dir: 007", "7"), ("output_dir: 1e3", "1000.0"),
                                       ("mixed_precision: no", "False"), ("teacher: on", "True")])
def test_a_text_key_yaml_reads_as_a_number_or_bool_must_be_quoted(tmp_path, line, got):
    p = tmp_path / "c.yaml"
    p.write_text(line + "\n")
    with pytest.raises(ConfigError, match=f"expects text, got {got}.*quote the value") as err:
        parse_config(DistillConfig, ["--config", str(p)])
    assert "\n" not in str(err.value)
    p.write_text(line.replace(": ", ": '") + "'\n")
    assert getattr(parse_config(DistillConfig, ["--config", str(p)]), line.split(":")[0]) == line.split(": ")[1]


def test_a_key_set_twice_in_yaml_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("max_steps: 2\nlr: 1.0e-3\nlr: 0.5\n")
    with pytest.raises(ConfigError, match=r"sets 'lr' twice \(line 3\); keep one"):
        parse_config(DistillConfig, ["--config", str(p)])


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
    cls = recipe_config_class(module)
    cfg = parse_config(cls, ["--config", str(path)])
    assert set(data) <= {f.name for f in dataclasses.fields(cfg)}


def recipe_config_class(module) -> type:
    """The config dataclass a recipe script parses (``main`` reads it; the distill one lives in the library)."""
    names = {"recipes.distill": "DistillConfig", "recipes.retrofit": "RetrofitConfig", "recipes.export": "ExportConfig",
             "recipes.cache_teacher": "CacheTeacherConfig"}
    return getattr(module, names[module.__name__])


def test_demo_config_is_the_default():
    cfg = parse_config(DistillConfig, ["--config", "recipes/configs/smollm2_demo.yaml"])
    default = DistillConfig()
    assert dataclasses.asdict(cfg) == dataclasses.asdict(default)


def test_saved_config_round_trips(tmp_path):
    cfg = parse_config(DistillConfig, ["max_steps=7", "attn_layers=[1:2]", "attn_weight=0.1"])
    save_config(cfg, tmp_path / "c.yaml")
    again = parse_config(DistillConfig, ["--config", str(tmp_path / "c.yaml")])
    assert again == cfg


# --------------------------------------------------------------------------------------------
# Ranges and choices, declared on the field, checked in one place
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Toy:
    rate: float = field(1.0, gt=0, help="x")
    ratio: float = field(0.5, ge=0, le=1, help="x")
    half_open: float = field(0.0, ge=0, lt=1, help="x")
    count: int = field(1, ge=1, help="x")
    lengths: list[int] = field(default_factory=lambda: [4], ge=2, help="x")
    mode: str = field("a", choices=("a", "b"), help="x")
    maybe: int | None = field(None, ge=0, help="x")
    anything: float = field(math.inf, allow_nonfinite=True, help="x")
    free: float = field(0.0, help="x")

    def __post_init__(self) -> None:
        check_fields(self)


@pytest.mark.parametrize("meta, text", [
    ({"gt": 0}, "> 0"), ({"ge": 0}, ">= 0"), ({"le": 1}, "<= 1"), ({"lt": 1}, "< 1"),
    ({"ge": 0, "le": 1}, "in [0, 1]"), ({"ge": 0, "lt": 1}, "in [0, 1)"), ({"gt": 0, "le": 1}, "in (0, 1]"),
    ({"gt": 0.5, "lt": 2.5}, "in (0.5, 2.5)"), ({}, ""),
])
def test_range_text(meta, text):
    assert range_text(meta) == text


@pytest.mark.parametrize("key, value, message", [
    ("rate", "nan", "rate must be a finite number > 0, got nan"),
    ("rate", "inf", "rate must be a finite number > 0, got inf"),
    ("rate", "-.inf", "rate must be a finite number > 0, got -inf"),
    ("rate", "0", "rate must be > 0, got 0"),
    ("ratio", "-5", "ratio must be in [0, 1], got -5"),
    ("ratio", "1.0001", "ratio must be in [0, 1], got 1.0001"),
    ("half_open", "1", "half_open must be in [0, 1), got 1"),
    ("count", "0", "count must be >= 1, got 0"),
    ("lengths", "[4, 1]", "lengths must be >= 2, got 1 in [4, 1]"),
    ("mode", "c", "mode must be one of a, b, got 'c'"),
    ("maybe", "-1", "maybe must be >= 0, got -1"),
    ("free", "nan", "free must be a finite number, got nan"),
])
def test_out_of_range_is_one_line_naming_key_value_and_range(key, value, message):
    with pytest.raises(ConfigError) as err:
        parse_config(_Toy, [f"{key}={value}"])  # the command-line path: YAML scalar, coercion, check
    assert str(err.value) == message


def test_direct_construction_checks_too():
    # eval.gate builds GateConfig(**flags) and the recipes use dataclasses.replace: no build_config there.
    with pytest.raises(ConfigError, match="lr must be a finite number > 0, got nan"):
        dataclasses.replace(DistillConfig(), lr=math.nan)
    with pytest.raises(ConfigError, match=r"floor must be a finite number in \[-1, 1\], got nan"):
        GateConfig(candidate="c", baseline="b", floor=math.nan)
    with pytest.raises(ConfigError, match=r"lengths must be >= 2, got 1 in \[1\]"):
        _Toy(lengths=[1])


@pytest.mark.parametrize("values", [
    {"rate": 1e-30}, {"ratio": 0}, {"ratio": 1}, {"half_open": 0.999}, {"count": 10**9}, {"lengths": [2, 3]},
    {"mode": "b"}, {"maybe": None}, {"maybe": 0}, {"anything": "nan"}, {"anything": "-inf"}, {"free": -1e30},
])
def test_in_range_and_opted_in_values_pass(values):
    build_config(_Toy, values)


def test_bools_are_not_numbers_for_ranges():
    @dataclasses.dataclass
    class B:
        flag: bool = field(False, ge=1, help="x")  # a bound on a bool is ignored, not misapplied
    check_values(B, {"flag": False})


def _recipe_configs():
    return [(DistillConfig, {}), (RetrofitConfig, {}), (CacheTeacherConfig, {}),
            (ExportConfig, {"source": "s", "output_dir": "o"}), (GateConfig, {"candidate": "c", "baseline": "b"})]


def _numeric(tp) -> bool:
    """int / float, or a list or optional of them (``list[int] | None`` too)."""
    while typing.get_origin(tp) in (list, typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp in (int, float)


@pytest.mark.parametrize("cls, required", _recipe_configs(), ids=lambda x: getattr(x, "__name__", ""))
def test_every_numeric_field_of_every_recipe_declares_its_range(cls, required):
    hints = typing.get_type_hints(cls)
    bare = [f.name for f in dataclasses.fields(cls) if _numeric(hints[f.name])
            and not set(f.metadata) & {"ge", "gt", "le", "lt", "choices"}]
    assert bare == [], f"{cls.__name__}: declare ge/gt/le/lt/choices on {bare}"
    cls(**required)  # and the defaults satisfy them


def _bound_cases():
    """For every bounded numeric field of every recipe config: a value just outside each bound, and NaN."""
    for cls, required in _recipe_configs():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not _numeric(hints[f.name]):
                continue
            is_float = float in typing.get_args(hints[f.name]) or hints[f.name] is float
            step = 1e-6 if is_float else 1
            m = f.metadata
            bad = [m["ge"] - step] if "ge" in m else [m["gt"]] if "gt" in m else []
            bad += [m["le"] + step] if "le" in m else [m["lt"]] if "lt" in m else []
            if "choices" in m:
                bad.append(max(c for c in m["choices"]) + 1)
            if is_float:
                bad.append(math.nan)
            for value in bad:
                yield pytest.param(cls, required, f.name, value, id=f"{cls.__name__}.{f.name}={value}")


@pytest.mark.parametrize("cls, required, name, value", list(_bound_cases()))
def test_every_declared_bound_is_enforced(cls, required, name, value):
    wrapped = [value] if typing.get_origin(typing.get_type_hints(cls)[name]) is list else value
    with pytest.raises(ConfigError, match=rf"^{name} must be ") as err:
        build_config(cls, {**required, name: wrapped})
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# Resuming with a changed config
# --------------------------------------------------------------------------------------------

def test_config_changes_compares_after_a_yaml_round_trip():
    saved = {"lr": 0.0003, "layers": ["1:2"], "seed": 0, "max_steps": 8, "t": 1}
    new = {"lr": 3e-4, "layers": ("1:2",), "seed": 99, "max_steps": 16, "t": 1.0}
    assert config_changes(saved, new) == {"seed": (0, 99), "max_steps": (8, 16)}
    assert config_changes(saved, new, safe=["seed", "max_steps"]) == {}
    assert config_changes({"a": 1}, {"b": 2}) == {"b": (ABSENT, 2), "a": (1, ABSENT)}
    assert config_changes({"a": True}, {"a": 1}) == {"a": (True, 1)}  # a bool is not the int 1
    assert config_changes({"a": math.nan}, {"a": math.nan}) == {}
    assert config_changes({"a": None}, {"a": 0}) == {"a": (None, 0)}


def _saved_run(tmp_path, **overrides) -> tuple:
    cfg = parse_config(DistillConfig, ["--config", "recipes/configs/tiny.yaml", "max_steps=8"])
    save_config(cfg, tmp_path / "config.yaml")
    return tmp_path / "config.yaml", dataclasses.replace(cfg, **overrides)


def test_resume_with_the_same_or_safe_changes_is_accepted(tmp_path):
    for overrides in [{}, {"resume": "latest"}, {"max_steps": 20, "eval_every": 5, "log_every": 2, "save_every": 4,
                                                 "keep_checkpoints": 5, "tracker": "tensorboard", "gate": True,
                                                 "gate_prompts": 10, "output_dir": "elsewhere",
                                                 "debug_exit_at_step": 3}]:
        path, cfg = _saved_run(tmp_path, **overrides)
        check_resume_config(path, cfg, distill.RESUME_SAFE)


def test_resume_with_a_changed_config_names_every_key_and_the_fix(tmp_path):
    path, cfg = _saved_run(tmp_path, max_steps=4, seed=99, lr=0.5, resume="latest")
    with pytest.raises(ConfigError) as err:
        check_resume_config(path, cfg, distill.RESUME_SAFE)
    assert str(err.value) == (
        "resume would change the run's config (max_steps: 8 → 4, lr: 0.001 → 0.5, seed: 0 → 99) "
        "(max_steps may only grow); put the values back to continue this run, or start a new output_dir= "
        "to train with them")
    # Only max_steps shrinking: still refused.
    path, cfg = _saved_run(tmp_path, max_steps=7)
    with pytest.raises(ConfigError, match=r"max_steps: 8 → 7\) \(max_steps may only grow\)"):
        check_resume_config(path, cfg, distill.RESUME_SAFE)


def test_resume_tolerates_a_key_older_checkpoints_lack_only_at_its_default(tmp_path):
    path, cfg = _saved_run(tmp_path)
    data = yaml.safe_load(path.read_text())
    del data["focal_alpha"]
    path.write_text(yaml.safe_dump(data))
    check_resume_config(path, cfg, distill.RESUME_SAFE)
    with pytest.raises(ConfigError, match="focal_alpha: <absent> → 0.5"):
        check_resume_config(path, dataclasses.replace(cfg, focal_alpha=0.5), distill.RESUME_SAFE)


def test_resume_without_a_saved_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no config.yaml"):
        check_resume_config(tmp_path / "config.yaml", DistillConfig(), distill.RESUME_SAFE)


@pytest.mark.parametrize("module", [distill, retrofit], ids=["distill", "retrofit"])
def test_resume_safe_lists_name_real_keys_and_never_the_training_math(module):
    cls = recipe_config_class(module)
    names = {f.name for f in dataclasses.fields(cls)}
    assert set(module.RESUME_SAFE) <= names
    assert not set(module.RESUME_SAFE) & {"lr", "seed", "max_steps", "teacher", "dataset", "seq_len",
                                          "min_lr_ratio", "warmup_steps"}
    # The split of a step's blocks may change; their product with the processes, the global batch, may not
    # (distill.training.check_resume_world, tested in tests/test_training.py).
    assert {"micro_batch_size", "grad_accum"} <= set(module.RESUME_SAFE)


def test_check_output_dir_refuses_a_file_or_a_path_under_one_and_accepts_new_folders(tmp_path):
    import os

    from core.config import ConfigError, check_output_dir

    check_output_dir(tmp_path, "--out")  # an existing folder
    check_output_dir(tmp_path / "new" / "deeper", "--out")  # created later, under a folder
    f = tmp_path / "file.txt"
    f.write_text("x")
    for bad, why in ((f, "is a file"), (f / "sub", "which is a file"), (f / "a" / "b", "which is a file")):
        with pytest.raises(ConfigError, match=why) as err:
            check_output_dir(bad, "output_dir")
        assert "\n" not in str(err.value) and "choose another output_dir" in str(err.value)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            with pytest.raises(ConfigError, match="cannot write"):
                check_output_dir(locked / "run", "--out")
        finally:
            locked.chmod(0o700)
