"""`headbudget prune --task lm`: label-free head pruning of causal LMs, metric = held-out perplexity."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import assert_names, error_line

TEXT = Path(__file__).resolve().parent / "fixtures" / "lm" / "tiny_corpus.txt"
COMMON = ["--context", "32", "--calib-windows", "8", "--pool-size", "8", "--batch-size", "4", "--no-progress",
          "--device", "cpu"]


def _tiny_headbudget(path: Path, with_tokenizer: bool) -> Path:
    """A `headbudget train`-style run folder: run/model (weights) and, optionally, run/tokenizer (byte)."""
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.models.tokenizers import ByteTokenizer
    from headbudget.schedules import prism

    torch.manual_seed(0)
    cfg = HeadBudgetConfig(schedule=prism(3, 64, 32, 8), vocab_size=257, n_positions=64, dropout=0.0)
    model = HeadBudgetForCausalLM(cfg).eval()
    model.save_pretrained(path / "model")
    if with_tokenizer:
        ByteTokenizer().save(path / "tokenizer")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return _tiny_headbudget(tmp_path_factory.mktemp("lm") / "run", with_tokenizer=True)


def test_prune_lm_cahp_cli_end_to_end(run_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from headbudget.cli.main import main
    from headbudget.models import HeadBudgetForCausalLM
    from headbudget.pruning.lm import lm_data, lm_perplexity
    from headbudget.pruning.report import METRIC_KEYS, REPORT_KEYS

    out = tmp_path / "cahp"
    rc = main(["prune", str(run_dir), "--task", "lm", "--data", str(TEXT), "--method", "cahp", "--keep", "6",
               "--out", str(out), *COMMON])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "perplexity dense" in printed
    rep = json.loads((out / "report.json").read_text())
    assert tuple(rep) == REPORT_KEYS and tuple(rep["metric"]) == METRIC_KEYS
    assert rep["method"] == "cahp" and rep["heads_total"] == 2 + 4 + 8
    assert rep["heads_kept"] == 6 == sum(len(v) for v in rep["kept"].values())
    assert all(len(rep["kept"][str(layer)]) >= 1 for layer in range(3))
    assert rep["metric"]["finetuned"] is None  # lm default: no fine-tuning
    assert rep["metric"]["dense"] > 1 and rep["metric"]["pruned"] > 1
    details = json.loads((out / "details.json").read_text())
    assert details["metric_name"] == "perplexity" and details["calib_windows"] == 8
    assert "Perplexity (lower is better)" in (out / "report.md").read_text()

    # the saved model is a plain headbudget checkpoint (no sidecar) with its tokenizer at the root; it
    # reloads with the pruned head counts and reproduces the reported perplexity
    assert not (out / "model" / "kept_heads.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert isinstance(model, HeadBudgetForCausalLM)
    assert list(model.config.head_schedule.heads) == [len(rep["kept"][str(i)]) for i in range(3)]
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert tok("Hi", add_special_tokens=False)["input_ids"] == [72, 105]  # the byte tokenizer's ids
    data = lm_data(tok, TEXT, context=32, calib_windows=8, vocab_size=257)
    ppl = lm_perplexity(model, data)["ppl"]
    assert ppl == pytest.approx(rep["metric"]["pruned"], rel=1e-4)
    dense = HeadBudgetForCausalLM.from_pretrained(run_dir / "model").eval()
    assert lm_perplexity(dense, data)["ppl"] == pytest.approx(rep["metric"]["dense"], rel=1e-4)


def test_prune_lm_baseline_with_tokenizer_flag_and_finetuning(tmp_path, capsys):
    """A model folder without a tokenizer takes --tokenizer byte; --finetune-epochs trains on the
    calibration windows and the fine-tuned perplexity is measured."""
    from headbudget.cli.main import main

    bare = _tiny_headbudget(tmp_path / "bare", with_tokenizer=False) / "model"
    out = tmp_path / "mag"
    rc = main(["prune", str(bare), "--task", "lm", "--data", str(TEXT), "--tokenizer", "byte", "--method",
               "magnitude", "--keep", "5", "--finetune-epochs", "3", "--lr", "3e-3", "--out", str(out), *COMMON])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert rep["heads_kept"] == 5 and rep["knee_k"] is None
    m = rep["metric"]
    assert m["finetuned"] is not None and m["finetuned"] < m["pruned"]
    assert (out / "model" / "tokenizer.json").is_file()  # the --tokenizer given is saved with the model


def test_prune_compare_lm_on_tiny_gpt2(tmp_path):
    """prune-compare with --task lm on a Hugging Face GPT-2: every method keeps the same head count, and
    the pruned GPT-2 is saved as a headbudget checkpoint whose schedule is what was kept."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from headbudget.pruning.compare import run_prune_compare
    from headbudget.pruning.job import PruneCompareJob

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=257, n_embd=32, n_layer=2, n_head=4, n_positions=64)).save_pretrained(
        tmp_path / "gpt2")
    job = PruneCompareJob(str(tmp_path / "gpt2"), "lm", None, str(tmp_path / "cmp"), data=str(TEXT),
                          tokenizer="byte", context=32, calib_windows=8, pool_size=8, batch_size=4, keep=4,
                          finetune_epochs=0, progress=False, device="cpu", methods="cahp,random")
    summary = run_prune_compare(job)
    assert summary["metric_name"] == "perplexity"
    assert [r["heads_kept"] for r in summary["rows"]] == [4, 4]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "cmp" / "random" / "model")
    assert model.config.model_type == "headbudget"
    kept = summary["rows"][1]["kept"]
    assert list(model.config.head_schedule.heads) == [len(kept["0"]), len(kept["1"])] and sum(
        model.config.head_schedule.heads) == 4
    cost = summary["rows"][1]["cost"]
    # 4 of 8 GPT-2 heads (d 32, head dim 8) removed: 4 x (q/k/v rows with bias 3*(8*32+8) + 8*32 o columns)
    assert cost["params"]["before"] - cost["params"]["after"] == 4 * 1048
    assert cost["params"]["after"] == sum(p.numel() for p in model.parameters())
    assert "lower is better" in (tmp_path / "cmp" / "compare.md").read_text()


@pytest.mark.parametrize(
    ("extra", "values"),
    [
        ([], ("lm", "data")),
        (["--data", str(TEXT), "--curve", "accuracy"], ("accuracy", "lm")),
        (["--data", str(TEXT), "--context", "999"], ("context", 999, 64)),
    ],
)
def test_prune_lm_one_line_errors(run_dir, tmp_path, capsys, extra, values):
    from headbudget.cli.main import main

    rc = main(["prune", str(run_dir), "--task", "lm", "--out", str(tmp_path / "o"), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert_names(error_line(err, "prune"), *values)


def test_prune_lm_model_without_tokenizer_needs_flag(tmp_path, capsys):
    from headbudget.cli.main import main

    bare = _tiny_headbudget(tmp_path / "bare", with_tokenizer=False) / "model"
    capsys.readouterr()  # the setup's own save bar
    rc = main(["prune", str(bare), "--task", "lm", "--data", str(TEXT), "--keep", "5", "--out", str(tmp_path / "o"),
               "--no-progress"])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "prune"), bare)


def test_prune_lm_knee_warns_when_perplexity_blows_up(run_dir, tmp_path, capsys):
    """Knee-chosen count in the label-free mode: pruned perplexity > ratio x dense -> one stderr line + report."""
    from headbudget.cli.main import main

    base = ["prune", str(run_dir), "--task", "lm", "--data", str(TEXT), "--method", "cahp", *COMMON]
    # an injected threshold below the measured ratio (pruned / dense ~ 1 on this random model) must warn
    assert main([*base, "--out", str(tmp_path / "w"), "--knee-warn-ratio", "0.5"]) == 0
    err = capsys.readouterr().err
    rep = json.loads((tmp_path / "w" / "report.json").read_text())
    ratio = rep["metric"]["pruned"] / rep["metric"]["dense"]
    assert ratio > 0.5 and rep["knee_k"] is not None
    warn_lines = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warn_lines) == 1 and "more than 0.5x" in warn_lines[0] and f"{ratio:.1f}x dense" in warn_lines[0]
    assert rep["warning"] in warn_lines[0]
    assert f"{rep['heads_kept']}/14 heads" in rep["warning"]
    assert "**Warning:**" in (tmp_path / "w" / "report.md").read_text()
    # the default 2x is not reached here: no warning, no key
    assert main([*base, "--out", str(tmp_path / "ok")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert "warning" not in json.loads((tmp_path / "ok" / "report.json").read_text())
    # a forced count is the user's choice: never warned about
    assert main([*base, "--out", str(tmp_path / "k"), "--keep", "3", "--knee-warn-ratio", "0.5"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_cahp_forced_count_is_not_called_a_knee(run_dir, tmp_path, capsys, monkeypatch):
    """With --keep-ratio the cluster count k follows from the forced head count: report.md, report.json, the
    printed line and the MSS plot say so instead of calling it a knee; a knee-chosen k stays "knee k"."""
    from headbudget.cli.main import main
    from headbudget.pruning import report as rpt

    titles = []
    real_plot = rpt.plot_mss
    monkeypatch.setattr(rpt, "plot_mss", lambda mss, k, path, title="": titles.append(title) or real_plot(
        mss, k, path, title))
    base = ["prune", str(run_dir), "--task", "lm", "--data", str(TEXT), "--method", "cahp", *COMMON]
    out = tmp_path / "forced"
    assert main([*base, "--keep-ratio", "0.5", "--allocation", "importance", "--clusters", "4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    said = "clusters k = 4, forced by --keep-ratio 0.5; no knee computed"
    rep = json.loads((out / "report.json").read_text())
    assert rep["knee_k"] == 4 and rep["k_source"] == "forced" and rep["heads_kept"] == 7
    assert f"Kept **7 / 14** heads ({said})." in (out / "report.md").read_text()
    assert f"cahp: kept 7/14 heads ({said});" in printed and "knee" not in printed.replace("no knee computed", "")
    assert titles == [f"MSS (mean), {said}"]

    # --keep: the same, naming that flag
    assert main([*base, "--keep", "6", "--out", str(tmp_path / "keep")]) == 0
    rep = json.loads((tmp_path / "keep" / "report.json").read_text())
    assert rep["k_source"] == "forced"
    assert f"(clusters k = {rep['knee_k']}, forced by --keep 6; no knee computed);" in capsys.readouterr().out

    # no forced count: CAHP's own k from the MSS curve, a knee (or, on this random model possibly, no knee at all)
    titles.clear()
    assert main([*base, "--out", str(tmp_path / "knee")]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((tmp_path / "knee" / "report.json").read_text())
    source = json.loads((tmp_path / "knee" / "details.json").read_text())["knee_source"]
    k = rep["knee_k"]
    said = {"mss": f"knee k = {k}", "fallback-max-mss": f"clusters k = {k}, no knee found: the k of the highest MSS"}
    assert rep["k_source"] == {"mss": "knee", "fallback-max-mss": "fallback"}[source]
    assert f"({said[source]})." in (tmp_path / "knee" / "report.md").read_text()
    assert f"({said[source]});" in printed and titles == [f"MSS (mean), {said[source]}"]


def test_describe_k_wording():
    from headbudget.pruning.report import build_report, describe_k

    assert describe_k(30, "keep", keep_ratio=0.5) == "clusters k = 30, forced by --keep-ratio 0.5; no knee computed"
    assert describe_k(12, "keep", keep=13) == "clusters k = 12, forced by --keep 13; no knee computed"
    assert describe_k(9, "mss") == describe_k(9, "accuracy") == describe_k(9, "knee") == "knee k = 9"
    assert describe_k(5, "fallback-max-accuracy") == "clusters k = 5, no knee found: the k of the highest accuracy"
    assert describe_k(None, None) is None
    rep = build_report("random", 8, {0: [1]}, None, None, {"dense": 1.0, "pruned": 2.0}, {})
    assert rep["knee_k"] is None and rep["k_source"] is None


def test_prune_compare_says_each_stage_with_no_progress(run_dir, tmp_path, capsys):
    """--no-progress draws no bar, yet every method's stages are printed as they finish, with their seconds
    (the ones report.json records)."""
    from headbudget.cli.main import main

    out = tmp_path / "cmp"
    assert main(["prune-compare", str(run_dir), "--task", "lm", "--data", str(TEXT), "--methods", "cahp,fisher",
                 "--keep", "6", "--out", str(out), *COMMON]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"load model and data \d+\.\d s", lines[0]), lines
    for label, stages in (("cahp", ["dense evaluation", "signatures", "salience", "cluster", "selection (all of it)",
                                    "head removal", "pruned evaluation", "save model", "method total"]),
                          ("fisher", ["selection (all of it)", "head removal", "pruned evaluation", "save model",
                                      "method total"])):
        mine = [ln for ln in lines if ln.startswith(f"{label}: ") and ln.endswith(" s")]
        assert [re.sub(r" \d+\.\d s$", "", ln[len(label) + 2:]) for ln in mine] == stages, lines
        seconds = json.loads((out / label / "report.json").read_text())["seconds"]
        total = float(mine[-1].rsplit(" ", 2)[1])
        assert total == pytest.approx(seconds["total"], abs=0.051)
    # as they ran: all of cahp's stages before fisher's, then the summary
    staged = [ln.split(":")[0] for ln in lines[1:] if re.search(r" \d+\.\d s$", ln)]
    assert staged == ["cahp"] * 9 + ["fisher"] * 5
    assert lines[15].startswith("cahp: 6 heads; heldout pruned")


def test_prune_compare_cut_short_keeps_the_finished_methods(run_dir, tmp_path, monkeypatch):
    """A comparison stopped after its first method has compare.json / compare.md with that method's row."""
    import headbudget.pruning.pipeline as pl
    from headbudget.pruning.compare import run_prune_compare
    from headbudget.pruning.job import PruneCompareJob

    real = pl.run_prune
    calls = []

    def stop_at_second(sub, loaded=None, **kw):
        calls.append(sub.method)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run cut short, e.g. Ctrl-C or a job's time limit
        return real(sub, loaded, **kw)

    monkeypatch.setattr(pl, "run_prune", stop_at_second)
    out = tmp_path / "cmp"
    job = PruneCompareJob(str(run_dir), "lm", None, str(out), data=str(TEXT), context=32, calib_windows=8,
                          pool_size=8, batch_size=4, keep=6, progress=False, device="cpu",
                          methods="magnitude,random,fisher")
    with pytest.raises(KeyboardInterrupt):
        run_prune_compare(job)
    summary = json.loads((out / "compare.json").read_text())
    rep = json.loads((out / "magnitude" / "report.json").read_text())
    assert [r["label"] for r in summary["rows"]] == ["magnitude"]
    assert summary["methods_planned"] == ["magnitude", "random", "fisher"]
    assert summary["rows"][0]["heads_kept"] == 6 and summary["rows"][0]["kept"] == rep["kept"]
    assert summary["rows"][0]["metric"]["heldout"]["pruned"] == rep["metric"]["pruned"]
    md = (out / "compare.md").read_text()
    assert "**Partial:** 1 of 3 methods finished (random, fisher not yet)." in md and "| magnitude | 6 |" in md

    # the finished comparison has every row and no partial marks
    monkeypatch.setattr(pl, "run_prune", real)
    summary = run_prune_compare(job, resume=True)
    assert [r["label"] for r in summary["rows"]] == ["magnitude", "random", "fisher"]
    assert "methods_planned" not in json.loads((out / "compare.json").read_text())
    assert "Partial" not in (out / "compare.md").read_text()


def test_prune_compare_seeds_cut_short_keep_the_finished_seeds(run_dir, tmp_path, monkeypatch):
    import headbudget.pruning.pipeline as pl
    from headbudget.pruning.compare import run_prune_compare
    from headbudget.pruning.job import PruneCompareJob

    real = pl.run_prune

    def stop_in_seed_1(sub, loaded=None, **kw):
        if sub.calib_seed == 1:
            raise KeyboardInterrupt
        return real(sub, loaded, **kw)

    monkeypatch.setattr(pl, "run_prune", stop_in_seed_1)
    out = tmp_path / "cmp"
    job = PruneCompareJob(str(run_dir), "lm", None, str(out), data=str(TEXT), context=32, calib_windows=8,
                          pool_size=8, batch_size=4, keep=6, progress=False, device="cpu",
                          methods="magnitude,random", calibration_seeds=(0, 1))
    with pytest.raises(KeyboardInterrupt):
        run_prune_compare(job)
    summary = json.loads((out / "compare.json").read_text())
    assert summary["calibration_seeds"] == [0] and summary["calibration_seeds_planned"] == [0, 1]
    seed0 = json.loads((out / "seed0" / "compare.json").read_text())
    assert summary["values"]["pruned"]["random"]["tiny_corpus (held-out tail)"] == [
        seed0["rows"][1]["metric"]["heldout"]["pruned"]]
    assert "**Partial:** seeds 0 of 0, 1 finished." in (out / "compare.md").read_text()


def test_one_calibration_seed_prints_no_spread(run_dir, tmp_path, capsys):
    """One seed has no spread: no "± 0.0000" (which reads as "no variation") on stdout or in compare.md."""
    from headbudget.cli.main import main

    out = tmp_path / "one"
    assert main(["prune-compare", str(run_dir), "--task", "lm", "--data", str(TEXT), "--methods", "magnitude,random",
                 "--keep", "6", "--calibration-seeds", "0", "--out", str(out), *COMMON]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "compare.json").read_text())
    v = summary["values"]["pruned"]["random"]["tiny_corpus (held-out tail)"][0]
    assert "pruned (one calibration seed):" in printed and f"random: tiny_corpus (held-out tail) {v:.4f}\n" in printed
    md = (out / "compare.md").read_text()
    assert "±" not in printed and "±" not in md
    assert "## Pruned: one seed (0), no spread" in md and f"| {v:.4f} |" in md
