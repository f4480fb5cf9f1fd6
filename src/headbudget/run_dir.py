"""The output folder of a command: checked before the work starts, never silently replaced, one writer.

Every command that writes a folder (``train``, ``compare``, ``quickstart``, ``finetune``, ``prune``,
``prune-compare``, ``compress``, ``experiment``) enters :func:`claim_output_dir` before its work: an unusable
path, an output that is (or contains, or lies in) one of the inputs, another run's results without
``--overwrite``/``--resume``, or a live second writer (an exclusive ``flock`` on ``.headbudget.lock``, which
the kernel drops when its writer dies) is one :class:`OutputDirError` line before anything is computed.
``overwrite=True`` stages the new results and swaps them in only on success; a dead writer's temporaries are
removed by the next claim.  See docs/training.md.

    >>> from headbudget.run_dir import claim_output_dir
    >>> with claim_output_dir("/tmp/headbudget-run-example", overwrite=True, inputs={"MODEL": "runs/prism"}) as out:
    ...     _ = (out / "summary.json").write_text("{}")   # out: the folder itself, or its staging folder
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from headbudget.io import atomic_write_text, pid_alive

LOCK_NAME = ".headbudget.lock"

#: what headbudget commands write into an output folder; a sub-folder holding one (``prism-seed0/``) counts
RESULT_NAMES = frozenset({
    "summary.json", "metrics.jsonl", "checkpoints", "model", "config.yaml", "tokenizer", "tensorboard",
    "compare.json", "compare.md", "report.json", "report.md", "details.json", "timings.json", "attention.json",
    "sweep.json", "finetune.json", "kept_heads.json", "saturation.json", "ngram.json",
    "config.json", "model.safetensors", "pytorch_model.bin",
})
RESULT_SUFFIXES = (".png",)


class OutputDirError(ValueError):
    """An output path that cannot be used (one line: the flag, the path and what is wrong)."""


#: where ``overwrite`` stages the new results, where the old ones wait during the swap, and the swap's journal
STAGING_NAME, REPLACED_NAME, SWAP_JOURNAL = ".headbudget-new.tmp", ".headbudget-old.tmp", ".headbudget-swap.json"

#: an atomic write's temporary (``.model.<pid>-<random>.tmp``; ``.model.<random>.tmp`` of earlier releases)
_TEMP = re.compile(r"^\..+\.(\d+-)?[a-z0-9_]{8}\.tmp$")


def is_temporary(name: str) -> bool:
    """Is ``name`` a temporary entry headbudget writes (an atomic write in progress, a claim's staging)?

    >>> is_temporary(".model.4242-k2j9x0ab.tmp"), is_temporary("model")
    (True, False)
    """
    return bool(_TEMP.match(name)) or name in (STAGING_NAME, REPLACED_NAME, SWAP_JOURNAL)


def _is_result(entry: Path) -> bool:
    if is_temporary(entry.name):
        return False
    if entry.name in RESULT_NAMES or entry.suffix in RESULT_SUFFIXES:
        return True
    if entry.is_dir() and not entry.is_symlink():
        with contextlib.suppress(OSError):
            return any(child.name in RESULT_NAMES for child in entry.iterdir())
    return False


def previous_results(directory: str | os.PathLike, keep: tuple[str, ...] = ()) -> list[str]:
    """Names of the entries of ``directory`` that are results of an earlier run (sorted; [] when none).

    >>> run = Path(tempfile.mkdtemp())          # a finished training run, and a note of one's own
    >>> for name in ("checkpoints", "model", "tokenizer"): (run / name).mkdir()
    >>> for name in ("config.yaml", "metrics.jsonl", "summary.json", "notes.txt"): (run / name).touch()
    >>> previous_results(run)
    ['checkpoints', 'config.yaml', 'metrics.jsonl', 'model', 'summary.json', 'tokenizer']
    """
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(e.name for e in d.iterdir() if e.name != LOCK_NAME and e.name not in keep and _is_result(e))


def _existing_base(path: Path, start: Path, flag: str) -> Path:
    """The first existing entry at or above ``start``: a folder, else OutputDirError naming ``path``."""
    base = start.absolute()
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise OutputDirError(f"{flag} {path}: {base} is a file, not a folder")
    return base


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_output_file(path: str | os.PathLike, flag: str = "--json",
                      inputs: Mapping[str, object] | None = None) -> Path:
    """Refuse, before any work, an output file that cannot be written (one of the ``inputs``, a folder, under
    a file, in a read-only folder).  Creates nothing.

    >>> check_output_file("results/eval.json", inputs={"MODEL": "runs/prism/model"})
    PosixPath('results/eval.json')
    """
    check_not_an_input(path, inputs, flag)
    path = Path(path)
    if path.is_dir():
        raise OutputDirError(f"{flag} {path} is a folder, not a file")
    base = _existing_base(path, path.parent, flag)
    try:  # a real write probe: access() says yes to root on a read-only mount
        fd, probe = tempfile.mkstemp(dir=base, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputDirError(f"{flag} {path}: cannot write in {base} ({_reason(exc)})") from None
    return path


def _within(inner: str, outer: str) -> bool:
    """Is real path ``inner`` ``outer`` itself or below it (path components, not string prefixes)?"""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def check_not_an_input(out: str | os.PathLike, inputs: Mapping[str, object] | None,
                       flag: str = "--out") -> None:
    """Refuse an output ``out`` that is, contains or lies inside one of ``inputs`` (flag -> path(s) or None),
    real paths compared (a symlink to the input is the input): writing it would destroy what is read.

    >>> with tempfile.TemporaryDirectory() as m:             # a model folder
    ...     check_not_an_input(m, {"MODEL": m, "--data": "text.txt"})
    Traceback (most recent call last):
    headbudget.run_dir.OutputDirError: --out ... is the MODEL ...: choose another --out
    """
    target = os.path.realpath(out)
    for name, value in (inputs or {}).items():
        for path in value if isinstance(value, (list, tuple, set, frozenset)) else [value]:
            if not (isinstance(path, (str, os.PathLike)) and str(path) and os.path.lexists(path)):
                continue  # None, a hub name, synthetic:N
            path, real = os.fspath(path), os.path.realpath(path)
            how = ("is" if real == target else "contains" if _within(real, target)
                   else "lies inside" if _within(target, real) else None)
            if how is not None:
                shown = path if real == os.path.abspath(path) else f"{path} (= {real})"
                raise OutputDirError(f"{flag} {out} {how} the {name} {shown}: choose another {flag}")


@contextlib.contextmanager
def claim_output_dir(path: str | os.PathLike, *, flag: str = "--out", command: str = "",
                     resume: bool | None = None, overwrite: bool = False, keep: tuple[str, ...] = (),
                     inputs: Mapping[str, object] | None = None) -> Iterator[Path]:
    """Check, lock and claim the output folder ``path`` for the block; yields the folder to write into.

    ``inputs``: flag -> path(s) the command reads (:func:`check_not_an_input`).  ``resume`` is None for
    commands that cannot continue a run; True lets a folder with results through.  ``overwrite`` with results
    present yields a staging folder whose entries replace the old results when the block ends without error.
    ``keep`` names entries that are never results nor replaced (quickstart's ``data-cache``).

    >>> with claim_output_dir("runs/prism", command="headbudget train", resume=False) as out:
    ...     pass   # OutputDirError if runs/prism holds a finished run: --resume, --overwrite or another --out
    """
    path = Path(path)
    if resume and overwrite:
        raise OutputDirError("--resume and --overwrite exclude each other: continue the run or replace it")
    check_not_an_input(path, inputs, flag)
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"{flag} {path} is a file, not a folder")
    _existing_base(path, path, flag)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputDirError(f"{flag} {path}: cannot create the folder ({_reason(exc)})") from None
    lock = path / LOCK_NAME
    fd = _lock(lock, path, flag, created)
    try:
        _clear_dead_writer(path, keep)  # the lock is ours: whoever wrote these temporary files is gone
        found = previous_results(path, keep)
        staging = None
        if found and not resume:
            if not overwrite:
                ways = "add --resume to continue it, " if resume is not None else ""
                shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
                raise OutputDirError(f"{flag} {path} already holds another run's results ({shown}): {ways}"
                                     f"add --overwrite to replace them, or choose another {flag}")
            staging = path / STAGING_NAME
            staging.mkdir()
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        if staging is None:
            yield path
        else:
            try:
                yield staging
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)  # the old results were never touched
                raise
            _swap_in(path, staging, keep)
    finally:
        _release(fd, lock, path, created)


def write_dir(path: str | os.PathLike, overwrite: bool, keep: tuple[str, ...] = ()) -> Path:
    """The folder a process that does not hold the claim (a torchrun worker) writes into: the staging folder
    :func:`claim_output_dir` yields to the claiming process, decided from the same state of ``path``."""
    path = Path(path)
    return path / STAGING_NAME if overwrite and previous_results(path, keep) else path


def _swap_in(path: Path, staging: Path, keep: tuple[str, ...]) -> None:
    """Replace ``path``'s results by ``staging``'s entries.  A journal names the staged entries first, so a
    kill at any point is rolled back (or finished) by the next claim: :func:`_clear_dead_writer`."""
    new = sorted(e.name for e in staging.iterdir())
    old = dict.fromkeys([*previous_results(path, keep), *(n for n in new if os.path.lexists(path / n))])
    journal, replaced = path / SWAP_JOURNAL, path / REPLACED_NAME
    atomic_write_text(journal, json.dumps({"new": new}))
    replaced.mkdir()
    for name in old:
        os.replace(path / name, replaced / name)
    for name in new:
        os.replace(staging / name, path / name)
    staging.rmdir()
    shutil.rmtree(replaced)
    journal.unlink()


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    elif os.path.lexists(entry):
        entry.unlink()


def _clear_dead_writer(path: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove what a dead writer left in ``path``: a staging folder (the old results were never touched), an
    interrupted swap (rolled back while new entries were still staged, else finished), and the temporary files
    of interrupted atomic writes anywhere below (never inside ``keep`` entries)."""
    staging, replaced, journal = path / STAGING_NAME, path / REPLACED_NAME, path / SWAP_JOURNAL
    if replaced.is_dir() and staging.is_dir():  # killed mid-swap: put the old results back
        try:
            staged = json.loads(journal.read_text()).get("new", [])
        except (OSError, ValueError):
            staged = []
        for name in staged:
            if not os.path.lexists(staging / name):  # already moved in: a new entry, not an old one
                _remove(path / name)
        for entry in list(replaced.iterdir()):
            _remove(path / entry.name)
            os.replace(entry, path / entry.name)
        print(f"headbudget: {path}: restored the results an interrupted --overwrite had begun to replace",
              file=sys.stderr)
    for entry in (staging, replaced, journal):
        _remove(entry)
    for root, dirs, files in os.walk(path):
        if Path(root) == path:
            dirs[:] = [d for d in dirs if d not in keep]
            files = [f for f in files if f not in keep]
        for name in [*files, *dirs]:
            if _TEMP.match(name):
                _remove(Path(root) / name)
        dirs[:] = [d for d in dirs if not _TEMP.match(d)]


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
            try:
                holder = json.loads(lock.read_text() or "{}")
            except (OSError, ValueError):
                holder = {}
            # EAGAIN/EACCES: another writer holds the flock; any other error: no flock on this filesystem,
            # then the recorded pid decides (same host only)
            if exc.errno in (errno.EAGAIN, errno.EACCES) or (
                    holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int)
                    and holder["pid"] != os.getpid() and pid_alive(holder["pid"])):
                os.close(fd)
                who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
                who += f", {holder['command']}" if holder.get("command") else ""
                raise OutputDirError(f"{flag} {path} is being written by another headbudget process ({who}; "
                                     f"lock {lock}): wait for it to end or choose another {flag}") from None
            return fd
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
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


__all__ = ["LOCK_NAME", "OutputDirError", "check_not_an_input", "check_output_file", "claim_output_dir",
           "is_temporary", "previous_results", "write_dir"]
