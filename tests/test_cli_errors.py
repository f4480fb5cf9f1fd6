"""Every anticipated error is one line, exit 2; an unexpected one keeps its traceback."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import headbudget.cli.experiment_cmd as experiment_cmd
from conftest import assert_names, error_line, names
from headbudget.cli.main import main


class _Payload:
    def __reduce__(self):
        return (print, ("pwned",))


def _refused_pickle() -> pickle.UnpicklingError:
    buf = io.BytesIO()
    torch.save({"x": _Payload()}, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError as exc:
        return exc
    raise AssertionError("torch.load(weights_only=True) accepted a payload")


def _safetensors_error(tmp_path: Path) -> Exception:
    from safetensors.torch import load_file, save_file

    f = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(64)}, str(f))
    f.write_bytes(f.read_bytes()[:100])
    try:
        load_file(str(f))
    except Exception as exc:  # safetensors_rust.SafetensorError
        return exc
    raise AssertionError("a truncated safetensors file loaded")


def _one_line(capsys, monkeypatch, exc: BaseException) -> tuple[int, str]:
    def fail(args):
        raise exc

    monkeypatch.setattr(experiment_cmd, "run_experiment", fail)
    rc = main(["experiment", "ngram"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("exc, line", [
    (PermissionError(errno.EACCES, "Permission denied", "/data/run/summary.json"),
     "/data/run/summary.json: Permission denied"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/data/out.json"), "/data/out.json: Is a directory"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/data/file/out"), "/data/file/out: Not a directory"),
    (OSError(errno.ENOSPC, "No space left on device", "/data/run/model.safetensors"),
     "/data/run/model.safetensors: No space left on device"),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/ro/run"), "/mnt/ro/run: Read-only file system"),
    (OSError(errno.EXDEV, "Invalid cross-device link", "/a", "/b"), None),  # not anticipated: traceback
])
def test_os_errors_are_one_line(capsys, monkeypatch, exc, line):
    if line is None:
        with pytest.raises(OSError):
            _one_line(capsys, monkeypatch, exc)
        return
    rc, err = _one_line(capsys, monkeypatch, exc)
    assert rc == 2
    assert_names(error_line(err, "experiment"), *line.split(": "))  # the path and the system's reason


def test_refused_pickles_and_bad_safetensors_are_one_line(capsys, monkeypatch, tmp_path):
    rc, err = _one_line(capsys, monkeypatch, _refused_pickle())
    assert rc == 2
    assert_names(error_line(err, "experiment"), "GLOBAL print")  # the payload's callable
    rc, err = _one_line(capsys, monkeypatch, _safetensors_error(tmp_path))
    assert rc == 2
    assert_names(error_line(err, "experiment"), "safetensors", "Error while deserializing")


def test_a_safetensors_write_error_is_not_called_unreadable(capsys, monkeypatch):
    from safetensors import SafetensorError

    rc, err = _one_line(capsys, monkeypatch, SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"))
    assert rc == 2
    line = error_line(err, "experiment")
    assert_names(line, "safetensors", "Error while serializing: I/O error: No space left on device (os error 28)")
    assert "unreadable" not in line


def test_an_unexpected_error_keeps_its_traceback(capsys, monkeypatch):
    with pytest.raises(ZeroDivisionError):
        _one_line(capsys, monkeypatch, ZeroDivisionError("division by zero"))
    with pytest.raises(RuntimeError):
        _one_line(capsys, monkeypatch, RuntimeError("a bug"))


def _tiny_llama(d: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def test_weights_that_do_not_fit_their_config_name_the_file_and_tensor(tmp_path):
    from headbudget.loading import load_model
    from headbudget.weight_shapes import WeightsMismatchError

    d = _tiny_llama(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 1  # kv heads that do not match the weights
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsMismatchError) as info:
        load_model(d)
    assert_names(str(info.value), d / "model.safetensors", "model.layers.0.self_attn.k_proj.weight", "[16, 32]",
                 d / "config.json", "[8, 32]")


def test_train_init_on_a_truncated_model_is_one_line(tmp_path, capsys):
    d = _tiny_llama(tmp_path / "m")
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()  # save_pretrained's progress bar
    rc = main(["train", "quickstart", "--init", str(d), "--out", str(tmp_path / "run"),
               "--set", "data.source=synthetic:20000", "--set", "data.tokenizer=byte",
               "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "train.steps=1",
               "--set", "train.context=16", "--set", "train.batch_size=2", "--set", "train.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2
    assert_names(error_line(err, "train"), weights, "safetensors",
                 "Error while deserializing header: incomplete metadata, file not fully covered")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.tmp"))


def test_resume_from_a_checkpoint_of_another_shape_names_the_tensor(tmp_path):
    from headbudget.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    small = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path / "ck", 1, small, torch.optim.AdamW(small.parameters()))
    big = torch.nn.Linear(4, 2)
    before = big.weight.detach().clone()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, big, torch.optim.AdamW(big.parameters()))
    assert_names(str(info.value), path, "model.weight", "[2, 3]", "[2, 4]")
    assert torch.equal(big.weight, before)


def test_a_set_typo_is_refused_before_torch_is_imported():
    code = textwrap.dedent("""
        import sys
        from headbudget.cli.main import main
        rcs = [main(["train", "quickstart", "--set", "train.stpes=3"]),
               main(["compare", "quickstart", "--set", "train.stpes=3"]),
               main(["quickstart", "--set", "train.stpes=3"]),
               main(["prepare", "quickstart", "--set", "train.stpes=3"])]
        print(rcs, "torch" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "[2, 2, 2, 2] False"
    lines = res.stderr.splitlines()
    assert len(lines) == 4
    for c, line in zip(("train", "compare", "quickstart", "prepare"), lines):
        assert_names(error_line(line, c), "--set", "'train.stpes=3'", "'train.stpes'", "'train.steps'")


def test_non_utf8_files_name_the_file_and_byte_offset(tmp_path, capsys):
    from headbudget.data.sources import read_source
    from headbudget.evaluation.tasks import iter_jsonl
    from headbudget.io import read_text

    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(b"name: x\n# caf\xe9\n")
    assert main(["train", str(cfg)]) == 2
    assert_names(error_line(capsys.readouterr().err, "train"), cfg, "UTF-8", "0xe9", "offset 13", "line 2")
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello\n\nworld \xff\xfe\n")
    with pytest.raises(ValueError, match=names(text, "UTF-8", "0xff", "offset 13", "line 3")):
        read_source(str(text))
    with pytest.raises(ValueError, match=names(text, "UTF-8", "0xff", "offset 13", "line 3")):
        read_text(str(text))
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"text": "a"}\n{"text": "\x81"}\n')
    with pytest.raises(ValueError, match=names(rows, "UTF-8", "0x81", "offset 24", "line 2")):
        list(iter_jsonl(rows))
    with pytest.raises(ValueError, match=names(rows, "UTF-8", "0x81", "offset 24", "line 2")):
        read_source(f"jsonl:{rows}:text")


def test_malformed_include_path_yaml_names_the_file_and_the_yaml_error(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "good.yaml").write_text("task: hb_good\ndataset_path: json\nprocess_docs: !function utils.p\n")
    (tasks / "bad.yaml").write_text("task: hb_bad\ndataset_path: json\n  output_type: [multiple_choice\n")
    rc = main(["eval", str(tmp_path / "no-model"), "--tasks", "hb_bad", "--include-path", str(tasks), "--quiet"])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "eval"), f"{tasks / 'bad.yaml'}:3:14", "YAML",
                 "mapping values are not allowed here", "'hb_bad'")


def test_eval_and_perplexity_json_in_a_read_only_folder_fail_before_any_work(tmp_path, capsys, monkeypatch):
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkstemp = tempfile.mkstemp

    def read_only(*a, dir=None, **k):  # root ignores chmod: refuse where the first byte would be written
        if dir is not None and Path(dir) == ro:
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    missing = str(tmp_path / "no-model")  # loading it would be a different error: the check comes first
    assert main(["perplexity", missing, "--data", str(text), "--json", str(ro / "p.json")]) == 2
    assert_names(error_line(capsys.readouterr().err, "perplexity"), f"--json {ro / 'p.json'}", ro,
                 "Permission denied")
    assert main(["eval", missing, "--tasks", "piqa", "--json", str(ro / "e.json")]) == 2
    assert_names(error_line(capsys.readouterr().err, "eval"), f"--json {ro / 'e.json'}", ro, "Permission denied")
    assert os.listdir(ro) == []


def test_attention_out_is_held_by_the_guard(tmp_path, capsys):
    out = tmp_path / "attn"
    out.mkdir()
    (out / "distance_prism.png").write_bytes(b"png")
    assert main(["attention", str(tmp_path / "m"), "--data", "x.txt", "--out", str(out)]) == 2
    assert_names(error_line(capsys.readouterr().err, "attention"), f"--out {out}", "distance_prism.png",
                 "--overwrite")


class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_model_whose_bin_weights_hide_code_is_one_line_naming_the_folder(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.loading import load_model

    d = tmp_path / "m"
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, n_positions=8))
    model.config.save_pretrained(d)
    state = dict(model.state_dict(), payload=_System(tmp_path / "pwned"))
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(ValueError) as info:
        load_model(d)
    assert_names(str(info.value), d, "pickle", "posix.system")
    assert not (tmp_path / "pwned").exists()
