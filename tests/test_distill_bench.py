"""benchmarks/distill_smollm2.py --score-checkpoint: the newest checkpoint of a recovery run is scored as the
model it holds (a run that cannot finish in a session still reports where it got to)."""

from __future__ import annotations

import argparse

import pytest
import torch

from conftest import load_benchmark
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
    with pytest.raises(SystemExit, match="no checkpoint to score"):
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
