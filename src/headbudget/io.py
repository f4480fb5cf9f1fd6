"""Files in and out: atomic writes, and the one text and JSONL reader.

Writes go to a temporary sibling, then ``os.replace``: nothing half-written is ever left at the target path,
and a failed write removes its temporary file.  Written files and folders follow the user's umask
(:func:`follow_umask`; ``tempfile`` and safetensors alone would make them 0600/0700).

    >>> from headbudget.io import atomic_write_json
    >>> p = atomic_write_json("/tmp/headbudget-io-example.json", {"ok": True})
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def refused_pickle_reason(exc: BaseException) -> str:
    """The one line of ``torch.load(weights_only=True)``'s several that says what it refused.

    >>> refused_pickle_reason(exc)   # doctest: +SKIP
    'Trying to load unsupported GLOBAL posix.system whose module posix is blocked.'
    """
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("WeightsUnpickler error:"):
            return ln.split(":", 1)[1].strip().split(" Please use `torch.serialization", 1)[0]
    return next((ln for ln in lines if "GLOBAL" in ln), lines[0] if lines else type(exc).__name__)


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def regular_file(path: str | os.PathLike, error: type[Exception] = ValueError) -> Path:
    """``path`` if it is a regular file (or a link to one), else ``error`` naming what it is (a FIFO blocks
    ``open``, a device never ends); a missing file is ``os.stat``'s ``FileNotFoundError``.

    >>> regular_file("runs/demo/model/config.json")   # a FIFO: one error naming it  # doctest: +SKIP
    PosixPath('runs/demo/model/config.json')
    """
    path = Path(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _NOT_REGULAR if test(mode)), "a special file")
        raise error(f"{path}: {kind}, not a regular file; refusing to read it")
    return path


def current_umask() -> int:
    """This process's umask (read from /proc where it exists: setting it to read it is not thread-safe)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> Path:
    """Give ``path`` (a file, or a folder and all in it) a plain ``open``/``mkdir``'s mode: 0666/0777 - umask.

    >>> follow_umask("runs/demo/model")   # after save_pretrained, whose model.safetensors is 0600
    PosixPath('runs/demo/model')
    """
    path = Path(path)
    mask = current_umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    if path.is_dir() and not path.is_symlink():
        os.chmod(path, dir_mode)
        for root, dirs, files in os.walk(path):
            for name, mode in [*((d, dir_mode) for d in dirs), *((f, file_mode) for f in files)]:
                if not os.path.islink(entry := os.path.join(root, name)):
                    os.chmod(entry, mode)
    elif path.is_file() and not path.is_symlink():
        os.chmod(path, file_mode)
    return path


def pid_alive(pid: int) -> bool:
    """Is process ``pid`` (on this host) alive?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _temp_prefix(path: Path) -> str:
    """The prefix of ``path``'s temporary siblings: ``.NAME.<pid>-`` (then 8 random characters and ``.tmp``).
    The pid lets the next write to ``path`` tell a dead writer's leftover from a live writer's file."""
    return f".{path.name}.{os.getpid()}-"


def remove_dead_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove (and return) the temporary siblings of ``path`` left by dead writers (a killed GGUF export
    leaves hundreds of MB); live writers' files stay.

    >>> remove_dead_temporaries("runs/m.gguf")   # [PosixPath('runs/.m.gguf.4242-k2j9x0ab.tmp')] after a kill
    []
    """
    path = Path(path)
    pattern = re.compile(re.escape(f".{path.name}.") + r"(\d+)-[a-z0-9_]{8}\.tmp$")
    removed = []
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return removed
    for entry in siblings:
        m = pattern.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            try:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
                removed.append(entry)
            except OSError:
                pass
    return removed


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` (parents created) through a temporary file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        _name_the_target(exc, Path(tmp), path)
        raise
    return path


def _name_the_target(exc: BaseException, tmp: Path, path: Path) -> None:
    """An OSError about the temporary file (or a file in the temporary folder) names the path the user
    asked for instead: the temporary one no longer exists when the message is read."""
    if not isinstance(exc, OSError) or exc.filename is None:
        return
    try:
        rel = Path(os.fsdecode(exc.filename)).relative_to(tmp)
    except ValueError:
        return
    exc.filename = str(path / rel) if rel.parts else str(path)


#: below this many free bytes a failed torch writer (which raises RuntimeError, not OSError) ran out of disk
_FULL_BELOW = 16 << 20


def as_os_error(exc: BaseException, path: str | os.PathLike) -> OSError | None:
    """The OSError behind a failed write to ``path`` when the writer hid it (Rust's ``... (os error 28)``;
    torch's reasonless ``inline_container.cc`` failure on a nearly full disk is ENOSPC), else None.  Call it
    before removing the partial output, which frees the space.

    >>> as_os_error(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), "m")
    OSError(28, 'No space left on device')
    """
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):  # (DCP's CheckpointException is
        return None  # a BaseException wrapping each rank's error)
    for failure in (getattr(exc, "failures", None) or {}).values():  # DCP: {rank: (exception, traceback)}
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException) and (found := as_os_error(inner, path)) is not None:
            return OSError(found.errno, found.strerror, str(path))
    text = str(exc)
    if m := re.search(r"\(os error (\d+)\)", text):
        code = int(m.group(1))
        return OSError(code, os.strerror(code), str(path))
    if "inline_container.cc" in text:
        where = Path(path)
        while not where.exists() and where != where.parent:
            where = where.parent
        try:
            if shutil.disk_usage(where).free < _FULL_BELOW:
                return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError:
            pass
    return None


def atomic_write_json(path: str | os.PathLike, data: Any, indent: int = 2) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=indent) + "\n")


def _atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], folder: bool) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path)
    if folder:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp"))
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
    try:
        write(tmp)
        follow_umask(tmp)  # mkstemp/mkdtemp made it 0600/0700
        if folder and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException as exc:
        hidden = as_os_error(exc, path)  # before the cleanup frees the space
        if folder:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if hidden is not None and hidden is not exc:
            raise hidden from exc
        _name_the_target(exc, tmp, path)
        raise
    return path


def atomic_write_file(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Write one file through ``write(tmp)`` (a temporary sibling path), then move it to ``path``, so a
    failure (or Ctrl-C) never leaves a half-written file there.

    >>> atomic_write_file("/tmp/headbudget-io.bin", lambda p: p.write_bytes(b"GGUF"))
    PosixPath('/tmp/headbudget-io.bin')
    """
    return _atomic_write(path, write, folder=False)


def atomic_write_dir(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Fill a folder through ``write(tmp)`` in a temporary sibling, then move it to ``path`` (replacing it).

    >>> atomic_write_dir("/tmp/headbudget-io-model", lambda d: (d / "config.json").write_text("{}"))
    PosixPath('/tmp/headbudget-io-model')
    """
    return _atomic_write(path, write, folder=True)


def new_figure(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float] | None = None,
               layout: str | None = None, **subplot_kw: Any) -> tuple[Any, Any]:
    """``plt.subplots(nrows, ncols, figsize=..., layout=..., sharey=...)`` on the Agg canvas, without pyplot: no
    global backend change, and no figure kept alive after :func:`save_figure`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **subplot_kw)


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically (format from the suffix, PNG by default), then close it, written or
    not: pyplot keeps every figure it made until closed, and a sweep drawing many would hold them all.

        fig, ax = new_figure(); ax.plot([0, 1]); save_figure(fig, "runs/x/curve.png")
    """
    fmt = Path(path).suffix[1:] or "png"
    try:
        return atomic_write_file(path, lambda tmp: fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format=fmt))
    finally:
        import sys

        pyplot = sys.modules.get("matplotlib.pyplot")  # not imported: no figure of pyplot's to close
        if pyplot is not None:
            pyplot.close(fig)  # a no-op for new_figure's figures, which pyplot does not hold


# ----------------------------------------------------------------------------- reading text and JSONL
class NotUTF8Error(ValueError):
    """A text file that is not UTF-8: names the file, the byte, its offset and line."""


def _not_utf8(path: str | os.PathLike, raw: bytes, exc: UnicodeDecodeError, base: int = 0,
              line: int | None = None) -> NotUTF8Error:
    offset = base + exc.start
    line = line if line is not None else raw.count(b"\n", 0, exc.start) + 1
    return NotUTF8Error(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {offset}, line {line})")


def read_text(source: str | os.PathLike, *, hf_config: str | None = None, split: str = "test",
              column: str = "text", flag: str = "--data") -> str:
    """The text of a UTF-8 file (else :class:`NotUTF8Error`), or of a Hugging Face dataset ``name[:config]``
    (its ``column`` joined with blank lines, as the HF perplexity guide does).  A source that looks like a
    path (a suffix, a leading ``.``, ``/`` or ``~``, a folder) is never looked up as a dataset: a
    ``FileNotFoundError`` naming ``flag``.

    >>> read_text("wikitext:wikitext-2-raw-v1")[:4]                  # doctest: +SKIP
    ' = V'
    """
    p = Path(source)
    if p.is_file():
        raw = p.read_bytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _not_utf8(source, raw, exc) from None
    if p.suffix or str(source).startswith((".", "/", "~")) or p.is_dir():
        raise FileNotFoundError(f"{flag}: no file {source}")
    name, _, config = str(source).partition(":")
    import datasets

    try:
        ds = datasets.load_dataset(name, config or hf_config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds
        raise ValueError(f"{flag} {source!r}: not a file and not loadable as a dataset "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if column not in ds.column_names:
        raise ValueError(f"{flag} {source!r}: no column {column!r} (columns: {ds.column_names})")
    return "\n\n".join(ds[column])


def iter_text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line_number, line)`` (newline kept) of a UTF-8 file read line by line, so a large file is never
    held whole; bytes that are not UTF-8 are one :class:`NotUTF8Error` naming the file, offset and line."""
    offset = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, raw, exc, base=offset, line=lineno) from None
            offset += len(raw)


def iter_jsonl(path: str | os.PathLike, *,
               error: type[ValueError] = ValueError) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line_number, row)`` for each non-blank line of a JSONL file; a line that is not a JSON object raises
    ``error`` (the caller's ``ValueError`` subclass) naming ``path:line`` (``rows.jsonl:3: expected a JSON
    object, got list``); bytes that are not UTF-8 raise :class:`NotUTF8Error`."""
    for lineno, line in iter_text_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise error(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        yield lineno, row


__all__ = ["NotUTF8Error", "iter_jsonl", "iter_text_lines", "read_text"]
