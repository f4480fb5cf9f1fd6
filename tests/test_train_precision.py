"""bf16 autocast and ``torch.compile`` train on CPU, and their losses stay close to fp32 eager."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from headbudget.train import Trainer
from test_train_trainer import tiny_config  # tests/ is on sys.path under pytest


def _run(tmp_path, name: str, **train_kw):
    cfg = tiny_config(tmp_path, steps=3, ckpt_every=0, eval_every=3, **train_kw).replace(model={"dropout": 0.0})
    result = Trainer(cfg, tmp_path / name, save_model=False).run()
    return [r["train_loss"] for r in result.history], result.final_val_loss


def test_bf16_autocast_trains_close_to_fp32(tmp_path, monkeypatch):
    fp32_train, fp32_val = _run(tmp_path, "fp32", precision="fp32")
    seen: list[tuple[bool, torch.dtype]] = []
    real = Trainer.compute_loss

    def recording(model, x, y):  # what the forward actually runs under
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real(model, x, y)

    monkeypatch.setattr(Trainer, "compute_loss", staticmethod(recording))
    bf16_train, bf16_val = _run(tmp_path, "bf16", precision="bf16")
    assert seen and all(s == (True, torch.bfloat16) for s in seen)
    # bf16 rounding moves the losses a little (measured ~2e-4), never like a different model
    assert all(abs(a - b) < 2e-2 for a, b in zip(bf16_train, fp32_train)), (bf16_train, fp32_train)
    assert abs(bf16_val - fp32_val) < 2e-2
    assert bf16_train != fp32_train  # autocast really changed the arithmetic
    assert bf16_train[-1] < bf16_train[0]  # and it learns


def _has_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++"))


@pytest.mark.slow  # ~40 s: inductor compiles forward + backward C++ kernels
@pytest.mark.skipif(not _has_cxx(), reason="torch.compile on CPU needs a C++ compiler (apt-get install g++)")
def test_torch_compile_trains_like_eager(tmp_path):
    eager_train, eager_val = _run(tmp_path, "eager")
    compiled_train, compiled_val = _run(tmp_path, "compiled", compile=True)
    assert all(abs(a - b) < 1e-4 for a, b in zip(compiled_train, eager_train)), (compiled_train, eager_train)
    assert abs(compiled_val - eager_val) < 1e-4
    assert eager_train[-1] < eager_train[0]
