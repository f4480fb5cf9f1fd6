"""``headbudget finetune``, ``headbudget prune`` and ``headbudget prune-compare``.

    headbudget finetune MODEL --task sst5 --data-dir ../shared/data/classification/sst5 --out runs/ft
    headbudget prune runs/ft --task sst5 --data-dir ../shared/data/classification/sst5 \\
        --method cahp --poly-degree 6 --out runs/cahp
    headbudget prune-compare runs/ft --task sst5 --data-dir ../shared/data/classification/sst5 \\
        --methods cahp@2,cahp@6,michel,fisher,magnitude,random --out runs/compare
    headbudget prune runs/prism --task lm --data ../shared/data/text/tinyshakespeare.txt \\
        --method cahp --keep 12 --out runs/cahp-lm   # causal LMs, label-free (held-out perplexity)

Flags only: the pipelines are :mod:`headbudget.pruning.pipeline` and
:func:`headbudget.pruning.finetune.run_finetune` (their outputs: docs/pruning.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from headbudget.cli.dataclass_flags import (
    add_config_flags,
    add_dataclass_flags,
    add_overwrite_flag,
    build,
    dataclass_from_args,
    print_config,
    settings_mapping,
)
from headbudget.pruning.job import CAHP, ENTRY_POINT_GROUP, FinetuneJob, PruneCompareJob, PruneJob
from headbudget.run_dir import claim_output_dir

#: the signature settings of headbudget's earlier releases (--legacy-signatures)
LEGACY_SIGNATURES = {"ddof": 0, "var_floor": None, "var_eps": 1e-10, "tsne_dtype": "float64"}


def job_classes() -> tuple[type[PruneJob], type[PruneCompareJob]]:
    """``PruneJob`` and ``PruneCompareJob`` with the settings of plug-in methods joined in, so a plug-in's settings
    are flags and config keys (torch is imported only when a plug-in is installed or a method was registered)."""
    from importlib.metadata import entry_points

    if not entry_points(group=ENTRY_POINT_GROUP) and "headbudget.pruning.methods" not in sys.modules:
        return PruneJob, PruneCompareJob
    from headbudget.pruning.methods import load_plugins, with_method_settings

    load_plugins()
    return with_method_settings(PruneJob), with_method_settings(PruneCompareJob)


def _add_common(p: argparse.ArgumentParser, cls: type[PruneJob], skip: tuple[str, ...] = ()) -> None:
    """The flags of every field of ``cls`` (generated from its declaration) plus the run's own."""
    add_dataclass_flags(p, cls, positional=("model",), skip=skip)
    cahp_flags = next(g for g in p._action_groups if g.title == CAHP)  # where the signature settings are listed
    cahp_flags.add_argument("--legacy-signatures", action="store_true",
                            help="population variance, var + 1e-10 (no 1e-6 floor) and float64 t-SNE instead of "
                                 "the published code's sample variance, max(var, 1e-6) and float32 (sets "
                                 + ", ".join(f"{k}={v}" for k, v in LEGACY_SIGNATURES.items()) + ")")
    add_config_flags(p, cls, "the prune job's settings")
    add_overwrite_flag(p)

    def validate(args: argparse.Namespace) -> None:  # before torch is imported: a bad key costs nothing
        args.job = _job(args, cls)

    p.set_defaults(validate=validate)


def prune_inputs(job: PruneJob, args: argparse.Namespace) -> dict[str, Any]:
    """What a prune job reads, by flag: the output folder must be none of them (nor contain or lie in one)."""
    return {"MODEL": job.model, "--data": job.data, "--data-dir": job.data_dir, "--tokenizer": job.tokenizer,
            "--eval-data": list(job.eval_data), "--config": getattr(args, "config", None)}


def _job(args: argparse.Namespace, cls: type[PruneJob] = PruneJob) -> Any:
    """The job of the flags, --config and --set."""
    d = settings_mapping(cls, args, base=LEGACY_SIGNATURES if args.legacy_signatures else None)
    return build(cls, d, args, positional=("model",))


def _cmd_finetune(args: argparse.Namespace) -> int:
    job: FinetuneJob = args.job
    if args.print_config:
        return print_config(job)
    from headbudget.devices import resolve_device
    from headbudget.pruning.finetune import run_finetune

    if job.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {job.epochs}")
    resolve_device(job.device)  # the flags first, then the folders
    with claim_output_dir(job.out, command="headbudget finetune", overwrite=args.overwrite,
                          inputs={"MODEL": job.model, "--data-dir": job.data_dir,
                                  "--config": getattr(args, "config", None)}) as out:
        summary = run_finetune(dataclasses.replace(job, out=str(out)))
    accs = ", ".join(f"{s} {a:.4f}" for s, a in summary.get("final", {}).items())
    print(f"fine-tuned {job.model} on {job.task}: {accs}; saved to {job.out}")
    return 0


def _validate_finetune(args: argparse.Namespace) -> None:
    args.job = dataclass_from_args(FinetuneJob, args, positional=("model",))


def _print_report(rep: dict[str, Any], out: str, metric_name: str = "accuracy",
                  details: dict[str, Any] | None = None) -> None:
    from headbudget.pruning.report import describe_k

    m = rep["metric"]
    job = (details or {}).get("job") or {}
    k_text = describe_k(rep["knee_k"], (details or {}).get("knee_source") or rep.get("k_source"),
                        keep=job.get("keep"), keep_ratio=job.get("keep_ratio"))

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}"

    print(f"{rep['method']}: kept {rep['heads_kept']}/{rep['heads_total']} heads"
          + (f" ({k_text})" if k_text else "")
          + f"; {metric_name} dense {f(m['dense'])}, pruned {f(m['pruned'])}, fine-tuned {f(m['finetuned'])}; "
          f"report in {out}/report.md")
    if sizes := _sizes(rep.get("cost") or {}):
        print("  " + sizes)


def _sizes(cost: dict[str, Any]) -> str:
    """``params 9,000 -> 7,000; FLOPs / token ...``: the before/after of the costs a report holds."""
    from headbudget.pruning.report import COST_LABELS

    return "; ".join(f"{label} {cost[key]['before']:,} -> {cost[key]['after']:,}"
                     for key, label in COST_LABELS.items() if key in cost)


def _cmd_prune(args: argparse.Namespace) -> int:
    job = args.job
    if args.print_config:
        return print_config(job)
    from headbudget.pruning.pipeline import run_prune

    with claim_output_dir(job.out, command="headbudget prune", overwrite=args.overwrite,
                          inputs=prune_inputs(job, args)) as out:
        res = run_prune(dataclasses.replace(job, out=str(out)))
    if res["report"].get("warning"):
        print(f"warning: {res['report']['warning']}", file=sys.stderr)
    _print_report(res["report"], job.out, res["details"].get("metric_name", "accuracy"), res["details"])
    return 0


#: report.json's stage names as a reader says them
STAGE_NAMES = {"load": "load model and data", "dense_eval": "dense evaluation", "select": "selection (all of it)",
               "prune": "head removal", "pruned_eval": "pruned evaluation", "finetune": "fine-tune",
               "save": "save model", "total": "method total", "reused": "reused (finished earlier; its total)"}


def _print_stage(where: str, stage: str, seconds: float) -> None:
    """One line per finished stage, so a long comparison (and its log) says where it is, bars on or off."""
    print(f"{where + ': ' if where else ''}{STAGE_NAMES.get(stage, stage)} {seconds:.1f} s", flush=True)


def _cmd_compare(args: argparse.Namespace) -> int:
    settings: PruneCompareJob = args.job
    if args.print_config:
        return print_config(settings)
    from headbudget.evaluation.rankings import format_spread
    from headbudget.pruning.compare import check_compare_job, run_prune_compare

    check_compare_job(settings)  # before the output folder is claimed
    with claim_output_dir(settings.out, command="headbudget prune-compare", resume=args.resume,
                          overwrite=args.overwrite, inputs=prune_inputs(settings, args)) as out:
        summary = run_prune_compare(dataclasses.replace(settings, out=str(out)), resume=args.resume,
                                    on_stage=_print_stage)
    seeds = settings.calibration_seeds
    if seeds is not None:
        for stage, rank in summary["ranking"].items():
            lines = [f"{lbl}: " + ", ".join(f"{t} {format_spread(a, 4)}" for t, a in d.items())
                     for lbl, d in summary["aggregate"][stage].items()]
            how = f"{len(seeds)} calibration seeds, mean ± std" if len(seeds) > 1 else "one calibration seed"
            print(f"{stage} ({how}):\n  " + "\n  ".join(lines))
            print(f"ranking ({stage}, rule {rank['rule']}): {rank['label']}")
    else:
        for r in summary["rows"]:
            if r.get("warning"):
                print(f"warning: {r['label']}: {r['warning']}", file=sys.stderr)
            print(f"{r['label']}: {r['heads_kept']} heads; " + ", ".join(
                f"{s} pruned {a['pruned']:.4f} fine-tuned "
                f"{'-' if a['finetuned'] is None else format(a['finetuned'], '.4f')}"
                for s, a in r["metric"].items()))
            if (r.get("cost") or {}).get("kv_cache_bytes_per_token"):
                print("  " + _sizes(r["cost"]))
    print(f"table in {settings.out}/compare.md")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("finetune", help="fine-tune a sequence classifier (SST-5, MNLI)",
                              description="Fine-tune a classifier: AdamW, linear warmup, dynamic padding.")
    add_dataclass_flags(p, FinetuneJob, positional=("model",))
    add_config_flags(p, FinetuneJob, "the fine-tuning job's settings")
    add_overwrite_flag(p)
    p.set_defaults(func=_cmd_finetune, validate=_validate_finetune)

    p = subparsers.add_parser("prune", help="prune attention heads (CAHP or a baseline), fine-tune, report",
                              description="Prune heads with CAHP or a baseline; writes the model and report.json.")
    job_cls, compare_cls = job_classes()
    _add_common(p, job_cls)
    p.set_defaults(func=_cmd_prune)

    p = subparsers.add_parser("prune-compare", help="several pruning methods, one table",
                              description="Run several methods and tabulate: each cahp@d finds its own knee, each "
                                          "baseline takes the count of the nearest cahp entry before it (or --keep).")
    _add_common(p, compare_cls, skip=("method",))
    p.add_argument("--resume", action="store_true",
                   help="reuse every method already finished in --out with the same settings; run the rest")
    p.set_defaults(func=_cmd_compare)
