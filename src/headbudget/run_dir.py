"""The output folder of a command: checked before the work starts, never silently replaced, one writer.

Every command that writes a folder (``train``, ``compare``, ``quickstart``, ``finetune``, ``prune``,
``prune-compare``, ``compress``, ``experiment``) enters :func:`claim_output_dir` before its work:

* a path that is a file, or lies under one, or a folder that cannot be created or written to is one
  :class:`OutputDirError` line before anything is computed;
* a folder that holds another run's results (:func:`previous_results`) is refused in one line naming
  them and the ways out (``--resume`` where the command has it, ``--overwrite``, another folder);
  ``overwrite=True`` deletes those results first;
* one writer per folder: ``.headbudget.lock`` holds the writer's pid and host under an exclusive
  ``flock``; a second writer is refused in one line naming them; the kernel drops the ``flock`` when its
  process dies, so the lock of a dead (even ``kill -9``-ed) writer is simply taken over.  The lock file is
  removed on exit, and so is a folder the claim created that stayed empty.

    >>> from headbudget.run_dir import claim_output_dir
    >>> with claim_output_dir("/tmp/headbudget-run-example", overwrite=True) as out:
    ...     _ = (out / "summary.json").write_text("{}")
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".headbudget.lock"

#: entries any headbudget command writes into its output folder (a run, a comparison, a pruned or
#: compressed model, an experiment); a sub-folder holding one of them (compare's ``prism-seed0/``) counts too
RESULT_NAMES = frozenset({
    "summary.json", "metrics.jsonl", "checkpoints", "model", "config.yaml", "tokenizer", "tensorboard",
    "compare.json", "compare.md", "report.json", "report.md", "details.json", "timings.json", "attention.json",
    "sweep.json", "finetune.json", "kept_heads.json", "saturation.json", "ngram.json",
    "config.json", "model.safetensors", "pytorch_model.bin",
})
RESULT_SUFFIXES = (".png",)


class OutputDirError(ValueError):
    """An output path that cannot be used (one line: the flag, the path and what is wrong)."""


def _is_result(entry: Path) -> bool:
    if entry.name in RESULT_NAMES or entry.suffix in RESULT_SUFFIXES:
        return True
    if entry.is_dir() and not entry.is_symlink():
        with contextlib.suppress(OSError):
            return any(child.name in RESULT_NAMES for child in entry.iterdir())
    return False


def previous_results(directory: str | os.PathLike, keep: tuple[str, ...] = ()) -> list[str]:
    """Names of the entries of ``directory`` that are results of an earlier run (sorted; [] when none).

    >>> previous_results("runs/prism")          # a finished training run
    ['checkpoints', 'config.yaml', 'metrics.jsonl', 'model', 'summary.json', 'tokenizer']
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(e.name for e in d.iterdir() if e.name != LOCK_NAME and e.name not in keep and _is_result(e))


def _first_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_output_file(path: str | os.PathLike, flag: str = "--json") -> Path:
    """Refuse, before any work, an output file that cannot be written: a folder at ``path``, a file where
    a parent folder should be, or a folder nothing can be created in.  Creates nothing.

    >>> check_output_file("results/eval.json")
    PosixPath('results/eval.json')
    """
    path = Path(path)
    if path.is_dir():
        raise OutputDirError(f"{flag} {path} is a folder, not a file")
    base = _first_existing(path.parent)
    if not base.is_dir():
        raise OutputDirError(f"{flag} {path}: {base} is a file, not a folder")
    try:  # a real write probe: access() says yes to root on a read-only mount
        fd, probe = tempfile.mkstemp(dir=base, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputDirError(f"{flag} {path}: cannot write in {base} ({_reason(exc)})") from None
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _read_holder(lock: Path) -> dict:
    try:
        return json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    return f"{who}, {holder['command']}" if holder.get("command") else who


@contextlib.contextmanager
def claim_output_dir(path: str | os.PathLike, *, flag: str = "--out", command: str = "",
                     resume: bool | None = None, overwrite: bool = False,
                     keep: tuple[str, ...] = ()) -> Iterator[Path]:
    """Check, lock and (``overwrite``) clear the output folder ``path`` for the duration of the block.

    ``resume`` is None for commands that cannot continue a run (the refusal then names only
    ``--overwrite`` and another folder); True lets a folder with results through (the command continues
    them).  ``keep`` names entries that are never results nor deleted (quickstart's ``data-cache``).

    >>> with claim_output_dir("runs/prism", command="headbudget train", resume=False) as out:
    ...     pass   # OutputDirError if runs/prism holds a finished run: --resume, --overwrite or another --out
    """
    path = Path(path)
    if resume and overwrite:
        raise OutputDirError("--resume and --overwrite exclude each other: continue the run or replace it")
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"{flag} {path} is a file, not a folder")
    base = _first_existing(path)
    if not base.is_dir():
        raise OutputDirError(f"{flag} {path}: {base} is a file, not a folder")
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputDirError(f"{flag} {path}: cannot create the folder ({_reason(exc)})") from None
    lock = path / LOCK_NAME
    fd = _lock(lock, path, flag, created)
    try:
        found = previous_results(path, keep)
        if found and not resume:
            if not overwrite:
                ways = "add --resume to continue it, " if resume is not None else ""
                shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
                raise OutputDirError(f"{flag} {path} already holds another run's results ({shown}): {ways}"
                                     f"add --overwrite to replace them, or choose another {flag}")
            for name in found:
                entry = path / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield path
    finally:
        _release(fd, lock, path, created)


def _lock(lock: Path, path: Path, flag: str, created: bool) -> int:
    """An open descriptor of ``lock`` holding its exclusive flock (OutputDirError when another writer has it)."""
    for _ in range(3):  # retried when the file was replaced between open and flock
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            if created:
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise OutputDirError(f"{flag} {path}: cannot write there ({_reason(exc)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(lock)
            # EAGAIN/EACCES: another writer holds the flock; any other error: no flock on this filesystem,
            # then the recorded pid decides (same host only)
            if exc.errno in (errno.EAGAIN, errno.EACCES) or (
                    holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)
                    and holder["pid"] != os.getpid() and _pid_alive(holder["pid"])):
                os.close(fd)
                raise OutputDirError(
                    f"{flag} {path} is being written by another headbudget process ({_describe(holder)}; lock "
                    f"{lock}): wait for it to end or choose another {flag}") from None
            return fd
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise OutputDirError(f"{flag} {path}: the lock {lock} keeps changing; is another process writing there?")


def _release(fd: int, lock: Path, path: Path, created: bool) -> None:
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_ino == os.stat(lock).st_ino:
            lock.unlink()
    with contextlib.suppress(OSError):
        os.close(fd)
    if created:  # nothing was written: leave no empty folder behind
        with contextlib.suppress(OSError):
            path.rmdir()


__all__ = ["LOCK_NAME", "OutputDirError", "check_output_file", "claim_output_dir", "previous_results"]
