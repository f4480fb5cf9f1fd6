"""Rankings that hold: prune-compare over several held-out texts (--eval-data) and calibration
seeds (--calibration-seeds), mean / spread per method and text, and a "best" method only where it is best on
every text."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from conftest import assert_names, error_line, names

FIX = Path(__file__).resolve().parent / "fixtures" / "lm"
TEXT = FIX / "tiny_corpus.txt"
EVAL_TEXTS = [FIX / "eval_recipe.txt", FIX / "eval_numbers.csv"]


# --------------------------------------------------------------------------- the ranking rule
def test_spread_exact():
    from headbudget.evaluation.rankings import spread

    s = spread([4.0, 6.0, 11.0])
    assert s == {"n": 3, "mean": 7.0, "std": pytest.approx(statistics.stdev([4.0, 6.0, 11.0]), abs=1e-12),
                 "min": 4.0, "max": 11.0, "values": [4.0, 6.0, 11.0]}
    assert spread([3.5])["std"] == 0.0
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_rank_best_on_two_of_three_texts_is_no_method_best():
    from headbudget.evaluation.rankings import NO_BEST, rank_methods, ranking_markdown

    # cahp has the lowest mean perplexity on wiki and reviews, fisher on shakespeare (the situation)
    values = {"cahp": {"wiki": [50.0, 52.0, 51.0], "reviews": [60.0, 61.0, 62.0], "shakespeare": [90.0, 86.0, 88.0]},
              "fisher": {"wiki": [63.0, 60.0, 62.0], "reviews": [64.0, 66.0, 65.0], "shakespeare": [67.0, 68.0, 66.0]},
              "random": {"wiki": [70.0, 90.0, 80.0], "reviews": [99.0, 98.0, 97.0], "shakespeare": [98.0, 99.0, 97.0]}}
    r = rank_methods(values, lower_is_better=True)
    assert r["best"] is None and r["label"] == NO_BEST == "no method best"
    assert r["per_text"] == {"wiki": "cahp", "reviews": "cahp", "shakespeare": "fisher"}
    md = ranking_markdown(values, lower_is_better=True)
    assert "**no method best**" in md
    assert "| cahp | **51.00 ± 1.00 [50.00–52.00]** | **61.00 ± 1.00 [60.00–62.00]** | 88.00 ± 2.00 [86.00–90.00] |" in md
    assert "| fisher | 61.67 ± 1.53 [60.00–63.00] | 65.00 ± 1.00 [64.00–66.00] | **67.00 ± 1.00 [66.00–68.00]** |" in md


def test_rank_best_on_every_text_is_named_and_range_rule_is_stricter():
    from headbudget.evaluation.rankings import rank_methods

    values = {"cahp": {"wiki": [50.0, 58.0], "reviews": [60.0, 61.0], "shakespeare": [66.0, 67.0]},
              "fisher": {"wiki": [55.0, 57.0], "reviews": [64.0, 66.0], "shakespeare": [67.0, 68.0]}}
    r = rank_methods(values, lower_is_better=True)
    assert r["best"] == "cahp" == r["label"] and set(r["per_text"].values()) == {"cahp"}
    # the ranges overlap on wiki (50-58 vs 55-57) and shakespeare (66-67 vs 67-68): no method best by range
    rr = rank_methods(values, lower_is_better=True, rule="range")
    assert rr["best"] is None and rr["per_text"] == {"wiki": None, "reviews": "cahp", "shakespeare": None}
    # higher is better (accuracy): the same numbers rank the other way
    assert rank_methods(values, lower_is_better=False)["best"] == "fisher"
    # a tie on one text: nobody beats everyone there
    tie = {"a": {"x": [1.0], "y": [2.0]}, "b": {"x": [1.0], "y": [3.0]}}
    assert rank_methods(tie, lower_is_better=True) == {
        "best": None, "label": "no method best", "per_text": {"x": None, "y": "a"}, "rule": "mean",
        "rule_text": rank_methods(tie, lower_is_better=True)["rule_text"], "lower_is_better": True}
    with pytest.raises(ValueError, match=names("median", "mean", "range")):
        rank_methods(values, lower_is_better=True, rule="median")
    with pytest.raises(ValueError, match=names("b", "x", "y")):
        rank_methods({"a": {"x": [1.0]}, "b": {"y": [1.0]}}, lower_is_better=True)


# --------------------------------------------------------------------------- calibration windows per seed
def test_calibration_offsets_differ_per_seed():
    from headbudget.loading import load_tokenizer
    from headbudget.pruning.lm import calibration_offsets, lm_data

    assert calibration_offsets(1000, 32, 4) == [0, 32, 64, 96]  # no seed: the first windows (as before)
    offs = {s: calibration_offsets(1000, 32, 4, s) for s in (0, 1, 2)}
    assert offs[0] == calibration_offsets(1000, 32, 4, 0)  # deterministic
    assert len({tuple(o) for o in offs.values()}) == 3
    for o in offs.values():
        assert o == sorted(o) and len(set(o)) == 4 and all(x % 32 == 0 and x + 32 <= 1000 for x in o)
    assert calibration_offsets(100, 32, 8, 5) == [0, 32, 64]  # more windows asked than fit: all 3 slots

    tok = load_tokenizer("byte")
    ids = torch.tensor(tok(TEXT.read_text(), add_special_tokens=False)["input_ids"])
    n_calib = len(ids) - int(len(ids) * 0.1)
    for seed in (None, 0, 1):
        data = lm_data(tok, TEXT, context=32, calib_windows=8, calib_seed=seed)
        assert list(data.calib_offsets) == calibration_offsets(n_calib, 32, 8, seed)
        for row, o in zip(data.calib, data.calib_offsets):
            assert torch.equal(row, ids[o:o + 32])
        assert torch.equal(data.heldout, ids[n_calib:])  # the held-out tail does not move with the seed


# --------------------------------------------------------------------------- prune-compare, seeds x texts
def _tiny_run(path: Path) -> Path:
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.models.tokenizers import ByteTokenizer
    from headbudget.schedules import prism

    torch.manual_seed(0)
    cfg = HeadBudgetConfig(schedule=prism(3, 64, 32, 8), vocab_size=257, n_positions=64, dropout=0.0)
    HeadBudgetForCausalLM(cfg).eval().save_pretrained(path / "model")
    ByteTokenizer().save(path / "tokenizer")
    return path


@pytest.fixture(scope="module")
def seeded_compare(tmp_path_factory):
    """`headbudget prune-compare --task lm --eval-data A,B --calibration-seeds 0,1,2` on a random 14-head LM."""
    from headbudget.cli.main import main

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("rank")
    run = _tiny_run(root / "run")
    out = root / "cmp"
    rc = main(["prune-compare", str(run), "--task", "lm", "--data", str(TEXT), "--methods", "fisher,random,magnitude",
               "--keep", "6", "--context", "32", "--calib-windows", "8", "--batch-size", "4", "--limit-eval", "6",
               "--eval-data", ",".join(map(str, EVAL_TEXTS)), "--calibration-seeds", "0,1,2", "--no-progress",
               "--device", "cpu", "--out", str(out)])
    assert rc == 0
    return run, out


def test_seeded_compare_records_exact_per_seed_values(seeded_compare):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from headbudget.evaluation.perplexity import perplexity

    run, out = seeded_compare
    summary = json.loads((out / "compare.json").read_text())
    texts = ["tiny_corpus (held-out tail)", "eval_recipe", "eval_numbers"]
    assert summary["calibration_seeds"] == [0, 1, 2] and list(summary["texts"].values()) == texts
    values = summary["values"]["pruned"]
    assert list(values) == ["fisher", "random", "magnitude"]
    tok = AutoTokenizer.from_pretrained(run / "tokenizer")
    for text_path, name in zip(EVAL_TEXTS, texts[1:]):
        ids = torch.tensor(tok(text_path.read_text(), add_special_tokens=False)["input_ids"])
        for i, seed in enumerate((0, 1, 2)):
            for label in values:
                model = AutoModelForCausalLM.from_pretrained(out / f"seed{seed}" / label / "model").eval()
                want = perplexity(model, None, input_ids=ids, context=32, stride=31, max_windows=6)["ppl"]
                # same weights reloaded from disk, possibly another thread count: fp32 NLL sums over ~190 tokens
                # then exp() differ in the last bits, so a relative tolerance of 1e-5, not float equality
                assert values[label][name][i] == pytest.approx(want, rel=1e-5), (label, seed, name)
                det = json.loads((out / f"seed{seed}" / label / "details.json").read_text())
                assert det["perplexity"][name]["pruned"] == values[label][name][i]
                assert det["perplexity"]["heldout"]["pruned"] == values[label][texts[0]][i]
    for label, d in summary["aggregate"]["pruned"].items():
        for t, s in d.items():
            vs = values[label][t]
            assert s["mean"] == pytest.approx(statistics.mean(vs), abs=1e-12)
            assert s["std"] == pytest.approx(statistics.stdev(vs), abs=1e-12)
            assert (s["min"], s["max"], s["n"]) == (min(vs), max(vs), 3)
    # magnitude reads only the weights: the same heads, the same scores for every seed; fisher depends on the
    # calibration windows
    assert len(set(values["magnitude"]["eval_recipe"])) == 1
    kept = {s: json.loads((out / f"seed{s}" / "fisher" / "report.json").read_text())["kept"] for s in (0, 1, 2)}
    scores = {s: json.loads((out / f"seed{s}" / "fisher" / "details.json").read_text())["scores"] for s in (0, 1, 2)}
    assert scores[0] != scores[1] != scores[2]
    assert all(sum(len(v) for v in k.values()) == 6 for k in kept.values())


def test_seeded_compare_uses_other_windows_per_seed(seeded_compare):
    from headbudget.pruning.lm import calibration_offsets

    _, out = seeded_compare
    summary = json.loads((out / "compare.json").read_text())
    n = len(TEXT.read_bytes())
    n_calib = n - int(n * 0.1)
    for seed in (0, 1, 2):
        want = calibration_offsets(n_calib, 32, 8, seed)
        assert summary["per_seed"][str(seed)]["calib_offsets"] == want
        det = json.loads((out / f"seed{seed}" / "fisher" / "details.json").read_text())
        assert det["calib_seed"] == seed and det["calib_offsets"] == want and det["job"]["seed"] == 42 + seed
    assert len({tuple(summary["per_seed"][str(s)]["calib_offsets"]) for s in (0, 1, 2)}) == 3


def test_seeded_compare_ranking_and_table(seeded_compare):
    from headbudget.evaluation.rankings import rank_methods

    _, out = seeded_compare
    summary = json.loads((out / "compare.json").read_text())
    want = rank_methods(summary["values"]["pruned"], lower_is_better=True)
    assert summary["ranking"]["pruned"] == want
    md = (out / "compare.md").read_text()
    assert f"**{want['label']}**" in md and "calibration seeds 0, 1, 2" in md
    v = summary["values"]["pruned"]["random"]["eval_numbers"]
    assert "| random | eval_numbers | " + " | ".join(f"{x:.4f}" for x in v) + " |" in md
    for s in (0, 1, 2):
        assert "eval_recipe pruned" in (out / f"seed{s}" / "compare.md").read_text()


@pytest.mark.parametrize(
    ("extra", "values"),
    [
        (["--eval-data", "/nonexistent/x.txt"], ("eval_data", "/nonexistent/x.txt")),
        (["--calibration-seeds", "0,x"], ("--calibration-seeds", "'x'")),
        (["--calibration-seeds", "1,1"], ("calibration_seeds", "1,1")),
        (["--eval-data", f"{EVAL_TEXTS[0]},{EVAL_TEXTS[0]}"], ("eval_data", f"{EVAL_TEXTS[0]},{EVAL_TEXTS[0]}")),
    ],
)
def test_prune_compare_seed_flags_one_line_errors(tmp_path, capsys, extra, values):
    from headbudget.cli.main import main

    out = tmp_path / "o"
    try:
        rc = main(["prune-compare", str(tmp_path / "none"), "--task", "lm", "--data", str(TEXT), "--keep", "6",
                   "--out", str(out), "--no-progress", *extra])
    except SystemExit as exc:  # a value of the wrong type: argparse's one-line error
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert_names(error_line(err, "prune-compare"), *values)
    assert "Traceback" not in err and not out.exists()


def test_prune_compare_seed_flags_need_task_lm(tmp_path, capsys):
    from headbudget.cli.main import main

    rc = main(["prune-compare", str(tmp_path / "none"), "--task", "sst5", "--data-dir", str(tmp_path),
               "--calibration-seeds", "0,1", "--keep", "3", "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "prune-compare"), "calibration_seeds", "task", "lm", "sst5")


def test_ranking_table_of_one_seed_shows_no_spread():
    from headbudget.evaluation.rankings import format_spread, ranking_markdown, spread

    one = ranking_markdown({"cahp": {"wiki": [51.0]}, "fisher": {"wiki": [60.5]}}, lower_is_better=True)
    assert "±" not in one and "| cahp | **51.00** |" in one and "| fisher | 60.50 |" in one
    assert "(lower is better; one seed, no spread): **cahp**" in one
    two = ranking_markdown({"cahp": {"wiki": [51.0, 53.0]}, "fisher": {"wiki": [60.0, 62.0]}}, lower_is_better=True)
    assert "| cahp | **52.00 ± 1.41 [51.00–53.00]** |" in two and "over 2 seeds" in two
    assert format_spread(spread([0.25]), 4) == "0.2500" and format_spread(spread([1.0, 3.0]), 1) == "2.0 ± 1.4"


def test_a_comparison_takes_its_own_job_and_typed_seeds():
    """run_prune_compare takes a PruneCompareJob (a PruneJob has no methods to compare: a TypeError saying so,
    not an AttributeError); its seeds read from a comma string as the flag does, and a bad one is named."""
    from headbudget.pruning.compare import run_prune_compare
    from headbudget.pruning.job import PruneCompareJob, PruneJob
    from headbudget.typed_config import ConfigError

    with pytest.raises(TypeError, match="PruneCompareJob"):
        run_prune_compare(PruneJob("m", "lm", None, "o"))
    with pytest.raises(TypeError):  # resume is keyword-only: the old positional methods string is refused
        run_prune_compare(PruneCompareJob("m", "lm", None, "o"), "cahp,random")
    assert PruneCompareJob("m", "lm", None, "o", calibration_seeds="0, 1").calibration_seeds == (0, 1)
    with pytest.raises(ConfigError) as info:
        PruneCompareJob("m", "lm", None, "o", calibration_seeds="0,x")
    assert_names(str(info.value), "calibration_seeds", "'x'")
