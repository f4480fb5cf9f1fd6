"""The ``headbudget`` command line.

Each sub-command lives in its own module under ``headbudget.cli`` whose ``register(subparsers)`` adds its
parser and sets ``func`` (called with the parsed arguments, returning an exit code); modules are imported
lazily so ``headbudget schedule`` does not pay for importing scikit-learn.  Errors a user can fix
(``ValueError``/``FileNotFoundError``/``KeyError``) and the anticipated failures of the machine and of files
from elsewhere (:func:`anticipated_error`) are printed as one line with exit code 2; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import pickle
import sys
import typing

# command name -> module implementing it (module.register(subparsers)), modules in the order of the help
COMMANDS: dict[str, str] = {command: f"headbudget.cli.{module}_cmd" for module, commands in (
    ("schedule", "schedule"), ("train", "train compare prepare distill"), ("quickstart", "quickstart"),
    ("eval", "eval perplexity attention"), ("prune", "finetune prune prune-compare"),
    ("compress", "compress"), ("experiment", "experiment"), ("export", "export"),
) for command in commands.split()}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


#: OSError numbers that mean "the machine or the path", not a bug: disk full, quota, read-only, ...
_OS_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR,
                        errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EFBIG, errno.ENOTEMPTY, errno.ELOOP})


def anticipated_error(exc: BaseException) -> str | None:
    """The one-line message of an anticipated error (None: a bug, whose traceback is shown).

    >>> anticipated_error(OSError(errno.ENOSPC, "No space left on device", "runs/a/model.safetensors"))
    'runs/a/model.safetensors: No space left on device'
    """
    if isinstance(exc, (CLIError, ValueError, FileNotFoundError, KeyError)):
        return str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
    if isinstance(exc, OSError) and exc.errno in _OS_ERRNOS:
        where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        return f"{where}: {exc.strerror}" if where else (exc.strerror or str(exc))
    if isinstance(exc, pickle.UnpicklingError):  # torch.load(weights_only=True): several lines, keep the cause
        from headbudget.io import refused_pickle_reason

        return f"refusing to unpickle a file that holds more than tensors: {refused_pickle_reason(exc)}"
    if type(exc).__name__ == "SafetensorError":  # safetensors' Rust error (import-free check)
        if "os error" in str(exc):  # writing: disk full, permission denied, ...
            return f"cannot write a safetensors file: {exc}"
        return f"unreadable safetensors file: {exc}"
    return None


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit 2 (``headbudget prune: error: argument --keep: ...``)
    instead of the whole usage (~35 lines for prune) before it; ``--help`` shows the usage.  Sub-command
    parsers inherit the class (``add_subparsers`` makes them with ``type(self)``)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> typing.NoReturn:
    """The error for arguments no parser took, from the command's own parser (its name, not ``headbudget``),
    naming the nearest flag of that command for the first unknown flag."""
    while parser._subparsers is not None:  # down to the (sub-)command that was chosen
        action = parser._subparsers._group_actions[0]
        chosen = action.choices.get(getattr(args, action.dest, None) or "")
        if chosen is None:
            break
        parser = chosen
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    unknown = next((x.split("=", 1)[0] for x in extra if x.startswith("--")), None)
    near = difflib.get_close_matches(unknown.replace("_", "-"), flags, n=1) if unknown else []
    parser.error(f"unrecognized arguments: {' '.join(extra)}"
                 + (f" (did you mean {near[0]}?)" if near else ""))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``command`` only that command's module is imported (``schedule`` needs no torch),
    without it every command (for ``--help``)."""
    parser = OneLineParser(prog="headbudget", description="Adaptive head budgeting: schedules, training, "
                                                          "evaluation, pruning, compression.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for module_name in modules:
        importlib.import_module(module_name).register(sub)
    from headbudget.threads import add_threads_flag

    for name, cmd in sub.choices.items():  # one --threads on every command (schedule needs none)
        if name != "schedule" and cmd._subparsers is None \
                and not any("--threads" in a.option_strings for a in cmd._actions):
            add_threads_flag(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # no global options take values
    parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, args, extra)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "validate", None):  # checks needing no torch: a --set typo costs no torch import
            args.validate(args)
        if "threads" in vars(args) and not getattr(args, "print_config", False):  # the one thread policy
            # (headbudget.threads), before any work; --print_config does none (and needs no torch)
            from headbudget.threads import configure_threads

            configure_threads(args.threads)
        return int(args.func(args) or 0)
    except Exception as exc:
        msg = anticipated_error(exc)
        if msg is None:
            raise
        print(f"headbudget {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"headbudget {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
