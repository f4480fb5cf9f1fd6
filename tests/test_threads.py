"""One thread policy (headbudget.threads) and one --threads flag on every command."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import names
from headbudget.cli.main import build_parser
from headbudget.threads import THREADS_HELP, auto_threads, configure_threads, resolve_threads, torch_threads


def test_requested_count_wins_and_bad_counts_name_the_flag():
    assert resolve_threads(3) == 3
    with pytest.raises(ValueError, match=names("--threads", -1)):
        resolve_threads(-1)


def test_automatic_count_follows_the_load_average(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.2, 0.0, 0.0))
    assert auto_threads(world_size=1) == 3          # 8 cores - 5.2 busy, rounded
    assert resolve_threads(None, world_size=1) == resolve_threads(0, world_size=1) == 3
    assert auto_threads(world_size=2) == 1          # shared among DDP ranks
    monkeypatch.setattr(os, "getloadavg", lambda: (12.0, 0.0, 0.0))
    assert auto_threads(world_size=1) == 1          # never below one


def test_configure_and_restore():
    old = torch.get_num_threads()
    with torch_threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == old
    try:
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)


#: commands whose --threads is their run config's train.threads (--train.threads: a hidden alias of it)
TRAIN_LIKE = ("train", "compare", "distill")


def test_every_command_has_the_same_threads_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    seen = []
    for name, cmd in sub.choices.items():
        parsers = [cmd] if cmd._subparsers is None else list(
            next(a for a in cmd._actions if a.__class__.__name__ == "_SubParsersAction").choices.values())
        for p in parsers:
            flags = [a for a in p._actions if "--threads" in a.option_strings]
            if name == "schedule":
                assert not flags
                continue
            assert len(flags) == 1, name
            if name in TRAIN_LIKE:  # the run config's train.threads (0 = automatic), the one field it sets
                assert flags[0].dest == "train.threads" and flags[0].default == 0, name
                assert "0 = auto" in flags[0].help and "--train.threads" not in p.format_help(), name
            else:
                assert flags[0].help == THREADS_HELP and flags[0].default is None, name
            seen.append(name)
    for name in ("train", "compare", "quickstart", "eval", "perplexity", "attention", "compress",
                 "prune", "prune-compare", "finetune", "experiment"):
        assert name in seen


def test_the_experiments_use_the_one_thread_helper():
    from headbudget.experiments import ngram, saturation

    assert ngram.torch_threads is saturation.torch_threads is torch_threads


@pytest.mark.parametrize("command", TRAIN_LIKE)
@pytest.mark.parametrize("flag", ["--threads", "--train.threads"])
def test_train_like_threads_spellings_write_one_field(command, flag):
    """--threads (documented) and --train.threads (hidden, old command lines) set train.threads, and cli.main's
    thread policy (args.threads) follows it: no two flags writing different places."""
    argv = [command, "cpu-small"] + (["--teacher", "t", "--data", "x"] if command == "distill" else []) + [flag, "3"]
    args = build_parser(command).parse_args(argv)
    args.validate(args)
    assert args.cfg.train.threads == 3 and args.threads == 3
