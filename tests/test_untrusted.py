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

from conftest import assert_names, names
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
    assert "\n" not in msg
    assert_names(msg, victim, "'../../other/step_000001/__0_0.distcp'", "outside")
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
    with _deadline(20), pytest.raises(CheckpointError, match=names("'/dev/zero'", "outside")):
        load_checkpoint(victim, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_symlink_out_of_the_folder_is_refused(two_runs, tmp_path):
    victim, _ = two_runs
    (victim / "__0_0.distcp").unlink()
    (victim / "__0_0.distcp").symlink_to(tmp_path / "other" / "step_000001" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=names("'__0_0.distcp'", "outside")):
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
    assert_names(str(err.value), target, "FIFO")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_slice_beyond_the_end_of_a_file_is_refused(two_runs):
    victim, _ = two_runs
    md = read_metadata(victim)
    info = next(iter(md.storage_data.values()))
    size = (victim / info.relative_path).stat().st_size
    info.length = size + 1
    (victim / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=names(f"{info.offset}+{size + 1}", "'__0_0.distcp'", size)):
        read_metadata(victim)


def test_pickle_payload_in_metadata_never_runs(two_runs, tmp_path):
    victim, _ = two_runs
    live = tmp_path / "live_marker"
    pickle.loads(pickle.dumps(_Marker(live)))  # a plain unpickler runs the payload ...
    assert live.exists()
    marker = tmp_path / "marker"
    (victim / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(CheckpointError, match=r"\b(builtins|io)\.open\b"):
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
    assert_names(str(err.value), victim / "rng_rank0.pt", "RNG")
    assert "\n" not in str(err.value)
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_torch_older_than_2_6_is_refused_for_loading():
    with pytest.raises(CheckpointError, match=names("torch", "2.5.1", "CVE-2025-32434")):
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
    """``--include-path`` runs a requested task's ``!function`` module only with ``allow_code`` (documented);
    indexing the folder or requesting another task of it never does."""
    pytest.importorskip("lm_eval")
    from headbudget.evaluation.harness import load_harness_tasks
    from headbudget.evaluation.task_code import TaskCodeError

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
    with pytest.raises(TaskCodeError, match=names(tasks / "coded.yaml", "!function payload.doc_to_text", "--allow-code")):
        load_harness_tasks(["coded_task"], include_path=str(tasks))
    assert not marker.exists()
    load_harness_tasks(["coded_task"], include_path=str(tasks), allow_code=True)
    assert marker.exists()  # the payload is live: the refusal is what kept it from running
    docs = (Path(__file__).resolve().parents[1] / "docs" / "evaluation.md").read_text()
    assert "**A task file of yours runs Python only with `--allow-code`.**" in docs


def _coded_task_folder(folder: Path, marker: Path, name: str = "hb_coded") -> Path:
    """``folder/t.yaml`` (task ``name``) whose ``process_docs`` is ``!function utils.process_docs``, and
    ``folder/utils.py``, which creates ``marker`` when imported."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "docs.jsonl"
    data.write_text('{"q": "pick one"}\n{"q": "or two"}\n')
    (folder / "utils.py").write_text(f"open({str(marker)!r}, 'w').close()\n\n\n"
                                     "def process_docs(ds):\n    return ds\n")
    (folder / "t.yaml").write_text(_TASK_YAML.format(name=name, data=data, text="'{{q}}'")
                                   + "process_docs: !function utils.process_docs\n")
    return folder / "t.yaml"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_a_task_file_in_tasks_runs_python_only_with_allow_code(tmp_path, capsys):
    """``eval --tasks DIR/t.yaml``: the ``!function`` module beside the file is refused in one line naming the
    file, the function and the Python file; ``--allow-code`` runs it.  (The model does not exist: the tasks
    load before it, so the marker tells whether the module ran.)"""
    pytest.importorskip("lm_eval")
    from headbudget.cli.main import main

    marker = tmp_path / "IMPORTED"
    task = _coded_task_folder(tmp_path / "mine", marker)
    missing = str(tmp_path / "no-model")
    assert main(["eval", missing, "--tasks", str(task), "--quiet"]) == 2
    line = _one_line(capsys)
    assert_names(line, "headbudget eval: error:", task, "!function utils.process_docs",
                 task.parent.resolve() / "utils.py", "--allow-code")
    assert not marker.exists()
    assert main(["eval", missing, "--tasks", str(task), "--quiet", "--allow-code"]) == 2  # (no model)
    assert marker.exists() and "--allow-code" not in capsys.readouterr().err


def test_include_chains_and_groups_of_include_path_need_allow_code(tmp_path, capsys):
    """A YAML under --include-path with no !function of its own that pulls one in -- by ``include:`` of
    another folder's file, or as a group listing such a task -- is refused too, naming the file that holds
    the !function."""
    pytest.importorskip("lm_eval")
    from headbudget.cli.main import main

    marker = tmp_path / "IMPORTED"
    coded = _coded_task_folder(tmp_path / "elsewhere", marker)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "child.yaml").write_text(f"include: {Path('..') / 'elsewhere' / 't.yaml'}\ntask: hb_child\n")
    group_dir = tmp_path / "groups"
    _coded_task_folder(group_dir / "member", marker, name="hb_member")
    (group_dir / "g.yaml").write_text("group: hb_group\ntask:\n  - hb_member\n")
    missing = str(tmp_path / "no-model")
    assert main(["eval", missing, "--tasks", "hb_child", "--include-path", str(tasks), "--quiet"]) == 2
    line = _one_line(capsys)
    assert_names(line, tasks / "child.yaml", "!function utils.process_docs", coded.parent.resolve() / "utils.py")
    assert main(["eval", missing, "--tasks", "hb_group", "--include-path", str(group_dir), "--quiet"]) == 2
    assert_names(_one_line(capsys), group_dir / "member" / "t.yaml", "!function utils.process_docs")
    assert not marker.exists()


def test_the_loader_guard_refuses_what_the_early_check_missed(tmp_path, monkeypatch):
    """Behind the early check, lm-eval's loader itself refuses a user's !function without allow_code (so a
    path into it the check did not foresee still runs nothing); the built-in task files keep working."""
    pytest.importorskip("lm_eval")
    from headbudget.evaluation import harness
    from headbudget.evaluation.task_code import TaskCodeError

    marker = tmp_path / "IMPORTED"
    task = _coded_task_folder(tmp_path / "mine", marker)
    monkeypatch.setattr(harness, "check_task_code", lambda *a, **k: None)
    with pytest.raises(TaskCodeError, match=names("!function utils.process_docs", task.parent.resolve() / "utils.py")):
        harness.load_harness_tasks([str(task)])
    assert not marker.exists()
    # headbudget's own task files (prompts.py) need no consent
    _, loaded = harness.load_harness_tasks(["piqa"], data_dir=str(Path(__file__).parent / "fixtures" / "zeroshot"))
    assert list(loaded["tasks"]) == ["piqa"]


def test_sibling_folder_sharing_the_name_prefix_is_outside_the_checkpoint(two_runs, tmp_path):
    # "step_0000011" starts with the string "step_000001" but is another folder: containment is by path
    # components, so a string-prefix comparison would read (and load) the sibling's weights
    victim, other_weights = two_runs
    sibling = victim.parent / (victim.name + "1")
    sibling.mkdir()
    (sibling / "__0_0.distcp").write_bytes((tmp_path / "other" / "step_000001" / "__0_0.distcp").read_bytes())
    rel = f"../{sibling.name}/__0_0.distcp"
    _rewrite_paths(victim, rel)
    model = _model(3)
    before = _params(model)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(victim, model)
    assert_names(str(err.value), victim, ".metadata", repr(rel), "outside")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not all(torch.equal(other_weights[k], before[k]) for k in before)  # the payload would change them


def _torch_save_call(path: Path) -> bytes:
    """A pickle calling ``torch.save({}, path)``, written opcode by opcode so the global is named ``torch.save``
    (pickling the function itself would name ``torch.serialization``, the module that defines it)."""
    import struct

    arg = str(path).encode()
    return b"ctorch\nsave\n(}X" + struct.pack("<I", len(arg)) + arg + b"tR."


def test_metadata_unpickler_admits_dtypes_but_no_other_torch_attribute(two_runs, tmp_path):
    victim, _ = two_runs
    # the payload is live: a plain unpickler writes the file
    live = tmp_path / "live_marker"
    pickle.loads(_torch_save_call(live))
    assert live.exists()
    marker = tmp_path / "marker"
    (victim / ".metadata").write_bytes(_torch_save_call(marker))
    with pytest.raises(CheckpointError, match=names(victim / ".metadata", "torch.save")):
        load_checkpoint(victim, _model(3))
    assert not marker.exists()

    def find(module: str, name: str):
        import io

        return ckpt._MetadataUnpickler(io.BytesIO(b"")).find_class(module, name)

    # the dtypes DCP's tensor properties name are admitted ...
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        assert find("torch", str(dtype).removeprefix("torch.")) is dtype
    assert find("torch", "Size") is torch.Size
    # ... and nothing else torch has: functions, classes, modules
    for module, name in [("torch", "load"), ("torch", "save"), ("torch", "tensor"), ("torch", "Tensor"),
                         ("torch", "nn"), ("torch", "from_file"), ("torch.serialization", "load"),
                         ("torch.distributed.checkpoint.metadata", "pickle")]:
        with pytest.raises(pickle.UnpicklingError, match=names(f"{module}.{name}")):
            find(module, name)


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_pickle_payload_in_the_tensor_bytes_never_runs(two_runs, tmp_path, writer):
    victim, _ = two_runs
    marker = tmp_path / "marker"
    distcp = victim / "__0_0.distcp"
    size = distcp.stat().st_size
    if writer == "pickle":
        body = pickle.dumps(_Marker(marker))
    else:
        torch.save(_Marker(marker), tmp_path / "payload.pt")
        body = (tmp_path / "payload.pt").read_bytes()
    assert len(body) <= size
    distcp.write_bytes(body + b"\0" * (size - len(body)))  # same length: the slice offsets stay valid
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(victim, _model(3))
    assert_names(str(err.value), distcp, "tensors")
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_a_task_template_runs_no_code_without_allow_code(tmp_path, capsys):
    """lm-eval renders templates with plain Jinja, where ``cycler.__init__.__globals__.os`` reaches any
    function: without --allow-code templates render in Jinja's sandbox, and the run stops in one line."""
    pytest.importorskip("lm_eval")
    from headbudget.cli.main import main

    marker = tmp_path / "MADE"
    data = tmp_path / "docs.jsonl"
    data.write_text('{"q": "pick one"}\n')
    task = tmp_path / "j.yaml"
    task.write_text(_TASK_YAML.format(
        name="hb_jinja", data=data, text=f"\"{{{{ cycler.__init__.__globals__.os.mkdir('{marker}') or q }}}}\""))
    missing = str(tmp_path / "no-model")
    assert main(["eval", missing, "--tasks", str(task), "--quiet"]) == 2
    line = _one_line(capsys)
    assert_names(line, "headbudget eval: error:", "Jinja", "__init__", "--allow-code")
    assert not marker.exists()
    assert main(["eval", missing, "--tasks", str(task), "--quiet", "--allow-code"]) == 2  # (no model)
    assert marker.is_dir()  # the payload is live
