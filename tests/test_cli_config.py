"""Typed configs as the single source of flags: prune / prune-compare flags generated from PruneJob's fields,
``--config`` / ``--set`` / ``--print_config`` from the same declarations, unknown keys refused in one line; train,
compare and prepare take their config as CONFIG or ``--config FILE`` (one, not both), and experiment's ``--out`` /
``--no-progress`` are config fields."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from conftest import assert_names, error_line, names
from headbudget.cli.main import build_parser, main
from headbudget.pruning.job import PruneJob


def _print_config(argv: list[str], capsys) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def test_every_prune_job_field_is_a_prune_flag_and_reaches_the_job():
    from headbudget.cli.prune_cmd import _job

    sub = build_parser("prune")._subparsers._group_actions[0].choices["prune"]
    dests = {a.dest for a in sub._actions}
    cli_fields = {f.name for f in dataclasses.fields(PruneJob) if f.metadata.get("cli", True)}
    assert cli_fields <= dests and {"save_model", "extra"}.isdisjoint(dests)
    args = sub.parse_args(["m", "--task", "lm", "--data", "t.txt", "--out", "o", "--clusters", "5", "--no-progress",
                           "--keep-ratio", "0.5", "--eval-data", "a.txt,b.txt", "--var-floor", "none",
                           "--method", "fisher", "--gate-cooldown", "7"])
    assert _job(args) == PruneJob("m", "lm", None, "o", data="t.txt", n_clusters=5, progress=False, keep_ratio=0.5,
                                  eval_data=("a.txt", "b.txt"), var_floor=None, method="fisher", gate_cooldown=7,
                                  finetune_epochs=0)  # task lm: no recovery fine-tuning unless asked for
    legacy = _job(sub.parse_args(["m", "--task", "sst5", "--data-dir", "d", "--out", "o", "--legacy-signatures"]))
    assert (legacy.ddof, legacy.var_floor, legacy.var_eps, legacy.tsne_dtype, legacy.finetune_epochs) == \
        (0, None, 1e-10, "float64", 3)


def test_print_config_round_trips_and_flags_beat_the_file(tmp_path, capsys):
    first = _print_config(["prune", "runs/ft", "--task", "sst5", "--data-dir", "d", "--out", "o", "--keep", "12",
                           "--legacy-signatures", "--eval-data", "a.txt", "--print_config"], capsys)
    d = yaml.safe_load(first)
    assert len(d) == len(dataclasses.fields(PruneJob)) and d["keep"] == 12 and d["eval_data"] == ["a.txt"]
    cfg = tmp_path / "job.yaml"
    cfg.write_text(first)
    assert _print_config(["prune", "--config", str(cfg), "--print_config"], capsys) == first
    again = yaml.safe_load(_print_config(["prune", "--config", str(cfg), "--keep", "3", "--set", "pool_size=8",
                                          "--no-progress", "--print_config"], capsys))
    assert again == {**d, "keep": 3, "pool_size": 8, "progress": False}
    # prune-compare reads the same file; its own settings (methods, seeds, ranking) are fields too
    cmp = yaml.safe_load(_print_config(["prune-compare", "--config", str(cfg), "--methods", "cahp,fisher",
                                        "--print_config"], capsys))
    assert cmp == {**d, "methods": "cahp,fisher", "calibration_seeds": None, "ranking_rule": "mean"}


@pytest.mark.parametrize(
    ("extra", "parts"),
    [
        (["--set", "kep=3"], ["--set", "'kep=3'", "'kep'", "'keep'"]),  # 'keep': the nearest key, suggested
        (["--set", "keep"], ["--set", "'keep'", "KEY=VALUE"]),
        (["--set", "keep=many"], ["--set", "keep", "integer", "'many'"]),
        (["--set", "mss=median"], ["--set", "mss", "'median'", "mean", "nearest"]),
    ],
)
def test_bad_overrides_are_one_line_errors(extra, parts, capsys):
    rc = main(["prune", "m", "--task", "sst5", "--data-dir", "d", "--out", "o", *extra, "--print_config"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert_names(error_line(err, "prune"), *parts)


def test_unknown_keys_and_missing_settings_in_a_config_file(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: m\ntask: lm\nout: o\nkeep_ration: 0.5\n")
    assert main(["prune", "--config", str(cfg), "--print_config"]) == 2
    assert_names(error_line(capsys.readouterr().err, "prune"), f"{cfg}:", "'keep_ration'", "'keep_ratio'")
    cfg.write_text("model: m\n")
    assert main(["prune-compare", "--config", str(cfg)]) == 2
    assert_names(error_line(capsys.readouterr().err, "prune-compare"), "--task", "--out", "--config")


def test_bad_flag_values_are_refused_by_argparse_with_the_field_type(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["prune", "m", "--task", "lm", "--out", "o", "--keep", "x"])
    assert exc.value.code == 2
    assert_names(capsys.readouterr().err.splitlines()[-1], "headbudget prune: error:", "--keep", "integer", "'x'")


def test_train_section_flags_set_and_print_config_round_trips(tmp_path, capsys):
    first = _print_config(["train", "quickstart", "--train.lr", "3e-4", "--schedule", "prism", "--set",
                           "train.steps=5", "--set", "train.batch_size=4", "--train.batch_size", "8",
                           "--data.split_blank_lines", "yes", "--seed", "3", "--print_config"], capsys)
    d = yaml.safe_load(first)
    assert (d["train"]["lr"], d["train"]["steps"], d["train"]["batch_size"], d["model"]["schedule"], d["seed"],
            d["data"]["split_blank_lines"], d["name"]) == (3e-4, 5, 8, "prism", 3, True, "quickstart")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(first)
    assert _print_config(["train", str(cfg), "--print_config"], capsys) == first
    with pytest.raises(SystemExit):
        main(["train", str(cfg), "--train.steps", "ten"])
    assert_names(capsys.readouterr().err.splitlines()[-1], "headbudget train: error:", "--train.steps", "integer",
                 "'ten'")


def test_prepare_and_distill_flags_are_config_fields(tmp_path, capsys):
    d = yaml.safe_load(_print_config(["prepare", "--source", "synthetic:500", "--tokenizer", "bpe:300",
                                      "--data.val_fraction", "0.2", "--print_config"], capsys))
    assert d["data"] == {**d["data"], "source": "synthetic:500", "tokenizer": "bpe:300", "val_fraction": 0.2}
    d = yaml.safe_load(_print_config(["distill", "runs/s", "--teacher", "runs/t", "--temperature", "4", "--data",
                                      "corpus.txt", "--tokens", "4096", "--train.batch_size", "2",
                                      "--train.context", "64", "--teacher-cache", "tc", "--print_config"], capsys))
    assert (d["model"]["init"], d["data"]["tokenizer"], d["distill"], d["data"]["source"], d["train"]["steps"],
            d["train"]["lr"]) == ("runs/s", "model", {"teacher": "runs/t", "temperature": 4.0, "alpha": 1.0,
                                                      "teacher_cache": "tc"}, "corpus.txt", 32, 1e-4)
    assert main(["distill", "runs/s", "--print_config"]) == 2
    assert_names(error_line(capsys.readouterr().err, "distill"), "--teacher", "distill.teacher")


def test_compress_flags_are_compress_job_fields(tmp_path, capsys):
    pytest.importorskip("torch")
    from headbudget.compression.allocation import ALLOCATIONS
    from headbudget.compression.job import ALLOCATION_NAMES, METHOD_NAMES
    from headbudget.compression.pipeline import METHODS

    assert (METHOD_NAMES, ALLOCATION_NAMES) == (METHODS, ALLOCATIONS)
    first = _print_config(["compress", "m", "--out", "o", "--sweep", "0.25,0.5", "--method", "group",
                           "--no-progress", "--print_config"], capsys)
    d = yaml.safe_load(first)
    assert (d["sweep"], d["method"], d["progress"], d["keep_ratio"]) == ([0.25, 0.5], "group", False, 0.5)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(first)
    assert _print_config(["compress", "--config", str(cfg), "--print_config"], capsys) == first
    assert main(["compress", "--config", str(cfg), "--set", "allocation=later", "--print_config"]) == 2
    assert_names(error_line(capsys.readouterr().err, "compress"), "--set", "allocation", "'later'", "uniform",
                 "later_layers_first", "earlier_layers_first")


def test_finetune_flags_are_finetune_job_fields(tmp_path, capsys):
    from headbudget.pruning.job import FinetuneJob

    d = yaml.safe_load(_print_config(["finetune", "m", "--task", "mnli", "--data-dir", "d", "--out", "o",
                                      "--max-steps", "5", "--no-progress", "--print_config"], capsys))
    assert FinetuneJob(**d) == FinetuneJob("m", "mnli", "d", "o", max_steps=5, progress=False)
    assert main(["finetune", "m", "--task", "sst5", "--out", "o", "--print_config"]) == 2
    assert_names(error_line(capsys.readouterr().err, "finetune"), "--data-dir", "--config")


def test_experiment_flags_are_config_fields_and_quick_is_a_base(tmp_path, capsys):
    pytest.importorskip("torch")
    from headbudget.experiments.ngram import NgramConfig

    first = _print_config(["experiment", "ngram", "--quick", "--budget", "32", "--offsets", "1,3",
                           "--print_config"], capsys)
    d = yaml.safe_load(first)
    quick = NgramConfig.quick()
    assert (d["budget"], d["head_counts"], d["offsets"], d["steps"], d["seeds"]) == (32, None, [1, 3], quick.steps,
                                                                                    [0])
    cfg = tmp_path / "ngram.yaml"
    cfg.write_text(first)
    assert _print_config(["experiment", "ngram", "--config", str(cfg), "--print_config"], capsys) == first
    assert main(["experiment", "ngram", "--config", str(cfg), "--set", "offset=2", "--print_config"]) == 2
    assert_names(error_line(capsys.readouterr().err, "experiment"), "--set", "'offset=2'", "'offset'", "'offsets'")


@pytest.mark.parametrize("argv", [
    ["schedule", "--preset", "cpu-tiny", "--kind", "uniform@32", "--json"],
    ["export", "m", "--out", "m.gguf", "--outtype", "f16"],
    ["eval", "m", "--tasks", "piqa", "--limit", "5", "--strategy", "full"],
    ["perplexity", "m", "--data", "t.txt", "--context", "64"],
    ["attention", "m", "--data", "t.txt", "--out", "a", "--compare", "n"],
])
def test_print_config_round_trips_on_every_settings_command(argv, tmp_path, capsys):
    first = _print_config([*argv, "--print_config"], capsys)
    assert yaml.safe_load(first)  # every setting, not just those given
    cfg = tmp_path / "s.yaml"
    cfg.write_text(first)
    assert _print_config([argv[0], "--config", str(cfg), "--print_config"], capsys) == first


def test_schedule_settings_reach_the_command(capsys):
    assert main(["schedule", "--preset", "cpu-tiny", "--kind", "uniform@32", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"kind": "uniform@32"' in out and '"preset": "cpu-tiny"' in out


def test_print_config_imports_no_torch():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import contextlib, io, sys
        from headbudget.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()):
            rcs = [main(a.split() + ["--print_config"]) for a in (
                "prune m --task sst5 --data-dir d --out o", "prune-compare m --task lm --data t --out o",
                "compress m --out o", "eval m", "train quickstart --train.lr 1e-3", "distill s --teacher t")]
        print(rcs, "torch" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "[0, 0, 0, 0, 0, 0] False", res.stderr


def test_a_flag_given_at_its_default_value_still_beats_the_config_file(tmp_path, capsys):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: m\ntask: sst5\ndata_dir: d\nout: o\npool_size: 8\nprogress: false\n")
    d = yaml.safe_load(_print_config(["prune", "--config", str(cfg), "--print_config"], capsys))
    assert (d["pool_size"], d["progress"]) == (8, False)
    d = yaml.safe_load(_print_config(["prune", "--config", str(cfg), "--pool-size", "32", "--print_config"], capsys))
    assert d["pool_size"] == 32  # 32 is PruneJob's default: given on the command line, it wins over the file


def test_threads_flag_at_zero_beats_the_config_file(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("train:\n  threads: 3\n")
    d = yaml.safe_load(_print_config(["train", str(cfg), "--threads", "0", "--print_config"], capsys))
    assert d["train"]["threads"] == 0  # 0 = automatic, given on the command line: it wins over the file's 3
    d = yaml.safe_load(_print_config(["train", str(cfg), "--print_config"], capsys))
    assert d["train"]["threads"] == 3


@pytest.mark.parametrize(("argv", "command", "parts"), [
    (["prune", "m", "--keep", "x"], "prune", ["--keep", "integer", "'x'"]),
    (["prune", "m", "--keep_ratoi", "0.5"], "prune", ["--keep_ratoi 0.5", "--keep-ratio"]),
    (["train", "quickstart", "--train.lrr=3"], "train", ["--train.lrr=3", "--train.lr"]),
    (["experiment", "ngram", "--stepz", "3"], "experiment ngram", ["--stepz 3", "--steps"]),
])
def test_usage_errors_are_one_line_naming_the_command_and_the_nearest_flag(argv, command, parts, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's own errors: no usage block before the line
        main(argv)
    assert exc.value.code == 2
    assert_names(error_line(capsys.readouterr().err, command), *parts)  # the nearest flag, suggested


@pytest.mark.parametrize("budget", [["--budget", "32"], ["--set", "budget=32"]])
def test_ngram_quick_with_another_budget_drops_the_quick_head_counts_however_the_budget_is_given(budget, capsys):
    pytest.importorskip("torch")
    d = yaml.safe_load(_print_config(["experiment", "ngram", "--quick", *budget, "--print_config"], capsys))
    assert (d["budget"], d["head_counts"]) == (32, None)  # quick's 1,2,4,16,64: 64 does not divide 32


def _help_of(command: str, flag: str) -> str:
    sub = build_parser(command)._subparsers._group_actions[0].choices[command]
    return next(a.help for a in sub._actions if flag in a.option_strings)


def test_help_says_required_only_for_settings_the_command_line_needs():
    # PruneJob.data_dir (str | None, no default) is needed by sst5/mnli only: not "(required)" in prune's help
    assert _help_of("prune", "--data-dir") == "sst5/mnli: folder with the task's files"
    assert _help_of("prune", "--out").endswith("(required)")
    assert _help_of("finetune", "--data-dir").endswith("(required)")  # FinetuneJob.data_dir is a str
    # a section's bool default is spelled as its {true,false} values and YAML spell it
    assert _help_of("train", "--model.bias").endswith("(default: true)")


def test_set_keeps_a_string_setting_as_typed_and_integers_exact(capsys):
    d = yaml.safe_load(_print_config(["train", "quickstart", "--set", "name=010", "--set", "model.schedule=no",
                                      "--set", "data.cache_dir=null", "--set", "data.source='a b'",
                                      "--print_config"], capsys))
    assert (d["name"], d["model"]["schedule"], d["data"]["cache_dir"]) == ("010", "no", None)  # not 8 / False
    assert d["data"]["source"] == "a b"  # a quoted value is unquoted, as YAML would
    big = 2**53 + 1  # float() would round it to 2**53
    d = yaml.safe_load(_print_config(["prune", "m", "--task", "lm", "--out", "o", "--seed", str(big), "--set",
                                      f"calib_seed={big}", "--set", "keep=1e1", "--print_config"], capsys))
    assert (d["seed"], d["calib_seed"], d["keep"]) == (big, big, 10)


def test_prune_help_groups_the_flags_by_what_they_set():
    from headbudget.pruning.job import BASELINES, CAHP, LM, RECOVERY

    sub = build_parser("prune")._subparsers._group_actions[0].choices["prune"]
    flags = {g.title: {o for a in g._group_actions for o in a.option_strings} for g in sub._action_groups}
    assert {"--pool-size", "--var-floor", "--clusters", "--legacy-signatures"} <= flags[CAHP]
    assert {"--gate-lr", "--attattr-steps", "--importance-batches"} <= flags[BASELINES]
    assert flags[RECOVERY] == {"--finetune-epochs", "--lr", "--warmup-ratio", "--weight-decay"}
    assert {"--data", "--context", "--calib-seed", "--eval-data"} <= flags[LM]
    assert {"--task", "--out", "--method", "--keep", "--config"} <= flags["options"]


@pytest.mark.parametrize(("item", "parts"), [
    ("train=3", ["'train'", "section"]),
    ("train.lr.x=3", ["'train.lr'", "key", "section"]),
    ("trian.lr=3", ["section", "'trian'", "'train'"]),  # 'train': the nearest section, suggested
])
def test_set_on_a_section_or_under_a_key_says_which_it_is(item, parts, capsys):
    assert main(["train", "quickstart", "--set", item, "--print_config"]) == 2  # was "unknown key 'train'
    assert_names(error_line(capsys.readouterr().err, "train"), "--set", f"'{item}'", *parts)  # (did you mean ...)


def test_compare_print_config_shows_the_steps_tokens_sets(capsys):
    d = yaml.safe_load(_print_config(["compare", "quickstart", "--tokens", "4096", "--train.batch_size", "2",
                                      "--train.context", "64", "--print_config"], capsys))
    assert d["train"]["steps"] == 32  # 4096 / (2 x 64), as distill's --print_config shows it (was quickstart's 150)


def test_compare_flags_are_its_compare_section_and_train_reads_the_same_file(tmp_path, capsys):
    first = _print_config(["compare", "quickstart", "--schedules", "uniform,reverse", "--seeds", "2", "--reference",
                           "reverse", "--until-flat", "--no-save-models", "--margin", "0.02", "--out", "runs/c",
                           "--print_config"], capsys)
    d = yaml.safe_load(first)
    assert d["compare"] == {"schedules": "uniform,reverse", "seeds": 2, "reference": "reverse", "until_flat": True,
                            "save_models": False, "margin": 0.02}
    assert (d["out"], d["name"], d["train"]["steps"]) == ("runs/c", "quickstart", 150)
    cfg = tmp_path / "cmp.yaml"
    cfg.write_text(first)
    assert _print_config(["compare", str(cfg), "--print_config"], capsys) == first  # round trip
    assert yaml.safe_load(_print_config(["compare", str(cfg), "--set", "compare.seeds=3", "--seeds", "4",
                                         "--print_config"], capsys))["compare"]["seeds"] == 4  # flag beats --set
    # train reads compare's file: the run config, its compare: section checked and left out
    assert _print_config(["train", str(cfg), "--print_config"], capsys) == first.split("compare:\n")[0]
    cfg.write_text(first.replace("  seeds: 2", "  sedes: 2"))
    for command in ("train", "compare"):
        assert main([command, str(cfg), "--print_config"]) == 2
        assert_names(error_line(capsys.readouterr().err, command), f"{cfg}:", "'compare.sedes'", "'compare.seeds'")
    assert main(["compare", "quickstart", "--seeds", "0", "--print_config"]) == 2  # before any training
    assert_names(error_line(capsys.readouterr().err, "compare"), "compare.seeds", "--seeds", "1", "0")


def test_train_init_is_model_init_and_takes_the_model_tokenizer_unless_one_is_given(capsys):
    d = yaml.safe_load(_print_config(["train", "quickstart", "--init", "runs/p", "--print_config"], capsys))
    assert (d["model"]["init"], d["data"]["tokenizer"]) == ("runs/p", "model")
    for extra in (["--data.tokenizer", "byte"], ["--set", "data.tokenizer=byte"]):
        d = yaml.safe_load(_print_config(["train", "quickstart", "--init", "runs/p", *extra, "--print_config"],
                                         capsys))
        assert (d["model"]["init"], d["data"]["tokenizer"]) == ("runs/p", "byte")
    d = yaml.safe_load(_print_config(["train", "quickstart", "--print_config"], capsys))
    assert (d["model"]["init"], d["data"]["tokenizer"]) == (None, "bpe:512")


def test_train_tokens_sets_the_steps_for_python_callers_too():
    from headbudget.train.config import RunConfig

    cfg = RunConfig.from_dict({"train": {"tokens": "1M"}})  # 1,000,000 / (16 x 128) = 488.28 -> 489
    assert (cfg.train.steps, cfg.train.tokens) == (489, "1M")
    assert cfg.replace(train={"batch_size": 32}).train.steps == 245  # the budget follows the batch
    assert (cfg.replace(train={"steps": 7}).train.steps, cfg.replace(train={"steps": 7}).train.tokens) == (7, None)
    with pytest.raises(ValueError, match=names("train.tokens", "--tokens", "'lots'", "positive")):
        RunConfig.from_dict({"train": {"tokens": "lots"}})


def test_task_lm_defaults_to_no_recovery_fine_tuning_in_the_library_and_the_cli(tmp_path, capsys):
    # the rule lives in PruneJob (was only in prune_cmd: a Python caller's lm job fine-tuned 3 epochs)
    assert PruneJob("m", "lm", None, "o").finetune_epochs == 0
    assert PruneJob("m", "sst5", "d", "o").finetune_epochs == 3
    assert PruneJob("m", "lm", None, "o", finetune_epochs=2).finetune_epochs == 2
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: m\ntask: lm\ndata: t.txt\nout: o\n")
    for extra, epochs in (([], 0), (["--finetune-epochs", "2"], 2), (["--task", "sst5", "--data-dir", "d"], 3)):
        d = yaml.safe_load(_print_config(["prune", "--config", str(cfg), *extra, "--print_config"], capsys))
        assert d["finetune_epochs"] == epochs, extra


# ------------------------------------------------------------------ CONFIG or --config FILE
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
    assert_names(error_line(capsys.readouterr().err, command), "CONFIG", "--config FILE")


@pytest.mark.parametrize("command", ["train", "compare"])
def test_commands_that_need_a_config_refuse_to_run_without_one(command, capsys):
    capsys.readouterr()
    assert main([command, "--print_config"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n")
    assert_names(error_line(err, command), "CONFIG", "--config FILE", "quickstart", "cpu-small", "gpt2-124m")


def test_prepare_needs_no_config(capsys):
    assert _printed(["prepare", "--print_config"], capsys)["data"]["source"] == "synthetic:1000000"


# ------------------------------------------------------------------ experiment --out / --no-progress as fields
@pytest.mark.parametrize("name", ["saturation", "ngram"])
def test_experiment_out_and_no_progress_round_trip_through_print_config(name, tmp_path, capsys):
    d = _printed(["experiment", name, "--out", str(tmp_path / "o"), "--no-progress", "--print_config"], capsys)
    assert (d["out"], d["progress"]) == (str(tmp_path / "o"), False)
    f = tmp_path / "cfg.yaml"
    f.write_text(yaml.safe_dump(d))
    assert _printed(["experiment", name, "--config", str(f), "--print_config"], capsys) == d
    defaults = _printed(["experiment", name, "--print_config"], capsys)
    assert (defaults["out"], defaults["progress"]) == (f"results/{name}", True)
