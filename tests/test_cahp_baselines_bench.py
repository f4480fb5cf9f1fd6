"""benchmarks/cahp_baselines_minilm.py (CAHP against the published baselines on MiniLM / SST-5): the pure
parts -- Jaccard, aggregation over seeds, resume bookkeeping, table rendering -- on synthetic rows, and the bf16
recovery fine-tune it can ask for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from conftest import assert_names, names
from headbudget.data.classification import Example
from headbudget.pruning.finetune import finetune
from headbudget.pruning.job import FinetuneRecipe

FIX = Path(__file__).resolve().parent / "fixtures" / "cls"


# --------------------------------------------------------------------------- finetune(precision=...)
def _toy(n: int) -> list[Example]:
    return [Example(f"the {'good' if i % 2 else 'bad'} film .", i % 2) for i in range(n)]


def test_finetune_bf16_autocasts_training_forward_only() -> None:
    tok = BertTokenizer(str(FIX / "vocab.txt"))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=45,
        max_position_embeddings=64, num_labels=2))
    seen: list[tuple[bool, torch.dtype]] = []
    model.bert.encoder.layer[0].attention.self.query.register_forward_hook(
        lambda m, i, o: seen.append((model.training, o.dtype)))
    data = {"train": _toy(8), "dev": _toy(4)}
    hist = finetune(model, tok, data, FinetuneRecipe(epochs=1, batch_size=4, progress=False, precision="bf16"))
    assert hist["config"]["precision"] == "bf16"
    assert {d for training, d in seen if training} == {torch.bfloat16}     # the training forwards
    assert {d for training, d in seen if not training} == {torch.float32}  # the evaluation stays fp32
    assert model.classifier.weight.dtype == torch.float32                  # fp32 weights
    seen.clear()
    finetune(model, tok, data, FinetuneRecipe(epochs=1, batch_size=4, progress=False))
    assert {d for _, d in seen} == {torch.float32}                         # default: fp32 throughout
    with pytest.raises(ValueError, match=names("precision", "fp16", "fp32", "bf16", "auto")):
        finetune(model, tok, data, FinetuneRecipe(epochs=1, progress=False, precision="fp16"))


# --------------------------------------------------------------------------- the benchmark's pure parts
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cahp_baselines_minilm as cb  # noqa: E402


def test_jaccard_and_head_sets() -> None:
    assert cb.head_set({"0": [1, 3], "2": [0]}) == {(0, 1), (0, 3), (2, 0)}
    assert cb.jaccard({1, 2}, {2, 3}) == pytest.approx(1 / 3)
    assert cb.jaccard(set(), set()) == 1.0
    # pairs: {1,2}-{1,2} 1, {1,2}-{3,4} 0, {1,2}-{3,4} 0  -> 1/3
    assert cb.mean_pairwise_jaccard([{1, 2}, {1, 2}, {3, 4}]) == pytest.approx(1 / 3)
    assert cb.mean_pairwise_jaccard([{1, 2, 3}, {2, 3, 4}]) == pytest.approx(0.5)
    assert cb.mean_pairwise_jaccard([{1}]) is None


def test_mean_std_skips_missing_values() -> None:
    m, s = cb.mean_std([0.4, 0.5, None, 0.6])
    assert m == pytest.approx(0.5) and s == pytest.approx(0.1)
    assert cb.mean_std([0.3]) == (0.3, None)
    assert cb.mean_std([None]) == (None, None)


PLAN_KW = dict(degrees=[6, 2], seeds=[42, 43], seed_methods=["cahp", "fisher"], one_seed_methods=["pass"],
               curve_methods=["cahp", "random"], curve_counts=[72, 24, 8], n_heads=72)


def test_plan_knees_first_then_every_cell_once() -> None:
    C = cb.Cell
    assert cb.plan({6: 15}, **PLAN_KW) == [C("cahp", "knee-d6", 42), C("cahp", "knee-d2", 42)]
    keys = [c.key for c in cb.plan({6: 15, 2: 24}, **PLAN_KW)]
    assert keys == [
        "cahp/knee-d6/s42", "cahp/knee-d2/s42",
        "fisher/k15/s42", "pass/k15/s42", "fisher/k24/s42", "pass/k24/s42",   # cahp at s42 = the knee runs
        "cahp/k15/s43", "fisher/k15/s43", "cahp/k24/s43", "fisher/k24/s43",
        "dense/k72/s42",
        "random/k24/s42", "cahp/k8/s42", "random/k8/s42",                   # curve: cahp at 24 = knee d2
    ]
    same = [c.key for c in cb.plan({6: 20, 2: 20}, **PLAN_KW)]  # two knees at one count: one set of cells
    assert same.count("fisher/k20/s42") == 1 and "cahp/k20/s43" in same and "cahp/k20/s42" not in same
    assert cb.resolve(C("cahp", 20, 42), {6: 20, 2: 20}, 42) == C("cahp", "knee-d6", 42)
    assert cb.Cell("cahp", "knee-d2", 42).degree == 2 and cb.Cell("fisher", 15, 42).degree is None


def test_pending_reruns_cells_of_other_settings() -> None:
    cells = [cb.Cell("fisher", 15, 42), cb.Cell("pass", 15, 42), cb.Cell("random", 8, 42)]
    done = {"fisher/k15/s42": {"settings": {"lr": 2e-5}}, "pass/k15/s42": {"settings": {"lr": 1e-4}}}
    assert cb.pending(cells, done, {"lr": 2e-5}) == cells[1:]
    assert cb.pending(cells, done, {"lr": 1e-4}) == [cells[0], cells[2]]


def _rec(method, count, seed, pruned, finetuned, kept, select=1.0, heads=None):
    return {"method": method, "count": count, "seed": seed, "heads_kept": heads or sum(map(len, kept.values())),
            "kept": kept, "mean_depth": 0.5, "middle_third_share": 0.25, "seconds": {"select": select},
            "accuracy": {"test": {"dense": 0.5, "pruned": pruned, "finetuned": finetuned}, "dev": {}}}


def _done() -> dict:
    a, b = {"0": [0, 1], "1": [0]}, {"0": [0, 2], "1": [0]}
    return {
        "cahp/knee-d6/s42": _rec("cahp", "knee-d6", 42, 0.30, 0.40, a, select=10.0),
        "cahp/k3/s43": _rec("cahp", 3, 43, 0.40, 0.50, a, select=20.0),
        "cahp/k3/s44": _rec("cahp", 3, 44, 0.50, 0.60, b, select=30.0),
        "fisher/k3/s42": _rec("fisher", 3, 42, 0.20, 0.45, b, select=5.0),
        "dense/k24/s42": _rec("dense", 24, 42, 0.50, 0.52, {"0": list(range(12)), "1": list(range(12))},
                              select=0.0),
        "fisher/k8/s42": _rec("fisher", 8, 42, 0.1, 0.3, a, heads=8),
    }


def test_comparison_curve_and_selection_times() -> None:
    done = _done()
    rows = cb.comparison(done, {6: 3}, [42, 43, 44], ["cahp", "fisher", "pass"])
    assert [r["method"] for r in rows] == ["cahp", "fisher"]  # pass has no cell: no row
    cahp = rows[0]
    assert cahp["seeds"] == [42, 43, 44] and cahp["knee"] == "cahp-d6" and cahp["count"] == 3
    assert cahp["pruned_mean"] == pytest.approx(0.4) and cahp["pruned_std"] == pytest.approx(0.1)
    assert cahp["finetuned_mean"] == pytest.approx(0.5) and cahp["finetuned_std"] == pytest.approx(0.1)
    assert cahp["jaccard"] == pytest.approx((1 + 0.5 + 0.5) / 3)  # a-a 1, a-b 2/4, a-b 2/4
    assert rows[1]["finetuned_std"] is None and rows[1]["jaccard"] is None
    times = cb.selection_times(rows)
    assert times["cahp"]["seconds"] == pytest.approx(20.0) and times["fisher"]["x_cahp"] == pytest.approx(0.25)
    cur = cb.curve(done, ["fisher", "random"], 42)
    assert cur["fisher"] == [(24, 0.52), (8, 0.3), (3, 0.45)]  # the dense recovery is every method's full count
    assert cur["random"] == [(24, 0.52)]


def test_render_tables() -> None:
    done = _done()
    rows = cb.comparison(done, {6: 3}, [42, 43, 44], ["cahp", "fisher"])
    res = {"n_test": 2210, "n_heads": 24, "dense": {"test": 0.5}, "seeds": [42, 43, 44], "knees": {"6": 3},
           "recipe": {"finetune_epochs": 3, "recovery_precision": "fp32"}, "comparison": rows,
           "curve": cb.curve(done, ["fisher"], 42), "selection_time": cb.selection_times(rows),
           "published_table_iii": "n/a"}
    md = cb.render_tables(res)
    assert "At the CAHP knee cahp-d6 (3 heads kept of 24)" in md
    assert "| cahp | 3 | 3 | 0.4000 ± 0.1000 | 0.5000 ± 0.1000 | 0.667 | 0.500 | 0.250 | 20.0 |" in md
    assert "| fisher | 1 | 3 | 0.2000 | 0.4500 | – | 0.500 | 0.250 | 5.0 |" in md
    rows[0]["heads_kept"] = [3, 2, 3]  # a forced CAHP that could not keep exactly the count
    assert "| cahp | 3 | 2-3 | 0.4000 ± 0.1000 |" in cb.render_tables(res)
    assert "| 24 | 0.5200 |\n| 8 | 0.3000 |\n| 3 | 0.4500 |" in md
    assert "| fisher | 5.0 | 0.25 |\n| cahp | 20.0 | 1.00 |" in md
    assert "Published Table III (relative costs): n/a." in md


class _FakeWorkload:
    heads_total = 72

    def __init__(self, job) -> None:
        self.evals = {"dev": [0] * 4, "test": [0] * 5}


def test_run_resumes_only_unfinished_cells(tmp_path, monkeypatch) -> None:
    import headbudget.pruning.workloads as workloads

    ran: list[str] = []

    def fake_cell(cell, loaded, base_job, out):
        ran.append(cell.key)
        count = {"knee-d6": 14, "knee-d2": 36}.get(cell.count, cell.count)
        kept = {str(layer): list(range(count // 6 + (layer < count % 6))) for layer in range(6)}
        return {"report": {"heads_kept": count, "kept": kept, "knee_k": None, "mean_depth": 0.5,
                           "middle_third_share": 0.3, "seconds": {"select": 1.0}},
                "details": {"accuracy": {"test": {"dense": 0.5, "pruned": 0.3, "finetuned": 0.4 + cell.seed / 1e3}}}}

    monkeypatch.setattr(cb, "run_cell", fake_cell)
    monkeypatch.setattr(cb, "_dense_finetune", lambda args, out, state: tmp_path / "ft")
    monkeypatch.setattr(workloads, "ClassificationWorkload", _FakeWorkload)
    argv = ["--model", "m", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "r.json"), "--data-dir",
            str(tmp_path), "--seeds", "1,2", "--seed-methods", "cahp,fisher", "--one-seed-methods", "pass",
            "--curve-methods", "cahp,random", "--curve-counts", "72,8", "--no-progress"]
    assert cb.run(cb.parse_args([*argv, "--max-cells", "3"])) == 3  # "killed" after 3 cells
    assert ran == ["cahp/knee-d6/s1", "cahp/knee-d2/s1", "fisher/k14/s1"]
    ran.clear()
    assert cb.run(cb.parse_args(argv)) == 10  # only the unfinished ones
    assert ran[0] == "pass/k14/s1" and "cahp/knee-d6/s1" not in ran and "fisher/k14/s1" not in ran
    assert len(set(ran)) == 10 and "dense/k72/s1" in ran and "cahp/k36/s2" in ran
    ran.clear()
    assert cb.run(cb.parse_args(argv)) == 0 and ran == []  # everything finished: no work
    res = json.loads((tmp_path / "r.json").read_text())
    assert len(res["cells"]) == 13 and res["knees"] == {"6": 14, "2": 36}
    assert (tmp_path / "r_curve.png").is_file()
    cahp14 = next(r for r in res["comparison"] if r["method"] == "cahp" and r["count"] == 14)
    assert cahp14["seeds"] == [1, 2] and cahp14["finetuned_mean"] == pytest.approx(0.4015)
    assert cb.main(["--table", "--results", str(tmp_path / "r.json")]) == 0
    assert cb.run(cb.parse_args([*argv, "--recovery-precision", "bf16", "--max-cells", "1"])) == 1
    assert ran == ["cahp/knee-d6/s1"]  # other settings: everything reruns, the old cells are kept aside
    assert len(list((tmp_path / "out").glob("cells_other_settings_*.json"))) == 1


def test_bad_input_is_one_line(tmp_path, capsys) -> None:
    assert cb.main(["--model", "m", "--out", str(tmp_path), "--data-dir", str(tmp_path),
                    "--curve-counts", "72,4"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert_names(lines[0], "--curve-counts", 6, 72, "[72, 4]")
    assert cb.main(["--table", "--results", str(tmp_path / "none.json")]) == 2


def test_a_failing_cell_is_skipped_then_retried(tmp_path, monkeypatch, capsys) -> None:
    import headbudget.pruning.workloads as workloads

    ran: list[str] = []
    broken = {"fisher/k14/s1"}

    def fake_cell(cell, loaded, base_job, out):
        ran.append(cell.key)
        if cell.key in broken:
            raise RuntimeError("gates never cooled")
        count = 14 if isinstance(cell.count, str) else cell.count
        kept = {str(layer): list(range(count // 6 + (layer < count % 6))) for layer in range(6)}
        return {"report": {"heads_kept": count, "kept": kept, "knee_k": None, "mean_depth": 0.5,
                           "middle_third_share": 0.3, "seconds": {"select": 1.0}},
                "details": {"accuracy": {"test": {"dense": 0.5, "pruned": 0.3, "finetuned": 0.4}}}}

    monkeypatch.setattr(cb, "run_cell", fake_cell)
    monkeypatch.setattr(cb, "_dense_finetune", lambda args, out, state: tmp_path / "ft")
    monkeypatch.setattr(workloads, "ClassificationWorkload", _FakeWorkload)
    argv = ["--model", "m", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "r.json"), "--data-dir",
            str(tmp_path), "--seeds", "1", "--degrees", "6", "--seed-methods", "cahp,fisher", "--one-seed-methods",
            "pass", "--curve-methods", "cahp", "--curve-counts", "8", "--no-progress"]
    assert cb.main(argv) == 1
    assert ran == ["cahp/knee-d6/s1", "fisher/k14/s1", "pass/k14/s1", "cahp/k8/s1"]  # went on after the failure
    assert_names(capsys.readouterr().err, "fisher/k14/s1", "RuntimeError", "gates never cooled")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["failed"] == {"fisher/k14/s1": "RuntimeError: gates never cooled"} and len(res["cells"]) == 3
    ran.clear()
    broken.clear()
    assert cb.main(argv) == 0 and ran == ["fisher/k14/s1"]  # retried, nothing else rerun
    assert json.loads((tmp_path / "r.json").read_text())["failed"] == {}
