"""Crafted model folders, tokenizers and GGUF files: nothing waits forever, nothing ends in a traceback.

A FIFO where a file should be is refused before anything opens it (each test runs a writer that unblocks a
reader which did open it, so without the check the test fails instead of hanging); a too deeply
nested JSON file, a pickle for weights and a corrupt GGUF header are one line naming the file, exit 2."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_names, error_line
from headbudget.cli.main import main
from tiny_gguf import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny GPT-2 folder with its own (byte) tokenizer, a tiny GGUF and a text to score."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.models.tokenizers import ByteTokenizer

    root = tmp_path_factory.mktemp("crafted")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=257, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                               bos_token_id=256, eos_token_id=256)).save_pretrained(root / "model")
    ByteTokenizer().save(root / "model")
    (root / "text.txt").write_text("the dogs that the cat chases run . " * 4)
    write_tiny_llama_gguf(root / "tiny.gguf")
    return {"model": root / "model", "gguf": root / "tiny.gguf", "text": root / "text.txt"}


def _perplexity(model: Path, folders: dict[str, Path], capsys, *extra: str) -> tuple[int, list[str]]:
    rc = main(["perplexity", str(model), "--data", str(folders["text"]), "--context", "16", "--quiet", *extra])
    err = capsys.readouterr().err
    noise = ("[transformers]", "Loading weights", "Converting and de-quantizing")  # transformers' own, not errors
    return rc, [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith(noise)]


#: polls a FIFO: opens it for writing whenever a reader has it open, then closes it (the reader sees its end)
#: and notes that in a file.  A process of its own: a reader in Rust (safetensors) blocks holding the GIL.
_WRITER = """
import errno, os, sys, time
path, log = sys.argv[1], sys.argv[2]
while True:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader has it open
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            sys.exit(0)
        time.sleep(0.2)
        continue
    os.close(fd)
    with open(log, "a") as f:
        f.write("opened\\n")
    time.sleep(0.2)
"""


@contextlib.contextmanager
def _fifo(path: Path):
    """Make ``path`` a FIFO whose readers never block for long (see ``_WRITER``); yields a function that
    says whether anything opened it."""
    os.mkfifo(path)
    log = path.parent / f".{path.name}.opened"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(log)])
    try:
        yield log.exists
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"])
def test_a_fifo_in_a_model_folder_is_refused_before_it_is_opened(folders, tmp_path, capsys, name):
    model = shutil.copytree(folders["model"], tmp_path / "m")
    (model / name).unlink()
    with _fifo(model / name) as opened:
        rc, lines = _perplexity(model, folders, capsys)
    assert not opened()  # nothing opened it
    assert rc == 2
    assert_names(error_line("\n".join(lines), "perplexity"), model / name, "FIFO")


def test_a_fifo_gguf_is_refused_by_name_and_in_its_folder(folders, tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    with _fifo(gguf) as opened:
        direct = _perplexity(gguf, folders, capsys)
        in_folder = _perplexity(tmp_path, folders, capsys)
    assert not opened()
    for rc, lines in (direct, in_folder):
        assert rc == 2
        assert_names(error_line("\n".join(lines), "perplexity"), gguf, "FIFO")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_a_too_deeply_nested_json_file_is_one_line_naming_it(folders, tmp_path, capsys, name):
    model = shutil.copytree(folders["model"], tmp_path / "m")
    (model / "tokenizer_spec.json").unlink()  # the Hugging Face tokenizer files are read, not headbudget's record
    (model / name).write_text("[" * 100_000)
    rc, lines = _perplexity(model, folders, capsys)
    assert rc == 2
    assert_names(error_line("\n".join(lines), "perplexity"), model / name, "JSON", "nested")


def test_a_too_deeply_nested_headbudget_tokenizer_record_is_one_line_naming_it(folders, tmp_path, capsys):
    tok = shutil.copytree(folders["model"], tmp_path / "tok")
    (tok / "tokenizer_spec.json").write_text("[" * 100_000)
    rc, lines = _perplexity(folders["model"], folders, capsys, "--tokenizer", str(tok))
    assert rc == 2
    assert_names(error_line("\n".join(lines), "perplexity"), tok / "tokenizer_spec.json", "JSON", "nested")


class _Marker:
    """Unpickling this creates a file: a stand-in for arbitrary code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_pickle_for_weights_is_refused_in_one_line_and_never_runs(folders, tmp_path, capsys):
    model = shutil.copytree(folders["model"], tmp_path / "m")
    (model / "model.safetensors").unlink()
    marker = tmp_path / "marker"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker(marker)))
    rc, lines = _perplexity(model, folders, capsys)
    assert rc == 2 and len(lines) == 1, lines  # no warning lines from torch before it
    assert_names(error_line(lines[0], "perplexity"), model, "weights", "Unsupported operand")
    assert "Weights only load failed" not in lines[0]
    assert not marker.exists()


def _gguf_variants(good: bytes) -> dict[str, tuple[bytes, list]]:
    """name -> (the file's bytes, the values the one line must name besides the file)."""
    huge_tensors = bytearray(good)
    huge_tensors[8:16] = struct.pack("<Q", 10**12)
    huge_kv = bytearray(good)
    huge_kv[16:24] = struct.pack("<Q", 10**12)
    return {
        "bad magic": (b"GGUX" + good[4:], ["GGUF", "b'GGUX'", "b'GGUF'"]),
        "empty": (b"", ["b''", "b'GGUF'"]),
        "truncated header": (good[:20], ["truncated", "header", "4", "20"]),
        "truncated metadata": (good[:2000], ["truncated"]),
        "tensor count larger than the file": (bytes(huge_tensors), [10**12, "tensors"]),
        "metadata count larger than the file": (bytes(huge_kv), [10**12, "metadata"]),
        "truncated tensor data": (good[:-5000], [len(good) - 5000]),
    }


@pytest.mark.parametrize("variant", ["bad magic", "empty", "truncated header", "truncated metadata",
                                     "tensor count larger than the file", "metadata count larger than the file",
                                     "truncated tensor data"])
def test_a_corrupt_gguf_is_one_line_naming_the_file_and_the_damage(folders, tmp_path, capsys, variant):
    data, parts = _gguf_variants(folders["gguf"].read_bytes())[variant]
    gguf = tmp_path / "bad.gguf"
    gguf.write_bytes(data)
    rc, lines = _perplexity(gguf, folders, capsys)
    assert rc == 2 and len(lines) == 1, lines
    assert_names(error_line(lines[0], "perplexity"), gguf, *parts)
