"""`headbudget eval --output-path/--json/--log-samples` write lm-eval's files: read back by lm-eval's own
`make_table`, file-name helpers, `EvaluationTracker` serialization and `datasets` JSON loader (how lm-eval
loads sample files), for built-in and lm-eval tasks alike.  Offline, tiny random model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from tests.test_eval_zeroshot import FIXTURES, byte_tokenizer

from conftest import assert_names, error_line
from headbudget.cli.main import main

lm_eval = pytest.importorskip("lm_eval")

# the autouse fixture of the harness tests: no hub access, run in the lm-eval fixture folder (its YAML
# files' data paths)
from tests.test_eval_harness import TASKS_DIR, _offline_one_thread  # noqa: E402, F401


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny_out") / "my:model"  # ':' is one of the characters lm-eval sanitizes
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=64, vocab_size=257,
                               bos_token_id=256, eos_token_id=256)).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


TASKS = "piqa,arc_easy,winogrande,hb_mc,hb_rolling"


@pytest.fixture(scope="module")
def written(model_dir, tmp_path_factory):
    """One `headbudget eval --output-path DIR --log-samples` run over built-in and lm-eval tasks."""
    import datasets
    import huggingface_hub.constants

    out = tmp_path_factory.mktemp("out")
    mp = pytest.MonkeyPatch()
    mp.chdir(TASKS_DIR)
    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    try:
        rc = main(["eval", str(model_dir), "--tasks", TASKS, "--data-dir", str(FIXTURES), "--include-path",
                   str(TASKS_DIR), "--log-samples", "--output-path", str(out), "--quiet", "--threads", "1"])
    finally:
        mp.undo()
    assert rc == 0
    return out


def _files(out: Path) -> list[str]:
    """The written files as lm-eval's hub listing names them: '<model folder>/<file>'."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def test_layout_is_lm_evals_output_path(written, model_dir):
    """DIR/<sanitized model name>/results_<datetime>.json + samples_<task>_<datetime>.jsonl per task, found
    and parsed by lm-eval's own file-name helpers (one datetime for the run)."""
    from lm_eval.utils import (
        get_file_datetime,
        get_file_task_name,
        get_latest_filename,
        get_results_filenames,
        get_sample_results_filenames,
        sanitize_model_name,
    )

    names = _files(written)
    folder = sanitize_model_name(str(model_dir))
    assert {n.split("/")[0] for n in names} == {folder} and "my__model" in folder
    results = get_results_filenames(names)
    samples = get_sample_results_filenames(names)
    assert len(results) == 1 and len(samples) == 5 and len(names) == 6
    stamp = get_file_datetime(get_latest_filename(results)).removesuffix(".json")
    assert sorted(get_file_task_name(Path(s).name) for s in samples) == sorted(TASKS.split(","))
    assert {get_file_datetime(Path(s).name) for s in samples} == {stamp}


def _results(out: Path) -> dict:
    from lm_eval.utils import get_latest_filename, get_results_filenames

    return json.loads((out / get_latest_filename(get_results_filenames(_files(out)))).read_text(encoding="utf-8"))


def test_make_table_prints_each_metric_once(written):
    """lm-eval's make_table on the results file: one row per (task, metric), built-in tasks in the same
    rows as lm-eval's, no `n` row; headbudget's own fields sit under one key."""
    from lm_eval.utils import make_table

    r = _results(written)
    table = make_table(r).strip().splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    # Tasks, Version, Filter, n-shot, Metric, (arrow), Value, ±, Stderr
    assert [(row[0], row[4]) for row in rows] == [
        ("arc_easy", "acc"), ("", "acc_norm"),
        ("hb_mc", "acc"), ("", "acc_norm"),
        ("hb_rolling", "bits_per_byte"), ("", "byte_perplexity"), ("", "word_perplexity"),
        ("piqa", "acc"), ("", "acc_norm"),
        ("winogrande", "acc")]
    assert all(row[2] == "none" and row[3] == "0" for row in rows)
    piqa = rows[7]
    assert piqa[1] == "1" and float(piqa[6]) == pytest.approx(r["results"]["piqa"]["acc,none"], abs=5e-5)
    assert float(piqa[8]) == pytest.approx(r["results"]["piqa"]["acc_stderr,none"], abs=5e-5)
    for task, res in r["results"].items():
        assert set(res) - {"name", "alias", "sample_len"} == {k for k in res if "," in k}, task
    assert r["results"]["piqa"]["sample_len"] == r["n-samples"]["piqa"]["effective"] == 3
    assert r["headbudget"]["predictions"]["piqa"] and set(r["headbudget"]) == {"predictions", "seconds",
                                                                                "details"}


def test_results_file_has_lm_evals_top_level_keys(written, model_dir):
    from lm_eval.result_schema import EvalResults

    r = _results(written)
    assert set(r) - {"headbudget"} <= set(EvalResults.__annotations__)
    for key in ("results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
                "config", "task_hashes", "model_name", "model_name_sanitized", "date"):
        assert key in r, key
    assert list(r)[:8] == ["results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better",
                           "n-samples", "config"]
    tasks = TASKS.split(",")
    assert r["group_subtasks"] == {} and set(r["task_hashes"]) == set(tasks) == set(r["configs"])
    assert r["config"]["model"] == "headbudget" and r["config"]["model_args"] == f"pretrained={model_dir}"
    assert r["model_name"] == str(model_dir) and r["n-shot"] == dict.fromkeys(tasks, 0)
    assert r["higher_is_better"]["winogrande"] == {"acc": True}


def _sample_files(out: Path) -> dict[str, Path]:
    from lm_eval.utils import get_file_task_name, get_sample_results_filenames

    return {get_file_task_name(Path(n).name): out / n for n in get_sample_results_filenames(_files(out))}


def test_samples_files_load_as_lm_evals_records(written, tmp_path):
    """Each samples file loads with `datasets`' JSON loader (how lm-eval reads them back) and every record
    has lm-eval's SampleResult keys and types: gen_args_N, string resps, string target, sha256 hashes."""
    import datasets
    from lm_eval.result_schema import SampleResult

    files = _sample_files(written)
    n_docs = {"piqa": 3, "arc_easy": 2, "winogrande": 2, "hb_mc": 11, "hb_rolling": 4}
    for task, path in files.items():
        ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "c"))
        recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert ds.num_rows == len(recs) == n_docs[task]
        for i, rec in enumerate(recs):
            assert set(SampleResult.__annotations__) <= set(rec), task
            assert rec["doc_id"] == i and isinstance(rec["doc"], dict) and isinstance(rec["target"], str)
            args = rec["arguments"]
            assert list(args) == [f"gen_args_{j}" for j in range(len(args))]
            assert all(set(a) <= {"arg_0", "arg_1"} and all(isinstance(v, str) for v in a.values())
                       for a in args.values())
            assert len(rec["resps"]) == len(rec["filtered_resps"]) == len(args)
            leaves = [x for r in rec["filtered_resps"] for x in (r if isinstance(r, list) else [r])]
            assert leaves and all(isinstance(x, str) for x in leaves)
            float(leaves[0])  # a log-likelihood, as a string
            assert all(len(rec[h]) == 64 for h in ("doc_hash", "prompt_hash", "target_hash"))
            for m in rec["metrics"]:
                assert m in rec
        if task in ("piqa", "arc_easy", "hb_mc"):
            assert recs[0]["metrics"] == ["acc", "acc_norm"] and isinstance(recs[0]["acc"], float)
            assert set(recs[0]["arguments"]["gen_args_0"]) == {"arg_0", "arg_1"}
            assert recs[0]["filtered_resps"][0][1] == "False"
    assert json.loads(files["piqa"].read_text().splitlines()[0])["doc"] == \
        json.loads((FIXTURES / "piqa_validation.jsonl").read_text().splitlines()[0])


def test_samples_lines_equal_lm_eval_trackers_own(model_dir, tmp_path):
    """lm-eval's EvaluationTracker, given the same in-memory records, writes byte-identical sample files
    (built-in and lm-eval tasks); its task hashes equal ours."""
    from lm_eval.loggers import EvaluationTracker

    from headbudget.evaluation.lm_eval_files import task_hashes, write_lm_eval_files
    from headbudget.evaluation.suite import SuiteSettings, evaluate_suite
    from headbudget.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(model_dir))
    rep = evaluate_suite(model, tok, SuiteSettings(tasks=("piqa", "winogrande", "hb_mc", "hb_rolling"),
                                                   data_dir=str(FIXTURES), include_path=str(TASKS_DIR),
                                                   log_samples=True, bootstrap_iters=0), progress=False)
    ours = write_lm_eval_files(rep, model_name="m", output_path=tmp_path / "ours", date_id="D")
    tracker = EvaluationTracker(output_path=str(tmp_path / "theirs"))
    tracker.general_config_tracker.model_name_sanitized = "m"
    tracker.date_id = "D"
    for task in rep["configs"]:
        tracker.save_results_samples(task_name=task, samples=copy.deepcopy(rep["samples"][task]))
    theirs = sorted((tmp_path / "theirs" / "m").iterdir())
    assert [p.name for p in theirs] == sorted(p.name for p in ours if p.name.startswith("samples_"))
    for p in theirs:
        assert (tmp_path / "ours" / "m" / p.name).read_bytes() == p.read_bytes(), p.name
    results = json.loads((tmp_path / "ours" / "m" / "results_D.json").read_text())
    assert results["task_hashes"] == task_hashes(rep["samples"])
    assert isinstance(rep["samples"]["piqa"][0]["target"], int)  # the report itself is not rewritten


def test_builtin_piqa_records_equal_lm_evals_piqa(model_dir, tmp_path):
    """Built-in piqa and lm-eval's piqa YAML on the same rows: the same doc, target, arguments and hashes
    in the samples file (the scores to float rounding)."""
    from headbudget.evaluation.lm_eval_files import write_lm_eval_files
    from headbudget.evaluation.suite import SuiteSettings, evaluate_suite
    from headbudget.loading import load_model_and_tokenizer

    yaml = (Path(__file__).resolve().parents[1] / "benchmarks" / "lm_eval_tasks" / "piqa_local.yaml").read_text()
    yaml = yaml.replace("../shared/data/zeroshot/piqa_validation.jsonl", str(FIXTURES / "piqa_validation.jsonl"))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "piqa_local.yaml").write_text(yaml)
    model, tok = load_model_and_tokenizer(str(model_dir))
    rep = evaluate_suite(model, tok, SuiteSettings(tasks=("piqa", "piqa_local"), data_dir=str(FIXTURES),
                                                   include_path=str(tmp_path / "tasks"), log_samples=True,
                                                   bootstrap_iters=0), progress=False)
    write_lm_eval_files(rep, model_name="m", output_path=tmp_path / "o", date_id="D")
    a, b = ([json.loads(x) for x in (tmp_path / "o" / "m" / f"samples_{t}_D.jsonl").read_text().splitlines()]
            for t in ("piqa", "piqa_local"))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        lx = [float(r[0]) for r in x.pop("filtered_resps")]
        ly = [float(r[0]) for r in y.pop("filtered_resps")]
        assert lx == pytest.approx(ly, abs=1e-4)
        del x["resps"], y["resps"]
        assert x == y
    assert rep["results"]["piqa"]["acc,none"] == rep["results"]["piqa_local"]["acc,none"]


def test_json_flag_writes_the_results_dict_to_exactly_that_file(model_dir, tmp_path, capsys):
    """--json FILE: lm-eval's results dict at FILE (make_table reads it); --log-samples puts the samples
    files next to it, as lm-eval does for an output path ending in .json."""
    from lm_eval.utils import make_table

    out = tmp_path / "r.json"
    assert main(["eval", str(model_dir), "--tasks", "piqa", "--data-dir", str(FIXTURES), "--log-samples",
                 "--json", str(out), "--quiet"]) == 0
    r = json.loads(out.read_text())
    assert "samples" not in r and r["results"]["piqa"]["alias"] == "piqa"
    assert make_table(r).count("acc_norm") == 1
    side = [p.name for p in tmp_path.iterdir() if p.name.startswith("samples_piqa_")]
    assert len(side) == 1 and side[0].endswith(".jsonl")
    assert f"wrote {out}" in capsys.readouterr().out


def test_output_path_rules(tmp_path):
    from headbudget.evaluation.lm_eval_files import output_paths

    res, samples = output_paths(tmp_path / "runs", "org/model:v1", ["piqa"], "D")
    assert res == tmp_path / "runs" / "org__model__v1" / "results_D.json"
    assert samples == {"piqa": tmp_path / "runs" / "org__model__v1" / "samples_piqa_D.jsonl"}
    res, samples = output_paths(tmp_path / "x" / "res.json", "m", ["piqa"], "D")
    assert res == tmp_path / "x" / "res_D.json" and samples["piqa"] == tmp_path / "x" / "samples_piqa_D.jsonl"


@pytest.mark.parametrize("flags, values", [
    (["--output-path", "{file}"], ("--output-path", "{file}")),  # an existing file, not a folder
    (["--output-path", "{file}/sub"], ("--output-path", "{file}")),  # under a file
    (["--json", "{dir}"], ("--json", "{dir}")),  # a folder, not a file, as every command's --json
    (["--log-samples"], ("--log-samples", "--output-path")),  # needs --output-path
])
def test_bad_output_flags_fail_before_any_work(tmp_path, capsys, flags, values):
    """One line, exit 2, before the model is even opened (the model path does not exist here)."""
    (tmp_path / "f.txt").write_text("keep me")
    sub = {"file": str(tmp_path / "f.txt"), "dir": str(tmp_path)}
    rc = main(["eval", str(tmp_path / "no-such-model"), "--tasks", "piqa",
               *[f.format(**sub) for f in flags]])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "eval"), *[v.format(**sub) for v in values])
    assert (tmp_path / "f.txt").read_text() == "keep me"


def test_a_failed_write_leaves_no_files(model_dir, tmp_path, monkeypatch):
    """The results file fails to write: the samples files of that call are removed too."""
    import headbudget.evaluation.lm_eval_files as files
    from headbudget.evaluation.suite import SuiteSettings, evaluate_suite
    from headbudget.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(model_dir))
    rep = evaluate_suite(model, tok, SuiteSettings(tasks=("piqa",), data_dir=str(FIXTURES), log_samples=True),
                         progress=False)
    real = files.atomic_write_text

    def fail_on_results(path, text):
        if Path(path).name.startswith("results_"):
            raise OSError("disk full")
        return real(path, text)

    monkeypatch.setattr(files, "atomic_write_text", fail_on_results)
    with pytest.raises(OSError, match="disk full"):
        files.write_lm_eval_files(rep, model_name="m", output_path=tmp_path / "o")
    assert [p for p in (tmp_path / "o").rglob("*") if p.is_file()] == []


def test_builtin_stderr_is_na_where_lm_eval_gives_none(model_dir):
    """As lm-eval: no stderr with --bootstrap-iters 0 or a single document ("N/A", which make_table prints;
    a null there made it raise), a number otherwise."""
    from lm_eval.utils import make_table

    from headbudget.evaluation.suite import SuiteSettings, evaluate_suite, format_report
    from headbudget.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(model_dir))
    for limit, iters, want_na in ((None, 0, True), (1, 100000, True), (None, 100000, False)):
        rep = evaluate_suite(model, tok, SuiteSettings(tasks=("piqa",), data_dir=str(FIXTURES), limit=limit,
                                                       bootstrap_iters=iters), progress=False)
        res = rep["results"]["piqa"]
        assert rep["n-samples"]["piqa"] == {"original": 3, "effective": limit or 3}  # the file has 3 rows
        assert (res["acc_stderr,none"] == res["acc_norm_stderr,none"] == "N/A") == want_na
        assert isinstance(res["acc,none"], float)
        rows = [line for line in make_table(rep).splitlines() if "acc" in line]
        assert len(rows) == 2 and all(("N/A" in line) == want_na for line in rows)
        printed = format_report(rep)  # headbudget's own table: N/A there too, not nan
        assert printed.count("|piqa") == 1 and ("|   N/A|" in printed) == want_na and "nan" not in printed


def test_output_path_in_a_read_only_folder_fails_before_any_work(tmp_path, capsys, monkeypatch):
    """A real write probe where the results file would go, before the tasks and the model load (the model
    path does not exist: loading it would be another error)."""
    import errno
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkstemp = tempfile.mkstemp

    def read_only(*a, dir=None, **k):  # root ignores chmod: refuse where the first byte would be written
        if dir is not None and Path(dir) == ro:
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    for out in (ro, ro / "new" / "deeper"):  # the folder itself, or one to be made inside it
        rc = main(["eval", str(tmp_path / "no-such-model"), "--tasks", "piqa", "--output-path", str(out)])
        assert rc == 2
        line = error_line(capsys.readouterr().err, "eval")
        assert_names(line, "--output-path", ro, "Permission denied")
        assert f" {out}/" in line  # the file it would write, inside --output-path
    assert list(ro.iterdir()) == []


def test_the_suite_takes_its_settings_whole():
    """prepare_suite / evaluate_suite take a SuiteSettings: a bare task list is a TypeError naming it (not an
    AttributeError), and a comma string of tasks reads as the flag does."""
    from headbudget.evaluation.suite import SuiteSettings, evaluate_suite, prepare_suite

    for call in (lambda: prepare_suite(["piqa"]), lambda: evaluate_suite(None, None, ["piqa"])):
        with pytest.raises(TypeError, match="SuiteSettings"):
            call()
    assert SuiteSettings(tasks="piqa, arc_easy").tasks == ("piqa", "arc_easy")
