"""No command destroys what it reads: an output that is, contains or lies inside one of the command's inputs
(real paths: a symlink to an input is the input) is refused in one line before any work; ``--overwrite`` writes
the new results beside the old ones and swaps them in only when they are complete, so a failure or a kill
leaves the old results; a dead writer's temporary files are removed by the next run and never count as
results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import assert_names, error_line, names
from headbudget.cli.main import main
from headbudget.io import atomic_write_file, remove_dead_temporaries
from headbudget.run_dir import (
    REPLACED_NAME,
    STAGING_NAME,
    OutputDirError,
    check_not_an_input,
    claim_output_dir,
    previous_results,
)

TEXT = Path(__file__).resolve().parent / "fixtures" / "lm" / "tiny_corpus.txt"


def _snapshot(d: Path) -> dict[str, bytes]:
    if d.is_file():
        return {d.name: d.read_bytes()}
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from headbudget.models.tokenizers import ByteTokenizer

    d = tmp_path_factory.mktemp("guard") / "tiny-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64)).save_pretrained(d)
    ByteTokenizer().save(d)
    return d


#: command -> (the input the output is placed against: "model", "text" or "config"; argv with {IN}, {M},
#: {T}, {C} and {OUT}); every command that has --overwrite gets it, so nothing may be deleted either way
COMMANDS = {
    "prune": ("model", ["prune", "{IN}", "--task", "lm", "--data", "{T}", "--keep-ratio", "0.5", "--method",
                        "random", "--finetune-epochs", "0", "--out", "{OUT}", "--overwrite"]),
    "prune-compare": ("model", ["prune-compare", "{IN}", "--task", "lm", "--data", "{T}", "--methods", "random",
                                "--keep-ratio", "0.5", "--finetune-epochs", "0", "--out", "{OUT}", "--overwrite"]),
    "prune --data": ("text", ["prune", "{M}", "--task", "lm", "--data", "{IN}", "--keep-ratio", "0.5",
                              "--method", "random", "--finetune-epochs", "0", "--out", "{OUT}", "--overwrite"]),
    "finetune": ("model", ["finetune", "{IN}", "--task", "sst5", "--data-dir", "{T}", "--out", "{OUT}",
                           "--overwrite"]),
    "finetune --config": ("config", ["finetune", "{M}", "--task", "sst5", "--data-dir", "{T}", "--config", "{IN}",
                                     "--out", "{OUT}", "--overwrite"]),
    "compress": ("model", ["compress", "{IN}", "--keep-ratio", "0.5", "--out", "{OUT}", "--overwrite"]),
    "compress merge-kv --calib-data": ("text", ["compress", "{M}", "--method", "merge-kv", "--kv-heads", "1",
                                                "--calib-data", "{IN}", "--out", "{OUT}", "--overwrite"]),
    "attention": ("model", ["attention", "{IN}", "--data", "{T}", "--out", "{OUT}", "--overwrite"]),
    "train --init": ("model", ["train", "quickstart", "--init", "{IN}", "--set", "data.source={T}", "--set", "train.steps=1",
                               "--out", "{OUT}", "--overwrite"]),
    "distill student": ("model", ["distill", "{IN}", "--teacher", "{M}", "--data", "{T}", "--tokens", "256",
                                  "--out", "{OUT}", "--overwrite"]),
    "distill --teacher": ("model", ["distill", "{M}", "--teacher", "{IN}", "--data", "{T}", "--tokens", "256",
                                    "--out", "{OUT}", "--overwrite"]),
    "compare --data": ("text", ["compare", "quickstart", "--set", "data.source={IN}", "--out", "{OUT}",
                                "--overwrite"]),
    "experiment --config": ("config", ["experiment", "ngram", "--config", "{IN}", "--out", "{OUT}",
                                       "--overwrite"]),
    "quickstart --config": ("config", ["quickstart", "--config", "{IN}", "--out", "{OUT}", "--overwrite"]),
    "perplexity --json": ("text", ["perplexity", "{M}", "--data", "{IN}", "--json", "{OUT}"]),
    "eval --json": ("model", ["eval", "{IN}", "--tasks", "piqa", "--json", "{OUT}"]),
    "eval --output-path": ("model", ["eval", "{IN}", "--tasks", "piqa", "--output-path", "{OUT}"]),
    "export": ("model", ["export", "{IN}", "--out", "{OUT}", "--overwrite"]),
}

#: where the output goes relative to the input: the input itself, a folder holding it, a path inside it, a
#: symlink to it
RELATIONS = ("is", "contains", "lies inside", "symlink")


@pytest.mark.parametrize("relation", RELATIONS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_writes_over_what_it_reads(command, relation, model_dir, tmp_path, capsys):
    kind, argv = COMMANDS[command]
    home = tmp_path / "home"  # each input in a folder of its own: "contains" holds only that one
    model = home / "models" / "model"
    shutil.copytree(model_dir, model)
    text = home / "texts" / "text.txt"
    text.parent.mkdir()
    shutil.copy(TEXT, text)
    config = home / "configs" / "run.yaml"
    config.parent.mkdir()
    config.write_text({"experiment": "steps: 1\n", "finetune": "epochs: 1\n"}.get(command.split()[0], "name: guard\n"))
    the_input = {"model": model, "text": text, "config": config}[kind]
    out = {"is": the_input, "contains": the_input.parent, "lies inside": the_input / "sub",
           "symlink": tmp_path / "link"}[relation]
    if relation == "symlink":
        out.symlink_to(the_input)
    before = _snapshot(home)
    args = [a.format(IN=the_input, M=model, T=text, C=config, OUT=out) for a in argv]
    assert main(args) == 2, args
    line = error_line(capsys.readouterr().err, args[0])
    assert_names(line, out, "is" if relation == "symlink" else relation, the_input)
    assert _snapshot(home) == before  # every input byte-identical, nothing added


def test_an_input_given_through_a_symlink_is_compared_by_its_real_path(model_dir, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    with pytest.raises(OutputDirError, match=names("--out", model_dir, "MODEL", link, f"(= {model_dir})")):
        check_not_an_input(model_dir, {"MODEL": str(link)})
    # components, not string prefixes: a sibling whose name extends the input's is no part of it
    check_not_an_input(str(model_dir) + "-pruned", {"MODEL": model_dir})
    check_not_an_input(tmp_path / "out", {"--data": "synthetic:2000", "--tokenizer": None, "--eval-data": []})


def _results(d: Path, tag: str) -> None:
    (d / "model").mkdir(parents=True)
    (d / "model" / "config.json").write_text(json.dumps({"tag": tag}))
    (d / "report.json").write_text(tag)


def test_overwrite_keeps_the_old_results_until_the_new_ones_are_complete(tmp_path):
    out = tmp_path / "out"
    _results(out, "old")
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(RuntimeError, match="mid-run"):
        with claim_output_dir(out, overwrite=True) as write_to:
            assert write_to == out / STAGING_NAME
            _results(write_to, "new")
            assert _snapshot(out / "model") == {"config.json": b'{"tag": "old"}'}  # untouched meanwhile
            raise RuntimeError("mid-run")
    assert _snapshot(out) == before  # a failure: the old results as they were, the staging folder gone
    with claim_output_dir(out, overwrite=True) as write_to:
        _results(write_to, "new")
        (write_to / "details.json").write_text("{}")
    assert sorted(os.listdir(out)) == ["details.json", "model", "notes.txt", "report.json"]
    assert (out / "report.json").read_text() == "new" and (out / "notes.txt").read_text() == "mine"
    with claim_output_dir(out, overwrite=True) as write_to:  # results the new run does not write go too
        (write_to / "report.json").write_text("newer")
    assert sorted(os.listdir(out)) == ["notes.txt", "report.json"]


_KILLED = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from headbudget.run_dir import claim_output_dir
    out, when = Path(sys.argv[1]), sys.argv[2]
    real_replace, calls = os.replace, [0]
    def replace(a, b):  # the swap: journal, old model and report.json out, new model in, then death
        calls[0] += 1
        if when == "swap" and calls[0] == 5:
            os._exit(9)
        return real_replace(a, b)
    os.replace = replace
    with claim_output_dir(out, overwrite=True) as write_to:
        (write_to / "model").mkdir()
        (write_to / "model" / "config.json").write_text('{"tag": "new"}')
        (write_to / "report.json").write_text("new")
        (write_to / "report.md").write_text("new")
        if when == "run":
            os._exit(9)
""")


@pytest.mark.parametrize("when", ["run", "swap"])
def test_a_kill_mid_run_or_mid_swap_leaves_the_old_results(tmp_path, when, capfd):
    out = tmp_path / "out"
    _results(out, "old")
    before = _snapshot(out)
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(out), when], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    if when == "run":
        assert {k: v for k, v in _snapshot(out).items() if not k.startswith(".")} == before
    else:
        assert (out / REPLACED_NAME).is_dir()  # died between the renames
    with claim_output_dir(out, resume=True):  # the next run clears (or rolls back) what the dead one left
        pass
    assert _snapshot(out) == before
    assert ("restored the results" in capfd.readouterr().err) == (when == "swap")


def test_a_dead_writers_temporary_files_are_removed_and_never_results(tmp_path, capsys):
    out = tmp_path / "out"
    (out / ".model.abc123_x.tmp").mkdir(parents=True)  # a prune killed while saving its model
    (out / ".model.abc123_x.tmp" / "config.json").write_text("{}")
    (out / "seed0" / ".report.json.4242-k2j9x0ab.tmp").parent.mkdir()
    (out / "seed0" / ".report.json.4242-k2j9x0ab.tmp").write_text("{")
    assert previous_results(out) == []
    with claim_output_dir(out) as write_to:  # not "another run's results": claimed, and the debris is gone
        assert sorted(p.name for p in write_to.rglob("*")) == [".headbudget.lock", "seed0"]


def test_a_killed_export_leaves_no_temporary_file_behind_its_next_run(tmp_path):
    target = tmp_path / "m.gguf"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / f".m.gguf.{dead.pid}-abcdefgh.tmp"
    leftover.write_bytes(b"\0" * 1000)
    live = tmp_path / f".m.gguf.{os.getppid()}-abcdefgh.tmp"  # a writer that is still running
    live.write_bytes(b"\0")
    other = tmp_path / f".n.gguf.{dead.pid}-abcdefgh.tmp"  # another file's: not ours to judge here
    other.write_bytes(b"\0")
    atomic_write_file(target, lambda p: p.write_bytes(b"GGUF"))
    assert target.read_bytes() == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other.name])
    assert remove_dead_temporaries(tmp_path / "n.gguf") == [other]
