"""Typed settings: a dataclass field declares a setting once (type, default, help, choices, flag spelling),
and config files, ``--set key=value`` overrides, generated flags (:mod:`headbudget.cli.dataclass_flags`) and
``--print_config`` all read that one declaration.  Every value is coerced to its field's type (YAML reads
``3e-4`` as a string; ``"auto"``/``null`` is None for an optional field); an unknown key is one error line
naming where it came from and the nearest valid key.

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Job:
    ...     steps: int = option(10, help="optimizer steps")
    >>> from_dict(Job, {"steps": "1e3"})
    Job(steps=1000)
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """An invalid config file, override or flag value (the message names where it came from and the key)."""


def option(default: Any = dataclasses.MISSING, *, help: str = "", choices: tuple[Any, ...] | None = None,
           flag: str | None = None, metavar: str | None = None, cli: bool = True, group: str | None = None,
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with what its flag needs: ``help``, ``choices``, ``flag`` (its spelling when not
    ``--field-name``; ``--no-x`` for a bool that is on by default), ``metavar``, ``group`` (the title its flag
    is listed under in ``--help``) and ``cli=False`` for a setting only a config file or Python sets.

        keep: int | None = option(None, help="force the number of heads kept (skips the knee)")
    """
    meta = {"help": help, "choices": choices, "flag": flag, "metavar": metavar, "cli": cli, "group": group}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


#: the names of headbudget.devices.DTYPES (not imported: settings are read without torch)
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


def device_option() -> Any:
    """The ``device`` field of every job that loads a model (checked by ``headbudget.devices.resolve_device``)."""
    return option(None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")


def dtype_option(auto: str = "the checkpoint's own") -> Any:
    """The ``dtype`` field of every job that loads a model: a plain string checked by
    ``headbudget.devices.resolve_dtype`` (a bad value is one error line)."""
    return option("auto", metavar="{" + ",".join(DTYPE_NAMES) + "}",
                  help=f"float type of the model's weights (default auto: {auto}); bfloat16/float16 halve memory "
                       "and, on hardware with fast half-precision, time")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``{field name: resolved type}`` of a dataclass (string annotations evaluated)."""
    return typing.get_type_hints(cls)


def coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` as type ``tp`` (``int``, ``float``, ``bool``, ``str``, ``X | None``, ``tuple[str, ...]``,
    ``dict``); a ``ConfigError`` starting with ``where`` when it is not one.

    >>> coerce("3e-4", float, "train.lr"), coerce("1e3", int, "steps"), coerce("auto", int | None, "n")
    (0.0003, 1000, None)
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or value == "auto" or (
                isinstance(value, str) and value.strip().lower() in ("null", "none", "~"))):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is tuple:
        items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(coerce(x, typing.get_args(tp)[0], where) for x in items)
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.strip().lower() in ("true", "yes", "on", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return int(value.replace("_", ""))  # exact: float() would round a seed above 2**53
            with contextlib.suppress(ValueError):
                if (f := float(value.replace("_", ""))).is_integer():  # 1e3
                    return int(f)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported field type {tp}")


def unknown_key(origin: str, dotted: str, key: str, valid: typing.Iterable[str], what: str = "key") -> ConfigError:
    """``origin: unknown key 'a.bb' (did you mean 'a.b'?)``, or without a near key ``...; valid keys here: ...``."""
    valid = sorted(valid)
    near = difflib.get_close_matches(key, valid, n=1)
    if near:
        return ConfigError(f"{origin}: unknown {what} {dotted!r} (did you mean {dotted[:len(dotted) - len(key)] + near[0]!r}?)")
    return ConfigError(f"{origin}: unknown {what} {dotted!r}; valid keys here: {', '.join(valid)}")


def from_dict(cls: type, d: dict[str, Any] | None, origin: str = "config", prefix: str = "",
              partial: bool = False) -> Any:
    """An instance of dataclass ``cls`` from a (nested) mapping: values coerced to the field types, nested
    dataclasses from sub-mappings, choices checked, unknown keys refused (:func:`unknown_key`).  ``partial``:
    only check ``d`` (required fields may be missing) and return the coerced mapping."""
    if d is not None and not isinstance(d, dict):
        raise ConfigError(f"{origin}: {prefix.rstrip('.') or 'the top level'} must be a mapping, got {d!r}")
    hints = field_types(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in (d or {}).items():
        dotted = f"{prefix}{key}"
        if key not in by_name:
            raise unknown_key(origin, dotted, str(key), by_name)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                value = dataclasses.asdict(value)
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{origin}: {dotted!r} must be a section (mapping), got {value!r}")
            kwargs[key] = from_dict(tp, value, origin, dotted + ".", partial)
            continue
        value = coerce(value, tp, f"{origin}: {dotted}")
        choices = by_name[key].metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{origin}: {dotted}: {value!r} is not one of {', '.join(map(str, choices))}")
        kwargs[key] = value
    if partial:
        return kwargs
    missing = [f.name for f in by_name.values() if f.name not in kwargs and f.init
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{origin}: missing {', '.join(prefix + m for m in missing)}")
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as plain YAML-ready data (tuples become lists)."""
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(obj))


def to_yaml(obj: Any) -> str:
    """Every field of ``obj`` as YAML, in declaration order; :func:`load_yaml` + :func:`from_dict` read it back
    to an equal object."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML file's top-level mapping (empty file: ``{}``); a missing file, invalid YAML (with its line) or a
    non-mapping is one error line naming the file."""
    from headbudget.io import read_text

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} not found")
    try:
        raw = yaml.safe_load(read_text(p))  # not UTF-8: names the file and the byte offset
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark else str(p)
        raise ConfigError(f"{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return raw or {}


def example_override(cls: type, prefix: str = "") -> str:
    """``key=default`` of the first field of ``cls`` with a number default (sections searched in order), else
    of its first string field: the example of an override in help texts and errors."""
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            found = example_override(tp, f"{prefix}{f.name}.")
            if found:
                return found
        elif isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
            return f"{prefix}{f.name}={f.default}"
    return next((f"{prefix}{f.name}={f.default}" for f in dataclasses.fields(cls) if isinstance(f.default, str)),
                "KEY=VALUE") if not prefix else ""


def apply_overrides(cls: type, d: dict[str, Any], overrides: typing.Iterable[str] | None,
                    flag: str = "--set") -> dict[str, Any]:
    """``d`` (a mapping for dataclass ``cls``) with ``section.key=value`` strings applied; values are read as
    YAML and coerced later by :func:`from_dict`.  A key that is not a field of ``cls`` is refused here.

    >>> Job = dataclasses.make_dataclass("Job", [("steps", int)])     # a dataclass with a field steps: int
    >>> apply_overrides(Job, {}, ["steps=20"])
    {'steps': 20}
    """
    d = dict(d)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} {example_override(cls)}")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node, tp = d, cls
        for i, part in enumerate(parts):
            names = {f.name for f in dataclasses.fields(tp)}
            sub = field_types(tp).get(part)
            last = i == len(parts) - 1
            dotted = ".".join(parts[:i + 1])
            if part not in names:
                raise unknown_key(f"{flag} {item!r}", dotted, part, names, "key" if last else "section")
            if dataclasses.is_dataclass(sub) and last:
                raise ConfigError(f"{flag} {item!r}: {dotted!r} is a section; set one of its keys, e.g. {flag} "
                                  f"{example_override(sub, dotted + '.') or dotted + '.KEY=VALUE'}")
            if not dataclasses.is_dataclass(sub) and not last:
                raise ConfigError(f"{flag} {item!r}: {dotted!r} is a key, not a section")
            if last:
                # a string field takes an unquoted value as typed (YAML reads name=010 as 8, name=no as false;
                # null/none is still None for an optional field: coerce); anything else is read as YAML
                node[part] = raw
                quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
                if sub not in (str, str | None) or quoted:
                    with contextlib.suppress(yaml.YAMLError):
                        node[part] = yaml.safe_load(raw) if raw.strip() else ""
            else:
                child = node.get(part)
                node[part] = dict(dataclasses.asdict(child) if dataclasses.is_dataclass(child) else child or {})
                node, tp = node[part], sub
    return d


__all__ = ["DTYPE_NAMES", "ConfigError", "apply_overrides", "coerce", "device_option", "dtype_option",
           "example_override", "field_types", "from_dict", "load_yaml", "option", "to_dict", "to_yaml",
           "unknown_key"]
