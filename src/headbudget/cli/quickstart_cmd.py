"""``headbudget quickstart``: the main job end to end on the built-in corpus, in a few CPU minutes.

    headbudget quickstart --out runs/quickstart
    headbudget quickstart --set train.steps=300 --print_config     # its run config, as train/compare read it

Stages: prepare the synthetic corpus, train a uniform and a prism ``cpu-tiny`` model on identical batches,
compare their validation loss and write ``report.md`` / ``compare.json`` / ``loss_curves.png``, printing where
each file is and how long every stage took.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from headbudget.cli.dataclass_flags import (
    add_config_flags,
    add_dataclass_flags,
    add_overwrite_flag,
    build,
    print_config,
    settings_mapping,
)
from headbudget.io import atomic_write_json, atomic_write_text
from headbudget.progress import library_bars
from headbudget.train.config import (
    CompareConfig,
    DataSection,
    RunConfig,
    apply_overrides,
    resolve_config_path,
)

#: ``--tiny`` (hidden, for tests): seconds instead of minutes.
TINY_OVERRIDES = [
    "data.source=synthetic:20000", "data.tokenizer=byte", "model.n_layers=3", "model.d_model=64",
    "model.n_heads=2", "model.prism_max_head_dim=32", "model.prism_min_head_dim=8", "train.steps=6",
    "train.batch_size=4", "train.context=32", "train.eval_every=3", "train.eval_batches=2",
    "train.log_every=3", "train.warmup_steps=2",
]

SCHEDULES = ("uniform", "prism")


def quickstart_config(overrides: list[str] | None = None, tiny: bool = False) -> RunConfig:
    """The bundled ``quickstart`` config (package data, so a wheel install has it), then ``--tiny`` and ``--set``."""
    cfg = RunConfig.load(resolve_config_path("quickstart"))
    return apply_overrides(cfg, (TINY_OVERRIDES if tiny else []) + list(overrides or []))


def _attention_stage(summary: dict[str, Any], data, cfg: RunConfig, out: Path) -> str:
    """Per-layer mean attention distance of the two trained models on fixed validation windows: writes
    ``attention.json`` and ``attention_distance.png``, returns a markdown section."""
    from headbudget.analysis.attention import attention_summary, plot_distance_comparison, write_json
    from headbudget.data.loader import val_batches
    from headbudget.models import HeadBudgetForCausalLM

    n_seqs = 2 if cfg.train.batch_size < 8 else 8
    ids = val_batches(data.val, n_batches=1, batch_size=n_seqs, context=cfg.train.context)[0][0]
    summaries = {}
    for run in summary["runs"]:
        model = HeadBudgetForCausalLM.from_pretrained(str(out / run["run_dir"] / "model"))
        summaries[run["schedule"]] = attention_summary(model, ids, local_window=8, batch_size=2)
    write_json(summaries, out / "attention.json")
    plot_distance_comparison(summaries, out / "attention_distance.png",
                             title="mean attention distance per head (tokens)")
    names = list(summaries)
    lines = ["## Attention distance", "",
             f"Mean attention distance (tokens back, averaged over heads and {n_seqs} validation windows of "
             f"{cfg.train.context} tokens) per layer; local share = mass on the 8 most recent tokens.", "",
             "| layer | " + " | ".join(f"{n} heads | {n} distance | {n} local share" for n in names) + " |",
             "|---:|" + "---:|---:|---:|" * len(names)]
    for i in range(len(summaries[names[0]]["layers"])):
        cells = [f"{r['n_heads']} | {r['mean_distance']:.1f} | {r['mean_local_share']:.2f}"
                 for r in (summaries[n]["layers"][i] for n in names)]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines += ["", "![attention distance](attention_distance.png)", ""]
    return "\n".join(lines)


def _validate(args: argparse.Namespace) -> None:
    """The bundled config, --tiny, then --config, --set and the flags given, read before torch is imported
    (cli.main calls it first)."""
    base = quickstart_config(tiny=args.tiny).to_dict()
    if getattr(args, "threads", None):  # --threads (cli.main) wins over train.threads
        base["train"]["threads"] = args.threads
    args.cfg = build(RunConfig, settings_mapping(RunConfig, args, base=base), args)


def cmd_quickstart(args: argparse.Namespace) -> int:
    from headbudget.run_dir import claim_output_dir

    if getattr(args, "cfg", None) is None:
        _validate(args)
    if args.print_config:
        return print_config(args.cfg)
    cfg = args.cfg.replace(out=args.cfg.out or "runs/quickstart")
    # its data-cache/ is a cache, not a result: kept by --overwrite, never a reason to refuse
    if cfg.data.cache_dir is None:  # in the claimed folder itself, not in an --overwrite's staging folder
        cfg = cfg.replace(data={"cache_dir": str(Path(cfg.out) / "data-cache")})
    with claim_output_dir(cfg.out, command="headbudget quickstart", overwrite=args.overwrite, keep=("data-cache",),
                          inputs={"--config": getattr(args, "config", None)}) as write_to:
        return _quickstart(cfg, write_to)


@library_bars(False)  # it draws its own bars: transformers' per-file load/save bars stay off
def _quickstart(cfg: RunConfig, write_to: Path) -> int:
    """The quickstart writing into ``write_to`` (``cfg.out``, or the staging folder of an --overwrite)."""
    from headbudget.train.compare import run_compare
    from headbudget.train.setup import prepare_for

    t_all = time.perf_counter()
    out, shown = Path(write_to), Path(cfg.out)
    timings: dict[str, float] = {}
    print(f"headbudget quickstart -> {shown}")
    print(f"[1/4] preparing {cfg.data.source} with tokenizer {cfg.data.tokenizer} ...", flush=True)
    t0 = time.perf_counter()
    data = prepare_for(cfg, progress=False)
    timings["prepare data"] = time.perf_counter() - t0
    m = data.meta
    print(f"      {m['train_tokens']:,} train / {m['val_tokens']:,} val tokens, vocab {m['vocab_size']} "
          f"({'cached' if data.reused else 'built'}) in {timings['prepare data']:.1f}s", flush=True)

    stage = {"i": 2, "t": time.perf_counter()}

    def on_run(sched: str, seed: int, result) -> None:
        dt = time.perf_counter() - stage["t"]
        timings[f"train {sched}"] = dt
        print(f"      {sched}: val loss {result.final_val_loss:.4f} ({result.params:,} params, "
              f"{result.tokens_per_s:,.0f} tokens/s) in {dt:.1f}s", flush=True)
        stage["i"] += 1
        stage["t"] = time.perf_counter()
        if stage["i"] <= 3:
            print(f"[{stage['i']}/4] training {SCHEDULES[stage['i'] - 2]} ...", flush=True)

    print(f"[2/4] training {SCHEDULES[0]} ({cfg.model.preset}, {cfg.train.steps} steps x "
          f"{cfg.train.batch_size} x {cfg.train.context} tokens) ...", flush=True)
    # one seed (cfg.seed) keeps it to minutes on a CPU; `compare --seeds 3` is the way to judge the noise
    settings = CompareConfig.from_run(cfg, schedules=",".join(SCHEDULES), seeds=1)
    summary = run_compare(settings, out, data=data, on_run=on_run)
    t0 = time.perf_counter()
    print("[4/4] attention distance and report", flush=True)
    att = _attention_stage(summary, data, cfg, out)
    timings["attention analysis"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_all
    s = summary["schedules"]
    u, p = s["uniform"]["val_loss_mean"], s["prism"]["val_loss_mean"]
    better = "prism" if p < u else "uniform"
    print(f"      val loss: uniform {u:.4f}   prism {p:.4f}   (Δ prism-uniform {p - u:+.4f}; lower is "
          f"better: {better}; one seed - use `headbudget compare --seeds 3` to judge noise)")
    text = (out / "report.md").read_text() + "\n" + att
    text += "\n## Quickstart stage times\n\n| stage | seconds |\n|---|---:|\n" + "".join(
        f"| {k} | {v:.1f} |\n" for k, v in timings.items())
    atomic_write_text(out / "report.md", text)
    atomic_write_json(out / "timings.json", timings)
    print("      stage times: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    print(f"      report: {shown / 'report.md'}\n      curves: {shown / 'loss_curves.png'}\n"
          f"      numbers: {shown / 'compare.json'}")
    print(f"      attention: {shown / 'attention_distance.png'}, {shown / 'attention.json'}")
    print(f"      models: {shown / 'uniform-seed0' / 'model'}, {shown / 'prism-seed0' / 'model'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart", help="train uniform vs prism on the built-in corpus (a few CPU minutes)",
                       description="Prepare the synthetic corpus, train a uniform and a prism model, compare. "
                                   "The settings are the bundled quickstart run config (train's; --set any key); "
                                   "the data cache is OUT/data-cache unless --cache-dir names one.")
    add_dataclass_flags(p, RunConfig, aliases={"data.cache_dir": ("--cache-dir",)},  # --out and --cache-dir
                        skip=[f.name for f in dataclasses.fields(RunConfig) if f.name not in ("out", "data")]
                        + [f"data.{f.name}" for f in dataclasses.fields(DataSection) if f.name != "cache_dir"])
    add_config_flags(p, RunConfig, "the quickstart's run config")
    add_overwrite_flag(p, "quickstart")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_quickstart, validate=_validate)
