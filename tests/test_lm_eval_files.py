"""lm-eval's results file as headbudget writes it, checked field by field on hand-made reports (no model
run): task hashes as lm-eval computes them, strict JSON where a stderr is NaN, the caller's model_args, and
the per-document predictions in document-id order."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from headbudget.evaluation.lm_eval_files import results_document, task_hashes, write_lm_eval_files


def _sample(doc_id: int, doc: str, prompt: str, target: str) -> dict:
    """An in-memory sample record with only what the hashes and the samples file need."""
    h = {"doc_hash": hashlib.sha256(doc.encode()).hexdigest(),
         "prompt_hash": hashlib.sha256(prompt.encode()).hexdigest(),
         "target_hash": hashlib.sha256(target.encode()).hexdigest()}
    return {"doc_id": doc_id, "doc": {"q": doc}, "target": 0, "arguments": [(prompt, " a")],
            "resps": [[(-1.0, False)]], "filtered_resps": [(-1.0, False)], **h}


SAMPLES = {"t": [_sample(0, "d0", "p0", "t0"), _sample(1, "d1", "p1", "t1")],
           "u": [_sample(0, "other doc", "other prompt", "other target")]}


def test_task_hashes_are_lm_evals_doc_prompt_target_order():
    """lm-eval's EvaluationTracker: sha256 of the concatenated doc_hash + prompt_hash + target_hash of
    every record in order (the order matters: the same hashes in another order are another task hash)."""
    want = {task: hashlib.sha256("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"]
                                         for s in recs).encode("utf-8")).hexdigest()
            for task, recs in SAMPLES.items()}
    assert task_hashes(SAMPLES) == want
    swapped = hashlib.sha256("".join(s["prompt_hash"] + s["doc_hash"] + s["target_hash"]
                                     for s in SAMPLES["t"]).encode()).hexdigest()
    assert want["t"] != swapped
    doc = results_document({"results": {}, "samples": SAMPLES}, model_name="m", date=0.0)
    assert doc["task_hashes"] == want


def test_task_hashes_equal_lm_eval_trackers_own(tmp_path):
    """lm-eval's own EvaluationTracker, given the same records, writes the same task_hashes."""
    pytest.importorskip("lm_eval")
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(tmp_path / "theirs"))
    tracker.general_config_tracker.model_name_sanitized = "m"
    tracker.save_results_aggregated(results={"results": {}}, samples=SAMPLES)
    (theirs,) = (tmp_path / "theirs" / "m").glob("results_*.json")
    assert task_hashes(SAMPLES) == json.loads(theirs.read_text())["task_hashes"]


def _no_nan(name: str):
    raise AssertionError(f"{name} in the results file: not valid JSON")


def test_nan_stderr_is_written_as_strict_json(tmp_path):
    """A NaN stderr (one document, a group pooling one) must not reach the file as a bare NaN, which
    json.dumps writes by default and jq / JavaScript / strict parsers reject: null (or lm-eval's "N/A")."""
    nan = float("nan")
    report = {"results": {"t": {"acc,none": 1.0, "acc_stderr,none": nan},
                          "u": {"acc,none": 0.5, "acc_stderr,none": np.float64("nan")}},
              "groups": {"g": {"acc,none": 0.75, "acc_stderr,none": nan}},
              "configs": {"t": {}, "u": {}}, "details": {"per_doc": [0.5, nan]}, "seconds": 1.0}
    (path,) = write_lm_eval_files(report, model_name="m", output_path=tmp_path, date_id="D")
    text = path.read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text
    r = json.loads(text, parse_constant=_no_nan)
    for where in (r["results"]["t"], r["results"]["u"], r["groups"]["g"]):
        assert where["acc_stderr,none"] in (None, "N/A")
    assert r["results"]["t"]["acc,none"] == 1.0 and r["groups"]["g"]["acc,none"] == 0.75
    assert r["headbudget"]["details"]["per_doc"][0] == 0.5 and r["headbudget"]["details"]["per_doc"][1] in (None, "N/A")
    assert report["results"]["t"]["acc_stderr,none"] != report["results"]["t"]["acc_stderr,none"]  # not rewritten


@pytest.mark.parametrize("in_report", [None, "pretrained=loaded-object"], ids=["report-none", "report-set"])
def test_explicit_model_args_win(tmp_path, in_report):
    """model_args given by the caller (the CLI's pretrained=...,gguf_file=...) are the file's, whatever the
    report's config holds; without them the report's own, else pretrained=<model_name>."""
    report = {"results": {}, "config": {"model": "headbudget", "model_args": in_report}}
    args = "pretrained=runs/m,gguf_file=m.Q8_0.gguf"
    assert results_document(report, model_name="runs/m", model_args=args)["config"]["model_args"] == args
    (path,) = write_lm_eval_files(report, model_name="runs/m", model_args=args, json_path=tmp_path / "r.json")
    assert json.loads(path.read_text())["config"]["model_args"] == args
    default = results_document(report, model_name="runs/m")["config"]["model_args"]
    assert default == (in_report or "pretrained=runs/m")
    assert report["config"]["model_args"] == in_report  # the report itself is not rewritten


def test_harness_predictions_are_by_document_id():
    """Predictions list each document's argmax choice at its doc id, whatever order lm-eval's requests
    (and so the records) came in; rolling tasks have none."""
    from headbudget.evaluation.harness import harness_predictions

    lls = {2: [-1.0, -5.0, -3.0], 0: [-4.0, -2.0, -3.0], 1: [-9.0, -8.0, -1.0]}  # argmax 0, 1, 2
    records = {}
    for doc in (2, 0, 1):  # record order: not doc id order
        for idx in (2, 0, 1):
            records[("t", doc, idx)] = (lls[doc][idx], False)
    records[("r", 0, 0)] = (-3.0, False)
    lm = SimpleNamespace(records=records)
    tasks = {"t": SimpleNamespace(OUTPUT_TYPE="multiple_choice"),
             "r": SimpleNamespace(OUTPUT_TYPE="loglikelihood_rolling")}
    assert harness_predictions(lm, tasks) == {"t": [1, 2, 0]}


def test_headbudget_lm_predictions_by_document_id_when_requests_come_out_of_order():
    """The scorer behind lm-eval's requests, fed documents 2, 1, 0: predictions[d] is document d's."""
    from tests.test_eval_zeroshot import byte_tokenizer, tiny_gpt2

    from headbudget.evaluation.harness import HeadBudgetLM, harness_predictions

    # a continuation of 12 more byte tokens is far less likely under a random model: argmax = the short one
    choices = {0: (" a", " a a a a a a a"), 1: (" b b b b b b b", " b"), 2: (" c c c c c c c", " c")}
    requests = [SimpleNamespace(task_name="t", doc_id=d, idx=i, args=(f"Doc {d}:", c))
                for d in (2, 1, 0) for i, c in enumerate(choices[d])]
    lm = HeadBudgetLM(pretrained=tiny_gpt2(), tokenizer=byte_tokenizer(), progress=False)
    out = lm.loglikelihood(requests)
    by_doc = {r.doc_id: [] for r in requests}
    for r, (ll, _) in zip(requests, out, strict=True):
        by_doc[r.doc_id].append(ll)
    want = [int(np.argmax(by_doc[d])) for d in range(3)]
    assert want == [0, 1, 1]  # record order (2, 1, 0) would read [1, 1, 0]
    assert harness_predictions(lm, {"t": SimpleNamespace(OUTPUT_TYPE="multiple_choice")}) == {"t": want}
