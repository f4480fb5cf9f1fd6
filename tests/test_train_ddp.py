"""2-process DDP on CPU (gloo): ranks stay in sync and match one process with the same global batch."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp

from headbudget.train import RunConfig, Trainer, build_model


def _config(cache: str, **train_kw) -> RunConfig:
    t = {"steps": 4, "batch_size": 8, "grad_accum": 2, "context": 32, "eval_every": 4, "eval_batches": 2,
         "log_every": 1, "ckpt_every": 0, "warmup_steps": 1, "lr": 3e-3, "progress": False, "threads": 1}
    t.update(train_kw)
    return RunConfig.from_dict({
        "model": {"preset": "cpu-tiny", "schedule": "prism", "n_layers": 3, "d_model": 64, "n_heads": 2,
                  "prism_max_head_dim": 32, "prism_min_head_dim": 8},
        "data": {"source": "synthetic:20000", "tokenizer": "byte", "cache_dir": cache},
        "train": t,
    })


def _worker(rank: int, world: int, port: int, out: str, cache: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    trainer = Trainer(_config(cache), out, save_model=False)
    result = trainer.run()
    torch.save({"state": trainer.model.state_dict(), "val": result.final_val_loss,
                "train": [r["train_loss"] for r in result.history]}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_matches_single_process(tmp_path):
    cache = str(tmp_path / "cache")
    single = Trainer(_config(cache), tmp_path / "single", save_model=False)
    res = single.run()  # also prepares the data cache the workers reuse
    out = tmp_path / "ddp"
    mp.spawn(_worker, args=(2, _free_port(), str(out), cache), nprocs=2, join=True)
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    # the ranks are bit-identical (DDP all-reduces gradients; every rank steps the same optimizer)
    for k, v in r0["state"].items():
        assert torch.equal(v, r1["state"][k]), k
    assert r0["val"] == r1["val"] and r0["train"] == r1["train"]
    # and equal, up to float summation order, to one process on the same global batch
    ref = single.model.state_dict()
    worst = max((v - ref[k]).abs().max().item() for k, v in r0["state"].items())
    assert worst < 1e-5, worst
    assert abs(r0["val"] - res.final_val_loss) < 1e-5
    assert all(abs(a - r["train_loss"]) < 1e-5 for a, r in zip(r0["train"], res.history))
    # the weights moved: the comparison is not trivially true
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the trainer's init seed
        init = build_model(_config(cache), ref["transformer.wte.weight"].shape[0]).state_dict()
    assert max((v - init[k]).abs().max().item() for k, v in ref.items()) > 1e-3
