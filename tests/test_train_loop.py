"""The one training loop (headbudget.train.loop): accumulation, clipping, schedules, host reads only at log
steps, and the NaN guard of the trainer built on it (stops at the next log or checkpoint step, names the first
bad step, writes no checkpoint after it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import names
from headbudget.train import Trainer, TrainingDivergedError, train
from headbudget.train.checkpoint import list_checkpoints
from headbudget.train.loop import (
    TrainLoop,
    build_adamw,
    fused_adamw_available,
    param_groups,
    warmup_cosine,
    warmup_linear,
)
from test_train_trainer import tiny_config


def _linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _data(n: int, rows: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 4, generator=g) for _ in range(n)]


def test_accumulation_equals_one_big_batch_and_clipping_is_recorded():
    def loss_of(model):
        return lambda x: model(x).pow(2).mean()

    a, b = _linear(), _linear()
    data = _data(6)
    logged = []
    TrainLoop(a, torch.optim.SGD(a.parameters(), lr=0.1), loss_of(a), grad_accum=2, grad_clip=0.05).run(
        iter(data), steps=3, log_every=1, on_log=logged.append)
    big = [torch.cat(data[i:i + 2]) for i in range(0, 6, 2)]  # equal halves: mean of means = mean
    ref_norms = []
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    for x in big:
        loss_of(b)(x).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    assert torch.allclose(a.weight, b.weight, atol=1e-6) and torch.allclose(a.bias, b.bias, atol=1e-6)
    assert [r.step for r in logged] == [1, 2, 3] and [r.steps for r in logged] == [1, 1, 1]
    assert [r.grad_norm for r in logged] == pytest.approx(ref_norms, rel=1e-5)
    assert all(n > 0.05 for n in ref_norms)  # the clip was active: the comparison is not trivial


def test_schedules_are_the_reference_floats():
    from transformers import get_linear_schedule_with_warmup

    model = _linear()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    hf = get_linear_schedule_with_warmup(opt, 3, 11)
    ours = warmup_linear(3e-4, 3, 11)
    for step in range(13):  # identical floats, past the end too
        assert opt.param_groups[0]["lr"] == ours(step), step
        opt.step()
        hf.step()
    f = warmup_cosine(1.0, 10, 110, 0.1)
    assert (f(0), f(9), f(110), f(500)) == (0.1, 1.0, pytest.approx(0.1), pytest.approx(0.1))
    assert f(60) == pytest.approx(0.55)


def test_a_torch_lr_scheduler_is_stepped_after_each_step_bit_for_bit():
    a, b = _linear(), _linear()
    data = _data(5)
    opt_a = torch.optim.Adam(a.parameters(), lr=0.05)
    sched_a = torch.optim.lr_scheduler.CosineAnnealingLR(opt_a, T_max=5)
    lrs = []
    TrainLoop(a, opt_a, lambda x: a(x).pow(2).mean(), lr_schedule=sched_a).run(
        iter(data), steps=5, log_every=1, on_log=lambda r: lrs.append(r.lr))
    opt_b = torch.optim.Adam(b.parameters(), lr=0.05)
    sched_b = torch.optim.lr_scheduler.CosineAnnealingLR(opt_b, T_max=5)
    want = []
    for x in data:
        want.append(opt_b.param_groups[0]["lr"])
        b(x).pow(2).mean().backward()
        opt_b.step()
        opt_b.zero_grad()
        sched_b.step()
    assert torch.equal(a.weight, b.weight) and lrs == want


def test_param_groups_leave_out_frozen_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    model[2].weight.requires_grad_(False)
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([3, 3])]
    assert len(no_decay["params"]) == 4  # two biases, the norm's weight and bias
    opt = build_adamw(model, lr=1e-3, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_the_device_is_read_only_at_log_steps_and_the_end():
    model = _linear()
    loop = TrainLoop(model, torch.optim.SGD(model.parameters(), lr=0.01), lambda x: model(x).pow(2).mean())
    reads = []
    real = TrainLoop.check

    def counting(self):
        reads.append([p.step for p in self._pending])
        return real(self)

    loop.check = counting.__get__(loop)
    result = loop.run(iter(_data(12)), steps=12, log_every=5)
    assert reads == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12], []]
    assert result.steps == 12 and len(result.losses) == 12


def test_a_loop_ends_with_its_batches_and_refuses_a_partial_step():
    model = _linear()
    loop = TrainLoop(model, torch.optim.SGD(model.parameters(), lr=0.01), lambda x: model(x).sum(), grad_accum=2)
    assert loop.run(iter(_data(4)), steps=10).steps == 2
    with pytest.raises(ValueError, match=names("step 2", 1, 2)):  # 1 of 2 micro-batches
        loop.run(iter(_data(3)), steps=10)


def test_the_package_s_training_diverged_error_loads_the_loop_alone():
    import subprocess
    import sys

    code = ("import sys\nfrom headbudget.train import TrainingDivergedError\n"
            "print(TrainingDivergedError.__module__, sorted(m for m in ('headbudget.train.trainer', 'transformers') "
            "if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.split("\n")[0] == "headbudget.train.loop []", res.stderr


def test_nonfinite_raise_names_the_first_bad_step_and_ignore_runs_on():
    model = _linear()
    calls = {"n": 0}

    def loss_fn(x):
        calls["n"] += 1
        loss = model(x).pow(2).mean()
        return loss * float("inf") if calls["n"] in (3, 4) else loss

    loop = TrainLoop(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn,
                     divergence_hint=lambda: "; try less")
    with pytest.raises(TrainingDivergedError, match=names("inf", "step 3", "lr 0.01", "; try less")):
        loop.run(iter(_data(8)), steps=8, log_every=4)
    assert isinstance(TrainingDivergedError("x"), FloatingPointError)  # what classifier fine-tuning raised
    calls["n"] = 0
    model = _linear()
    result = TrainLoop(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn, nonfinite="ignore").run(
        iter(_data(5)), steps=5)
    assert result.steps == 5 and not math.isfinite(result.losses[2])


@pytest.mark.parametrize("log_every, ckpt_every, nan_from, stops_at, ckpts, logged", [
    (10, 4, 7, 8, ["step_000004"], []),  # the step-8 checkpoint would hold NaN weights: never written
    (3, 0, 4, 6, [], [3]),  # no checkpoints: the next log step stops it
    (5, 3, 4, 5, ["step_000003"], []),  # NaN at 4, log step 5 comes before the checkpoint at 6
])
def test_trainer_nan_stops_at_the_next_log_or_checkpoint_step(tmp_path, monkeypatch, log_every, ckpt_every, nan_from,
                                                              stops_at, ckpts, logged):
    cfg = tiny_config(tmp_path, steps=12, ckpt_every=ckpt_every, log_every=log_every, eval_every=0)
    real = Trainer.compute_loss
    calls = {"n": 0}
    seen = []

    def poisoned(model, x, y):
        calls["n"] += model.training  # training forwards only
        loss = real(model, x, y)
        return loss * float("nan") if calls["n"] > 2 * (nan_from - 1) else loss  # grad_accum=2

    monkeypatch.setattr(Trainer, "compute_loss", staticmethod(poisoned))
    run = tmp_path / "nan"
    where = ckpts[-1] if ckpts else "no checkpoint was written before it"
    with pytest.raises(TrainingDivergedError, match=names("nan", f"step {nan_from}", where)):
        train(cfg, run, callbacks=[lambda trainer, step, record: seen.append(step)])
    assert seen == list(range(1, stops_at))  # the step that read the NaN ran no callback
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ckpts
    path = run / "metrics.jsonl"
    metrics = [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []
    assert metrics == logged and not (run / "model").exists() and not (run / "summary.json").exists()


def test_trainer_logs_at_log_steps_only_and_reads_losses_once_per_log(tmp_path):
    cfg = tiny_config(tmp_path, steps=6, ckpt_every=0, log_every=4, eval_every=0)
    records = []
    result = Trainer(cfg, tmp_path / "r", save_model=False,
                     callbacks=[lambda trainer, step, record: records.append((step, record is not None))]).run()
    assert records == [(1, False), (2, False), (3, False), (4, True), (5, False), (6, True)]
    assert [r["step"] for r in result.history] == [4, 6] and result.final_train_loss == result.history[-1]["train_loss"]
    assert all(r["tokens_per_s"] > 0 for r in result.history)


def test_stop_requested_between_log_steps_reads_the_last_loss(tmp_path):
    cfg = tiny_config(tmp_path, steps=8, ckpt_every=0, log_every=4, eval_every=0)

    def stop_at_3(trainer, step, record):
        trainer.stop_requested = step == 3

    straight = Trainer(cfg.replace(train={"log_every": 1}), tmp_path / "s", save_model=False).run()
    result = Trainer(cfg, tmp_path / "r", save_model=False, callbacks=[stop_at_3]).run()
    assert result.steps == 3 and result.history == []
    assert result.final_train_loss == straight.history[2]["train_loss"]  # step 3's loss, read at the stop
    assert result.final_val_loss is not None and Path(tmp_path / "r" / "summary.json").is_file()


# ---------------------------------------------------------------------------- the optimizer build_adamw picks
def _adamw_run(fused, steps=12):
    model = _linear()
    opt = build_adamw(model, lr=3e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=fused)
    TrainLoop(model, opt, lambda x: model(x).pow(2).mean(), grad_clip=0.5).run(iter(_data(steps)), steps=steps)
    return model, opt


def test_build_adamw_takes_the_fused_kernel_on_cpu_with_the_same_update_rule():
    fused, opt_f = _adamw_run(None)
    loop, opt_l = _adamw_run(False)
    assert all(g["fused"] is True for g in opt_f.param_groups)  # torch >= 2.4 has it on CPU
    assert all(not g["fused"] for g in opt_l.param_groups)
    assert [g["weight_decay"] for g in opt_f.param_groups] == [0.1, 0.0]
    assert [g["betas"] for g in opt_f.param_groups] == [(0.9, 0.95)] * 2
    start = _linear()
    assert (fused.weight - start.weight).abs().min() > 1e-3  # the weights moved: the comparison is not trivial
    torch.testing.assert_close(fused.weight, loop.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.bias, loop.bias, rtol=1e-5, atol=1e-6)


def test_build_adamw_falls_back_where_torch_has_no_fused_kernel():
    meta = torch.nn.Linear(4, 3, device="meta")  # no fused kernel for the meta device
    assert fused_adamw_available(meta.parameters()) is False
    assert all(not g["fused"] for g in build_adamw(meta, lr=1e-3, weight_decay=0.1).param_groups)
    with pytest.raises(ValueError, match="no fused kernel"):
        build_adamw(meta, lr=1e-3, weight_decay=0.1, fused=True)
    assert fused_adamw_available(_linear().parameters()) is True


def _train(model, opt, data, steps, start_step=0):
    TrainLoop(model, opt, lambda x: model(x).pow(2).mean(), grad_clip=0.5).run(
        iter(data), steps=steps, start_step=start_step)


@pytest.mark.parametrize("saved_fused", [False, None])  # a checkpoint of the for-loop AdamW (older runs), of the fused
def test_a_resumed_optimizer_keeps_the_kind_of_its_checkpoint_and_resumes_bit_for_bit(saved_fused):
    data = _data(8)
    whole = _linear()
    _train(whole, build_adamw(whole, lr=3e-2, weight_decay=0.1, fused=saved_fused), data, 8)
    first = _linear()
    opt = build_adamw(first, lr=3e-2, weight_decay=0.1, fused=saved_fused)
    _train(first, opt, data[:4], 4)
    resumed = _linear(seed=5)
    resumed.load_state_dict(first.state_dict())
    opt2 = build_adamw(resumed, lr=3e-2, weight_decay=0.1)  # today's default: fused
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["fused"] == opt.param_groups[0]["fused"]
    _train(resumed, opt2, data[4:], 8, start_step=4)
    assert torch.equal(resumed.weight, whole.weight) and torch.equal(resumed.bias, whole.bias)
