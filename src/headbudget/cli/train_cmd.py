"""``headbudget train``, ``headbudget compare``, ``headbudget prepare`` and ``headbudget distill``.

    headbudget train configs/cpu-small.yaml --schedule prism --out runs/prism --set train.lr=3e-4 [--resume]
    torchrun --nproc_per_node 2 -m headbudget.cli.main train configs/cpu-small.yaml   # DDP
    headbudget compare cpu-small --schedules uniform,prism --seeds 5 --tokens 4M --until-flat [--resume]
    headbudget prepare --source "jsonl:corpus.jsonl:text" --tokenizer bpe:4096   # tokenize once, cached
    headbudget distill runs/pruned/model --teacher runs/dense/model --data corpus.txt --tokens 1M --out runs/rec
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headbudget.cli.dataclass_flags import (
    add_dataclass_flags,
    add_overwrite_flag,
    deep_merge,
    flag_values,
    print_config,
)
from headbudget.progress import library_bars
from headbudget.train.config import CompareConfig, RunConfig, load_config, resolve_config_path

#: ``train.threads`` is set by the one ``--threads`` every command takes (headbudget.threads); its generated
#: ``--train.threads`` spelling still parses, into the same field, but is left out of the help
THREADS = {"aliases": {"train.threads": ("--threads",)}, "hidden": ("train.threads",)}


def _add_common(p: argparse.ArgumentParser, config_required: bool = True, skip: tuple[str, ...] = (),
                aliases: dict[str, tuple[str, ...]] | None = None, cls: type[RunConfig] = RunConfig) -> None:
    """CONFIG (or ``--config FILE``, as every other command), one ``--section.key`` flag per field of ``cls``
    (generated from its declaration), --set and --print_config."""
    what = "config file (YAML) or a bundled name: quickstart, cpu-small, gpt2-124m, ..."
    p.add_argument("config", nargs="?", metavar="CONFIG",
                   help=f"{what}{'' if config_required else ' (optional)'}; or give it as --config FILE")
    p.add_argument("--config", dest="config_file", metavar="FILE", default=None,
                   help="the config as a flag, as the other commands take it (same as CONFIG; give one of the two)")
    p.set_defaults(config_required=config_required)
    if "train" not in skip:
        aliases = {**THREADS["aliases"], **(aliases or {})}
    add_dataclass_flags(p, cls, skip=skip, aliases=aliases, hidden=THREADS["hidden"])
    _add_set_flags(p)


def _config_name(args: argparse.Namespace) -> str | None:
    """The config CONFIG or ``--config FILE`` names (one of them; both is an error, and so is neither where the
    command needs one)."""
    positional, flag = getattr(args, "config", None), getattr(args, "config_file", None)
    if positional and flag:
        raise ValueError(f"the config is given twice ({positional!r} and --config {flag!r}): give CONFIG or "
                         "--config FILE, not both")
    name = positional or flag
    if not name and getattr(args, "config_required", False):
        raise ValueError("missing the config: give CONFIG or --config FILE (a YAML file or a bundled name: "
                         "quickstart, cpu-small, gpt2-124m, ...)")
    return name


def _add_set_flags(p: argparse.ArgumentParser, example: str = "train.lr=3e-4") -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config key, e.g. --set {example} (repeatable; flags given win)")
    p.add_argument("--print_config", "--print-config", action="store_true",
                   help="print the full run config as YAML (give it back as CONFIG for the same run) and exit")


def _load(args: argparse.Namespace, defaults: list[str] | None = None, cls: type[RunConfig] = RunConfig) -> RunConfig:
    """The config of CONFIG or ``--config`` (or, with none, the built-in defaults changed by ``defaults``), its --set
    overrides, then the ``--section.key`` flags given."""
    name = _config_name(args)
    path = resolve_config_path(name) if name else None
    cfg = load_config(path, ([] if path else defaults or []) + args.overrides, cls=cls)
    given = flag_values(args)
    return cls.from_dict(deep_merge(cfg.to_dict(), given), "flags") if given else cfg


def _validator(config: Callable[[argparse.Namespace], RunConfig]) -> Callable[[argparse.Namespace], None]:
    """A ``validate`` (cli.main calls it first, before torch is imported) that reads the run config into
    ``args.cfg``; cli.main's thread policy then follows its ``train.threads``, which --threads sets
    (0: automatic; prepare has no train section: cli.main's own --threads)."""
    def validate(args: argparse.Namespace) -> None:
        args.cfg = config(args)
        if "train.threads" in vars(args):
            args.threads = args.cfg.train.threads or None

    return validate


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _claim(out: Path, command: str, args: argparse.Namespace, inputs: dict[str, object]) -> Any:
    """One writer: rank 0 holds the folder for the whole job (torchrun stops the others if it refuses)."""
    from headbudget.run_dir import claim_output_dir, write_dir

    if not _is_main():
        return contextlib.nullcontext(write_dir(out, args.overwrite))
    return claim_output_dir(out, command=f"headbudget {command}", resume=args.resume,
                            overwrite=args.overwrite, inputs=inputs)


def _given(args: argparse.Namespace, key: str) -> bool:
    """Was config key ``section.name`` set on the command line (its flag or --set)?"""
    section, name = key.split(".")
    return any(o.split("=", 1)[0].strip() == key for o in args.overrides) \
        or name in flag_values(args).get(section, {})


def _with_init(cfg: RunConfig, init: str, args: argparse.Namespace) -> RunConfig:
    """Continue a saved model: its layout and weights, and its tokenizer unless data.tokenizer is set."""
    explicit_tok = _given(args, "data.tokenizer")
    return cfg.replace(model={"init": init}, **({} if explicit_tok else {"data": {"tokenizer": "model"}}))


def cmd_train(args: argparse.Namespace) -> int:
    cfg = getattr(args, "cfg", None) or _train_config(args)
    if args.print_config:
        return print_config(cfg)
    out = Path(cfg.out or f"runs/{cfg.name}-{cfg.model.schedule}-s{cfg.seed}")
    return _run_training(cfg, out, args, "train")


def _train_config(args: argparse.Namespace) -> RunConfig:
    """The run config; ``--init`` (model.init) given on the command line also takes the model's tokenizer."""
    cfg = _load(args)
    return _with_init(cfg, cfg.model.init, args) if cfg.model.init and _given(args, "model.init") else cfg


def run_inputs(cfg: RunConfig, args: argparse.Namespace, command: str = "train") -> dict[str, object]:
    """What a run reads, by flag: its output folder must be none of them (nor contain or lie in one)."""
    import glob

    kind, _, arg = str(cfg.data.tokenizer).partition(":")  # byte, bpe:N, model: no path; gpt2:DIR, hf:PATH
    tokenizer = arg if kind in ("gpt2", "hf") else None if kind in ("byte", "bpe", "model") else cfg.data.tokenizer
    source = str(cfg.data.source)  # a file, folder or glob; jsonl:PATH[:FIELD]; hf:NAME and synthetic:N read none
    source = source.split(":")[1] if source.startswith("jsonl:") else source
    return {("STUDENT" if command == "distill" else "--init"): cfg.model.init, "--teacher": cfg.distill.teacher,
            "--data": glob.glob(source) or source, "--tokenizer": tokenizer,
            "--config": getattr(args, "config", None)}


@library_bars(False)  # the trainer draws its own bars: transformers' per-file load/save bars stay off
def _run_training(cfg: RunConfig, out: Path, args: argparse.Namespace, command: str) -> int:
    """Claim ``out`` and train (or distill: ``cfg.distill.teacher``) into it; what train and distill share."""
    from headbudget.run_dir import check_not_an_input
    from headbudget.train.loop import TrainingDivergedError
    from headbudget.train.trainer import Trainer

    t0 = time.perf_counter()
    inputs = run_inputs(cfg, args, command)
    if cfg.distill.teacher_cache:  # written too: never into what the run reads, nor into the folder it may replace
        check_not_an_input(cfg.distill.teacher_cache, {**inputs, "--out": out}, flag="--teacher-cache")
    try:
        with _claim(out, command, args, inputs) as write_to:
            trainer = Trainer(cfg, write_to, resume=args.resume)
            result = trainer.run()
    except TrainingDivergedError as exc:
        print(f"headbudget {command}: stopped: {exc}", file=sys.stderr)
        return 3
    if trainer.already_finished:
        return 0  # the trainer said so on stderr; the run is left exactly as it was
    if _is_main():
        val = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
        what = f"from {cfg.model.init}" if cfg.model.init else cfg.model.schedule
        if cfg.distill.teacher:
            what += f" distilling {cfg.distill.teacher} (T={cfg.distill.temperature:g}, alpha={cfg.distill.alpha:g})"
            if cache := (trainer.summary or {}).get("distill", {}).get("cache"):
                what += f" [teacher cache: {cache['hits']} batches read, {cache['misses']} computed]"
        print(f"trained {what} ({result.params:,} params) for {result.steps} steps in "
              f"{time.perf_counter() - t0:.1f}s: val loss {val}, {result.tokens_per_s:,.0f} tokens/s, "
              f"peak {result.peak_memory_mb:,.0f} MB")
        model_dir = out / Path(result.model_dir).name if result.model_dir else None
        print(f"model: {model_dir}   metrics: {out / 'metrics.jsonl'}")
    return 0


#: what ``distill`` changes in the built-in defaults when no config is given (fine-tuning a trained model)
DISTILL_DEFAULTS = ["name=distill", "train.lr=1e-4"]


def _distill_config(args: argparse.Namespace) -> RunConfig:
    """The run ``distill`` trains: ``train --init STUDENT --teacher TEACHER`` with --data and --tokens applied."""
    cfg = _with_init(_load(args, DISTILL_DEFAULTS), args.student, args)
    if not cfg.distill.teacher:
        raise ValueError("distill needs a teacher: --teacher MODEL (or distill.teacher in the config)")
    # the default data.source is the built-in synthetic corpus: recovering a model on it is surely a mistake,
    # so the data must be named (--print_config trains nothing and may show the rest of the run without it)
    if not args.print_config and not _given(args, "data.source") and not _file_sets(args, "data.source"):
        raise ValueError("distill needs training text: --data SOURCE (or data.source in the config); without it "
                         "the student would train on the built-in synthetic corpus")
    return cfg


def _file_sets(args: argparse.Namespace, key: str) -> bool:
    """Does the config file (CONFIG or --config) set ``section.name`` itself (not by default)?"""
    name = _config_name(args)
    if not name:
        return False
    from headbudget.typed_config import load_yaml

    section, field_name = key.split(".")
    raw = load_yaml(resolve_config_path(name)).get(section)
    return isinstance(raw, dict) and raw.get(field_name) is not None


def cmd_distill(args: argparse.Namespace) -> int:
    cfg = getattr(args, "cfg", None) or _distill_config(args)
    if args.print_config:
        return print_config(cfg)
    out = Path(cfg.out or f"runs/{cfg.name}-s{cfg.seed}")
    return _run_training(cfg, out, args, "distill")


def cmd_compare(args: argparse.Namespace) -> int:
    settings: CompareConfig = getattr(args, "cfg", None) or _load(args, cls=CompareConfig)
    if args.print_config:  # the run config and its compare: section, one file train and compare both read
        return print_config(settings)
    return _run_compare(settings, args)


@library_bars(False)  # the trainer draws its own bars
def _run_compare(settings: CompareConfig, args: argparse.Namespace) -> int:
    from headbudget.train.compare import default_reference, parse_schedules, run_compare

    cfg, c = settings.run_config(), settings.compare
    schedules = parse_schedules(c.schedules)
    default_reference(schedules, c.reference)  # a --reference not compared fails before the output folder is claimed
    out = Path(cfg.out or f"runs/compare-{cfg.name}")
    n = len(schedules) * c.seeds

    def on_run(sched: str, seed: int, result) -> None:
        print(f"[{on_run.i}/{n}] {sched} seed {seed}: val loss {result.final_val_loss:.4f}, "
              f"{result.tokens_per_s:,.0f} tokens/s, {result.wall_s:.1f}s"
              + (" (finished earlier: read back)" if result.read_back else ""), flush=True)
        on_run.i += 1

    on_run.i = 1
    with _claim(out, "compare", args, run_inputs(cfg, args)) as write_to:  # torchrun: every run on all ranks
        summary = run_compare(settings, write_to, on_run=on_run, resume=args.resume)
    if not _is_main():
        return 0
    print()
    table, reading = (out / "report.md").read_text().split("## Reading", 1)
    print(table.split("\n\n", 2)[-1].strip())
    print("\n".join(["", *[line for line in reading.splitlines() if line.startswith("- ")]]))
    written = [f for f in ("compare.json", "report.md", "loss_curves.png", "paired_curves.png",
                           "paired_differences.png") if (out / f).is_file()]
    print(f"\n{', '.join(written)} in {out}  ({summary['wall_s']:.0f}s)")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from headbudget.train.setup import prepare_for

    cfg = getattr(args, "cfg", None) or _load(args)
    if args.print_config:
        return print_config(cfg)
    t0 = time.perf_counter()
    data = prepare_for(cfg, force=args.force)
    print(f"{'reused' if data.reused else 'prepared'} {data.directory} in {time.perf_counter() - t0:.1f}s")
    print(json.dumps({k: data.meta[k] for k in ("source", "tokenizer", "vocab_size", "dtype", "train_tokens",
                                                "val_tokens", "content_hash")}, indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train one model from a config",
                       description="Train one model; writes metrics.jsonl, checkpoints/, model/ (HF format). Every "
                                   "config key is also a flag: --section.key VALUE (e.g. --train.lr 3e-4); flags given "
                                   "override CONFIG, whose values override the defaults shown.")
    # --data and --tokens as distill spells them: recovering a model without a teacher (train --init) and with
    # one (distill) take the same flags
    _add_common(p, aliases={"model.schedule": ("--schedule",), "distill.teacher": ("--teacher",),
                            "model.init": ("--init",), "data.source": ("--data",), "train.tokens": ("--tokens",)})
    p.add_argument("--resume", action="store_true", help="continue exactly from the newest checkpoint in --out (none yet: start at step 0 "
                   "with a notice; a finished run is left as it is)")
    add_overwrite_flag(p)
    p.set_defaults(func=cmd_train, validate=_validator(_train_config))

    p = sub.add_parser("distill", help="recover a pruned/compressed model by logit distillation from a teacher",
                       description="train --init STUDENT --teacher TEACHER: loss alpha*T^2*KL(teacher||student) + "
                                   "(1-alpha)*CE on --data (required: no built-in corpus), same loop, checkpoints, "
                                   "resume and outputs as train (model/ opens with AutoModelForCausalLM).")
    p.add_argument("student", help="the model to recover (model folder, run folder or GGUF); its tokenizer is used")
    p.add_argument("--config", help="run config (YAML or bundled name) for the training settings (default: the "
                   "built-in defaults with " + ", ".join(DISTILL_DEFAULTS) + ")")
    add_dataclass_flags(p, RunConfig, skip=("model.init",), hidden=THREADS["hidden"],
                        aliases={"distill.teacher": ("--teacher",), "distill.temperature": ("--temperature",),
                                 "distill.alpha": ("--alpha",), "distill.teacher_cache": ("--teacher-cache",), "data.source": ("--data",),
                                 "train.tokens": ("--tokens",), **THREADS["aliases"]})
    _add_set_flags(p, "train.batch_size=8")
    p.add_argument("--resume", action="store_true", help="continue exactly from the newest checkpoint in --out")
    add_overwrite_flag(p)
    p.set_defaults(func=cmd_distill, validate=_validator(_distill_config))

    p = sub.add_parser("compare", help="train schedules x seeds on identical data and compare val loss",
                       description="Writes compare.json, report.md, loss_curves.png, paired_curves.png and (2+ seeds) "
                                   "paired_differences.png. Every config key is also "
                                   "a flag: --section.key VALUE.")
    _add_common(p, cls=CompareConfig, aliases={"train.tokens": ("--tokens",)})
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted comparison in --out: finished runs are read back, a run with a "
                        "checkpoint continues from it exactly, the rest are trained")
    add_overwrite_flag(p, "comparison")
    p.set_defaults(func=cmd_compare, validate=_validator(functools.partial(_load, cls=CompareConfig)))

    p = sub.add_parser("prepare", help="tokenize a data source into cached train/val memmaps",
                       description="Prepare (or find in the cache) the data of a config or of --source.")
    _add_common(p, config_required=False, skip=("name", "seed", "out", "model", "train", "distill"),
                aliases={"data.source": ("--source",), "data.tokenizer": ("--tokenizer",),
                         "data.cache_dir": ("--cache-dir",)})
    p.add_argument("--force", action="store_true", help="rebuild even when a cached copy exists")
    p.set_defaults(func=cmd_prepare, validate=_validator(_load))
