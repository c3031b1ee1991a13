"""Recipe configuration: one typed dataclass per recipe, YAML, then ``key=value`` overrides.

Every recipe (``distill.py``, ``retrofit.py``, ``export.py``, ``cache_teacher.py``) and the gate
declare a dataclass whose fields come from :func:`field`: a help string, and for numbers the range
they accept (``ge``/``gt``/``le``/``lt``) or the ``choices``. :func:`check_fields` enforces them all in
one place (NaN and infinities are refused unless a field opts in); ``__post_init__`` calls it first
and then checks only the rules that relate several fields.
:func:`parse_config` turns ``--config PATH key=value ...`` into an instance:

* the YAML file sets fields, then each ``key=value`` overrides one (``a.b=1`` is not supported on
  purpose: configs are flat so that every key is visible in one place);
* an unknown key, in YAML or on the command line, is an error that lists the close matches;
* values are parsed as YAML scalars/lists (``hidden_layers=[15:20]``, ``lr=3e-4``, ``gate=true``)
  and then coerced to the field's declared type, then range-checked; a text field's ``key=value``
  keeps the text as typed, and in a YAML file a text field that YAML reads as a number or a boolean
  (``output_dir: 007``, ``mixed_precision: no``) is an error that says to quote it;
* a YAML file that sets a key twice is an error (YAML itself keeps the last).

Resuming compares the new config with the one saved in the checkpoint (:func:`check_resume_config`):
only the keys a recipe lists as safe (cadence, logging, where outputs go) may change.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
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
    """YAML 1.2-style scalars: ``15:20`` stays a string (YAML 1.1 would read base-60 ``920``) and ``010`` is ten
    (YAML 1.1 would read octal eight)."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(0x[0-9a-fA-F_]+|0o[0-7_]+|[0-9][0-9_]*)$"), list("-+0123456789")
)


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """YAML 1.2 integers: octal only with ``0o``; a zero-padded ``010`` is ten (YAML 1.1 would read eight)."""
    text = loader.construct_scalar(node).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    if digits[:2] in ("0x", "0X"):
        return sign * int(digits[2:], 16)
    if digits[:2] == "0o":
        return sign * int(digits[2:], 8)
    return sign * int(digits, 10)


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."),
)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping sets one key twice: YAML would keep the last silently."""


def _mapping_without_duplicates(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise DuplicateKeyError(f"sets '{key}' twice (line {key_node.start_mark.line + 1}); keep one")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


class _Dumper(yaml.SafeDumper):
    """Quotes a string that either :class:`_Loader` or YAML 1.1 would read as something else (``1e3``, ``0o17``:
    numbers to :class:`_Loader` only; ``010``, ``15:20``: to YAML 1.1 only), so the file reads back as written."""


_Dumper.yaml_implicit_resolvers = {
    ch: [*yaml.SafeDumper.yaml_implicit_resolvers.get(ch, []), *_Loader.yaml_implicit_resolvers.get(ch, [])]
    for ch in {*yaml.SafeDumper.yaml_implicit_resolvers, *_Loader.yaml_implicit_resolvers}
}


def yaml_dump(values: Any) -> str:
    """``values`` as YAML that :func:`yaml_load` reads back equal (keys in their order)."""
    return yaml.dump(values, Dumper=_Dumper, sort_keys=False)


class ConfigError(ValueError):
    """A user-facing problem (config, paths, data, checkpoints); one line that names the fix.

    Recipes turn it into ``error: <message>`` and exit code ``exit_code`` without a traceback;
    the library's own error types (data, checkpoints, model sources ...) derive from it.
    """

    exit_code = 2


def check_output_dir(path: str | os.PathLike, name: str, *, writable: bool = True) -> None:
    """A one-line :class:`ConfigError` unless ``path`` is a folder this process can write in, or can be created as one.

    For a command's output option (``name``, as the user typed it: ``--out``, ``output_dir``), checked with the
    arguments, so that a typo is not found when the results are written, after the work. ``writable=False``: a
    folder, or one to be made, that may be read-only (a data cache prepared ahead).
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{name} {path} is a file, not a folder; choose another {name}")
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{name} {path} lies under {parent}, which is a file; choose another {name}")
    if writable and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {path}: cannot write in {parent}; choose another {name}")


def field(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING,
          ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
          choices: typing.Iterable[Any] | None = None, allow_nonfinite: bool = False):
    """A dataclass field with a mandatory help string and the values it accepts.

    ``ge``/``gt``/``le``/``lt`` bound an int/float field (or each item of a list of them), ``choices``
    lists the values a field may take; NaN and infinities are refused unless ``allow_nonfinite``.
    :func:`check_fields` enforces all of it in one place, so a recipe's ``__post_init__`` keeps only
    the rules that relate several fields.
    """
    metadata: dict[str, Any] = {"help": help}
    for key, bound in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)):
        if bound is not None:
            metadata[key] = bound
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if allow_nonfinite:
        metadata["allow_nonfinite"] = True
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _fmt(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else repr(x) if isinstance(x, str) else str(x)


def range_text(meta: typing.Mapping[str, Any]) -> str:
    """``{"ge": 0, "le": 1}`` → ``"in [0, 1]"``; ``{"gt": 0}`` → ``"> 0"``; ``{}`` → ``""``."""
    low = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    high = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
    if low and high:
        return f"in {low[0]}{_fmt(low[1])}, {_fmt(high[1])}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {_fmt(low[1])}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {_fmt(high[1])}"
    return ""


def _value_problem(value: Any, meta: typing.Mapping[str, Any]) -> str | None:
    """What is wrong with one value under a field's metadata (``None``: nothing)."""
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        return f"one of {', '.join(str(c) for c in choices)}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    rng = range_text(meta)
    if isinstance(value, float) and not math.isfinite(value) and not meta.get("allow_nonfinite"):
        return f"a finite number {rng}".rstrip()
    ok = ((("ge" not in meta) or value >= meta["ge"]) and (("gt" not in meta) or value > meta["gt"])
          and (("le" not in meta) or value <= meta["le"]) and (("lt" not in meta) or value < meta["lt"]))
    return None if ok else rng


def check_values(cls: type, values: typing.Mapping[str, Any]) -> None:
    """Check each ``name → value`` against the ranges/choices declared by ``cls``'s :func:`field` s.

    Raises a one-line :class:`ConfigError` naming the key, the bad value and what it accepts. ``None``
    (an unset optional field) always passes; a list is checked item by item.
    """
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}
    for name, value in values.items():
        if name not in meta or value is None:
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            problem = _value_problem(item, meta[name])
            if problem:
                got = _fmt(value) if items is not value else f"{_fmt(item)} in {value!r}"
                raise ConfigError(f"{name} must be {problem}, got {got}")


def check_fields(config: Any) -> None:
    """:func:`check_values` over every field of a dataclass instance (call first in ``__post_init__``)."""
    check_values(type(config), {f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


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
    if tp is str and isinstance(value, (bool, int, float)):  # YAML read the text as a number or a boolean
        raise ConfigError(f"config key '{name}' expects text, got {value!r} (YAML reads 007, 1e3, 0x10, no and on "
                          "as numbers or booleans); quote the value")
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
    except DuplicateKeyError as err:
        raise ConfigError(f"config file {path} {err}") from None
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
    # Ranges before __post_init__: its cross-field rules may assume each value is already sane.
    check_values(cls, kwargs)
    try:
        return cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{err}; set it in the YAML or as key=value") from None


def parse_config(cls: type[T], argv: list[str] | None = None, default_config: str | Path | None = None) -> T:
    """``[--config PATH] [key=value ...]`` → an instance of ``cls``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    hints = typing.get_type_hints(cls)
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
            key = key.strip()
            # A text field takes the text as typed: YAML would turn output_dir=007 into 7 and teacher=no into False.
            text = key in hints and _unwrap_optional(hints[key])[0] is str
            overrides[key] = value if text else _parse_scalar(value)
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
    atomic_write_text(path, yaml_dump(to_dict(config)))


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


# --------------------------------------------------------------------------------------------
# Resuming with a changed config
# --------------------------------------------------------------------------------------------

class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()
"""Stands for a key that one of the two configs does not have (shown as ``<absent>``)."""


def config_changes(saved: typing.Mapping[str, Any], new: typing.Mapping[str, Any],
                   safe: typing.Iterable[str] = ()) -> dict[str, tuple[Any, Any]]:
    """The keys whose values differ between ``saved`` and ``new``, except those in ``safe``.

    Returns ``{key: (old, new)}`` in ``new``'s key order (then keys only ``saved`` has); a key
    missing on one side shows :data:`ABSENT` there. Values compare after a YAML round trip, so
    ``3e-4`` read back from ``config.yaml`` equals the float it was written from and a tuple
    equals the list it was saved as.
    """
    safe = set(safe)
    a, b = _normalize(dict(saved)), _normalize(dict(new))
    changes: dict[str, tuple[Any, Any]] = {}
    for key in [*b, *(k for k in a if k not in b)]:
        if key in safe:
            continue
        old, now = a.get(key, ABSENT), b.get(key, ABSENT)
        if not _same(old, now):
            changes[key] = (old, now)
    return changes


def _normalize(values: dict[str, Any]) -> dict[str, Any]:
    return yaml_load(yaml_dump(values)) or {}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                            and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def check_resume_config(saved_path: str | Path, config: Any, safe: typing.Iterable[str],
                        grow_only: typing.Iterable[str] = ("max_steps",)) -> None:
    """Refuse to resume ``config`` from a checkpoint whose ``config.yaml`` differs outside ``safe``.

    A resumed run must train what its checkpoint started: a changed learning rate, seed or data
    would make the finished model match neither config, and ``config.yaml`` would then describe
    settings that were never used. Keys in ``safe`` (logging, cadence, where outputs go) may
    change; keys in ``grow_only`` (``max_steps``) may change only upwards. A key the checkpoint's
    config lacks (written by an older version) counts as unchanged while it holds its default.
    Raises one-line :class:`ConfigError` that lists each differing key as ``key: old → new``.
    """
    saved_path = Path(saved_path)
    if not saved_path.is_file():
        raise ConfigError(f"checkpoint {saved_path.parent} has no config.yaml to compare the config with; resume "
                          "from a checkpoint this toolkit wrote, or start a new output_dir")
    saved = load_yaml(saved_path)
    new = to_dict(config)
    defaults = _normalize({f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                           for f in dataclasses.fields(config)
                           if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING})
    grow_only = [k for k in grow_only if k in new]
    changes = {k: v for k, v in config_changes(saved, new, [*safe, *grow_only]).items()
               if not (v[0] is ABSENT and k in defaults and _same(defaults[k], v[1]))}
    for key in grow_only:
        old = saved.get(key)
        if isinstance(old, (int, float)) and new[key] < old:
            changes[key] = (old, new[key])
    changes = {k: changes[k] for k in dict.fromkeys([*new, *saved]) if k in changes}  # the config's order
    if changes:
        listed = ", ".join(f"{k}: {_fmt(o)} → {_fmt(n)}" for k, (o, n) in changes.items())
        grow = f" ({', '.join(grow_only)} may only grow)" if any(k in changes for k in grow_only) else ""
        raise ConfigError(f"resume would change the run's config ({listed}){grow}; put the values back to "
                          f"continue this run, or start a new output_dir= to train with them")
