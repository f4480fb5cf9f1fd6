"""acc_norm end to end through the built-in tasks (piqa, arc_easy, hellaswag from local JSONL, no
lm-eval YAML): the library call and ``headbudget eval`` both report the hand-computed value, the
argmax of log-likelihood / len(choice) in characters (hellaswag: of the cleaned-up ending), on data
where it differs from acc."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.test_eval_zeroshot import byte_tokenizer, hand_score, tiny_gpt2

from headbudget.cli.main import main
from headbudget.evaluation.tasks import load_examples
from headbudget.evaluation.zeroshot import evaluate_tasks

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
def setup(tmp_path_factory):
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


def test_the_data_tells_acc_and_acc_norm_apart(setup):
    # (on this model: piqa 0 vs 1, arc_easy 0 vs 0.5, hellaswag 0 vs 1: a short choice wins on the raw
    # sum, a long one per character)
    assert all(acc != acc_norm for acc, acc_norm in setup["want"].values()), setup["want"]
    # and the tasks build the examples written out by hand: " " + choice, divided by len(choice)
    for task in TASK_FILES:
        for ex, (ctx, choices, target) in zip(load_examples(task, setup["data"]), _hand_items(task), strict=True):
            assert ex.contexts == [ctx] * len(choices) and ex.target == target
            assert ex.continuations == [" " + c for c in choices]
            assert ex.norm_lengths == [float(len(c)) for c in choices]


def test_acc_norm_through_the_built_in_tasks(setup):
    torch.set_num_threads(1)
    for strategy in ("prefix", "full"):
        report = evaluate_tasks(setup["model"], setup["tok"], list(TASK_FILES), data_dir=str(setup["data"]),
                                batch_size=3, strategy=strategy, progress=False)
        for task, (acc, acc_norm) in setup["want"].items():
            res = report["results"][task]
            assert (res["acc"], res["acc_norm"], res["n"]) == (acc, acc_norm, len(ROWS[TASK_FILES[task]])), \
                (strategy, task)


def test_acc_norm_through_the_eval_command(setup, tmp_path: Path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", str(setup["model_dir"]), "--tasks", ",".join(TASK_FILES), "--data-dir",
                 str(setup["data"]), "--batch-size", "2", "--json", str(out), "--quiet", "--threads", "1",
                 "--log-samples"]) == 0
    r = json.loads(out.read_text())
    for task, (acc, acc_norm) in setup["want"].items():
        assert (r["results"][task]["acc,none"], r["results"][task]["acc_norm,none"]) == (acc, acc_norm), task
        (samples,) = tmp_path.glob(f"samples_{task}_*.jsonl")  # per document, in lm-eval's form
        records = sorted(map(json.loads, samples.read_text().splitlines()), key=lambda rec: rec["doc_id"])
        assert [rec["acc_norm"] for rec in records] == setup["per_doc"][task], task


# non-ASCII choices: "é" is one character and two UTF-8 bytes (two tokens of the byte tokenizer)
ACCENTED = "é" * 10


def test_acc_norm_counts_characters_not_bytes_of_non_ascii_choices():
    """lm-eval's acc_norm divides by ``len(choice)`` of the Python string: characters, not UTF-8 bytes."""
    from headbudget.evaluation.tasks import get_task
    from headbudget.evaluation.zeroshot import mc_metrics

    ex = get_task("piqa").example({"goal": "g", "sol1": "ééééé", "sol2": "abcdefg", "label": 1})
    assert ex.norm_lengths == [5.0, 7.0]  # bytes would be 10 and 7
    arc = get_task("arc_easy").example({"question": "q", "answerKey": "A",
                                        "choices": {"text": ["naïve café", "x"], "label": ["A", "B"]}})
    assert arc.norm_lengths == [10.0, 1.0]
    # -6 / 5 = -1.2 < -7.5 / 7 = -1.07: choice 1 per character (per byte, -6 / 10 = -0.6: choice 0)
    res, preds = mc_metrics([ex], [[-6.0, -7.5]])
    assert preds == [0] and res["acc"] == 0.0 and res["acc_norm"] == 1.0


def test_acc_norm_of_non_ascii_choices_through_the_built_in_task(tmp_path):
    """piqa from a local file with an accented choice: evaluate_tasks reports lm-eval's acc_norm, the
    argmax of log-likelihood / characters, on data where dividing by bytes picks the other choice."""
    rows = [{"goal": "Say it", "sol1": ACCENTED, "sol2": "abcde", "label": 1},
            {"goal": "Say it again", "sol1": "vwxyz", "sol2": ACCENTED, "label": 0}]
    (tmp_path / "piqa_validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    model, tok = tiny_gpt2(), byte_tokenizer()
    torch.set_num_threads(1)
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
