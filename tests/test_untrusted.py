"""Untrusted files: a crafted DCP checkpoint cannot read outside its folder, block on a FIFO or a device,
or run code through a pickle.  Every payload is harmless (weights of another run, a marker file) and
each test also shows the payload is live, i.e. that the test would fail if the check were missing."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch

from headbudget.train import checkpoint as ckpt
from headbudget.train.checkpoint import CheckpointError, load_checkpoint, read_metadata, save_checkpoint


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rewrite_paths(path: Path, new_path: str) -> None:
    """Point every storage entry of ``path/.metadata`` at ``new_path`` (offsets kept)."""
    md = read_metadata(path)
    for info in md.storage_data.values():
        info.relative_path = new_path
    (path / ".metadata").write_bytes(pickle.dumps(md))


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail (instead of hanging the suite) when the body blocks, e.g. on a FIFO or /dev/zero."""
    def expired(*_):
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class _Marker:
    """Unpickling this creates a file: a stand-in for arbitrary code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture()
def two_runs(tmp_path):
    """(victim checkpoint, weights of another run whose checkpoint sits next to it)."""
    other = _model(1)
    save_checkpoint(tmp_path / "other", 1, other, meta={})
    victim = save_checkpoint(tmp_path / "victim", 1, _model(2), meta={})
    return victim, _params(other)


def test_metadata_path_into_another_run_is_refused_and_nothing_is_loaded(two_runs, monkeypatch):
    victim, other_weights = two_runs
    _rewrite_paths(victim, "../../other/step_000001/__0_0.distcp")
    model = _model(3)
    before = _params(model)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(victim, model)
    msg = str(err.value)
    assert "\n" not in msg and str(victim) in msg and "'../../other/step_000001/__0_0.distcp'" in msg
    assert "outside the checkpoint folder" in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The payload is live: without the check the other run's weights would be loaded silently.
    monkeypatch.setattr(ckpt, "_check_storage", lambda *a: None)
    load_checkpoint(victim, model)
    assert all(torch.equal(other_weights[k], v) for k, v in model.state_dict().items())


def test_absolute_device_path_is_refused_without_opening_it(two_runs):
    victim, _ = two_runs
    _rewrite_paths(victim, "/dev/zero")
    model = _model(3)
    before = _params(model)
    with _deadline(20), pytest.raises(CheckpointError, match=r"'/dev/zero', outside the checkpoint folder"):
        load_checkpoint(victim, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_symlink_out_of_the_folder_is_refused(two_runs, tmp_path):
    victim, _ = two_runs
    (victim / "__0_0.distcp").unlink()
    (victim / "__0_0.distcp").symlink_to(tmp_path / "other" / "step_000001" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"'__0_0.distcp', outside the checkpoint folder"):
        read_metadata(victim)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "trainer_state.json"])
def test_fifo_inside_the_folder_is_refused_as_not_a_regular_file(two_runs, name):
    victim, _ = two_runs
    target = victim / name
    target.unlink()
    os.mkfifo(target)  # opening it for reading would block until a writer comes
    model = _model(3)
    before = _params(model)
    with _deadline(20), pytest.raises(CheckpointError) as err:
        load_checkpoint(victim, model)
    assert str(err.value) == f"{target}: not a regular file; refusing to read it"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_slice_beyond_the_end_of_a_file_is_refused(two_runs):
    victim, _ = two_runs
    md = read_metadata(victim)
    info = next(iter(md.storage_data.values()))
    size = (victim / info.relative_path).stat().st_size
    info.length = size + 1
    (victim / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=rf"reads bytes {info.offset}\+{size + 1} of '__0_0.distcp', "
                                              rf"which has {size}"):
        read_metadata(victim)


def test_pickle_payload_in_metadata_never_runs(two_runs, tmp_path):
    victim, _ = two_runs
    live = tmp_path / "live_marker"
    pickle.loads(pickle.dumps(_Marker(live)))  # a plain unpickler runs the payload ...
    assert live.exists()
    marker = tmp_path / "marker"
    (victim / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(CheckpointError, match=r"refusing to load (builtins|io)\.open"):
        load_checkpoint(victim, _model(3))
    assert not marker.exists()  # ... the checkpoint's does not


def test_pickle_payload_in_rng_state_never_runs(two_runs, tmp_path):
    victim, _ = two_runs
    marker = tmp_path / "marker"
    torch.save({"torch": _Marker(marker)}, victim / "rng_rank0.pt")
    model = _model(3)
    before = _params(model)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(victim, model)
    assert str(err.value).startswith(f"{victim / 'rng_rank0.pt'}: not a headbudget RNG state")
    assert "\n" not in str(err.value)
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_torch_older_than_2_6_is_refused_for_loading():
    with pytest.raises(CheckpointError, match=r"torch 2\.5\.1 cannot load checkpoints safely .*CVE-2025-32434"):
        ckpt.require_safe_torch_load("2.5.1")
    ckpt.require_safe_torch_load("2.6.0")
    ckpt.require_safe_torch_load("2.13.0+cpu")


def test_pyproject_and_readme_require_torch_2_6():
    root = Path(__file__).resolve().parents[1]
    assert '"torch>=2.6",' in (root / "pyproject.toml").read_text()
    assert "torch >= 2.5" not in (root / "README.md").read_text()


_TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: {text}
doc_to_target: 0
doc_to_choice: ["a", "b"]
metric_list:
  - metric: acc
"""


def test_include_path_runs_python_only_for_the_tasks_requested(tmp_path):
    """``--include-path`` runs a task's ``!function`` module (documented, as lm-eval); indexing the folder
    or requesting another task of it must not."""
    pytest.importorskip("lm_eval")
    from headbudget.evaluation.harness import load_harness_tasks

    data = tmp_path / "docs.jsonl"
    data.write_text('{"q": "pick one"}\n')
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    marker = tmp_path / "IMPORTED"
    (tasks / "payload.py").write_text(f"open({str(marker)!r}, 'w').close()\n\n\n"
                                      "def doc_to_text(doc):\n    return doc['q']\n")
    (tasks / "coded.yaml").write_text(_TASK_YAML.format(name="coded_task", data=data,
                                                        text="!function payload.doc_to_text"))
    (tasks / "plain.yaml").write_text(_TASK_YAML.format(name="plain_task", data=data, text="'{{q}}'"))
    _, loaded = load_harness_tasks(["plain_task"], include_path=str(tasks))
    assert list(loaded["tasks"]) == ["plain_task"] and not marker.exists()
    load_harness_tasks(["coded_task"], include_path=str(tasks))
    assert marker.exists()  # what docs/evaluation.md warns about
    docs = (Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text()
    assert "**`--include-path` runs Python from that folder**" in docs
