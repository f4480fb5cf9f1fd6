"""Nothing a user made is lost: the output-folder guard, the one-writer lock, failed writes
that leave nothing behind, files that follow the umask, and torchrun workers that die with their launcher."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import assert_names, error_line, names
from headbudget.cli.main import main
from headbudget.io import atomic_write_dir, atomic_write_json, atomic_write_text, save_figure
from headbudget.run_dir import LOCK_NAME, OutputDirError, claim_output_dir, previous_results

TINY = ["--set", "data.source=synthetic:20000", "--set", "data.tokenizer=byte", "--set", "model.n_layers=2",
        "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.prism_max_head_dim=16",
        "--set", "model.prism_min_head_dim=8", "--set", "train.batch_size=2", "--set", "train.context=16",
        "--set", "train.eval_batches=1", "--set", "train.log_every=1", "--set", "train.warmup_steps=1",
        "--set", "train.progress=false", "--set", "train.threads=1", "--set", "train.ckpt_every=1"]


def _train(out: Path, cache: Path, steps: int, *flags: str) -> int:
    return main(["train", "quickstart", "--out", str(out), *TINY, "--set", f"data.cache_dir={cache}",
                 "--set", f"train.steps={steps}", *flags])


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def _save_pretrained_on_a_full_disk(self, directory, *a, **k):
    """A partial weights file, then ENOSPC (as safetensors would): monkeypatched over ``save_pretrained``."""
    path = Path(directory) / "model.safetensors"
    Path(directory).mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * 100)
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def _no_temp_left(d: Path) -> list[str]:
    return [str(p) for p in d.rglob("*") if p.name.endswith(".tmp") or ".tmp" in p.name or p.name == LOCK_NAME]


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_finished_run_is_refused_then_overwritten_or_resumed(tmp_path, capsys, umask022):
    run, cache = tmp_path / "run", tmp_path / "cache"
    assert _train(run, cache, 3) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3
    # the files a user shares follow the umask (they were 0600)
    for rel in ("config.yaml", "summary.json", "model/model.safetensors", "model/config.json",
                "checkpoints/latest"):
        assert stat.S_IMODE((run / rel).stat().st_mode) == 0o644, rel
    assert stat.S_IMODE((run / "model").stat().st_mode) == 0o755
    capsys.readouterr()
    before = _snapshot(run)

    # 1. the same command again: refused in one line, nothing touched (this was a silent 2-step rerun)
    assert _train(run, cache, 2) == 2
    err = capsys.readouterr().err
    assert_names(error_line(err, "train"), f"--out {run}", "checkpoints", "config.yaml", "metrics.jsonl", "model",
                 "--resume", "--overwrite")
    assert _snapshot(run) == before and not (run / LOCK_NAME).exists()

    # 2. --resume continues it (here: two more steps from its step-3 checkpoint)
    assert _train(run, cache, 5, "--resume") == 0
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    capsys.readouterr()

    # 3. --overwrite replaces it: a 2-step run, no record of the old one left
    assert _train(run, cache, 2, "--overwrite") == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    assert not (run / LOCK_NAME).exists()
    assert _train(run, cache, 2, "--overwrite", "--resume") == 2
    assert_names(error_line(capsys.readouterr().err, "train"), "--resume", "--overwrite")


def test_every_folder_writing_command_refuses_a_folder_with_results(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    commands = [
        ["compress", str(tmp_path / "m"), "--out", str(out)],
        ["prune", str(tmp_path / "m"), "--task", "lm", "--data", "x.txt", "--out", str(out)],
        ["prune-compare", str(tmp_path / "m"), "--task", "lm", "--data", "x.txt", "--out", str(out)],
        ["finetune", str(tmp_path / "m"), "--task", "sst5", "--data-dir", "d", "--out", str(out)],
        ["experiment", "ngram", "--quick", "--out", str(out)],
        ["experiment", "saturation", "--quick", "--out", str(out)],
        ["compare", "quickstart", "--out", str(out)],
        ["quickstart", "--out", str(out)],
    ]
    for argv in commands:
        assert main(argv) == 2, argv
        line = error_line(capsys.readouterr().err, argv[0])
        assert_names(line, f"--out {out}", "report.json", "--overwrite")
        assert ("--resume" in line) == (argv[0] in ("prune-compare", "compare")), argv  # only they can resume
    assert sorted(os.listdir(out)) == ["report.json"]


def test_results_are_recognised_in_subfolders_and_caches_are_not(tmp_path):
    (tmp_path / "prism-seed0").mkdir()
    (tmp_path / "prism-seed0" / "summary.json").write_text("{}")
    (tmp_path / "data-cache" / "abc").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("mine")
    assert previous_results(tmp_path, keep=("data-cache",)) == ["prism-seed0"]
    with claim_output_dir(tmp_path, overwrite=True, keep=("data-cache",)):
        pass
    assert sorted(os.listdir(tmp_path)) == ["data-cache", "notes.txt"]  # only the results went


_HOLDER = textwrap.dedent("""
    import sys, time
    from headbudget.run_dir import claim_output_dir
    with claim_output_dir(sys.argv[1], command="holder"):
        print("locked", flush=True)
        time.sleep(120)
""")


def test_one_writer_per_folder_and_a_dead_writers_lock_is_taken_over(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirError) as info:
            with claim_output_dir(out):
                pass
        assert_names(str(info.value), f"--out {out}", f"pid {holder.pid}", socket.gethostname(), "holder",
                     out / LOCK_NAME)
        holder.send_signal(signal.SIGKILL)  # dies without cleaning up: its lock file stays
        holder.wait(10)
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid
        with claim_output_dir(out):  # the kernel dropped its flock: taken over
            assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert not (out / LOCK_NAME).exists()
    finally:
        holder.kill()
        holder.wait(10)


def test_a_second_writer_in_the_same_process_is_refused_too(tmp_path):
    with claim_output_dir(tmp_path / "o", command="first"):
        with pytest.raises(OutputDirError, match=names(tmp_path / "o", f"pid {os.getpid()}", "first")):
            with claim_output_dir(tmp_path / "o"):
                pass
    assert not (tmp_path / "o").exists()  # created by the claim, left empty: removed


def test_output_path_that_is_a_file_or_unwritable_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    f = tmp_path / "file"
    f.write_bytes(b"precious")
    for out, what in ((f, [f"--out {f}", "file", "folder"]),
                      (f / "sub", [f"--out {f / 'sub'}", f, "file", "folder"])):  # f: the file in the way
        assert main(["train", "quickstart", "--out", str(out), *TINY]) == 2
        assert_names(error_line(capsys.readouterr().err, "train"), *what)
        assert main(["compress", str(tmp_path / "m"), "--out", str(out)]) == 2
        assert_names(error_line(capsys.readouterr().err, "compress"), *what)
    assert f.read_bytes() == b"precious"

    # a read-only folder (we may be root, for whom chmod changes nothing: the refusal is simulated
    # where the first byte would be written)
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "mine.txt").write_text("kept")
    real_open = os.open

    def read_only(path, flags, *a):
        if flags & os.O_CREAT and str(path).startswith(str(ro)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", read_only)
    assert main(["train", "quickstart", "--out", str(ro / "run"), *TINY]) == 2
    assert_names(error_line(capsys.readouterr().err, "train"), f"--out {ro / 'run'}", "Permission denied")
    assert sorted(os.listdir(ro)) == ["mine.txt"]


def test_disk_full_mid_run_is_one_line_and_leaves_no_temp_files(tmp_path, capsys, monkeypatch):
    from headbudget.models import HeadBudgetForCausalLM

    monkeypatch.setattr(HeadBudgetForCausalLM, "save_pretrained", _save_pretrained_on_a_full_disk)
    run = tmp_path / "run"
    assert _train(run, tmp_path / "cache", 2) == 2
    err = capsys.readouterr().err
    # named where the user will look for it, not by the temporary folder that is gone
    assert_names(error_line(err, "train"), run / "model" / "model.safetensors", "No space left on device")
    assert _no_temp_left(run) == [] and not (run / "model").exists()


def test_failed_writes_keep_the_earlier_file_byte_identical(tmp_path, monkeypatch):
    import headbudget.io as hio

    target = tmp_path / "summary.json"
    atomic_write_json(target, {"old": 1})
    before = target.read_bytes()
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            self.fh.write(text[:3])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hio.os, "fdopen", lambda fd, *a, **k: Full(real_fdopen(fd, *a, **k)))
    with pytest.raises(OSError, match="No space left"):
        atomic_write_json(target, {"new": 2})
    monkeypatch.undo()
    assert target.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["summary.json"]

    model = tmp_path / "model"
    atomic_write_dir(model, lambda d: (d / "config.json").write_text("{}"))

    def half(d: Path) -> None:
        (d / "config.json").write_text("{\"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        atomic_write_dir(model, half)
    assert (model / "config.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["model", "summary.json"]


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_written_files_follow_the_umask(tmp_path, mask):
    import torch
    from safetensors.torch import save_file

    from headbudget.io import new_figure

    old = os.umask(mask)
    try:
        atomic_write_text(tmp_path / "a.yaml", "x: 1\n")
        atomic_write_dir(tmp_path / "model", lambda d: save_file({"w": torch.zeros(2)}, str(d / "model.safetensors")))
        fig, ax = new_figure()
        ax.plot([0, 1])
        save_figure(fig, tmp_path / "plot.png")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "a.yaml") == 0o666 & ~mask
    assert mode(tmp_path / "model" / "model.safetensors") == 0o666 & ~mask  # safetensors alone writes 0600
    assert mode(tmp_path / "model") == 0o777 & ~mask
    assert mode(tmp_path / "plot.png") == 0o666 & ~mask


_LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    print(child.pid, child.stdout.readline().strip(), flush=True)
    child.wait()
""")
_WORKER = textwrap.dedent("""
    import time
    from headbudget.train.launcher import die_with_launcher
    die_with_launcher()
    print("armed", flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_their_killed_launcher(tmp_path):
    """kill -9 on the launcher (torchrun's role) ends its worker instead of leaving it training on."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _WORKER], stdout=subprocess.PIPE, text=True)
    pid_text, state = launcher.stdout.readline().split()
    worker = int(pid_text)
    assert state == "armed" and _alive(worker)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(10)
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not _alive(worker)
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_prepared_data_and_analysis_files_follow_the_umask(tmp_path, umask022):
    from headbudget.analysis.attention import write_json
    from headbudget.data.prepare import prepare_data

    data = prepare_data("synthetic:2000", "byte", tmp_path / "cache", progress=False)
    write_json({"layers": []}, tmp_path / "attention.json")
    for f in (data.directory / "meta.json", tmp_path / "attention.json"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f  # were 0600 (tempfile.mkstemp)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_compress_disk_full_is_one_line_and_leaves_no_temp_files(tmp_path, capsys, monkeypatch):
    from headbudget.models import HeadBudgetConfig, HeadBudgetForCausalLM
    from headbudget.models.tokenizers import make_tokenizer

    model_dir = tmp_path / "model"
    HeadBudgetForCausalLM(HeadBudgetConfig.from_preset("cpu-tiny", "uniform", vocab_size=257)).save_pretrained(model_dir)
    make_tokenizer("byte").save(model_dir / "tokenizer")
    capsys.readouterr()

    monkeypatch.setattr(HeadBudgetForCausalLM, "save_pretrained", _save_pretrained_on_a_full_disk)
    out = tmp_path / "out"
    assert main(["compress", str(model_dir), "--keep", "0.5", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # (after transformers' own "Loading weights" bar)
    assert_names(err, "headbudget compress: error:", out / "model" / "model.safetensors", "No space left on device")
    assert not out.exists() or _no_temp_left(out) == []


@pytest.fixture
def full_disk_dir(tmp_path):
    """A 120 KiB tmpfs: a real ENOSPC (needs root and mount; skipped elsewhere)."""
    d = tmp_path / "small-fs"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=120k", "tmpfs", str(d)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs a tmpfs mount (root)")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_a_really_full_disk_is_one_line_for_train_and_compress(tmp_path, full_disk_dir, capsys):
    """torch's checkpoint writer and safetensors hide ENOSPC in a RuntimeError / SafetensorError."""
    run = full_disk_dir / "run"
    assert _train(run, tmp_path / "cache", 2) == 2  # its first checkpoint does not fit
    err = capsys.readouterr().err
    assert_names(error_line(err, "train"), run / "checkpoints" / "step_000001", "No space left on device")
    assert _no_temp_left(full_disk_dir) == []
    assert _train(tmp_path / "ok", tmp_path / "cache", 2) == 0  # a model to compress
    capsys.readouterr()
    out = full_disk_dir / "c"
    assert main(["compress", str(tmp_path / "ok"), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert_names(err, "headbudget compress: error:", out / "model", "No space left on device")
    assert _no_temp_left(full_disk_dir) == [] and not out.exists()


def test_hidden_write_errors_become_os_errors(tmp_path, monkeypatch):
    import shutil as sh
    from collections import namedtuple

    import headbudget.io as hio

    e = hio.as_os_error(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
                        tmp_path / "m")
    assert (e.errno, e.strerror, e.filename) == (errno.ENOSPC, "No space left on device", str(tmp_path / "m"))
    usage = namedtuple("usage", "total used free")
    torch_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 4096))
    assert hio.as_os_error(torch_writer, tmp_path / "ck").errno == errno.ENOSPC
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10 << 30, 1 << 30, 9 << 30))
    assert hio.as_os_error(torch_writer, tmp_path / "ck") is None  # space left: not a full disk, a bug
    assert hio.as_os_error(ZeroDivisionError(), tmp_path) is None


def test_save_figure_closes_a_pyplot_figure_written_or_not(tmp_path):
    """pyplot holds every figure until closed; every plot in headbudget goes through save_figure, which closes it."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    save_figure(fig, tmp_path / "ok.png")
    assert (tmp_path / "ok.png").read_bytes()[:4] == b"\x89PNG" and fig.number not in plt.get_fignums()
    (tmp_path / "file").write_text("x")
    fig2, _ = plt.subplots()
    with pytest.raises(OSError):
        save_figure(fig2, tmp_path / "file" / "bad.png")  # the parent is a file: the write fails
    assert fig2.number not in plt.get_fignums() and sorted(p.name for p in tmp_path.iterdir()) == ["file", "ok.png"]


def _no_flock(monkeypatch) -> None:
    """A filesystem without flock (some NFS/FUSE mounts): every flock fails with ENOLCK."""
    import fcntl

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)


def _stale_lock(out: Path, pid: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "command": "holder"}))


def test_without_flock_a_live_writers_lock_is_refused_and_a_dead_ones_taken_over(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    # the recorded pid decides: a live process (sleeping) keeps the folder ...
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / "live"
        _stale_lock(live, sleeper.pid)
        with pytest.raises(OutputDirError) as info:
            with claim_output_dir(live):
                pass
        assert_names(str(info.value), f"--out {live}", f"pid {sleeper.pid}", socket.gethostname(), "holder",
                     live / LOCK_NAME)
        assert json.loads((live / LOCK_NAME).read_text())["pid"] == sleeper.pid  # its lock left alone
    finally:
        sleeper.kill()
        sleeper.wait(10)
    # ... and once it has died (reaped: its pid names no process) the lock is taken over
    dead = tmp_path / "dead"
    _stale_lock(dead, sleeper.pid)
    with claim_output_dir(dead, command="me"):
        holder = json.loads((dead / LOCK_NAME).read_text())
        assert (holder["pid"], holder["command"]) == (os.getpid(), "me")
    assert not (dead / LOCK_NAME).exists()


def test_overwrite_keeps_the_data_cache_byte_identical_and_it_alone_is_no_previous_run(tmp_path):
    # quickstart's data-cache/ is kept by name, whatever it holds: here prepared data and entries whose
    # names are also result names (a tokenizer folder, a meta file named config.json)
    from headbudget.data.prepare import prepare_data

    out = tmp_path / "out"
    prepare_data("synthetic:3000", "byte", out / "data-cache", progress=False)
    (out / "data-cache" / "tokenizer").mkdir()
    (out / "data-cache" / "tokenizer" / "tokenizer_spec.json").write_text('{"kind": "byte"}')
    (out / "data-cache" / "config.json").write_text("{}")
    cache = _snapshot(out / "data-cache")
    assert len(cache) >= 6

    # a folder holding only the cache holds no other run's results: claimed without --overwrite
    assert previous_results(out, keep=("data-cache",)) == []
    with claim_output_dir(out, command="headbudget quickstart", keep=("data-cache",)) as claimed:
        (claimed / "summary.json").write_text("{}")
        (claimed / "compare.md").write_text("# results")
    assert _snapshot(out / "data-cache") == cache

    # now it holds results: refused without --overwrite, and --overwrite deletes them but not the cache
    assert previous_results(out, keep=("data-cache",)) == ["compare.md", "summary.json"]
    with pytest.raises(OutputDirError, match=names(out, "compare.md", "summary.json")):
        with claim_output_dir(out, keep=("data-cache",)):
            pass
    with claim_output_dir(out, overwrite=True, keep=("data-cache",)) as claimed:
        (claimed / "summary.json").write_text('{"new": true}')
    assert sorted(os.listdir(out)) == ["data-cache", "summary.json"]  # the old results replaced
    assert (out / "summary.json").read_text() == '{"new": true}'
    assert _snapshot(out / "data-cache") == cache
