"""Progress bars: tqdm's in-place bar on a terminal; off a terminal (a log file, a pipe) plain newline-terminated
lines at a modest interval, and the final state."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "headbudget"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_bar_writes_few_plain_lines():
    from headbudget.progress import ProgressBar

    log = io.StringIO()  # not a terminal, as `2> log` is
    bar = ProgressBar(total=5000, desc="train", file=log, leave=False)
    for step in range(5000):
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}")  # refreshes on every call, as the trainer's bar does
        if step % 1000 == 0:
            ProgressBar.write(f"epoch {step}", file=log)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    bars = [line for line in lines if line.startswith("train")]
    # well under a second: the start and the final state, nothing in between; the messages kept as written
    assert len(bars) == 2, lines
    assert "0/5000" in bars[0] and "5000/5000" in bars[1] and "loss=0.000" in bars[1]
    assert [line for line in lines if line.startswith("epoch")] == [f"epoch {s}" for s in range(0, 5000, 1000)]
    assert len(text) < 400


def test_off_a_terminal_one_line_per_interval(monkeypatch):
    import headbudget.progress as progress

    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    log = io.StringIO()
    bar = progress.ProgressBar(total=100, desc="sweep", file=log)  # leave=True: no extra blank line either
    for _ in range(100):  # one step a second, 100 s in all
        clock[0] += 1.0
        bar.update(1)
        bar.set_postfix(x=1)
    bar.close()
    lines = log.getvalue().split("\n")
    assert lines[-1] == ""  # the text ends in a newline
    counts = [int(re.search(r"(\d+)/100", line).group(1)) for line in lines[:-1]]
    # the start, then every 30 s of the fake clock (steps 30, 60, 90), then the final state
    assert counts == [0, 30, 60, 90, 100]
    assert "\r" not in log.getvalue()


def test_iterating_a_bar_off_a_terminal():
    from headbudget.progress import ProgressBar

    log = io.StringIO()
    assert list(ProgressBar(range(7), desc="k-medoids", file=log, leave=False)) == list(range(7))
    lines = log.getvalue().split("\n")
    assert len(lines) == 3 and lines[-1] == "" and "7/7" in lines[1]


def test_on_a_terminal_the_bar_is_tqdms():
    from headbudget.progress import ProgressBar

    term = _Terminal()
    bar = ProgressBar(total=3, desc="train", file=term, leave=False, mininterval=0)
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert term.getvalue().count("\r") >= 3 and "\n" not in term.getvalue()  # redrawn in place, then erased


def test_disabled_bar_writes_nothing():
    from headbudget.progress import ProgressBar

    log = io.StringIO()
    for _ in ProgressBar(range(3), file=log, disable=True):
        pass
    assert log.getvalue() == ""


def test_every_bar_of_headbudget_is_the_progress_bar():
    """One place decides how bars are written: no module draws tqdm's own bar."""
    own = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py")) if p.name != "progress.py"
           and re.search(r"^\s*from tqdm(\.auto|\.std)? import tqdm\b", p.read_text(), flags=re.M)]
    assert own == []


@pytest.fixture
def library_bars_on():
    """transformers' bars on for the test, then as they were (whatever ran before in this process)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield
    (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_no_progress_also_silences_the_libraries_bars(tmp_path, capsys, library_bars_on):
    """``prune --no-progress`` wrote transformers' "Loading weights" / "Writing model shards" bars all the same;
    now a pipeline whose job has ``progress`` off turns the libraries' bars off for its run, and back on after."""
    from transformers.utils import logging as hf_logging

    from headbudget.cli.main import main
    from test_cahp_pipeline import DATA, _save_tiny  # tests/ is on sys.path under pytest

    tiny = _save_tiny(tmp_path, "bert")
    base = ["prune", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--method", "fisher", "--keep", "4",
            "--finetune-epochs", "0", "--limit-train", "32", "--limit-eval", "16"]
    assert hf_logging.is_progress_bar_enabled()
    assert main([*base, "--out", str(tmp_path / "bars")]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" in err and "Writing model shards" in err  # the libraries' bars, as they are
    assert main([*base, "--no-progress", "--out", str(tmp_path / "quiet")]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err and "it/s" not in err
    assert hf_logging.is_progress_bar_enabled()  # restored for whatever runs next


def test_quiet_unless_progress_reads_the_jobs_progress(library_bars_on):
    from types import SimpleNamespace

    from transformers.utils import logging as hf_logging

    from headbudget.progress import quiet_unless_progress

    @quiet_unless_progress
    def seen(job, extra=0):
        return hf_logging.is_progress_bar_enabled(), extra

    assert seen(SimpleNamespace(progress=False), extra=3) == (False, 3)
    assert seen(job=SimpleNamespace(progress=True)) == (True, 0)
    assert hf_logging.is_progress_bar_enabled()


def test_commands_that_draw_their_own_bars_turn_the_libraries_off_only_while_they_run(library_bars_on):
    """train, distill, compare, quickstart and export decorate their work with ``library_bars(False)``; before,
    they turned transformers' bars off for the rest of the process."""
    from transformers.utils import logging as hf_logging

    from headbudget.cli import export_cmd, quickstart_cmd, train_cmd
    from headbudget.progress import library_bars

    @library_bars(False)
    def work():
        return hf_logging.is_progress_bar_enabled()

    assert (work(), work(), hf_logging.is_progress_bar_enabled()) == (False, False, True)  # reusable, restored
    for fn in (train_cmd._run_training, train_cmd._run_compare, quickstart_cmd._quickstart, export_cmd._export):
        # the decorated function runs a stand-in for its body (held in the decorator's closure) with bars off
        cell = next(c for c in fn.__closure__ or () if c.cell_contents is fn.__wrapped__)
        cell.cell_contents = lambda *args, **kwargs: hf_logging.is_progress_bar_enabled()
        try:
            assert fn() is False, fn
        finally:
            cell.cell_contents = fn.__wrapped__
        assert hf_logging.is_progress_bar_enabled(), fn
