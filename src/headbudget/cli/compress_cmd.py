"""``headbudget compress``: low-rank (SVD) or K/V-grouping compression of a trained model.

    headbudget compress runs/cpu-small/model --method svd --keep-ratio 0.5 --allocation later_layers_first \\
        --data ../shared/data/text/tinyshakespeare.txt --out runs/cpu-small-svd50 --sweep 0.25,0.5,0.75
    headbudget compress gpt2-dir --method group --keep-ratio 0.5 --groups groups.json --out runs/gpt2-gqa
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from headbudget.cli.dataclass_flags import (
    add_config_flags,
    add_dataclass_flags,
    add_overwrite_flag,
    dataclass_from_args,
    print_config,
)
from headbudget.compression.job import CompressJob, check_compress_job


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compress", help="compress attention by per-head SVD or K/V head grouping, with a perplexity report",
        description="Compress a headbudget or Hugging Face GPT-2 model directory. Writes OUT/model/ "
        "(loadable with from_pretrained), OUT/report.json, and with --sweep OUT/sweep.json and "
        "OUT/sweep.png.")
    add_dataclass_flags(p, CompressJob, positional=("model",))  # every setting, declared on CompressJob
    add_config_flags(p, CompressJob, "the compress job's settings")
    add_overwrite_flag(p)
    p.set_defaults(func=run, validate=_validate)


def _validate(args: argparse.Namespace) -> None:
    """The job of the flags, --config and --set, before torch is imported."""
    args.job = _job(args)


def _job(args: argparse.Namespace) -> CompressJob:
    job = dataclass_from_args(CompressJob, args, positional=("model",))
    if not args.print_config:  # a config being written may lack what a run needs (e.g. --data for a sweep)
        check_compress_job(job)
    return job


def run(args: argparse.Namespace) -> int:
    job: CompressJob = getattr(args, "job", None) or _job(args)
    if args.print_config:
        return print_config(job)
    from headbudget.devices import resolve_device, resolve_dtype
    from headbudget.run_dir import claim_output_dir

    merge = job.method == "merge-kv"
    if merge:
        from headbudget.compression.merge_kv_pipeline import format_merge_report as format_report
        from headbudget.compression.merge_kv_pipeline import run_merge_kv as compress
    else:
        from headbudget.compression.pipeline import format_report
        from headbudget.compression.pipeline import run_compress as compress
    resolve_dtype(job.dtype)
    resolve_device(job.device)
    inputs = {"MODEL": job.model, "--data": job.data, "--calib-data": job.calib_data,  # what --out may not be
              "--tokenizer": job.tokenizer, "--groups": job.groups, "--config": getattr(args, "config", None)}
    with claim_output_dir(job.out, command="headbudget compress", overwrite=args.overwrite,
                          inputs=inputs) as out:
        report = compress(dataclasses.replace(job, out=str(out)), threads=args.threads)
    print(format_report(report))
    print(f"wrote {Path(job.out) / 'model'}, {Path(job.out) / 'report.json'}"
          + (f", {Path(job.out) / 'sweep.png'}" if job.sweep and not merge else ""))
    return 0
