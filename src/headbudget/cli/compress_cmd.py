"""``headbudget compress``: low-rank (SVD) or K/V-grouping compression of a trained model.

    headbudget compress runs/cpu-small/model --method svd --keep-ratio 0.5 --allocation later_layers_first \\
        --data ../shared/data/text/tinyshakespeare.txt --out runs/cpu-small-svd50 --sweep 0.25,0.5,0.75
    headbudget compress gpt2-dir --method group --keep-ratio 0.5 --groups groups.json --out runs/gpt2-gqa
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from headbudget.cli.dataclass_flags import (
    add_config_flags,
    add_dataclass_flags,
    add_overwrite_flag,
    dataclass_from_args,
    print_config,
)
from headbudget.compression.job import CompressJob
from headbudget.io import read_text


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
    _check_merge_kv_flags(job)
    return job


def _check_merge_kv_flags(job: CompressJob) -> None:
    """merge-kv's flags: exactly one target, a budget in (0, 1], and none of them with another method."""
    given = [f for f, v in (("--kv-heads", job.kv_heads), ("--kv-budget", job.kv_budget),
                            ("--calib-data", job.calib_data)) if v is not None]
    if job.method != "merge-kv":
        if given:
            raise ValueError(f"{given[0]} only applies to --method merge-kv")
        return
    if (job.kv_heads is None) == (job.kv_budget is None):
        raise ValueError("--method merge-kv needs --kv-heads N or --kv-budget FRACTION (one of them)")
    if job.kv_heads is not None and job.kv_heads < 1:
        raise ValueError(f"--kv-heads must be >= 1, got {job.kv_heads}")
    if job.kv_budget is not None:
        _fraction(job.kv_budget, "--kv-budget")
    for flag, value in (("--calib-tokens", job.calib_tokens), ("--sensitivity-tokens", job.sensitivity_tokens)):
        if value < 2:
            raise ValueError(f"{flag} must be >= 2, got {value}")
    if job.sweep or job.groups:
        raise ValueError(f"{'--sweep' if job.sweep else '--groups'} does not apply to --method merge-kv")


def _fraction(value: float, flag: str) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{flag} must be in (0, 1], got {value}")


def read_groups(path: str) -> list | dict:
    """Read a --groups JSON file: ``[[[0, 1], [2, 3]], null, ...]`` (one entry per layer) or
    ``{"0": [[0, 1], [2, 3]]}`` (only the named layers)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--groups: no file {path}")
    try:
        data = json.loads(read_text(p))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if isinstance(data, dict):  # {"layer": groups}: layers not named are allocated
        try:
            data = {int(k): v for k, v in data.items()}
        except ValueError:
            raise ValueError(f"{path}: keys must be layer indices, got {sorted(data)[:3]}") from None
    elif not isinstance(data, list):
        raise ValueError(f"{path}: expected a list with one entry per layer")
    for i, g in data.items() if isinstance(data, dict) else enumerate(data):
        if g is not None and not (isinstance(g, list) and all(isinstance(x, list) for x in g)):
            raise ValueError(f"{path}: layer {i}: expected a list of head-index lists or null, got {g!r}")
    return data


def run(args: argparse.Namespace) -> int:
    job: CompressJob = getattr(args, "job", None) or _job(args)
    if args.print_config:
        return print_config(job)
    from headbudget.devices import resolve_device, resolve_dtype
    from headbudget.run_dir import claim_output_dir

    merge = job.method == "merge-kv"  # its own flags were checked with the job
    if merge:
        from headbudget.compression.merge_kv_pipeline import format_merge_report as format_report
        from headbudget.compression.merge_kv_pipeline import run_merge_kv as compress
    else:
        from headbudget.compression.pipeline import format_report
        from headbudget.compression.pipeline import run_compress as compress
    resolve_dtype(job.dtype)
    resolve_device(job.device)
    if not merge:
        _fraction(job.keep_ratio, "--keep-ratio")
        for k in job.sweep:
            _fraction(k, "--sweep")
    if job.context < 2:
        raise ValueError(f"--context must be >= 2, got {job.context}")
    groups = read_groups(job.groups) if job.groups else None  # (merge-kv refuses --groups)
    if groups is not None and job.method != "group":
        raise ValueError("--groups only applies to --method group")
    inputs = {"MODEL": job.model, "--data": job.data, "--calib-data": job.calib_data,  # what --out may not be
              "--tokenizer": job.tokenizer, "--groups": job.groups, "--config": getattr(args, "config", None)}
    with claim_output_dir(job.out, command="headbudget compress", overwrite=args.overwrite,
                          inputs=inputs) as out:
        report = compress(dataclasses.replace(job, out=str(out)), threads=args.threads,
                          **({} if merge else {"groups": groups}))
    print(format_report(report))
    print(f"wrote {Path(job.out) / 'model'}, {Path(job.out) / 'report.json'}"
          + (f", {Path(job.out) / 'sweep.png'}" if job.sweep and not merge else ""))
    return 0
