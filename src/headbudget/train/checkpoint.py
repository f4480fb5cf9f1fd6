"""Sharded, atomic training checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint, ``step_NNNNNN/`` (DCP tensors, ``trainer_state.json``, ``rng_rankR.pt``), is written by every
process under a temporary name and renamed into place when all are done, so a crash never makes a half-written
one ``latest``; any number of FSDP2/DDP/plain processes loads it.  Nothing is unpickled beyond DCP's metadata
classes and ``weights_only`` tensors, and every file ``.metadata`` names must be a regular file inside the
folder.  See docs/training.md ("The trainer", Checkpoints).

    >>> import tempfile, torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> d = tempfile.mkdtemp()
    >>> for step in (10, 20, 30):
    ...     _ = save_checkpoint(d, step, model, opt, meta={"step": step}, keep_last=2)
    >>> [p.name for p in list_checkpoints(d)], latest_checkpoint(d).name
    (['step_000020', 'step_000030'], 'step_000030')
    >>> load_checkpoint(latest_checkpoint(d), model, opt)["step"]
    30
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import re
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headbudget.io import as_os_error, atomic_write_text, refused_pickle_reason, regular_file

_NAME = re.compile(r"^step_(\d+)$")
LATEST = "latest"
STATE_FILE = "trainer_state.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (message names the directory and the problem)."""


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (temporary directories are ignored)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir()
             if (m := _NAME.match(p.name)) and (p / STATE_FILE).is_file() and (p / ".metadata").is_file()]
    return [p for _, p in sorted(found)]


#: (pointer, its text, the checkpoint used instead) already said: a resume looks up the latest several times
_REPORTED: set[tuple[str, str, str]] = set()


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` points to (else the newest complete one), or None; a ``latest`` naming no
    complete checkpoint is said on stderr in one line (the file, what is wrong, the fallback)."""
    d = Path(directory)
    pointer, found = d / LATEST, list_checkpoints(d)
    if not pointer.is_file():  # none yet (or a crash before the first): the newest, silently
        return found[-1] if found else None
    try:
        with open(pointer, "rb") as f:
            raw = f.read(256)  # a name is ~12 bytes; a huge garbage file is not read whole
    except OSError as exc:
        text, problem = "", f"is unreadable ({exc.strerror})"
    else:
        text = raw.decode("latin-1").strip()  # any bytes decode; a checkpoint name is ASCII
        target = d / text
        if text and _NAME.match(text) and target in found:
            return target
        problem = ("is empty" if not text else  # ascii() below: any byte stays on the line
                   f"holds {text[:40]!a}, not the name of a checkpoint" if not _NAME.match(text) else
                   f"names {text}, which is incomplete (no {STATE_FILE} or .metadata)" if target.exists() else
                   f"names {text}, which does not exist")
    fallback = found[-1] if found else None
    key = (str(pointer), text, str(fallback))
    if key not in _REPORTED and os.environ.get("RANK", "0") == "0":  # one line per job, not one per process
        _REPORTED.add(key)
        instead = f"using the newest complete checkpoint, {fallback}, instead" if fallback \
            else "and there is no complete checkpoint to use instead"
        print(f"headbudget: warning: {pointer} {problem}; {instead}", file=sys.stderr, flush=True)
    return fallback


def legacy_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """``step_*.pt`` files of headbudget < 0.2 (pickled; they are never loaded)."""
    d = Path(directory)
    return sorted(d.glob("step_*.pt")) if d.is_dir() else []


# ---------------------------------------------------------------------------- RNG state as tensors
def rng_state() -> dict[str, Any]:
    """Every RNG state of this process as tensors and plain numbers (loadable with ``weights_only=True``)."""
    _, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"key": torch.from_numpy(np_key.astype(np.int64)), "pos": int(np_pos),
                      "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
            "python": {"version": int(py_version), "state": torch.tensor(py_state, dtype=torch.int64),
                       "gauss_next": py_gauss}}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    if s.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    n, p = s["numpy"], s["python"]
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss_next"]))


# ---------------------------------------------------------------------------- safe DCP reading
class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's ``.metadata`` is made of (no functions, no arbitrary objects)."""

    _ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata", "TensorProperties",
            "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("collections", "OrderedDict"),
        ("torch.serialization", "_get_layout"),  # maps the string "torch.strided" to the layout
        *((m, n) for m in ("pathlib", "pathlib._local")
          for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not part of DCP metadata)")


def _regular_file(path: Path) -> Path:
    """``path`` if it is a regular file (opening it cannot block on a FIFO or read a device forever)."""
    try:
        return regular_file(path, CheckpointError)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint file ({exc.strerror})") from None


def _check_storage(ckpt: Path, md: Any) -> None:
    """Every file ``.metadata`` points at is a regular file inside ``ckpt`` holding the bytes it claims."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    root = os.path.realpath(ckpt)
    sizes: dict[str, int] = {}
    for info in (getattr(md, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str):
            raise CheckpointError(f"{ckpt}: .metadata has a storage entry {info!r} that is not a file slice")
        if rel not in sizes:
            real = os.path.realpath(os.path.join(root, rel))
            if os.path.commonpath([root, real]) != root or real == root:
                raise CheckpointError(f"{ckpt}: .metadata points at {rel!r}, outside the checkpoint folder; "
                                      "refusing to read it")
            sizes[rel] = os.stat(_regular_file(Path(real))).st_size
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= sizes[rel]):
            raise CheckpointError(f"{ckpt}: .metadata reads bytes {offset}+{length} of {rel!r}, "
                                  f"which has {sizes[rel]}")


def read_metadata(path: str | os.PathLike):
    """DCP's ``.metadata`` of a checkpoint, unpickled safely; each entry a tensor in a file of the folder."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta_path = _regular_file(Path(path) / ".metadata")
    try:
        with open(meta_path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise CheckpointError(f"{meta_path}: not a headbudget checkpoint ({exc})") from None
    for key, item in getattr(md, "state_dict_metadata", {}).items():
        if not isinstance(item, TensorStorageMetadata):  # DCP would torch.load(weights_only=False) it
            raise CheckpointError(f"{meta_path}: entry {key!r} is not a tensor; refusing to load it")
    _check_storage(Path(path), md)
    return md


def _safe_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        reading: str | None = None  # the file of the slice being read, for the error naming it

        def read_metadata(self, *args: Any, **kwargs: Any):
            md = read_metadata(self.path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            self.reading = getattr(sinfo, "relative_path", None)
            return super()._slice_file(file, sinfo)

        def read_data(self, *args: Any, **kwargs: Any):
            # Each slice is torch.load(weights_only=True)-ed: a slice that is a pickle of anything else (or not
            # a tensor at all) is refused there, and named here instead of in DCP's per-rank traceback.
            try:
                with warnings.catch_warnings():  # torch's two lines on a pickle not of torch.save's protocol
                    warnings.filterwarnings("ignore", message="Detected pickle protocol")
                    return super().read_data(*args, **kwargs)
            except _BAD_SLICE as exc:
                if isinstance(exc, OSError) and exc.errno != errno.EINVAL:  # the disk, not the bytes
                    raise
                where = Path(self.path) / self.reading if self.reading else Path(self.path)
                from headbudget.model_files import weights_only_reason

                raise CheckpointError(f"{where}: not the tensors of a headbudget checkpoint "
                                      f"({weights_only_reason(exc)})") from None

    return SafeReader(str(path))


#: what torch.load and DCP raise on a slice whose bytes are not a saved tensor (EINVAL: a zip seeking outside it)
_BAD_SLICE = (pickle.UnpicklingError, RuntimeError, EOFError, AssertionError, AttributeError, TypeError,
              ValueError, IndexError, OSError)


def _raise_checkpoint_error(exc: BaseException) -> None:
    """Re-raise the CheckpointError DCP wrapped in its per-rank CheckpointException, if it holds one."""
    for failure in (getattr(exc, "failures", None) or {}).values():  # {rank: (exception, traceback)}
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            raise inner from None


def require_safe_torch_load(version: str | None = None) -> None:
    """Refuse to ``torch.load(weights_only=True)`` on torch < 2.6, whose check can be bypassed (CVE-2025-32434).

    >>> require_safe_torch_load("2.6.0")      # returns; "2.5.1" raises CheckpointError naming the CVE
    """
    v = torch.torch_version.TorchVersion(version or torch.__version__)
    if v < (2, 6):
        raise CheckpointError(f"torch {v} cannot load checkpoints safely (weights_only=True can be bypassed, "
                              "CVE-2025-32434); install torch >= 2.6")


# ---------------------------------------------------------------------------- save / load
def _dist() -> tuple[bool, int, int]:
    """(distributed, rank, world size)"""
    dist = torch.distributed
    on = dist.is_available() and dist.is_initialized()
    return on, (dist.get_rank() if on else 0), (dist.get_world_size() if on else 1)


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
        yield


def _barrier(on: bool) -> None:
    if on:
        torch.distributed.barrier()


def _tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """(DCP state of tensors only, the optimizer's param_groups) for any wrapper (DDP, FSDP2, none)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}, None
    msd, osd = get_state_dict(model, optimizer)  # initialises empty optimizer state, so loading has targets
    return {"model": msd, "optim": {"state": osd["state"]}}, osd["param_groups"]


def _check_shapes(path: Path, md: Any, state: dict[str, Any]) -> None:
    """CheckpointError naming the first tensor whose saved shape differs from the model's (DCP would raise
    it wrapped in a per-rank CheckpointException with a traceback per rank)."""
    saved = getattr(md, "state_dict_metadata", {}) or {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor) and prefix in saved:
            want = list(getattr(saved[prefix], "size", value.shape))
            if want != list(value.shape):
                raise CheckpointError(f"{path}: tensor {prefix} is {want} in the checkpoint but {list(value.shape)} "
                                      "in the model: the checkpoint was written by a model of another shape")

    walk("", state)


def save_checkpoint(directory: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, meta: dict[str, Any] | None = None,
                    keep_last: int = 2) -> Path:
    """Write ``step_{step}`` atomically (every process of the group calls this); returns its path.  ``meta``
    must be JSON (saved as ``trainer_state.json``, with ``step`` and ``world_size`` added)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    on, rank, world = _dist()
    d = Path(directory)
    final = checkpoint_path(d, step)
    tmp, old = d / f".{final.name}.tmp", d / f".{final.name}.old"
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
        tmp.mkdir()
    _barrier(on)
    try:
        state, _ = _tensor_state(model, optimizer)
        with _single_process_ok():
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp)), no_dist=not on)
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        _barrier(on)
        if rank == 0:
            record = dict(meta or {}, step=step, world_size=world)
            atomic_write_text(tmp / STATE_FILE, json.dumps(record, indent=1))
    except BaseException as exc:  # disk full, killed, ...: no half-written .step_*.tmp left behind
        hidden = as_os_error(exc, final)  # torch's writers hide ENOSPC in a RuntimeError: look before cleaning
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if hidden is not None and hidden is not exc:
            raise hidden from exc
        raise
    if rank == 0:
        if final.exists():  # rewritten after resuming from an older step: swap, then drop the old one
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        atomic_write_text(d / LATEST, final.name + "\n")
        for old_ckpt in list_checkpoints(d)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old_ckpt, ignore_errors=True)
    _barrier(on)
    return final


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    p = _regular_file(Path(path) / STATE_FILE)
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{p}: unreadable checkpoint state ({exc})") from None


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = True) -> dict[str, Any]:
    """Load model (and optimizer) in place from a checkpoint written by any number of processes; returns
    ``trainer_state.json`` with ``rng_restored``: whether this process found its own RNG state (new ranks
    have none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    require_safe_torch_load()
    path = Path(path)
    meta = read_trainer_state(path)
    md = read_metadata(path)  # a clear error here rather than one wrapped in DCP's per-rank exception
    on, rank, _ = _dist()
    rng_file = path / f"rng_rank{rank}.pt"
    saved_rng = None
    if restore_rng and rng_file.is_file():  # read before the model changes, so a bad file leaves it as it was
        try:
            saved_rng = torch.load(rng_file, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
            raise CheckpointError(f"{rng_file}: not a headbudget RNG state ({refused_pickle_reason(exc)})") from None
    state, param_groups = _tensor_state(model, optimizer)
    _check_shapes(path, md, state)
    with _single_process_ok():
        try:
            dcp.load(state, storage_reader=_safe_reader(path), no_dist=not on)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            _raise_checkpoint_error(exc)
            raise
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"]["state"], "param_groups": param_groups})
    meta["rng_restored"] = saved_rng is not None
    if saved_rng is not None:
        set_rng_state(saved_rng)
    return meta


__all__ = ["CheckpointError", "checkpoint_path", "latest_checkpoint", "legacy_checkpoints", "list_checkpoints",
           "load_checkpoint", "read_metadata", "read_trainer_state", "require_safe_torch_load", "rng_state",
           "save_checkpoint", "set_rng_state"]
