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
