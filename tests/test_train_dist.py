"""FSDP2 and DDP with 2 CPU processes (gloo): FSDP2 matches one process, ``kill -9`` during a checkpoint
write + ``--resume`` is bit-identical to an uninterrupted run, and a 2-process checkpoint resumes on 1.

Every run is the same tiny 5-step job; the spawned workers run a list of jobs so each test pays for
process start-up twice (straight + killed run, then the resume), not once per run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from headbudget.train import RunConfig, Trainer, build_model
from headbudget.train.checkpoint import latest_checkpoint, list_checkpoints, read_trainer_state

pytestmark = pytest.mark.slow  # ~15-25 s per test on 2 busy cores (process start-up dominates)


def _config(cache: str, fsdp: bool) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"preset": "cpu-tiny", "schedule": "prism", "n_layers": 3, "d_model": 64, "n_heads": 2,
                  "prism_max_head_dim": 32, "prism_min_head_dim": 8},
        "data": {"source": "synthetic:20000", "tokenizer": "byte", "cache_dir": cache},
        "train": {"steps": 5, "batch_size": 8, "grad_accum": 2, "context": 32, "eval_every": 5,
                  "eval_batches": 2, "log_every": 1, "ckpt_every": 3, "keep_last": 2, "warmup_steps": 1,
                  "lr": 3e-3, "progress": False, "threads": 1, "fsdp": fsdp},
    })


def _run_job(cache: str, job: dict) -> None:
    trainer = Trainer(_config(cache, job["fsdp"]), job["out"], resume=job.get("resume", False))
    result = trainer.run()
    if int(os.environ["RANK"]) == 0:  # trainer.model: the gathered plain model (FSDP2) or the DDP module's
        torch.save({"state": trainer.model.state_dict(), "val": result.final_val_loss,
                    "train": [r["train_loss"] for r in result.history if r["step"] > trainer.start_step]},
                   Path(job["out"]) / "result.pt")


def _worker(rank: int, world: int, port: int, cache: str, jobs: list[dict]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from headbudget.train import checkpoint

    for job in jobs:
        if job.get("kill_during_save") is not None:
            # rank 0 dies by SIGKILL inside save_checkpoint number N, after DCP wrote that step's shards
            # and before the checkpoint is complete (its rename and the 'latest' pointer)
            real, calls = checkpoint.rng_state, [0]

            def dying_rng_state(n=job["kill_during_save"], calls=calls, real=real):
                calls[0] += 1
                if calls[0] == n and rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real()

            checkpoint.rng_state = dying_rng_state
        _run_job(cache, job)
    dist.destroy_process_group()


def _spawn(cache: str, jobs: list[dict]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, cache, jobs), nprocs=2, join=True)


def _load(run: Path) -> dict:
    return torch.load(run / "result.pt", weights_only=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process, same config: the reference (also prepares the data cache the workers reuse)."""
    root = tmp_path_factory.mktemp("single")
    cache = str(root / "cache")
    trainer = Trainer(_config(cache, fsdp=False), root / "run")
    result = trainer.run()
    return {"cache": cache, "state": trainer.model.state_dict(), "val": result.final_val_loss,
            "train": [r["train_loss"] for r in result.history]}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((v - b[k]).abs().max().item() for k, v in a.items())


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_kill_9_and_resume_is_bit_identical_and_resumes_on_one_process(tmp_path, single, mode):
    fsdp = mode == "fsdp"
    cache = single["cache"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        _spawn(cache, [{"out": str(straight), "fsdp": fsdp},
                       {"out": str(killed), "fsdp": fsdp, "kill_during_save": 2}])  # saves at 3, 5

    # the uninterrupted 2-process run equals one process on the same global batches
    ref = _load(straight)
    assert len(ref["train"]) == 5
    assert max(abs(a - b) for a, b in zip(ref["train"], single["train"])) < 1e-5
    assert abs(ref["val"] - single["val"]) < 1e-5
    assert _max_diff(ref["state"], single["state"]) < 1e-5
    with torch.random.fork_rng():  # the weights moved: the comparison is not trivially true
        torch.manual_seed(0)  # the trainer's init seed
        start = build_model(_config(cache, fsdp), ref["state"]["transformer.wte.weight"].shape[0]).state_dict()
    assert _max_diff(ref["state"], start) > 1e-3
    # the checkpoint is sharded per process: one RNG file per rank, written by a world of 2
    ck = list_checkpoints(straight / "checkpoints")[-1]
    assert ck.name == "step_000005" and read_trainer_state(ck)["world_size"] == 2
    assert sorted(p.name for p in ck.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]

    # killed while writing the final step 5: that checkpoint is a hidden temp dir, 'latest' still says 3
    ckpts = killed / "checkpoints"
    assert (ckpts / ".step_000005.tmp").is_dir()
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_000003"]
    assert latest_checkpoint(ckpts).name == "step_000003"
    assert not (killed / "model").exists()
    one = tmp_path / "one"
    shutil.copytree(killed, one)

    # resume on 2 processes: bit-identical to the uninterrupted run
    _spawn(cache, [{"out": str(killed), "fsdp": fsdp, "resume": True}])
    res = _load(killed)
    assert res["train"] == ref["train"][3:] and res["val"] == ref["val"]
    for k, v in ref["state"].items():
        assert torch.equal(v, res["state"][k]), k
    assert [p.name for p in list_checkpoints(ckpts)] == ["step_000003", "step_000005"]
    assert not (ckpts / ".step_000005.tmp").exists()

    # the same 2-process checkpoint resumes on 1 process (DCP reshards), matching to float tolerance
    trainer = Trainer(_config(cache, fsdp), one, resume=True)
    result = trainer.run()
    assert trainer.start_step == 3 and [r["step"] for r in result.history] == [1, 2, 3, 4, 5]
    assert max(abs(a["train_loss"] - b) for a, b in zip(result.history[3:], ref["train"][3:])) < 1e-5
    assert _max_diff(trainer.model.state_dict(), ref["state"]) < 1e-5
    assert read_trainer_state(latest_checkpoint(one / "checkpoints"))["world_size"] == 1


# ---------------------------------------------------------------------------- compare under torchrun
def _compare_settings(cache: str):
    """uniform and prism at 2 seeds, no models saved: the comparison both the 2-process and the 1-process run make."""
    from headbudget.train.config import CompareConfig

    return CompareConfig.from_run(_config(cache, fsdp=False).replace(train={"ckpt_every": 0}),
                                  schedules="uniform,prism", seeds=2, save_models=False)


def _compare_worker(rank: int, world: int, port: int, cache: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import json

    import torch.distributed as dist

    from headbudget.train.compare import run_compare

    called = []
    run_compare(_compare_settings(cache), out, plot=False,
                on_run=lambda sched, seed, result: called.append([sched, seed]))
    Path(out, f"on_run_rank{rank}.json").write_text(json.dumps(called))
    dist.destroy_process_group()


def test_compare_under_torchrun_trains_each_run_on_both_processes_and_writes_once(tmp_path):
    """2 processes (DDP): the same runs as one process to float tolerance, one prepared dataset (the first
    process prepares it, the other waits), compare.json written once and on_run called on rank 0 only."""
    import json

    from headbudget.train.compare import run_compare

    cache = str(tmp_path / "cache")  # a fresh cache: both processes start with nothing prepared
    out = tmp_path / "cmp2"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_compare_worker, args=(2, port, cache, str(out)), nprocs=2, join=True)
    one = run_compare(_compare_settings(cache), tmp_path / "cmp1", plot=False)
    two = json.loads((out / "compare.json").read_text())
    assert [(r["schedule"], r["seed"]) for r in two["runs"]] == [(r["schedule"], r["seed"]) for r in one["runs"]]
    for a, b in zip(one["runs"], two["runs"]):
        assert abs(a["final_val_loss"] - b["final_val_loss"]) < 1e-5, (a["schedule"], a["seed"])
    assert json.loads((out / "on_run_rank0.json").read_text()) == [["uniform", 0], ["prism", 0], ["uniform", 1],
                                                                   ["prism", 1]]
    assert json.loads((out / "on_run_rank1.json").read_text()) == []
    assert len(list(Path(cache).iterdir())) == 1  # one prepared dataset
