"""Command-line flags generated from a dataclass's fields (:func:`headbudget.typed_config.option` metadata:
help, choices, flag spelling), and the dataclass built back from the parsed flags, a ``--config`` file and
``--set key=value`` overrides -- so a setting is declared once, on its field.

    >>> import argparse
    >>> from headbudget.pruning.job import PruneJob
    >>> p = argparse.ArgumentParser()
    >>> _ = add_dataclass_flags(p, PruneJob, positional=("model",)); add_config_flags(p, PruneJob)
    >>> args = p.parse_args(["runs/ft", "--task", "sst5", "--keep", "12", "--out", "runs/cahp"])
    >>> job = dataclass_from_args(PruneJob, args)
    >>> job.keep, job.pool_size
    (12, 32)

Precedence: the field's default < ``--config FILE`` < ``--set key=value`` < a flag given on the command line
(the namespace holds every field, its default when not given; the generated flags' actions record which were
given, and only those override the config file).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Iterable
from typing import Any

from headbudget.typed_config import (
    ConfigError,
    apply_overrides,
    coerce,
    example_override,
    field_types,
    from_dict,
    load_yaml,
    to_yaml,
)

#: namespace attribute: the dests of the generated flags given on the command line
_GIVEN = "_dataclass_flags_given"


def _recording(base: type[argparse.Action]) -> type[argparse.Action]:
    """``base`` that also notes its dest in ``namespace._dataclass_flags_given`` when the flag is given."""
    class Recording(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
            if not (option_string is None and self.nargs == "?" and values is self.default):  # absent positional
                setattr(namespace, _GIVEN, getattr(namespace, _GIVEN, frozenset()) | {self.dest})
            super().__call__(parser, namespace, values, option_string)

    Recording.__name__ = f"Recording{base.__name__}"
    return Recording


_STORE, _STORE_TRUE, _STORE_FALSE = (_recording(a) for a in (argparse._StoreAction, argparse._StoreTrueAction,
                                                             argparse._StoreFalseAction))


def flag_name(f: dataclasses.Field, prefix: str = "") -> str:
    """The flag of field ``f``: its ``flag`` metadata, else ``--name-with-dashes`` (with a section prefix,
    ``--section.name`` as in ``--set section.name=...``)."""
    return f.metadata.get("flag") or (f"--{prefix}{f.name}" if prefix else "--" + f.name.replace("_", "-"))


#: the value placeholder of a --section.key flag by type (a prune flag shows its name: --keep KEEP)
_METAVARS = {int: "N", float: "X", str: "VALUE"}


def _base(tp: Any) -> Any:
    """``int`` of ``int | None``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 else tp


def _converter(tp: Any, flag: str) -> Any:
    def convert(text: str) -> Any:
        try:
            return coerce(text, tp, flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None

    convert.__name__ = getattr(tp, "__name__", str(tp))  # argparse names the type in some messages
    return convert


def _optional_on_cli(cls: type) -> dict[str, None]:
    """``{name: None}`` of the fields typed ``X | None`` that have no default: Python callers pass them, on the
    command line they may be left out (``PruneJob.data_dir``: only sst5/mnli need one)."""
    return {f.name: None for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            and type(None) in typing.get_args(field_types(cls)[f.name])}


def _help(f: dataclasses.Field, show_bool: bool = False, optional: bool = False) -> str:
    text = (f.metadata.get("help") or "").replace("%", "%%")
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and not optional:
        return f"{text} (required)"
    default = f.default if f.default is not dataclasses.MISSING else None
    if default is not None and (show_bool or not isinstance(default, bool)) and default != () \
            and "default" not in text:
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default).lower() \
            if isinstance(default, bool) else default  # as --x.y {true,false} and YAML spell it
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text


def add_dataclass_flags(p: argparse.ArgumentParser, cls: type, *, prefix: str = "", skip: Iterable[str] = (),
                        positional: Iterable[str] = (), choices: dict[str, tuple[Any, ...]] | None = None,
                        aliases: dict[str, tuple[str, ...]] | None = None, group_title: str | None = None,
                        hidden: Iterable[str] = ()) -> list[str]:
    """One flag per field of dataclass ``cls`` with ``cli`` metadata true (nested dataclass fields: their
    fields as ``--section.key VALUE``); ``positional`` fields are optional positionals (a config file may give
    them); ``aliases`` maps a dest (``model.schedule``) to shorter spellings a command also accepts
    (``--schedule``); ``hidden`` names dests whose own ``--section.key`` spelling is left out of the help
    (still accepted, same field): their alias is the one documented spelling (``--threads`` for
    ``train.threads``); ``skip`` names fields or whole sections.  Returns the dests added."""
    skip, positional, hidden = set(skip), tuple(positional), frozenset(hidden)
    target = p.add_argument_group(group_title) if group_title else p
    groups: dict[str, Any] = {}  # a field's ``group`` title -> its argument group, made at its first field
    dests: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        tp, dest = field_types(cls)[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            dests += add_dataclass_flags(p, tp, prefix=f"{dest}.", aliases=aliases, hidden=hidden,
                                         skip={k[len(dest) + 1:] for k in skip if k.startswith(dest + ".")},
                                         group_title=f"{dest} section (or --set {dest}.KEY=VALUE)")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else \
            None if f.default is dataclasses.MISSING else f.default
        kw: dict[str, Any] = {"default": default, "action": _STORE,
                              "help": _help(f, show_bool=bool(prefix) and not f.metadata.get("flag"),  # not a switch's
                                           optional=f.name in _optional_on_cli(cls))}
        if f.name in positional:
            target.add_argument(dest, nargs="?", metavar=f.metadata.get("metavar") or f.name.upper(), **kw)
            dests.append(dest)
            continue
        flag = flag_name(f, prefix)
        if tp is bool and flag.startswith("--no-") and f.default is True:
            kw["action"] = _STORE_FALSE
        elif tp is bool and f.default is False and (not prefix or f.metadata.get("flag")):  # a switch
            kw["action"] = _STORE_TRUE
        else:
            kw["type"] = _converter(tp, flag)
            kw["choices"] = (choices or {}).get(f.name) or f.metadata.get("choices")
            kw["metavar"] = f.metadata.get("metavar") or ("{" + ",".join(map(str, kw["choices"])) + "}"
                                                          if kw["choices"] else "{true,false}" if tp is bool
                                                          else _METAVARS.get(_base(tp)) if prefix else None)
            if kw["choices"]:  # checked on the converted value; the metavar lists them
                kw["choices"] = tuple(kw["choices"])
        title = f.metadata.get("group")
        if title and title not in groups:
            groups[title] = p.add_argument_group(title)
        group, names = (groups[title] if title else target), (aliases or {}).get(dest, ())
        if dest in hidden and names:  # one documented spelling; the generated one still parses, into the same field
            group.add_argument(*names, dest=dest, **kw)
            group.add_argument(flag, dest=dest, **{**kw, "help": argparse.SUPPRESS})
        else:
            group.add_argument(*names, flag, dest=dest, **kw)
        dests.append(dest)
    return dests


def add_config_flags(p: argparse.ArgumentParser, cls: type, what: str = "the settings") -> None:
    """``--config FILE``, ``--set KEY=VALUE`` (repeatable) and ``--print_config`` for dataclass ``cls``."""
    p.add_argument("--config", metavar="FILE", default=None,
                   help=f"YAML file of {what} (as --print_config writes it); flags given override it")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override one setting by its config key, e.g. --set {example_override(cls)} (repeatable)")
    p.add_argument("--print_config", "--print-config", action="store_true",
                   help=f"print all of {what} as YAML (feed it back with --config) and exit")


def add_overwrite_flag(p: argparse.ArgumentParser, what: str = "run") -> None:
    """``--overwrite``: without it, a command that writes a run folder refuses one holding an earlier run's results."""
    p.add_argument("--overwrite", action="store_true",
                   help=f"replace the results of an earlier {what} in --out (without it such a folder is refused)")


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The generated flags given on the command line, as a nested mapping (``a.b`` -> ``{"a": {"b": ...}}``)."""
    out: dict[str, Any] = {}
    for dest in sorted(getattr(args, _GIVEN, ())):
        if dest in vars(args):
            *sections, key = dest.split(".")
            node = out
            for s in sections:
                node = node.setdefault(s, {})
            node[key] = vars(args)[dest]
    return out


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``top``'s keys set, sub-mappings merged key by key."""
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def settings_mapping(cls: type, args: argparse.Namespace, defaults: dict[str, Any] | None = None,
                     base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``defaults`` < ``base`` < ``--config`` file < ``--set`` < given flags, as one mapping for ``cls``
    (a key of the file or of --set that is not a field is refused, naming it and the nearest field)."""
    d = deep_merge({**_optional_on_cli(cls), **(defaults or {})}, base or {})
    path = getattr(args, "config", None)
    if path:  # each layer is checked as it comes, so an error names the file or --set it came from
        file_d = load_yaml(path)
        from_dict(cls, file_d, str(path), partial=True)
        d = deep_merge(d, file_d)
    if getattr(args, "overrides", None):
        d = apply_overrides(cls, d, args.overrides)
        from_dict(cls, d, "--set", partial=True)
    return deep_merge(d, flag_values(args))


def missing_flags(cls: type, d: dict[str, Any], positional: Iterable[str] = ()) -> list[str]:
    """The flags (``MODEL`` for a positional) of required fields of ``cls`` that ``d`` lacks."""
    return [f.name.upper() if f.name in positional else flag_name(f) for f in dataclasses.fields(cls)
            if f.name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def build(cls: type, d: dict[str, Any], args: argparse.Namespace, positional: Iterable[str] = ()) -> Any:
    """``cls`` from the merged mapping ``d``; a required field it lacks is one error naming its flag."""
    if missing := missing_flags(cls, d, positional):
        raise ConfigError(f"missing {', '.join(missing)} (give {'it' if len(missing) == 1 else 'them'} on the "
                          "command line or in --config)")
    return from_dict(cls, d, str(getattr(args, "config", None) or "flags"))


def dataclass_from_args(cls: type, args: argparse.Namespace, defaults: dict[str, Any] | None = None,
                        positional: Iterable[str] = ()) -> Any:
    """The ``cls`` the flags, ``--config`` and ``--set`` describe (see :func:`settings_mapping`)."""
    return build(cls, settings_mapping(cls, args, defaults), args, positional)


def print_config(obj: Any) -> int:
    """``--print_config``: the full settings as YAML on stdout."""
    sys.stdout.write(to_yaml(obj))
    return 0


def add_settings(p: argparse.ArgumentParser, cls: type, what: str, positional: Iterable[str] = ()) -> None:
    """A command whose settings are dataclass ``cls``: its flags, --config/--set/--print_config, and a
    ``validate`` (run by cli.main before the command, before torch) that builds ``args.settings`` and copies its
    fields onto ``args`` for the command to read; the command starts with ``if printed(args): return 0``."""
    positional = tuple(positional)
    add_dataclass_flags(p, cls, positional=positional)
    add_config_flags(p, cls, what)

    def validate(args: argparse.Namespace) -> None:
        args.settings = dataclass_from_args(cls, args, positional=positional)
        vars(args).update(dataclasses.asdict(args.settings))

    p.set_defaults(validate=validate)


def printed(args: argparse.Namespace) -> bool:
    """--print_config: ``args.settings`` printed as YAML (the command then does nothing else)."""
    if getattr(args, "print_config", False):
        print_config(args.settings)
        return True
    return False


__all__ = ["add_config_flags", "add_dataclass_flags", "add_overwrite_flag", "add_settings", "build",
           "dataclass_from_args", "deep_merge", "flag_name", "flag_values", "missing_flags", "print_config", "printed",
           "settings_mapping"]
