"""Checkpoint failures that would otherwise pass unnoticed: a stale or missing ``latest`` pointer, a
folder without its trainer state, a crash between writing a checkpoint and moving ``latest``, and each
of 2 processes resuming its own RNG stream (dropout > 0), all bit-for-bit against an uninterrupted run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tests.test_train_ddp import _free_port

from headbudget.train import RunConfig, Trainer, train
from headbudget.train import checkpoint as ckpt
from headbudget.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


def _linear_checkpoints(d: Path, steps: tuple[int, ...], keep_last: int = 0) -> torch.nn.Linear:
    """Checkpoints of a 3->2 linear layer whose weights all equal the step number."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    for s in steps:
        with torch.no_grad():
            model.weight.fill_(s)
        save_checkpoint(d, s, model, opt, meta={"step_weight": s}, keep_last=keep_last)
    return model


def _loaded_weight(path: Path) -> float:
    fresh = torch.nn.Linear(3, 2)
    load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()))
    assert torch.equal(fresh.weight, torch.full_like(fresh.weight, fresh.weight[0, 0].item()))
    return fresh.weight[0, 0].item()


def test_missing_or_stale_latest_pointer_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    d = tmp_path / "ck"
    _linear_checkpoints(d, (1, 2, 3))
    assert (d / "latest").read_text() == "step_000003\n"
    assert latest_checkpoint(d).name == "step_000003"

    (d / "latest").unlink()  # missing pointer: the newest, not the oldest
    assert latest_checkpoint(d).name == "step_000003"
    assert _loaded_weight(latest_checkpoint(d)) == 3.0

    for stale in ("step_000009\n", "", "garbage", "../ck/step_000001\n"):  # names nothing usable
        (d / "latest").write_text(stale)
        assert latest_checkpoint(d).name == "step_000003", stale

    # a valid pointer wins even when it is not the newest (it is where the run says it is)
    (d / "latest").write_text("step_000002\n")
    assert latest_checkpoint(d).name == "step_000002"
    assert _loaded_weight(latest_checkpoint(d)) == 2.0


@pytest.mark.parametrize(("text", "problem"), [
    ("garbage\n", "holds 'garbage', not the name of a checkpoint"),
    ("step_000009\n", "names step_000009, which does not exist"),
    ("", "is empty"),
    (b"\xff\xfe\x00junk\nmore", r"holds '\xff\xfe\x00junk\nmore', not the name of a checkpoint"),
    ("../ck/step_000001\n", "holds '../ck/step_000001', not the name of a checkpoint"),
])
def test_a_corrupt_latest_pointer_is_said_in_one_line_naming_it_and_the_checkpoint_used(tmp_path, capsys, text,
                                                                                         problem):
    d = tmp_path / "ck"
    _linear_checkpoints(d, (1, 2, 3))
    assert latest_checkpoint(d).name == "step_000003" and capsys.readouterr().err == ""  # a good pointer: silent
    (d / "latest").write_bytes(text if isinstance(text, bytes) else text.encode())
    assert latest_checkpoint(d).name == "step_000003"
    assert latest_checkpoint(d).name == "step_000003"  # looked up again (a resume does): said once
    err = capsys.readouterr().err
    assert err.splitlines() == [f"headbudget: warning: {d / 'latest'} {problem}; using the newest complete "
                                f"checkpoint, {d / 'step_000003'}, instead"], err
    (d / "latest").unlink()  # no pointer (e.g. none written yet): the newest, silently
    assert latest_checkpoint(d).name == "step_000003" and capsys.readouterr().err == ""


@pytest.mark.parametrize("missing", [ckpt.STATE_FILE, ".metadata"])
def test_a_folder_missing_its_trainer_state_or_tensors_is_never_resumed_or_pruned(tmp_path, missing):
    d = tmp_path / "ck"
    _linear_checkpoints(d, (1, 2, 3))
    (d / "step_000003" / missing).unlink()  # e.g. copied by hand, half-deleted
    assert [p.name for p in list_checkpoints(d)] == ["step_000001", "step_000002"]
    # 'latest' names the damaged folder: the newest good one is used instead, never the oldest
    assert (d / "latest").read_text().strip() == "step_000003"
    assert latest_checkpoint(d).name == "step_000002"
    assert _loaded_weight(latest_checkpoint(d)) == 2.0
    (d / "latest").unlink()
    assert latest_checkpoint(d).name == "step_000002"
    # keep_last prunes complete checkpoints only; the damaged folder is left for the user to inspect
    model = torch.nn.Linear(3, 2)
    save_checkpoint(d, 4, model, torch.optim.AdamW(model.parameters()), keep_last=1)
    assert [p.name for p in list_checkpoints(d)] == ["step_000004"]
    assert (d / "step_000003").is_dir()


def test_crash_between_writing_a_checkpoint_and_moving_latest_keeps_the_one_latest_names(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    model = _linear_checkpoints(d, (1, 2), keep_last=1)
    assert [p.name for p in list_checkpoints(d)] == ["step_000002"]
    real = ckpt.atomic_write_text

    def dies_on_latest(path, text):
        if Path(path).name == ckpt.LATEST:
            raise OSError("killed before moving latest")
        return real(path, text)

    monkeypatch.setattr(ckpt, "atomic_write_text", dies_on_latest)
    with torch.no_grad():
        model.weight.fill_(3)
    with pytest.raises(OSError, match="killed before moving latest"):
        save_checkpoint(d, 3, model, torch.optim.AdamW(model.parameters()), keep_last=1)
    monkeypatch.undo()
    # step 3 is complete, but keep_last=1 pruned nothing yet: the checkpoint 'latest' names survives
    assert [p.name for p in list_checkpoints(d)] == ["step_000002", "step_000003"]
    assert (d / "latest").read_text().strip() == "step_000002"
    assert latest_checkpoint(d).name == "step_000002" and _loaded_weight(latest_checkpoint(d)) == 2.0
    # the resumed run writes step 3 again over the complete one; then 'latest' moves and step 2 goes
    with torch.no_grad():
        model.weight.fill_(33)
    save_checkpoint(d, 3, model, torch.optim.AdamW(model.parameters()), keep_last=1)
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_000003"]
    assert _loaded_weight(latest_checkpoint(d)) == 33.0


# ---------------------------------------------------------------------------- the trainer's resume
def _config(cache: str, **train_kw) -> RunConfig:
    t = {"steps": 6, "batch_size": 4, "grad_accum": 2, "context": 16, "eval_every": 6, "eval_batches": 1,
         "log_every": 1, "ckpt_every": 2, "keep_last": 3, "warmup_steps": 1, "lr": 3e-3, "progress": False,
         "threads": 1}
    t.update(train_kw)
    return RunConfig.from_dict({
        "model": {"preset": "cpu-tiny", "schedule": "prism", "n_layers": 2, "d_model": 32, "n_heads": 2,
                  "prism_max_head_dim": 16, "prism_min_head_dim": 8, "dropout": 0.2},
        "data": {"source": "synthetic:20000", "tokenizer": "byte", "cache_dir": cache},
        "train": t,
    })


class _Kill(Exception):
    pass


def _kill_at(n: int):
    def cb(trainer, step, record):
        if step == n:
            raise _Kill
    return cb


@pytest.fixture(scope="module")
def straight_and_killed(tmp_path_factory):
    """An uninterrupted 6-step run with dropout, and the same run killed after its step-4 checkpoint."""
    root = tmp_path_factory.mktemp("resume")
    cache = str(root / "cache")
    straight = Trainer(_config(cache), root / "straight", save_model=False)
    result = straight.run()
    with pytest.raises(_Kill):
        train(_config(cache), root / "killed", callbacks=[_kill_at(4)], save_model=False)
    assert [p.name for p in list_checkpoints(root / "killed" / "checkpoints")] == ["step_000002", "step_000004"]
    return {"cache": cache, "root": root, "state": straight.model.state_dict(),
            "train": [r["train_loss"] for r in result.history]}


def _resume(ref: dict, name: str, damage) -> Trainer:
    run = ref["root"] / name
    shutil.copytree(ref["root"] / "killed", run)
    damage(run / "checkpoints")
    trainer = Trainer(_config(ref["cache"]), run, resume=True, save_model=False)
    result = trainer.run()
    resumed = [r for r in result.history if r["step"] > trainer.start_step]  # what this process trained
    assert [r["step"] for r in result.history] == list(range(1, 7))  # the history is the whole run's
    trainer.resumed_steps = [r["step"] for r in resumed]
    trainer.resumed_train = [r["train_loss"] for r in resumed]
    return trainer


def _assert_bit_identical(trainer: Trainer, ref: dict) -> None:
    assert trainer.resumed_train == ref["train"][-len(trainer.resumed_train):]
    for k, v in ref["state"].items():
        assert torch.equal(v, trainer.model.state_dict()[k]), k


@pytest.mark.parametrize("damage", ["no_latest", "stale_latest", "newest_without_state"])
def test_trainer_resumes_from_the_newest_good_checkpoint(straight_and_killed, damage):
    def hurt(ck: Path) -> None:
        if damage == "no_latest":
            (ck / "latest").unlink()
        elif damage == "stale_latest":
            (ck / "latest").write_text("step_000008\n")
        else:  # a step-6 folder that never got its trainer state: step 4 is the newest good one
            shutil.copytree(ck / "step_000004", ck / "step_000006")
            (ck / "step_000006" / ckpt.STATE_FILE).unlink()
            (ck / "latest").write_text("step_000006\n")

    trainer = _resume(straight_and_killed, damage, hurt)
    assert trainer.resumed_steps == [5, 6]  # from step 4, not from the oldest (step 2)
    _assert_bit_identical(trainer, straight_and_killed)


def test_trainer_resumes_from_the_newest_past_a_garbage_latest_and_says_so(straight_and_killed, capsys):
    trainer = _resume(straight_and_killed, "garbage_latest", lambda ck: (ck / "latest").write_text("garbage\n"))
    assert trainer.resumed_steps == [5, 6]  # from step 4, the newest complete checkpoint
    _assert_bit_identical(trainer, straight_and_killed)
    ck = straight_and_killed["root"] / "garbage_latest" / "checkpoints"
    said = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert said == [f"headbudget: warning: {ck / 'latest'} holds 'garbage', not the name of a checkpoint; using "
                    f"the newest complete checkpoint, {ck / 'step_000004'}, instead"], said


def test_trainer_resumes_after_a_crash_before_latest_moved(straight_and_killed):
    # step 4 was written and renamed into place, 'latest' still names step 2: the run redoes 3-4,
    # rewrites the complete step-4 folder in place and still ends bit-identical (dropout on)
    trainer = _resume(straight_and_killed, "crash_before_latest",
                      lambda ck: (ck / "latest").write_text("step_000002\n"))
    assert trainer.resumed_steps == [3, 4, 5, 6]
    _assert_bit_identical(trainer, straight_and_killed)
    ck = straight_and_killed["root"] / "crash_before_latest" / "checkpoints"
    assert [p.name for p in list_checkpoints(ck)] == ["step_000002", "step_000004", "step_000006"]
    assert latest_checkpoint(ck).name == "step_000006"


# ---------------------------------------------------------------------------- 2 processes, own RNG
def _worker(rank: int, world: int, port: int, cache: str, jobs: list[dict]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    for job in jobs:
        trainer = Trainer(_config(cache, batch_size=8, steps=4), job["out"], resume=job.get("resume", False),
                          callbacks=[_kill_at(job["kill_at"])] if job.get("kill_at") else [], save_model=False)
        try:
            result = trainer.run()
        except _Kill:
            continue
        # each rank's own view: the DDP weights are shared, the dropout stream after training is not
        torch.save({"state": trainer.model.state_dict(),
                    "train": [r["train_loss"] for r in result.history if r["step"] > trainer.start_step],
                    "rng": torch.get_rng_state()}, Path(job["out"]) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _spawn(cache: str, jobs: list[dict]) -> None:
    mp.spawn(_worker, args=(2, _free_port(), cache, jobs), nprocs=2, join=True)


@pytest.mark.slow
def test_each_of_two_processes_resumes_its_own_dropout_stream(straight_and_killed, tmp_path):
    cache = straight_and_killed["cache"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # one start-up of 2 processes: the straight run, the killed one, then its resume (what a resume
    # reads comes from the checkpoint, not from the process that wrote it: the RNG is restored from it)
    _spawn(cache, [{"out": str(straight)}, {"out": str(killed), "kill_at": 2}, {"out": str(killed), "resume": True}])
    ck = list_checkpoints(killed / "checkpoints")
    assert [p.name for p in ck] == ["step_000002", "step_000004"]
    r0, r1 = (torch.load(ck[0] / f"rng_rank{r}.pt", weights_only=True)["torch"] for r in (0, 1))
    assert not torch.equal(r0, r1)  # the ranks draw different dropout masks
    for rank in (0, 1):
        ref = torch.load(straight / f"rank{rank}.pt", weights_only=True)
        res = torch.load(killed / f"rank{rank}.pt", weights_only=True)
        assert res["train"] == ref["train"][2:], rank
        assert torch.equal(res["rng"], ref["rng"]), rank
        for k, v in ref["state"].items():
            assert torch.equal(v, res["state"][k]), (rank, k)
