"""The pruning-method registry (:mod:`headbudget.pruning.methods`): a scorer a user registers is a method of
``run_prune`` / ``run_prune_compare`` / the CLI, keeps exactly the heads its scores say, and unknown names are a
one-line error listing the registered ones.  The registry is the one table of importances: ``importance_table``
is a live, read-only view of it, and ``score_heads`` / ``select_by_method`` read it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import assert_names, error_line, names
from headbudget.pruning import methods
from headbudget.pruning.job import PruneCompareJob, PruneJob
from test_cahp_pipeline import DATA, _save_tiny  # tests/ is on sys.path under pytest

BUILTINS = ("cahp", "michel", "fisher", "magnitude", "random", "pipelined-dsp", "joint-dsp", "joint-dsp-finetuned",
            "pass", "pass-frozen", "attattr")
# tiny BERT: 2 layers x 4 heads; flat index = layer * 4 + head
SCORES = [np.array([0.1, 0.9, 0.2, 0.3]), np.array([0.8, 0.05, 0.7, 0.6])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("models"), "bert")


@pytest.fixture
def registered():
    """Names a test registers; removed afterwards so the registry stays the built-ins for other tests."""
    names: list[str] = []
    yield names
    for name in names:
        if name in methods.available_importances():
            methods.unregister(name)


def _job(model, out, **kw):
    base = dict(model=str(model), task="sst5", data_dir=str(DATA), out=str(out), pool_size=8, batch_size=16,
                finetune_epochs=0, progress=False, limit_train=32, limit_eval=16, save_model=False)
    base.update(kw)
    return (PruneCompareJob if "methods" in kw else PruneJob)(**base)  # with methods: a comparison


def test_builtins_are_registered_in_the_old_order():
    assert methods.available_importances()[: len(BUILTINS)] == BUILTINS
    assert methods.get_importance("cahp").finds_count and not methods.get_importance("fisher").finds_count
    assert methods.get_importance("pass").job_fields == ("gate_lr", "pretrained", "joint_epochs")
    assert methods.get_importance("pass-frozen").job_fields == ("gate_lr", "gate_epochs")


def test_user_scorer_decides_the_kept_heads(tiny, tmp_path, registered):
    from headbudget.pruning.pipeline import run_prune

    seen = {}

    @methods.register_importance("fixed-scores")
    def fixed(ctx):
        seen["counts"], seen["batches"] = ctx.head_counts, len(ctx.batches)
        return SCORES

    registered.append("fixed-scores")
    res = run_prune(_job(tiny, tmp_path / "fixed", method="fixed-scores", keep=4, importance_batches=1))
    # each layer's best (0,1) 0.9 and (1,0) 0.8, then the best of the rest: (1,2) 0.7, (1,3) 0.6
    assert res["report"]["kept"] == {"0": [1], "1": [0, 2, 3]}
    assert res["report"]["method"] == "fixed-scores" and res["report"]["heads_kept"] == 4
    assert res["details"]["scores"].tolist() == np.concatenate(SCORES).tolist()
    assert seen == {"counts": [4, 4], "batches": 1}
    # the opposite scores keep the opposite heads
    methods.register_importance("negated", lambda ctx: [-s for s in SCORES])
    registered.append("negated")
    res = run_prune(_job(tiny, tmp_path / "negated", method="negated", keep=4))
    # layer bests (0,0) -0.1 and (1,1) -0.05, then (0,2) -0.2, (0,3) -0.3
    assert res["report"]["kept"] == {"0": [0, 2, 3], "1": [1]}
    assert json.loads((tmp_path / "negated" / "report.json").read_text())["kept"] == {"0": [0, 2, 3], "1": [1]}


def test_user_scorer_in_a_comparison_and_a_class_registers_an_instance(tiny, tmp_path, registered):
    from headbudget.pruning.compare import run_prune_compare

    @methods.register_importance("by-class")
    class ByClass:  # Torch-Pruning style: an object with __call__(ctx)
        def __call__(self, ctx):
            return SCORES

    registered.append("by-class")
    assert isinstance(ByClass, type)  # the decorator gives the class back
    summary = run_prune_compare(_job(tiny, tmp_path / "cmp", keep=4, methods="by-class,random"))
    rows = {r["label"]: r for r in summary["rows"]}
    assert rows["by-class"]["kept"] == {"0": [1], "1": [0, 2, 3]}
    assert rows["random"]["heads_kept"] == 4 and rows["by-class"]["count_from"] == "keep=4"


def test_user_selector_that_finds_its_own_count_leads_a_comparison(tiny, tmp_path, registered):
    from headbudget.pruning.compare import run_prune_compare

    targets = []

    def first_of_each_layer(run):
        targets.append(run.target)
        return methods.Selection(kept=[0, 4, 5] if run.target is None else select(run.target))

    def select(n):
        return sorted([0, 4, 1, 5, 2, 6][:n])

    methods.register_selector("firsts", first_of_each_layer, finds_count=True)
    registered.append("firsts")
    summary = run_prune_compare(_job(tiny, tmp_path / "cmp", methods="firsts,magnitude"))
    rows = {r["label"]: r for r in summary["rows"]}
    assert targets == [None] and rows["firsts"]["kept"] == {"0": [0], "1": [0, 1]}
    assert rows["magnitude"]["heads_kept"] == 3 and rows["magnitude"]["count_from"] == "firsts knee"


def test_unknown_method_is_one_line_listing_the_registered_names(tiny, tmp_path, registered, capsys):
    from headbudget.cli.main import main
    from headbudget.pruning.compare import parse_methods
    from headbudget.pruning.pipeline import check_job

    methods.register_importance("mine", lambda ctx: SCORES)
    registered.append("mine")
    listed = [*BUILTINS, "mine"]  # the choices, the registered one included
    with pytest.raises(methods.UnknownMethodError) as e:
        check_job(_job(tiny, tmp_path / "x", method="nope", keep=4))
    assert_names(str(e.value), "'nope'", *listed)
    with pytest.raises(ValueError) as e:
        parse_methods("cahp,nope")
    assert_names(str(e.value), "'cahp,nope'", "'nope'", *listed)
    code = main(["prune", str(tiny), "--task", "sst5", "--data-dir", str(DATA),
                 "--out", str(tmp_path / "cli"), "--method", "nope", "--keep", "4", "--no-progress"])
    assert code == 2
    assert_names(error_line(capsys.readouterr().err, "prune"), "'nope'", *listed)
    assert not (tmp_path / "cli" / "report.json").exists()


def test_registration_errors_and_a_scorer_of_the_wrong_shape(tiny, tmp_path, registered):
    from headbudget.pruning.pipeline import check_job, run_prune

    with pytest.raises(ValueError, match=names("'fisher'", "registered")):
        methods.register_importance("fisher", lambda ctx: SCORES)
    with pytest.raises(ValueError, match=names("'a,b'")):
        methods.register_importance("a,b", lambda ctx: SCORES)
    with pytest.raises(TypeError, match=names("register_importance", "'broken'", 3)):
        methods.register_importance("broken", 3)
    assert "a,b" not in methods.available_importances() and "broken" not in methods.available_importances()
    methods.register_importance("short", lambda ctx: [np.ones(4)])
    registered.append("short")
    with pytest.raises(ValueError, match=names("short", "keep", "keep_ratio")):
        check_job(_job(tiny, tmp_path / "s", method="short"))
    with pytest.raises(ValueError, match=names("'short'", "[4]", "[4, 4]")):
        run_prune(_job(tiny, tmp_path / "s", method="short", keep=4))
    methods.register_selector("layer-0-only", lambda run: methods.Selection(kept=[0, 1, 2, 3]))
    registered.append("layer-0-only")
    with pytest.raises(ValueError, match=names("'layer-0-only'", "layer 1")):
        run_prune(_job(tiny, tmp_path / "l0", method="layer-0-only", keep=4))
    methods.register_selector("out-of-range", lambda run: methods.Selection(kept=[0, 8]))
    registered.append("out-of-range")
    with pytest.raises(ValueError, match=names("[0, 8]", "0..7")):
        run_prune(_job(tiny, tmp_path / "oor", method="out-of-range", keep=4))


def test_a_comparison_runs_every_methods_check_before_any_method(tiny, tmp_path, registered):
    from headbudget.pruning.compare import run_prune_compare

    def refuse(job):
        raise ValueError(f"method picky cannot run on task {job.task} ({job.method})")

    methods.register_importance("picky", lambda ctx: SCORES, check=refuse)
    registered.append("picky")
    with pytest.raises(ValueError, match=r"^method picky cannot run on task sst5 \(picky\)$"):
        run_prune_compare(_job(tiny, tmp_path / "cmp", keep=4, methods="random,picky"))
    assert not (tmp_path / "cmp" / "random").exists()  # was: random ran (and wrote its folder) first


def _install_plugin(root, monkeypatch, entry_points: str, module: str, name: str = "hb_demo_plugin") -> None:
    """An installed distribution outside src: a module and a dist-info whose entry_points.txt names it."""
    root.mkdir()
    (root / f"{name}.py").write_text(module)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{methods.ENTRY_POINT_GROUP}]\n{entry_points}\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(methods, "_plugins_loaded", False)


def test_an_installed_package_adds_an_importance_the_cli_can_use(tiny, tmp_path, monkeypatch, registered, capsys):
    from headbudget.cli.main import main

    _install_plugin(tmp_path / "site", monkeypatch, "fixed-plugin = hb_demo_plugin:scores\nbroken = hb_demo_plugin:gone",
                    "import numpy as np\n\ndef scores(ctx):\n"
                    "    return [np.array([0.1, 0.9, 0.2, 0.3]), np.array([0.8, 0.05, 0.7, 0.6])]\n")
    registered.append("fixed-plugin")
    rc = main(["prune", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--method", "fixed-plugin", "--keep", "4",
               "--finetune-epochs", "0", "--limit-train", "32", "--limit-eval", "16", "--no-progress",
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 0, err
    # the plug-in's scores decide, as a registered scorer's do (see test_user_scorer_decides_the_kept_heads)
    assert json.loads((tmp_path / "out" / "report.json").read_text())["kept"] == {"0": [1], "1": [0, 2, 3]}
    # the broken entry point is one warning line and stays out; the built-ins and the good plug-in are in
    assert [ln for ln in err.splitlines() if "plug-in" in ln] == [
        "headbudget: warning: importance plug-in broken = hb_demo_plugin:gone not loaded: "
        "module 'hb_demo_plugin' has no attribute 'gone'"]
    assert methods.available_importances()[: len(BUILTINS)] == BUILTINS
    assert "fixed-plugin" in methods.available_importances() and "broken" not in methods.available_importances()


PLUGIN_WITH_SETTINGS = """
import dataclasses
import numpy as np

@dataclasses.dataclass
class Settings:
    shift: int = dataclasses.field(default=0, metadata={"help": "rotate each layer's scores by this many heads"})

def scores(ctx):
    base = [np.array([0.1, 0.9, 0.2, 0.3]), np.array([0.8, 0.05, 0.7, 0.6])]
    return [np.roll(s, ctx.job.shift) for s in base]

scores.settings = Settings
"""


def test_a_plugin_declares_its_own_settings_and_they_are_flags_config_keys_and_job_fields(
        tiny, tmp_path, monkeypatch, registered, capsys):
    from headbudget.cli.main import build_parser, main
    from headbudget.pruning.pipeline import _job_fingerprint

    _install_plugin(tmp_path / "site", monkeypatch, "shifted = hb_shift_plugin:scores", PLUGIN_WITH_SETTINGS,
                    name="hb_shift_plugin")
    registered.append("shifted")
    sub = build_parser("prune")._subparsers._group_actions[0].choices["prune"]
    assert "--shift" in sub.format_help() and "rotate each layer's scores" in sub.format_help()
    base = ["prune", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--method", "shifted", "--keep", "4",
            "--finetune-epochs", "0", "--limit-train", "32", "--limit-eval", "16", "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "o"), "--shift", "1", "--print_config"]) == 0
    assert "shift: 1\n" in capsys.readouterr().out
    compare = ["prune-compare", str(tiny), "--task", "sst5", "--data-dir", str(DATA), "--out", str(tmp_path / "c")]
    assert main([*compare, "--methods", "shifted,fisher", "--shift", "2", "--print_config"]) == 0
    assert "shift: 2\n" in capsys.readouterr().out
    assert main([*compare, "--methods", "shifted", "--shift", "1", "--keep", "4", "--finetune-epochs", "0",
                 "--limit-train", "32", "--limit-eval", "16", "--no-progress"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "c" / "shifted" / "report.json").read_text())["kept"] == {"0": [2], "1": [0, 1, 3]}
    cfg = tmp_path / "job.yaml"
    cfg.write_text("shift: 1\n")
    assert main([*base, "--config", str(cfg), "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    # rolled by one head: layer 0 scores [0.3, 0.1, 0.9, 0.2], layer 1 [0.6, 0.8, 0.05, 0.7]; the 4 best with a
    # head per layer are 0.9 (0,2), 0.8 (1,1), 0.7 (1,3), 0.6 (1,0) -- not the unshifted {0: [1], 1: [0, 2, 3]}
    assert json.loads((tmp_path / "out" / "report.json").read_text())["kept"] == {"0": [2], "1": [0, 1, 3]}
    # the registry knows the setting is this method's: another method's fingerprint leaves it out
    job_cls = methods.with_method_settings(PruneJob)
    assert methods.method_job_fields()["shifted"] == ("shift",)
    fisher = job_cls("m", "lm", None, "o", method="fisher", shift=3)
    assert "shift" not in _job_fingerprint(fisher) and _job_fingerprint(dataclasses.replace(
        fisher, method="shifted"))["shift"] == 3
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*base, "--out", str(tmp_path / "bad"), "--shift", "x"])
    assert_names(error_line(capsys.readouterr().err, "prune"), "--shift", "'x'")


def test_builtin_methods_register_their_settings_and_the_job_is_composed_of_them():
    from headbudget.pruning.job import AttAttrSettings, CahpSettings, DspPassSettings, join_settings

    settings = {name: methods.get_importance(name).settings for name in BUILTINS}
    assert settings == {"cahp": CahpSettings, "michel": None, "fisher": None, "magnitude": None, "random": None,
                        "pipelined-dsp": DspPassSettings, "joint-dsp": DspPassSettings,
                        "joint-dsp-finetuned": DspPassSettings, "pass": DspPassSettings,
                        "pass-frozen": DspPassSettings, "attattr": AttAttrSettings}
    own = {f.name for s in (CahpSettings, DspPassSettings, AttAttrSettings) for f in dataclasses.fields(s)}
    assert len(own) == 22 and own <= {f.name for f in dataclasses.fields(PruneJob)}
    assert methods.with_method_settings(PruneJob) is PruneJob  # every built-in's settings are PruneJob's already
    assert methods.method_job_fields()["attattr"] == ("attattr_examples", "attattr_steps")
    with pytest.raises(TypeError) as info:  # a plug-in may not redeclare a setting of the job
        join_settings(PruneJob, [dataclasses.make_dataclass("Mine", [("seed", int, dataclasses.field(default=0))])])
    assert_names(str(info.value), "seed", "PruneJob's")
    with pytest.raises(TypeError) as info:  # settings without defaults could not be left out on the command line
        methods.register_importance("needs", lambda ctx: [], settings=dataclasses.make_dataclass("S", [("x", int)]))
    assert_names(str(info.value), "'needs'")


@pytest.mark.parametrize("field", ["seed", "calibration_seeds"])  # PruneJob's, prune-compare's own
def test_a_method_whose_settings_clash_is_refused_when_registered_so_the_cli_still_builds(registered, field):
    from headbudget.cli.main import build_parser

    registered.append("clashing")
    mine = dataclasses.make_dataclass("Mine", [(field, int, dataclasses.field(default=0))])
    with pytest.raises(TypeError) as info:  # an installed plug-in: load_plugins' one warning line, left out
        methods.register_importance("clashing", lambda ctx: [], settings=mine)
    assert_names(str(info.value), field, "PruneCompareJob's")
    assert "clashing" not in methods.available_importances()
    for command in ("prune", "prune-compare"):  # were a TypeError traceback for every prune command
        build_parser(command)


# ---------------------------------------------------------------------------- the registry is the one table
def test_the_importance_table_is_a_live_read_only_view_of_the_registry():
    from headbudget.pruning import importance

    @methods.register_importance("test-scorer")
    def scorer(ctx):
        return [np.arange(n, dtype=float) for n in ctx.head_counts]

    try:
        table = methods.importance_table()
        assert not hasattr(importance, "IMPORTANCES")  # no module-level table: the registry is the only one
        assert table["test-scorer"] is scorer  # registered after import: the registry is the table
        assert set(table) == set(methods.importance_table()) >= {"michel", "fisher", "magnitude", "random"}
        assert "cahp" not in table  # a selector without per-head scores
        with pytest.raises(TypeError):
            table["other"] = scorer  # read-only
    finally:
        methods.unregister("test-scorer")
    assert "test-scorer" not in table


def test_select_by_method_and_score_heads_read_the_registry():
    ctx = type("Ctx", (), {"head_counts": [3, 2]})()
    methods.register_importance("last-head-first", lambda c: [np.arange(n, dtype=float) for n in c.head_counts])
    try:
        assert [list(s) for s in methods.score_heads("last-head-first", ctx)] == [[0, 1, 2], [0, 1]]
        kept, flat = methods.select_by_method("last-head-first", ctx, 3)
        assert kept == [1, 2, 4] and list(flat) == [0, 1, 2, 0, 1]
    finally:
        methods.unregister("last-head-first")
    with pytest.raises(ValueError, match=names("'cahp'", "michel", "fisher", "magnitude", "random")):
        methods.score_heads("cahp", ctx)
