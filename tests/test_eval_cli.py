"""`headbudget eval/perplexity/attention` end to end on a tiny saved model; ``eval --quiet`` prints no progress
bars and no table.

acc_norm through the built-in tasks (piqa, arc_easy, hellaswag from local JSONL, no lm-eval YAML): the library call
and ``headbudget eval`` both report the hand-computed value, the argmax of log-likelihood / len(choice) in
characters (hellaswag: of the cleaned-up ending; non-ASCII choices: characters, not bytes), on data where it differs
from acc."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tests.test_eval_zeroshot import FIXTURES, byte_tokenizer, hand_score, tiny_gpt2

from conftest import assert_names, error_line
from headbudget.cli.main import main
from headbudget.evaluation.tasks import load_examples
from headbudget.evaluation.zeroshot import evaluate_tasks


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
    assert_names(error_line(capsys.readouterr().err, "eval"), "nope")
    assert main(["eval", str(model_dir), "--tasks", "piqa", "--data-dir", "/nonexistent"]) == 2
    assert_names(error_line(capsys.readouterr().err, "eval"), "--data-dir", "/nonexistent")


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
    for bad, values in (("1,x", ("--context-lengths", "'1,x'")), ("1,64", ("--context-lengths", 64, "--context"))):
        assert main(["perplexity", str(model_dir), "--data", str(text), "--context", "64",
                     "--context-lengths", bad]) == 2
        assert_names(error_line(capsys.readouterr().err, "perplexity"), *values)
    out = tmp_path / "attn"
    assert main(["attention", str(model_dir), "--data", str(text), "--out", str(out),
                 "--compare", str(model_dir), "--seq-len", "32", "--n-seqs", "2"]) == 0
    names = sorted(f.name for f in out.iterdir())
    assert "distance_comparison.png" in names and len([n for n in names if n.endswith(".json")]) == 2
    s = json.loads((out / f"attention_{model_dir.name}.json").read_text())
    assert len(s["layers"]) == 2 and s["n_sequences"] == 2 and s["n_tokens"] == 32


def test_run_perplexity_is_what_the_command_writes(model_dir, tmp_path, capsys):
    """The library call, given the settings the flags describe, returns the dict ``--json`` holds; its loss is
    the sliding-window loss of the model in memory."""
    from headbudget.evaluation.perplexity import PerplexitySettings, perplexity, run_perplexity

    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 8)
    settings = PerplexitySettings(model=str(model_dir), data=str(text), context=64, stride=32,
                                  context_lengths="16,1,4", quiet=True, device="cpu")
    scored: list[dict] = []
    got = run_perplexity(settings, on_scored=scored.append)
    js = tmp_path / "p.json"
    assert main(["perplexity", str(model_dir), "--data", str(text), "--context", "64", "--stride", "32",
                 "--context-lengths", "16,1,4", "--device", "cpu", "--json", str(js), "--quiet",
                 "--threads", "1"]) == 0  # the test's one thread: the same sums, so equal to the last bit
    written = json.loads(js.read_text())
    assert list(got) == list(written)  # the same keys in the same order
    assert {k: v for k, v in got.items() if k != "seconds"} == {k: v for k, v in written.items() if k != "seconds"}
    assert (got["model"], got["data"]) == (str(model_dir), str(text))
    assert got["by_context_length"]["lengths"] == [1, 4, 16]
    assert len(scored) == 1 and scored[0]["loss"] == got["loss"]
    want = perplexity(tiny_gpt2(), byte_tokenizer(), text.read_text(), context=64, stride=32, progress=False)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6) and got["tokens_scored"] == want["tokens_scored"]
    # the flags are checked before the model loads (there is none here)
    missing = PerplexitySettings(model=str(tmp_path / "no-model"), data=str(text), context=64,
                                 context_lengths="8,4,4")
    with pytest.raises(ValueError, match="--context-lengths: 4 is given twice in '8,4,4'"):
        run_perplexity(missing)


def test_run_attention_writes_the_files_and_returns_the_summaries(model_dir, tmp_path):
    from headbudget.analysis.attention import AttentionSettings, attention_summary_from_text, run_attention

    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question. " * 8)
    out = tmp_path / "attn"
    settings = AttentionSettings(model=str(model_dir), compare=str(model_dir), data=str(text), out=str(out),
                                 seq_len=32, n_seqs=2, device="cpu")
    seen: list[str] = []
    got = run_attention(settings, on_model=lambda label, s: seen.append(label))
    labels = [model_dir.name, f"{model_dir.name}_1"]
    assert list(got) == seen == labels
    assert sorted(f.name for f in out.iterdir()) == sorted(
        [f"attention_{x}.json" for x in labels] + [f"distance_{x}.png" for x in labels] + ["distance_comparison.png"])
    s = got[model_dir.name]
    assert len(s["layers"]) == 2 and s["n_sequences"] == 2 and s["n_tokens"] == 32
    assert json.loads((out / f"attention_{model_dir.name}.json").read_text()) == s
    want = attention_summary_from_text(tiny_gpt2(), byte_tokenizer(), text.read_text(), seq_len=32, n_seqs=2)
    assert s["mean_distance"] == pytest.approx(want["mean_distance"], rel=1e-5)


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
    assert_names(line, "tokenizer", "1000", "320")


def test_classifier_given_to_perplexity_is_a_one_line_error(tmp_path, capsys):
    from transformers import BertConfig, BertForSequenceClassification

    BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32)).save_pretrained(tmp_path / "b")
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    assert main(["perplexity", str(tmp_path / "b"), "--data", str(text), "--tokenizer", "byte", "--quiet"]) == 2
    line = _one_error_line(capsys.readouterr().err, "perplexity")
    assert_names(line, tmp_path / "b", "BertForSequenceClassification", "classifier", "causal")


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
    line = error_line(capsys.readouterr().err, "perplexity")
    assert_names(line, "--context-lengths", "8,4,4")
    assert_names(line.replace("8,4,4", ""), 4)  # the repeated length, besides the list


# ---------------------------------------------------------------------------- eval --quiet
def test_eval_quiet_prints_no_table_and_still_writes_the_results(tmp_path, capsys):
    model_dir = tmp_path / "m"
    tiny_gpt2().save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "r.json"
    from transformers.utils import logging as hf_logging

    bars_before = hf_logging.is_progress_bar_enabled()
    capsys.readouterr()
    assert main(["eval", str(model_dir), "--tasks", "piqa", "--data-dir", str(FIXTURES), "--limit", "2",
                 "--json", str(out), "--quiet", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"wrote {out}\n"  # no table, no timing lines
    assert "it/s" not in captured.err and "%|" not in captured.err  # no progress bar
    assert json.loads(out.read_text())["n-samples"]["piqa"]["effective"] == 2
    assert hf_logging.is_progress_bar_enabled() == bars_before  # the libraries' settings are restored
    from headbudget.cli.main import build_parser

    help_text = " ".join(build_parser("eval")._subparsers._group_actions[0].choices["eval"].format_help().split())
    assert "--quiet no progress bars and no results table" in help_text


# ---------------------------------------------------------------------------- acc_norm, built-in tasks
LONG = "put the lid back on and carry the whole jar carefully over to the table"
ROWS = {
    "piqa_validation.jsonl": [
        {"goal": "How do I open a jar?", "sol1": "twist", "sol2": LONG, "label": 1},
        {"goal": "How do I dry a cup?", "sol1": "use a clean towel and wipe it all around", "sol2": "sun",
         "label": 0},
        {"goal": "How do I close a door?", "sol1": "push", "sol2": "x", "label": 0},
    ],
    "arc_easy_test.jsonl": [
        {"question": "Which is a source of energy?", "answerKey": "B",
         "choices": {"text": ["Sand", "Sunlight that reaches the surface of the planet every day", "Ice"],
                     "label": ["A", "B", "C"]}},
        {"question": "What do plants need?", "answerKey": "1",
         "choices": {"text": ["water", "a", "plastic bags and metal boxes"], "label": ["1", "2", "3"]}},
    ],
    "hellaswag_validation.jsonl": [
        {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
         "endings": ["is using wrap to wrap a pair of skis.", "starts.",
                     "is ripping level tiles off. [title] Then he throws the old shingles down to the yard.",
                     "is holding a rubik's cube."], "label": 2},
        {"activity_label": "Clean and jerk", "ctx": "A lady walks to a barbell. She bends down",
         "endings": ["and lifts.", "a", "and grabs the pole with both hands before lifting it up over her head",
                     "b"], "label": 2},
    ],
}
TASK_FILES = {"piqa": "piqa_validation.jsonl", "arc_easy": "arc_easy_test.jsonl",
              "hellaswag": "hellaswag_validation.jsonl"}


def _hand_items(task: str) -> list[tuple[str, list[str], int]]:
    """(context, choices as acc_norm measures them, target) per row, written out by hand."""
    if task == "piqa":
        return [(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], r["label"]) for r in ROWS[TASK_FILES[task]]]
    if task == "arc_easy":
        return [(f"Question: {r['question']}\nAnswer:", r["choices"]["text"],
                 r["choices"]["label"].index(r["answerKey"])) for r in ROWS[TASK_FILES[task]]]
    first, second = ROWS[TASK_FILES[task]]
    cleaned = list(first["endings"])
    cleaned[2] = "is ripping level tiles off.. Then he throws the old shingles down to the yard."  # " [title]" -> ". "
    return [("Roof shingle removal: A man is sitting on a roof. He", cleaned, 2),
            ("Clean and jerk: A lady walks to a barbell. She bends down", second["endings"], 2)]


@pytest.fixture(scope="module")
def acc_norm_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc_norm")
    data = root / "data"
    data.mkdir()
    for name, rows in ROWS.items():
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, tok = tiny_gpt2(), byte_tokenizer()
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    want, per_doc = {}, {}
    for task in TASK_FILES:
        acc, acc_norm = [], []
        for ctx, choices, target in _hand_items(task):
            lls = np.array([hand_score(model, tok, ctx, " " + c) for c in choices])
            acc.append(float(np.argmax(lls) == target))
            acc_norm.append(float(np.argmax(lls / np.array([len(c) for c in choices], dtype=float)) == target))
        want[task] = (float(np.mean(acc)), float(np.mean(acc_norm)))
        per_doc[task] = acc_norm
    return {"data": data, "model": model, "tok": tok, "model_dir": model_dir, "want": want, "per_doc": per_doc}


def test_the_data_tells_acc_and_acc_norm_apart(acc_norm_setup):
    # (on this model: piqa 0 vs 1, arc_easy 0 vs 0.5, hellaswag 0 vs 1: a short choice wins on the raw
    # sum, a long one per character)
    assert all(acc != acc_norm for acc, acc_norm in acc_norm_setup["want"].values()), acc_norm_setup["want"]
    # and the tasks build the examples written out by hand: " " + choice, divided by len(choice)
    for task in TASK_FILES:
        for ex, (ctx, choices, target) in zip(load_examples(task, acc_norm_setup["data"]), _hand_items(task),
                                              strict=True):
            assert ex.contexts == [ctx] * len(choices) and ex.target == target
            assert ex.continuations == [" " + c for c in choices]
            assert ex.norm_lengths == [float(len(c)) for c in choices]


def test_acc_norm_through_the_built_in_tasks(acc_norm_setup):
    for strategy in ("prefix", "full"):
        report = evaluate_tasks(acc_norm_setup["model"], acc_norm_setup["tok"], list(TASK_FILES),
                                data_dir=str(acc_norm_setup["data"]), batch_size=3, strategy=strategy, progress=False)
        for task, (acc, acc_norm) in acc_norm_setup["want"].items():
            res = report["results"][task]
            assert (res["acc"], res["acc_norm"], res["n"]) == (acc, acc_norm, len(ROWS[TASK_FILES[task]])), \
                (strategy, task)


def test_acc_norm_through_the_eval_command(acc_norm_setup, tmp_path: Path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", str(acc_norm_setup["model_dir"]), "--tasks", ",".join(TASK_FILES), "--data-dir",
                 str(acc_norm_setup["data"]), "--batch-size", "2", "--json", str(out), "--quiet", "--threads", "1",
                 "--log-samples"]) == 0
    r = json.loads(out.read_text())
    for task, (acc, acc_norm) in acc_norm_setup["want"].items():
        assert (r["results"][task]["acc,none"], r["results"][task]["acc_norm,none"]) == (acc, acc_norm), task
        (samples,) = tmp_path.glob(f"samples_{task}_*.jsonl")  # per document, in lm-eval's form
        records = sorted(map(json.loads, samples.read_text().splitlines()), key=lambda rec: rec["doc_id"])
        assert [rec["acc_norm"] for rec in records] == acc_norm_setup["per_doc"][task], task


# non-ASCII choices: "é" is one character and two UTF-8 bytes (two tokens of the byte tokenizer)
ACCENTED = "é" * 10


def test_acc_norm_of_non_ascii_choices_through_the_built_in_task(tmp_path):
    """piqa from a local file with an accented choice: evaluate_tasks reports lm-eval's acc_norm, the
    argmax of log-likelihood / characters, on data where dividing by bytes picks the other choice."""
    rows = [{"goal": "Say it", "sol1": ACCENTED, "sol2": "abcde", "label": 1},
            {"goal": "Say it again", "sol1": "vwxyz", "sol2": ACCENTED, "label": 0}]
    (tmp_path / "piqa_validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    model, tok = tiny_gpt2(), byte_tokenizer()
    by_chars, by_bytes = [], []
    for r in rows:
        choices = [r["sol1"], r["sol2"]]
        lls = np.array([hand_score(model, tok, f"Question: {r['goal']}\nAnswer:", " " + c) for c in choices])
        chars = np.array([len(c) for c in choices], dtype=float)
        nbytes = np.array([len(c.encode("utf-8")) for c in choices], dtype=float)
        by_chars.append(float(np.argmax(lls / chars) == r["label"]))
        by_bytes.append(float(np.argmax(lls / nbytes) == r["label"]))
    assert by_chars == [1.0, 1.0] and by_bytes == [0.0, 0.0]  # the data tells the two apart
    report = evaluate_tasks(model, tok, ["piqa"], data_dir=str(tmp_path), batch_size=2, progress=False)
    assert report["results"]["piqa"]["acc_norm"] == 1.0
