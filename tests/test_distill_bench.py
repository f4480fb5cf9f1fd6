"""benchmarks/distill_smollm2.py --score-checkpoint: the newest checkpoint of a recovery run is scored as the
model it holds (a run that cannot finish in a session still reports where it got to)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from conftest import load_benchmark, names
from headbudget.evaluation.perplexity import perplexity
from headbudget.loading import load_model_and_tokenizer
from headbudget.train import Trainer
from test_distill import _cfg, _llama


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("distill_smollm2")


def test_score_checkpoint_scores_the_weights_of_the_newest_checkpoint(bench, tmp_path):
    teacher = _llama(tmp_path / "teacher", hidden=64, heads=4, kv=2, layers=2, seed=1, init_range=0.05)
    student = _llama(tmp_path / "student", hidden=32, heads=2, kv=1, layers=1, seed=2)
    run = tmp_path / "run"
    cfg = _cfg(tmp_path, student, teacher, train={"steps": 4, "ckpt_every": 2, "keep_last": 2})
    Trainer(cfg, run).run()
    texts = {}
    for i, name in enumerate(bench.HELDOUT):
        texts[name] = tmp_path / f"{name}.txt"
        texts[name].write_text(f"text number {i}: " + "the quick brown fox jumps over the lazy dog. " * 8)
    args = argparse.Namespace(score_context=16, max_windows=3, device=None)
    res = bench.score_checkpoint(run, args, texts)
    assert res["checkpoint"] == "step_000004" and res["step"] == 4
    trained, tok = load_model_and_tokenizer(str(run), dtype=torch.float32)  # the run's final model = step 4
    untrained, _ = load_model_and_tokenizer(str(student), dtype=torch.float32)
    with torch.no_grad():
        for name, path in texts.items():
            text = path.read_text()
            want = perplexity(trained.eval(), tok, text, context=16, stride=16, max_windows=3, progress=False)["ppl"]
            before = perplexity(untrained.eval(), tok, text, context=16, stride=16, max_windows=3,
                                progress=False)["ppl"]
            assert res["ppl"][name] == pytest.approx(want, rel=1e-6)
            assert abs(res["ppl"][name] - before) > 1e-3  # not the student it started from
    with pytest.raises(SystemExit, match=names(tmp_path / "student")):
        bench.score_checkpoint(tmp_path / "student", args, texts)


@pytest.mark.parametrize(("device", "expected"), [(None, "cpu"), ("cuda", "cuda")])
def test_recovery_runs_train_on_the_asked_device(bench, tmp_path, monkeypatch, device, expected):
    import headbudget.train

    seen = {}

    class Stop(Exception):
        pass

    def fake_train(cfg, out, resume):
        seen["cfg"] = cfg
        raise Stop

    monkeypatch.setattr(headbudget.train, "train", fake_train)
    args = argparse.Namespace(tokens=4096, batch_size=8, context=256, grad_accum=1, lr=1e-4, ckpt_every=10,
                              threads=1, precision="auto", temperature=2.0, alpha=1.0, device=device)
    with pytest.raises(Stop):
        bench.recover(tmp_path / "student", "teacher-dir", {"train": tmp_path / "train.txt"}, args, tmp_path / "run")
    t = seen["cfg"].train
    assert (t.device, t.steps, t.precision) == (expected, 2, "auto")
    assert seen["cfg"].distill.teacher == "teacher-dir"


def _fake_pipeline(bench, tmp_path, monkeypatch, pruned_ppl, dense_ppl=10.0):
    """main() with pruning, scoring and training replaced by stand-ins (perplexity: a number per model)."""
    text = tmp_path / "text"
    text.mkdir(exist_ok=True)
    (text / "movie_reviews.txt").write_text("a review. " * 100_000)
    for name in ("wikitext2_valid.tokens", "tinyshakespeare.txt"):
        (text / name).write_text("other text. " * 1000)
    monkeypatch.setattr(bench, "TEXT", text)
    monkeypatch.setattr(bench, "prune", lambda m, r, texts, args, work: work / f"pruned-{m}-{r:g}")
    ppl = {"dense": dense_ppl, "distilled": 20.0, "lm_trained": 25.0}

    def fake_ppl(model_path, texts, args, cache):
        kind = next((k for k in ppl if k in str(model_path)), None)
        return {t: ppl[kind] if kind else pruned_ppl for t in bench.HELDOUT}

    monkeypatch.setattr(bench, "perplexities", fake_ppl)
    monkeypatch.setattr(bench, "recover", lambda student, teacher, texts, args, out: {
        "tokens_per_s_median": 1.0, "projected_wall_h_1M_tokens": 1.0, "model": str(out / "model")})


def _main(bench, monkeypatch, tmp_path, *flags):
    out = tmp_path / "res.json"
    monkeypatch.setattr("sys.argv", ["distill_smollm2.py", "--tokens", "4096", "--model", "dense",
                                     "--work", str(tmp_path / "work"), "--out", str(out), *flags])
    bench.main()
    return json.loads(out.read_text())


def test_a_rerun_adds_its_cells_to_the_results_and_keeps_the_rest(bench, tmp_path, monkeypatch):
    _fake_pipeline(bench, tmp_path, monkeypatch, pruned_ppl=40.0)
    first = _main(bench, monkeypatch, tmp_path, "--methods", "fisher,cahp", "--keep-ratios", "0.5", "--skip-lm")
    assert set(first["rows"]) == {"fisher-0.5", "cahp-0.5"} and "lm_trained" not in first["rows"]["cahp-0.5"]
    # a later session runs only the missing cell: cahp-0.5's LM baseline
    res = _main(bench, monkeypatch, tmp_path, "--methods", "cahp", "--keep-ratios", "0.5", "--recoveries", "lm_trained")
    assert set(res["rows"]) == {"fisher-0.5", "cahp-0.5"}
    assert res["rows"]["fisher-0.5"] == first["rows"]["fisher-0.5"]
    row = res["rows"]["cahp-0.5"]
    assert row["ppl"]["distilled"] == first["rows"]["cahp-0.5"]["ppl"]["distilled"]
    assert row["gap_closed"]["distilled"]["wikitext2_valid"] == pytest.approx((40 - 20) / (40 - 10))
    assert row["gap_closed"]["lm_trained"]["wikitext2_valid"] == pytest.approx((40 - 25) / (40 - 10))
    assert row["distill_beats_lm"] == dict.fromkeys(bench.HELDOUT, True)
    assert len(res["commands"]) == 2 and "--recoveries lm_trained" in res["commands"][1]
    assert row["lm_trained"]["precision"] == "fp32"  # auto, resolved (conftest: fp32 on every CPU)
    with pytest.raises(SystemExit, match=names("lr=0.0001", "0.0002")):
        _main(bench, monkeypatch, tmp_path, "--methods", "cahp", "--keep-ratios", "0.5", "--lr", "2e-4")
    with pytest.raises(SystemExit, match=names("--recoveries", "'lm'")):
        _main(bench, monkeypatch, tmp_path, "--recoveries", "lm")


def test_a_rerun_refuses_to_add_to_a_row_of_another_pruned_model(bench, tmp_path, monkeypatch):
    _fake_pipeline(bench, tmp_path, monkeypatch, pruned_ppl=40.0)
    _main(bench, monkeypatch, tmp_path, "--methods", "cahp", "--keep-ratios", "0.5", "--skip-lm")
    _fake_pipeline(bench, tmp_path, monkeypatch, pruned_ppl=41.0)  # the pruning now chose other heads
    with pytest.raises(SystemExit, match=names("cahp-0.5", "wikitext2_valid", "41.00")):
        _main(bench, monkeypatch, tmp_path, "--methods", "cahp", "--keep-ratios", "0.5", "--recoveries", "lm_trained")
    _fake_pipeline(bench, tmp_path, monkeypatch, pruned_ppl=40.0, dense_ppl=10.5)  # another teacher
    with pytest.raises(SystemExit, match=names("dense", "wikitext2_valid", "10.50")):
        _main(bench, monkeypatch, tmp_path, "--methods", "cahp", "--keep-ratios", "0.5", "--recoveries", "lm_trained")
