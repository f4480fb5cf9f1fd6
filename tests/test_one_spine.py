"""Leftovers of issue 21 ("One spine"): every command takes --config FILE, one --threads, experiment --out and
--no-progress as config fields, the trainer's public surface for its logger, one importance table, eval --quiet."""

from __future__ import annotations

import pytest
import yaml

from headbudget.cli.main import main


def _printed(argv: list[str], capsys) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("command", ["train", "compare", "prepare"])
def test_config_as_flag_is_the_config_as_positional(command, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("name: viaflag\nseed: 7\ndata:\n  source: synthetic:5000\ntrain:\n  lr: 0.0005\n")
    positional = _printed([command, str(cfg), "--print_config"], capsys)
    flag = _printed([command, "--config", str(cfg), "--print_config"], capsys)
    assert flag == positional
    assert (flag["name"], flag["seed"], flag["data"]["source"], flag["train"]["lr"]) == ("viaflag", 7,
                                                                                        "synthetic:5000", 0.0005)
    bundled = _printed([command, "--config", "cpu-small", "--print_config"], capsys)
    assert bundled == _printed([command, "cpu-small", "--print_config"], capsys)


@pytest.mark.parametrize("command", ["train", "compare", "prepare"])
def test_config_given_both_ways_is_one_line_error(command, tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("name: a\n")
    capsys.readouterr()
    assert main([command, str(cfg), "--config", str(cfg), "--print_config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give CONFIG or --config FILE, not both" in err
    assert err.startswith(f"headbudget {command}: error: ")


@pytest.mark.parametrize("command", ["train", "compare"])
def test_config_still_required_where_it_was(command, capsys):
    capsys.readouterr()
    assert main([command, "--print_config"]) == 2
    err = capsys.readouterr().err
    assert err == f"headbudget {command}: error: missing the config: give CONFIG or --config FILE (a YAML file or " \
                  "a bundled name: quickstart, cpu-small, gpt2-124m, ...)\n"


def test_prepare_needs_no_config(capsys):
    assert _printed(["prepare", "--print_config"], capsys)["data"]["source"] == "synthetic:1000000"


# ------------------------------------------------------------------ experiment --out / --no-progress as fields
_NGRAM_TINY = ["--budget", "8", "--heads", "1,2", "--offsets", "1", "--vocab", "4", "--seq-len", "8", "--d-model", "8",
               "--steps", "2", "--batch", "4", "--eval-batch", "8", "--seeds", "0"]


@pytest.mark.parametrize("name", ["saturation", "ngram"])
def test_experiment_out_and_no_progress_round_trip_through_print_config(name, tmp_path, capsys):
    d = _printed(["experiment", name, "--out", str(tmp_path / "o"), "--no-progress", "--print_config"], capsys)
    assert (d["out"], d["progress"]) == (str(tmp_path / "o"), False)
    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(d))
    assert _printed(["experiment", name, "--config", str(f), "--print_config"], capsys) == d
    defaults = _printed(["experiment", name, "--print_config"], capsys)
    assert (defaults["out"], defaults["progress"]) == (f"results/{name}", True)


def test_experiment_runs_into_the_out_of_its_config_file(tmp_path, capsys):
    import json

    f = tmp_path / "cfg.yaml"
    f.write_text(f"out: {tmp_path / 'from_file'}\nprogress: false\n")
    capsys.readouterr()
    assert main(["experiment", "ngram", *_NGRAM_TINY, "--config", str(f), "--threads", "1"]) == 0
    captured = capsys.readouterr()
    result = json.loads((tmp_path / "from_file" / "ngram.json").read_text())
    assert "out" not in result["config"] and "progress" not in result["config"]  # where it reports: not a result
    assert "ngram:" not in captured.err  # progress: false in the file silenced the bar
