"""Recipe configuration: one typed dataclass per recipe, YAML, then ``key=value`` overrides.

Every recipe (``distill.py``, ``retrofit.py``, ``export.py``, ``cache_teacher.py``) declares a
dataclass whose fields carry ``metadata={"help": ...}`` and validates itself in ``__post_init__``.
:func:`parse_config` turns ``--config PATH key=value ...`` into an instance:

* the YAML file sets fields, then each ``key=value`` overrides one (``a.b=1`` is not supported on
  purpose: configs are flat so that every key is visible in one place);
* an unknown key, in YAML or on the command line, is an error that lists the close matches;
* values are parsed as YAML scalars/lists (``hidden_layers=[15:20]``, ``lr=3e-4``, ``gate=true``)
  and then coerced to the field's declared type.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from core.fsio import atomic_write_text

T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """YAML 1.2-style scalars: ``15:20`` stays a string (YAML 1.1 would read base-60 ``920``)."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(0|[1-9][0-9_]*|0x[0-9a-fA-F_]+|0o?[0-7_]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


class ConfigError(ValueError):
    """A user-facing problem (config, paths, data, checkpoints); one line that names the fix.

    Recipes turn it into ``error: <message>`` and exit code ``exit_code`` without a traceback;
    the library's own error types (data, checkpoints, model sources ...) derive from it.
    """

    exit_code = 2


def field(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING):
    """A dataclass field with a mandatory help string."""
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(name: str, value: Any, tp: Any) -> Any:
    tp, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional or tp is Any:
            return None
        raise ConfigError(f"config key '{name}' cannot be empty; give it a value")
    origin = typing.get_origin(tp)
    try:
        if tp is Any:
            return value
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
                return value.lower() in ("true", "yes", "1")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
        if origin in (list, tuple):
            (inner,) = typing.get_args(tp)[:1] or (Any,)
            if isinstance(value, str):
                value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
            if not isinstance(value, (list, tuple)):
                value = [value]
            return [_coerce(name, v, inner) for v in value]
        if origin is dict:
            if not isinstance(value, dict):
                raise ValueError
            return dict(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(f"config key '{name}' expects {getattr(tp, '__name__', tp)}, got {value!r}; fix the value")


def _parse_scalar(text: str) -> Any:
    try:
        return yaml_load(text)
    except yaml.YAMLError:
        return text


def _check_keys(cls: type, keys: typing.Iterable[str], where: str) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"unknown config key '{key}' in {where}{hint}")


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML with --config")
    try:
        data = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML ({err.__class__.__name__}); fix its syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of key: value")
    return data


def build_config(cls: type[T], values: dict[str, Any], where: str = "config") -> T:
    """Instantiate ``cls`` from a flat mapping, coercing types; unknown keys are an error."""
    _check_keys(cls, values, where)
    hints = typing.get_type_hints(cls)
    kwargs = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{err}; set it in the YAML or as key=value") from None


def parse_config(cls: type[T], argv: list[str] | None = None, default_config: str | Path | None = None) -> T:
    """``[--config PATH] [key=value ...]`` → an instance of ``cls``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path: str | Path | None = default_config
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(help_text(cls))
            raise SystemExit(0)
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path: --config recipes/configs/NAME.yaml")
            config_path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        elif "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            overrides[key.strip()] = _parse_scalar(value)
        else:
            raise ConfigError(f"cannot parse argument '{arg}'; use key=value or --config PATH")
        i += 1
    values: dict[str, Any] = {}
    if config_path is not None:
        values.update(load_yaml(config_path))
        _check_keys(cls, values, str(config_path))
    _check_keys(cls, overrides, "the command line")
    values.update(overrides)
    return build_config(cls, values)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def save_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable again with ``--config``), atomically and durably."""
    atomic_write_text(path, yaml.safe_dump(to_dict(config), sort_keys=False))


def help_text(cls: type) -> str:
    lines = [f"{cls.__name__} keys (set in YAML or as key=value):"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "<required>"
        )
        lines.append(f"  {f.name} = {default!r}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)


def run_cli(main: typing.Callable[[], Any]) -> None:
    """Run a recipe's ``main`` turning user errors into one line and exit code 2."""
    try:
        main()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
