"""Run configs: YAML loading, --set overrides with type coercion, unknown keys, bundled configs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import assert_names, error_line, names
from headbudget.train.config import RunConfig, apply_overrides, load_config, resolve_config_path
from headbudget.train.setup import build_schedule, lr_at
from headbudget.typed_config import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_overrides_coerce_to_field_types():
    cfg = apply_overrides(RunConfig(), [
        "train.lr=3e-4", "train.steps=1e3", "train.compile=yes", "model.vocab_size=auto",
        "model.d_model=256", "data.max_chars=null", "data.source=synthetic:500", "seed=7",
    ])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 1000 and isinstance(cfg.train.steps, int)
    assert cfg.train.compile is True
    assert cfg.model.vocab_size is None and cfg.model.d_model == 256
    assert cfg.data.source == "synthetic:500" and cfg.seed == 7


def test_yaml_strings_like_3e_4_become_floats(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 3e-4\n  steps: 20\nmodel:\n  schedule: uniform@64\n")
    cfg = RunConfig.load(p)
    assert cfg.train.lr == 0.0003 and cfg.model.schedule == "uniform@64"


def test_unknown_keys_are_errors_naming_the_key_and_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=names(p, "key", "'train.learning_rate'")):
        RunConfig.load(p)
    with pytest.raises(ConfigError, match=names("key", "'train.lrr'")):
        apply_overrides(RunConfig(), ["train.lrr=1"])
    with pytest.raises(ConfigError, match=names("section", "'optim'")):
        apply_overrides(RunConfig(), ["optim.lr=1"])
    with pytest.raises(ConfigError, match=names("--set", "'train.lr'", "KEY=VALUE")):
        apply_overrides(RunConfig(), ["train.lr"])
    with pytest.raises(ConfigError, match=names("train.steps", "integer", "'ten'")):
        apply_overrides(RunConfig(), ["train.steps=ten"])
    with pytest.raises(ConfigError, match=names("train.steps", "integer", "2.5")):
        apply_overrides(RunConfig(), ["train.steps=2.5"])


def test_invalid_yaml_names_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=re.escape(str(p)) + r":\d+") as exc:  # FILE:LINE
        RunConfig.load(p)
    assert exc.match(names("YAML"))


@pytest.mark.parametrize("name", ["quickstart", "cpu-small", "gpt2-124m", "gpt2-354m", "gpt-757m"])
def test_bundled_configs_load_and_build_every_schedule(name):
    cfg = load_config(resolve_config_path(name))
    assert cfg.name == name
    for sched in ("uniform", "prism", "reverse"):
        s = build_schedule(cfg.replace(model={"schedule": sched}))
        assert s.d_model * s.n_layers == s.budget  # neutral: same parameters as uniform
    if name.startswith("gpt"):
        assert cfg.train.context == 1024 and cfg.data.source.startswith("hf:")


def test_model_hidden_act_reaches_the_model_and_a_wrong_one_is_refused():
    from headbudget.train.setup import build_model

    exact = build_model(apply_overrides(RunConfig(), ["model.hidden_act=gelu"]), 256)
    assert exact.config.hidden_act == "gelu" and exact.transformer.h[0].mlp.gelu_approximate == "none"
    assert build_model(RunConfig(), 256).transformer.h[0].mlp.gelu_approximate == "tanh"
    with pytest.raises(ConfigError, match=names("model.hidden_act", "'relu'", "gelu_new", "gelu")):
        apply_overrides(RunConfig(), ["model.hidden_act=relu"])


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = apply_overrides(RunConfig(), ["train.lr=1.0", "train.warmup_steps=10", "train.steps=110",
                                        "train.min_lr_ratio=0.1"])
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(110, cfg) == pytest.approx(0.1)


def test_replace_and_round_trip_through_yaml(tmp_path):
    cfg = RunConfig().replace(seed=3, model={"schedule": "prism"})
    p = tmp_path / "rt.yaml"
    p.write_text(cfg.to_yaml())
    assert RunConfig.load(p) == cfg


@pytest.mark.parametrize("tokens", ["1e30", "1e20", "2e15", "inf", "nan", "-5", "0"])
def test_absurd_token_counts_are_one_line_naming_the_flag_and_value(tokens, capsys):
    from headbudget.cli.main import main

    with pytest.raises(ValueError, match=names("train.tokens", "--tokens", f"'{tokens}'")):
        RunConfig.from_dict({"train": {"tokens": tokens}})
    assert main(["compare", "quickstart", "--tokens", tokens, "--print_config"]) == 2  # inf: was a traceback
    assert_names(error_line(capsys.readouterr().err, "compare"), "--tokens", f"'{tokens}'")


def test_token_counts_and_steps_no_run_can_take_are_refused():
    from headbudget.train.config import MAX_STEPS, parse_token_count

    assert parse_token_count("1e15") == 10**15  # the most tokens a run may read
    # tiny batches: a plausible token count, an impossible number of steps (1e12 / 8 = 1.2e11)
    with pytest.raises(ConfigError, match=names("train.tokens", "--tokens", "'1e12'", "1.2e11", "1 x 8")):
        RunConfig.from_dict({"train": {"tokens": "1e12", "batch_size": 1, "context": 8}})
    with pytest.raises(ConfigError, match=names("train.steps", MAX_STEPS * 1000 + 1)):
        apply_overrides(RunConfig(), [f"train.steps={MAX_STEPS * 1000 + 1}"])
    assert apply_overrides(RunConfig(), [f"train.steps={MAX_STEPS}"]).train.steps == MAX_STEPS


@pytest.mark.parametrize("item", ["train.lr=inf", "train.lr=nan", "train.grad_clip=nan", "train.min_lr_ratio=nan",
                                  "train.weight_decay=-inf", "model.dropout=nan", "distill.temperature=inf",
                                  "data.val_fraction=nan"])
def test_non_finite_float_settings_are_one_line_naming_the_key(item, capsys):
    """inf or nan in a float setting is a typo (lr=inf diverged at step 1, grad_clip=nan turned clipping off):
    refused with the config, before any work."""
    from headbudget.cli.main import main

    key, value = item.split("=")
    with pytest.raises(ConfigError, match=names(key, "finite", value)):
        apply_overrides(RunConfig(), [item])
    assert main(["train", "quickstart", "--set", item, "--print_config"]) == 2
    assert_names(error_line(capsys.readouterr().err, "train"), key, "finite", value)


@pytest.mark.parametrize("margin", ["inf", "nan", "0", "-1"])
def test_compare_margin_must_be_finite_and_positive(margin, capsys):
    from headbudget.cli.main import main
    from headbudget.train.config import CompareConfig

    assert main(["compare", "quickstart", "--margin", margin, "--print_config"]) == 2  # inf was accepted
    assert_names(error_line(capsys.readouterr().err, "compare"), "compare.margin", "--margin", float(margin))
    with pytest.raises(ValueError, match=names("compare.margin", "--margin", float(margin))):  # Python callers too
        CompareConfig.from_run(RunConfig(), schedules="uniform", margin=float(margin))
