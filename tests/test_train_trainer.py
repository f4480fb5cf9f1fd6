"""The trainer: exact resume, atomic keep-last-K checkpoints, NaN guard, HF-format output.

Resume finds the newest complete checkpoint when the ``latest`` pointer is missing, stale or corrupt (said in one
warning line), when a folder lacks its trainer state or tensors, and after a crash between writing a checkpoint and
moving ``latest``; each of 2 processes resumes its own RNG stream (dropout > 0); all bit for bit against an
uninterrupted run.  The metrics logger uses only the trainer's public methods."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tests.test_train_ddp import _free_port

from conftest import assert_names, error_line, names
from headbudget.train import RunConfig, Trainer, TrainingDivergedError, build_model, train
from headbudget.train import checkpoint as ckpt
from headbudget.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


def tiny_config(tmp_path: Path, **train_kw) -> RunConfig:
    t = {"steps": 20, "batch_size": 4, "grad_accum": 2, "context": 32, "eval_every": 5, "eval_batches": 2,
         "log_every": 1, "ckpt_every": 5, "keep_last": 2, "warmup_steps": 3, "lr": 3e-3, "progress": False,
         "threads": 1}
    t.update(train_kw)
    return RunConfig.from_dict({
        "name": "tiny",
        "model": {"preset": "cpu-tiny", "schedule": "prism", "n_layers": 3, "d_model": 64, "n_heads": 2,
                  "prism_max_head_dim": 32, "prism_min_head_dim": 8, "dropout": 0.1},
        "data": {"source": "synthetic:20000", "tokenizer": "byte", "cache_dir": str(tmp_path / "cache")},
        "train": t,
    })


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


class Kill(Exception):
    pass


def test_resume_after_kill_is_exact(tmp_path):
    cfg = tiny_config(tmp_path)
    straight_trainer = Trainer(cfg, tmp_path / "straight", save_model=False)
    straight = straight_trainer.run()

    def kill_at_10(trainer, step, record):
        if step == 10:
            raise Kill

    run = tmp_path / "killed"
    with pytest.raises(Kill):
        train(cfg, run, callbacks=[kill_at_10], save_model=False)
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000005", "step_000010"]
    # resume in a fresh process through the CLI, as a user would after a crash
    (tmp_path / "cfg.yaml").write_text(cfg.to_yaml())
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "headbudget.cli.main", "train", str(tmp_path / "cfg.yaml"),
                           "--out", str(run), "--resume"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resuming from" in proc.stdout and "step 10" in proc.stdout
    a, b = _metrics(tmp_path / "straight"), _metrics(run)
    assert [r["step"] for r in b] == list(range(1, 21))
    for ra, rb in zip(a, b):
        assert (ra["train_loss"], ra["val_loss"], ra["lr"], ra["grad_norm"]) == \
               (rb["train_loss"], rb["val_loss"], rb["lr"], rb["grad_norm"]), ra["step"]
    w_straight = straight.history[-1]["val_loss"]
    assert w_straight == b[-1]["val_loss"]
    from headbudget.models import HeadBudgetForCausalLM

    resumed = HeadBudgetForCausalLM.from_pretrained(str(run / "model"))
    sd_resumed = resumed.state_dict()
    for k, v in straight_trainer.model.state_dict().items():
        assert torch.equal(v, sd_resumed[k]), k


def test_a_run_killed_between_checkpoints_logs_each_step_once_and_returns_its_whole_history(tmp_path):
    """Killed at step 12 (last checkpoint: 10), steps 11-12 were logged and are trained again on resume: the
    metrics keep one record per step, equal to an uninterrupted run's, and the resumed run's result carries the
    whole run's history (steps 1-20), as ``finished_result`` reads it back later, not only steps 11-20."""
    from headbudget.train.records import finished_result

    cfg = tiny_config(tmp_path)
    straight = Trainer(cfg, tmp_path / "straight", save_model=False).run()

    def kill_at_12(trainer, step, record):
        if step == 12:
            raise Kill

    run = tmp_path / "killed"
    with pytest.raises(Kill):
        train(cfg, run, callbacks=[kill_at_12], save_model=False)
    assert [r["step"] for r in _metrics(run)] == list(range(1, 13))
    resumed = Trainer(cfg, run, save_model=False, resume=True).run()
    keys = ("step", "train_loss", "val_loss", "lr", "grad_norm")
    assert [[r[k] for k in keys] for r in _metrics(run)] == [[r[k] for k in keys] for r in straight.history]
    assert [r["step"] for r in resumed.history] == list(range(1, 21))
    assert [[r[k] for k in keys] for r in resumed.history] == [[r[k] for k in keys] for r in straight.history]
    assert resumed.history == finished_result(run, cfg).history

def test_checkpoints_are_atomic_and_keep_last_k(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    for s in (1, 2, 3, 4):
        with torch.no_grad():
            model.weight.fill_(s)
        save_checkpoint(d, s, model, opt, meta={"note": "x"}, keep_last=3)
    assert [p.name for p in list_checkpoints(d)] == ["step_000002", "step_000003", "step_000004"]

    def crash(*a, **k):  # dies after DCP wrote the tensors, before the checkpoint is complete
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "rng_state", crash)
    with torch.no_grad():
        model.weight.fill_(5)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(d, 5, model, opt, keep_last=3)
    monkeypatch.undo()
    # the failed step 5 left nothing (its hidden temp dir is removed); older ones untouched
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_000002", "step_000003", "step_000004"]
    # what a kill -9 mid-write leaves is only a hidden temp dir: not listed, not latest
    (d / ".step_000005.tmp").mkdir()
    (d / ".step_000005.tmp" / "__0_0.distcp").write_bytes(b"half")
    assert [p.name for p in list_checkpoints(d)] == ["step_000002", "step_000003", "step_000004"]
    assert ckpt.latest_checkpoint(d).name == "step_000004" and (d / "latest").read_text().strip() == "step_000004"
    fresh = torch.nn.Linear(3, 2)
    meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(d), fresh, torch.optim.AdamW(fresh.parameters()))
    assert meta["step"] == 4 and meta["note"] == "x" and meta["world_size"] == 1
    assert torch.equal(fresh.weight, torch.full((2, 3), 4.0))
    # the next save replaces the leftover temp dir
    save_checkpoint(d, 5, model, opt, keep_last=3)
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_000003", "step_000004", "step_000005"]


def test_nan_loss_stops_with_message_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, steps=12, ckpt_every=4, log_every=4, eval_every=4)
    real = Trainer.compute_loss
    calls = {"n": 0}

    def poisoned(model, x, y):
        calls["n"] += model.training  # count training forwards only (eval also computes losses)
        loss = real(model, x, y)
        return loss * float("nan") if calls["n"] > 2 * 6 else loss  # grad_accum=2: NaN from step 7

    monkeypatch.setattr(Trainer, "compute_loss", staticmethod(poisoned))
    run = tmp_path / "nan"
    with pytest.raises(TrainingDivergedError, match=names("nan", "step 7", "step_000004")):
        train(cfg, run)
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_000004"]
    model = build_model(cfg, 320)
    assert ckpt.load_checkpoint(run / "checkpoints" / "step_000004", model)["step"] == 4
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert not (run / "model").exists()


def test_final_model_loads_with_automodel_and_reproduces_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    import headbudget  # noqa: F401  (registers the model type)

    cfg = tiny_config(tmp_path, steps=3, ckpt_every=0, eval_every=3)
    trainer = Trainer(cfg, tmp_path / "run")
    result = trainer.run()
    loaded = AutoModelForCausalLM.from_pretrained(str(result.model_dir)).eval()
    trainer.model.eval()
    x = torch.randint(0, 257, (2, 16))
    assert torch.equal(loaded(x).logits, trainer.model(x).logits)
    assert loaded.config.head_schedule.heads == (2, 4, 8)
    assert (result.model_dir / "tokenizer_spec.json").is_file() and (result.model_dir / "tokenizer.json").is_file()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_val_loss"] == result.final_val_loss and summary["params"] == result.params
    rec = _metrics(tmp_path / "run")[-1]
    assert set(rec) == {"step", "tokens", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s"}
    assert rec["tokens"] == 3 * 4 * 32


def test_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match=names("train.batch_size=5", "train.grad_accum")):
        Trainer(tiny_config(tmp_path, batch_size=5), tmp_path / "x")
    cfg = tiny_config(tmp_path).replace(model={"schedule": "uniform@48"})
    with pytest.raises(ValueError, match=names("head_dim=48")):
        Trainer(cfg, tmp_path / "x")


def test_resume_refuses_a_different_model_or_data_order(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, ckpt_every=2, eval_every=2)
    train(cfg, tmp_path / "r", save_model=False)
    other = cfg.replace(model={"schedule": "uniform"})
    with pytest.raises(ValueError, match=names("step_000002", "model.schedule='prism'")):
        train(other, tmp_path / "r", resume=True)
    longer = cfg.replace(train={"steps": 3})  # extending a run is allowed
    assert train(longer, tmp_path / "r", resume=True, save_model=False).steps == 3
    assert [r["step"] for r in _metrics(tmp_path / "r")] == [1, 2, 3]


def test_param_groups_decay_matrices_only():
    from headbudget.train.loop import param_groups
    from headbudget.train.setup import build_model

    cfg = tiny_config(Path("."))
    model = build_model(cfg, 320)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in decay["params"]} >= {"transformer.wte.weight", "transformer.h.0.attn.qkv_proj.weight"}
    assert all(names[id(p)].endswith(("bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")) for p in no_decay["params"])
    n_total = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == n_total  # tied weights once
    by_name = param_groups(model, 0.1, {"transformer.wte.weight"})  # FSDP path: names decide
    assert [names[id(p)] for p in by_name[0]["params"]] == ["transformer.wte.weight"]


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    from headbudget.cli.main import main

    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_resume_with_nothing_to_resume_starts_with_a_notice(tmp_path, capsys):
    cfg = tiny_config(tmp_path, steps=2, ckpt_every=0, eval_every=2)
    (tmp_path / "cfg.yaml").write_text(cfg.to_yaml())
    rc, out, err = _cli(["train", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "new"), "--resume"], capsys)
    assert rc == 0
    assert f"--resume: no checkpoint in {tmp_path / 'new' / 'checkpoints'}; starting from step 0" in err
    assert [r["step"] for r in _metrics(tmp_path / "new")] == [1, 2]


@pytest.mark.parametrize("ckpt_every", [2, 0])
def test_resume_on_a_finished_run_leaves_it_intact(tmp_path, capsys, ckpt_every):
    cfg = tiny_config(tmp_path, steps=2, ckpt_every=ckpt_every, eval_every=2)
    (tmp_path / "cfg.yaml").write_text(cfg.to_yaml())
    run = tmp_path / "run"
    assert _cli(["train", str(tmp_path / "cfg.yaml"), "--out", str(run)], capsys)[0] == 0

    def snapshot() -> dict[str, tuple[bytes, int]]:
        return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}

    before = snapshot()
    assert json.loads((run / "summary.json").read_text())["final_val_loss"] is not None
    rc, out, err = _cli(["train", str(tmp_path / "cfg.yaml"), "--out", str(run), "--resume"], capsys)
    assert rc == 0 and "already finished 2 steps" in err and "nothing changed" in err and out == ""
    assert snapshot() == before  # not one byte nor one mtime changed
    # resuming it as a different model is still refused
    (tmp_path / "other.yaml").write_text(cfg.replace(model={"schedule": "uniform"}).to_yaml())
    rc, _, err = _cli(["train", str(tmp_path / "other.yaml"), "--out", str(run), "--resume"], capsys)
    assert rc == 2
    assert_names(error_line(err, "train"), "model.schedule='prism'")
    assert snapshot() == before


class _Payload:
    """Pickles to a call of os.system: what a malicious checkpoint would hide."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoints_never_unpickle_code(tmp_path):
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path / "ck", 1, model, torch.optim.AdamW(model.parameters()))
    marker = tmp_path / "pwned"
    meta_file = path / ".metadata"
    genuine = meta_file.read_bytes()
    # 1. code in DCP's .metadata pickle: refused by the restricted unpickler
    meta_file.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ckpt.CheckpointError, match=names(path / ".metadata", "posix.system")):
        ckpt.load_checkpoint(path, torch.nn.Linear(3, 2))
    # 2. a well-formed .metadata declaring a non-tensor entry (DCP would torch.load it with weights_only=False)
    md = ckpt._MetadataUnpickler(__import__("io").BytesIO(genuine)).load()
    md.state_dict_metadata["model.weight"] = BytesStorageMetadata()
    meta_file.write_bytes(pickle.dumps(md))
    with pytest.raises(ckpt.CheckpointError, match=names("'model.weight'", "tensor")):
        ckpt.load_checkpoint(path, torch.nn.Linear(3, 2))
    # 3. code in a per-rank RNG file: torch.load(weights_only=True) refuses it
    meta_file.write_bytes(genuine)
    torch.save({"torch": _Payload(marker)}, path / "rng_rank0.pt")
    with pytest.raises(ckpt.CheckpointError, match=names(path / "rng_rank0.pt", "RNG", "GLOBAL")):
        ckpt.load_checkpoint(path, torch.nn.Linear(3, 2))
    assert not marker.exists()


def test_old_pickled_checkpoints_are_refused_by_name(tmp_path, capsys):
    cfg = tiny_config(tmp_path, steps=2, ckpt_every=0, eval_every=2)
    (tmp_path / "cfg.yaml").write_text(cfg.to_yaml())
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    (tmp_path / "old" / "checkpoints" / "step_000002.pt").write_bytes(b"pickled")
    rc, _, err = _cli(["train", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "old"), "--resume"], capsys)
    assert rc == 2
    assert_names(error_line(err, "train"), "step_*.pt", "0.2")


def test_stop_at_step_keeps_the_lr_schedule_and_a_resume_from_its_checkpoint_trains_nothing_more(tmp_path):
    """``stop_at_step`` (compare's runs as long as a flat reference): the run ends after 8 of 20 steps with the
    learning rates of a 20-step run; killed after its step-8 checkpoint but before it was exported, a resume
    trains no step 9 and returns the same result."""
    from headbudget.train.setup import lr_at

    cfg = tiny_config(tmp_path, ckpt_every=4)
    straight = Trainer(cfg, tmp_path / "straight", save_model=False, stop_at_step=8).run()
    assert straight.steps == 8 and [r["step"] for r in straight.history][-1] == 8
    assert straight.history[-1]["val_loss"] == straight.final_val_loss  # step 8 is an eval step
    assert straight.history[-1]["lr"] == lr_at(7, cfg)

    def kill_at_8(trainer, step, record):
        if step == 8:
            raise Kill

    run = tmp_path / "killed"
    with pytest.raises(Kill):
        Trainer(cfg, run, save_model=False, stop_at_step=8, callbacks=[kill_at_8]).run()
    assert (run / "checkpoints" / "step_000008").is_dir() and not (run / "summary.json").exists()
    with pytest.raises(ValueError, match=names("step 8", "4")):
        Trainer(cfg, run, save_model=False, stop_at_step=4, resume=True).run()
    resumed = Trainer(cfg, run, save_model=False, stop_at_step=8, resume=True).run()
    assert (resumed.steps, resumed.final_val_loss) == (8, straight.final_val_loss)
    assert [r["step"] for r in _metrics(run)] == list(range(1, 9))
    with pytest.raises(ValueError, match=names("stop_at_step=21", "train.steps", "20")):
        Trainer(cfg, tmp_path / "x", stop_at_step=21)


# ---------------------------------------------------------------------------- checkpoint folders
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
def _dropout_config(cache: str, **train_kw) -> RunConfig:
    """6 steps of a 2-layer model with dropout 0.2, a checkpoint every 2 steps."""
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


def _kill_at(n: int):
    def cb(trainer, step, record):
        if step == n:
            raise Kill
    return cb


@pytest.fixture(scope="module")
def straight_and_killed(tmp_path_factory):
    """An uninterrupted 6-step run with dropout, and the same run killed after its step-4 checkpoint."""
    root = tmp_path_factory.mktemp("resume")
    cache = str(root / "cache")
    straight = Trainer(_dropout_config(cache), root / "straight", save_model=False)
    result = straight.run()
    with pytest.raises(Kill):
        train(_dropout_config(cache), root / "killed", callbacks=[_kill_at(4)], save_model=False)
    assert [p.name for p in list_checkpoints(root / "killed" / "checkpoints")] == ["step_000002", "step_000004"]
    return {"cache": cache, "root": root, "state": straight.model.state_dict(),
            "train": [r["train_loss"] for r in result.history]}


def _resume(ref: dict, name: str, damage) -> Trainer:
    run = ref["root"] / name
    shutil.copytree(ref["root"] / "killed", run)
    damage(run / "checkpoints")
    trainer = Trainer(_dropout_config(ref["cache"]), run, resume=True, save_model=False)
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
        trainer = Trainer(_dropout_config(cache, batch_size=8, steps=4), job["out"],
                          resume=job.get("resume", False),
                          callbacks=[_kill_at(job["kill_at"])] if job.get("kill_at") else [], save_model=False)
        try:
            result = trainer.run()
        except Kill:
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


# ---------------------------------------------------------------------------- the logger uses the public surface
class _PublicTrainer:
    """Only what Trainer offers publicly to its logger: no underscore method exists here."""

    def __init__(self, out):
        self.cfg = RunConfig.from_dict({"train": {"steps": 4, "eval_every": 2, "progress": False}})
        self.out, self.callbacks, self.stop_requested, self.evaluated = out, [], False, 0

    def is_eval_step(self, done: int) -> bool:
        return done % 2 == 0

    def validation_loss(self, run) -> float:
        self.evaluated += 1
        return 1.5


def test_metrics_logger_needs_only_the_trainers_public_methods(tmp_path):
    from types import SimpleNamespace

    from headbudget.train.loop import LogRecord
    from headbudget.train.records import MetricsLogger

    trainer = _PublicTrainer(tmp_path)
    run = SimpleNamespace(is_main=True, teacher=None, metrics_path=tmp_path / "metrics.jsonl")
    logger = MetricsLogger(trainer, run, 0)
    try:
        for step in (1, 2):
            logger.after_step(step, logger.log(LogRecord(step, 2.0, 0.5, 1e-3, (), 0.1, 1)))
    finally:
        logger.close()
    records = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    assert [r["val_loss"] for r in records] == [None, 1.5] and trainer.evaluated == 1


def test_no_module_calls_a_trainers_private_methods():
    """``trainer._x`` / ``self.trainer._x`` anywhere outside train/trainer.py is a reach into its privates."""
    import ast

    src = Path(__file__).resolve().parents[1] / "src" / "headbudget"
    reaches = []
    for path in src.rglob("*.py"):
        if path.name == "trainer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) \
                    else ""
                if name == "trainer":
                    reaches.append(f"{path.relative_to(src)}:{node.lineno} .{node.attr}")
    assert reaches == []
