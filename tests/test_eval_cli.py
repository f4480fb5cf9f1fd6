"""`headbudget eval/perplexity/attention` end to end on a tiny saved model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.test_eval_zeroshot import FIXTURES, byte_tokenizer, tiny_gpt2

from headbudget.cli.main import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    tiny_gpt2().save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


def test_eval_json_schema(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["eval", str(model_dir), "--tasks", "piqa,hellaswag,arc_easy,winogrande",
               "--data-dir", str(FIXTURES), "--limit", "2", "--batch-size", "3", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    # lm-eval's table (the built-in tasks run as its YAML tasks when it is installed)
    rows = [line for line in printed.splitlines() if line.startswith("|piqa")]
    assert len(rows) == 1 and "|acc     |" in rows[0] and "forward passes" in printed
    r = json.loads(out.read_text())
    # lm-eval's results dict (what its make_table reads); headbudget's own fields under one key
    assert {"results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
            "config", "task_hashes", "model_name"} <= set(r)
    assert set(r["headbudget"]) == {"predictions", "seconds", "details"}
    assert isinstance(r["headbudget"]["seconds"], float)
    metrics = {"acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"}
    for task in ("piqa", "hellaswag", "arc_easy"):
        assert set(r["results"][task]) == metrics | {"name", "alias", "sample_len"}
        assert r["results"][task]["sample_len"] == r["n-samples"][task]["effective"] == 2
        assert r["n-shot"][task] == 0 and r["configs"][task]["output_type"] == "multiple_choice"
    assert set(r["results"]["winogrande"]) == {"acc,none", "acc_stderr,none", "name", "alias", "sample_len"}
    n_choices = {"piqa": [2, 2], "hellaswag": [4, 4], "arc_easy": [3, 4], "winogrande": [2, 2]}
    for task, sizes in n_choices.items():
        preds = r["headbudget"]["predictions"][task]
        assert len(preds) == 2 and all(0 <= p < k for p, k in zip(preds, sizes))
        acc = sum(p == t for p, t in zip(preds, _targets(task))) / 2
        assert r["results"][task]["acc,none"] == acc


def _targets(task: str) -> list[int]:
    from headbudget.evaluation.tasks import load_examples

    return [e.target for e in load_examples(task, FIXTURES, limit=2)]


def test_eval_user_errors(model_dir, capsys):
    assert main(["eval", str(model_dir), "--tasks", "piqa,nope", "--data-dir", str(FIXTURES)]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert main(["eval", str(model_dir), "--tasks", "piqa", "--data-dir", "/nonexistent"]) == 2
    assert "--data-dir: no directory" in capsys.readouterr().err


def test_perplexity_and_attention_commands(model_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 8)
    js = tmp_path / "p.json"
    assert main(["perplexity", str(model_dir), "--data", str(text), "--context", "64",
                 "--stride", "32", "--json", str(js), "--quiet"]) == 0
    p = json.loads(js.read_text())
    assert p["tokens_scored"] == p["tokens_total"] - 1 and p["ppl"] > 1.0 and "by_context_length" not in p
    assert main(["perplexity", str(model_dir), "--data", str(text), "--context", "64", "--context-lengths",
                 "16,1,4", "--json", str(tmp_path / "by.json"), "--quiet"]) == 0
    by = json.loads((tmp_path / "by.json").read_text())["by_context_length"]
    assert by["lengths"] == [1, 4, 16] and by["targets"] == p["tokens_total"] - 16 and by["gain_vs_shortest"][0] == 0
    assert "k=16" in capsys.readouterr().out
    for bad, msg in (("1,x", "--context-lengths: expected a comma list of integers, got '1,x'"),
                     ("1,64", "--context-lengths: 64 is not below --context 64")):
        assert main(["perplexity", str(model_dir), "--data", str(text), "--context", "64",
                     "--context-lengths", bad]) == 2
        assert msg in capsys.readouterr().err
    out = tmp_path / "attn"
    assert main(["attention", str(model_dir), "--data", str(text), "--out", str(out),
                 "--compare", str(model_dir), "--seq-len", "32", "--n-seqs", "2"]) == 0
    names = sorted(f.name for f in out.iterdir())
    assert "distance_comparison.png" in names and len([n for n in names if n.endswith(".json")]) == 2
    s = json.loads((out / f"attention_{model_dir.name}.json").read_text())
    assert len(s["layers"]) == 2 and s["n_sequences"] == 2 and s["n_tokens"] == 32


def test_tokenizer_saved_by_training_is_found_with_the_same_ids(tmp_path):
    """An older checkpoint keeps its tokenizer in model/tokenizer/ (the legacy place): still found, same ids."""
    from headbudget.loading import load_tokenizer
    from headbudget.models.tokenizers import make_tokenizer

    text = "the dogs that the cat chases run . = end marco = " * 20
    bpe = make_tokenizer("bpe:300", [text])
    model_dir = tmp_path / "run" / "model"
    bpe.save(model_dir / "tokenizer")
    hf = load_tokenizer(model_dir=model_dir)
    sample = "the cat chases the dogs . = end marco ="
    assert hf.encode(sample, add_special_tokens=False) == bpe.encode(sample)
    assert hf.eos_token_id == bpe.eos_id


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    """A `headbudget train`-style run folder: a headbudget model trained with the default byte tokenizer,
    the tokenizer saved at the model folder's root."""
    import torch

    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.models.tokenizers import ByteTokenizer
    from headbudget.schedules import prism

    run = tmp_path_factory.mktemp("byte") / "run"
    torch.manual_seed(0)
    HeadBudgetForCausalLM(HeadBudgetConfig(schedule=prism(2, 32, 16, 8), vocab_size=320,
                                           n_positions=64)).save_pretrained(run / "model")
    ByteTokenizer().save(run / "model")
    return run


def test_eval_perplexity_attention_take_a_byte_tokenizer_run_folder(byte_run, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 4)
    js = tmp_path / "p.json"
    assert main(["perplexity", str(byte_run), "--data", str(text), "--context", "64", "--stride", "32",
                 "--json", str(js), "--quiet"]) == 0, capsys.readouterr().err
    p = json.loads(js.read_text())
    assert p["tokens_total"] == len(text.read_bytes())  # one token per byte: the byte tokenizer's ids
    assert main(["eval", str(byte_run), "--tasks", "piqa", "--data-dir", str(FIXTURES), "--limit", "2",
                 "--quiet"]) == 0, capsys.readouterr().err
    assert main(["attention", str(byte_run), "--data", str(text), "--out", str(tmp_path / "a"),
                 "--seq-len", "16", "--n-seqs", "1"]) == 0, capsys.readouterr().err


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith(f"headbudget {command}: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_tokenizer_larger_than_the_model_vocabulary_is_a_one_line_error(byte_run, tmp_path, capsys):
    """A 1000-token tokenizer on a 320-row model: named before any id can index past the embedding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"w{i}": i for i in range(999)} | {"[UNK]": 999}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(tmp_path / "tk")
    text = tmp_path / "t.txt"
    text.write_text("w1 w998 " * 20)
    rc = main(["perplexity", str(byte_run), "--data", str(text), "--tokenizer", str(tmp_path / "tk"), "--quiet"])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err, "perplexity")
    assert "the tokenizer has 1000 tokens but the model's vocabulary has 320" in line


def test_classifier_given_to_perplexity_is_a_one_line_error(tmp_path, capsys):
    from transformers import BertConfig, BertForSequenceClassification

    BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32)).save_pretrained(tmp_path / "b")
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    assert main(["perplexity", str(tmp_path / "b"), "--data", str(text), "--tokenizer", "byte", "--quiet"]) == 2
    line = _one_error_line(capsys.readouterr().err, "perplexity")
    assert "BertForSequenceClassification is a sequence classifier, not a causal language model" in line


def test_context_lengths_print_one_row_per_length_shortest_first(model_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 8)
    assert main(["perplexity", str(model_dir), "--data", str(text), "--context", "64", "--context-lengths", "8,4",
                 "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out if line.startswith("  k=")] == ["k=4", "k=8"]
    assert "gain: loss with 4 minus loss with k" in out[1]
    # a repeated length is a typo, refused before the model loads (it does not exist here)
    assert main(["perplexity", str(tmp_path / "no-model"), "--data", str(text), "--context", "64",
                 "--context-lengths", "8,4,4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headbudget perplexity: error: --context-lengths: 4 ")
    assert "'8,4,4'" in err[0]
