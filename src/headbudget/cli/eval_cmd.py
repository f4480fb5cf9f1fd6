"""``headbudget eval``, ``headbudget perplexity`` and ``headbudget attention``.

    headbudget eval runs/prism --tasks piqa,hellaswag,arc_easy,winogrande \\
        --data-dir ../shared/data/zeroshot --limit 200 --json results.json
    headbudget perplexity runs/prism --data ../shared/data/text/wikitext2_valid.tokens \\
        --tokenizer ../shared/data/tokenizers/gpt2 --context 1024 --stride 512
    headbudget attention runs/uniform --data ../shared/data/text/tinyshakespeare.txt \\
        --out attn/ --compare runs/prism
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headbudget.cli.dataclass_flags import add_overwrite_flag, add_settings, printed
from headbudget.evaluation.suite import SuiteSettings
from headbudget.io import atomic_write_json
from headbudget.progress import library_bars
from headbudget.run_dir import check_not_an_input, check_output_file
from headbudget.typed_config import device_option, dtype_option, option


@dataclass(kw_only=True)
class ModelSettings:
    """The model a command scores (every flag declared once, on its field)."""

    model: str = option(help="model folder, `headbudget train` run folder, GGUF file or hub name", metavar="MODEL")
    tokenizer: str | None = option(None, help="tokenizer folder, byte, gpt2[:DIR], hf:NAME or hub name (default: "
                                              "the model's own, see headbudget.loading)")
    gguf_file: str | None = option(None, help="GGUF file name inside MODEL (a folder with several)")
    device: str | None = device_option()
    dtype: str = dtype_option()


@dataclass(kw_only=True)
class EvalSettings(SuiteSettings, ModelSettings):  # this base order lists MODEL's flags first in --help
    """``headbudget eval``: the model, the tasks and their scoring (:class:`SuiteSettings`), the output."""

    output_path: str | None = option(
        None, help="folder for lm-eval's files, as lm-eval's --output_path: DIR/<model>/results_<datetime>.json "
                   "(+ samples_<task>_<datetime>.jsonl with --log-samples); headbudget's own fields under the key "
                   "\"headbudget\"")
    json: str | None = option(None, help="write lm-eval's results dict to exactly this file (samples files, with "
                                         "--log-samples, in its folder)")
    quiet: bool = option(False, help="no progress bars and no results table (the --json / --output-path files are "
                                     "still written, and their 'wrote FILE' lines printed)")


@dataclass(kw_only=True)
class PerplexitySettings(ModelSettings):
    """``headbudget perplexity``."""

    data: str = option(help="text file, or HF dataset NAME[:CONFIG]")
    split: str = option("test", help="HF split")
    context: int = option(1024, help="window length in tokens")
    stride: int | None = option(None, help="window step (default: half the context)")
    max_windows: int | None = option(None, help="score only the first N windows")
    context_lengths: str | None = option(
        None, help="also score the same targets with each of these tokens of left context (e.g. 1,4,16,127): how "
                   "much the model gains from its context (paired by target)")
    json: str | None = option(None, help="also write the result (loss, ppl, windows, ...) to this JSON file")
    quiet: bool = option(False, help="no progress bar")


@dataclass(kw_only=True)
class AttentionSettings(ModelSettings):
    """``headbudget attention``."""

    data: str = option(help="text file, or HF dataset NAME[:CONFIG]")
    out: str = option(help="output directory")
    compare: str | None = option(None, help="a second model, plotted side by side")
    seq_len: int = option(128, help="tokens per sequence")
    n_seqs: int = option(4, help="sequences averaged")
    local_window: int = option(8, help="distance counted as local (local share)")


def _check_model_flags(args: argparse.Namespace) -> None:
    """--device and --dtype checked (one-line errors) before any slow work; ``args.device`` becomes
    the resolved device (cuda when available), which the scorer is given too."""
    from headbudget.devices import resolve_device, resolve_dtype

    args.device = str(resolve_device(args.device))
    resolve_dtype(args.dtype)


def _load(args: argparse.Namespace, other: str | None = None) -> tuple[Any, Any]:
    """The model (MODEL, or ``other`` without --gguf-file) and tokenizer of ``args``, its flags already
    checked by :func:`_check_model_flags`."""
    from headbudget.devices import resolve_dtype
    from headbudget.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(other or args.model, tokenizer=args.tokenizer,
                                    gguf_file=None if other else args.gguf_file, device=args.device,
                                    dtype=resolve_dtype(args.dtype))


def _inputs(args: argparse.Namespace) -> dict[str, Any]:
    """What ``eval``/``perplexity``/``attention`` read, by flag: no output may be, contain or lie in one."""
    kind, _, arg = str(args.tokenizer or "").partition(":")
    return {"MODEL": args.model, "--tokenizer": arg if kind in ("gpt2", "hf") else args.tokenizer,
            "--data": getattr(args, "data", None), "--data-dir": getattr(args, "data_dir", None),
            "--include-path": getattr(args, "include_path", None), "--compare": getattr(args, "compare", None),
            "--tasks": [t for t in getattr(args, "tasks", ()) if t.endswith((".yaml", ".yml"))],
            "--config": getattr(args, "config", None)}


def run_eval(args: argparse.Namespace) -> int:
    if printed(args):
        return 0
    from headbudget.evaluation.lm_eval_files import check_output_args, write_lm_eval_files
    from headbudget.evaluation.suite import evaluate_suite, format_report, prepare_suite

    if args.output_path:
        check_not_an_input(args.output_path, _inputs(args), "--output-path")
    check_output_args(output_path=args.output_path, json_path=args.json, log_samples=args.log_samples,
                      model_name=str(args.model))
    if args.json:  # a real write probe too (a read-only folder), before the evaluation, not after it
        check_output_file(args.json, "--json", inputs=_inputs(args))
    _check_model_flags(args)
    with library_bars(not args.quiet):
        harness_tasks = prepare_suite(args.settings)
        model, tok = _load(args)
        report = evaluate_suite(model, tok, args.settings, device=args.device, progress=not args.quiet,
                                harness_tasks=harness_tasks)
    if not args.quiet:
        _print_report(report, format_report)
    report["details"]["model"] = str(args.model)
    model_args = ",".join(f"{k}={v}" for k, v in (("pretrained", args.model), ("gguf_file", args.gguf_file),
                                                  ("tokenizer", args.tokenizer)) if v)
    written = []
    for where in ({"output_path": args.output_path}, {"json_path": args.json}):
        if all(where.values()):
            written += write_lm_eval_files(report, model_name=str(args.model), model_args=model_args, **where)
    for path in written:
        print(f"wrote {path}")
    return 0


def _print_report(report: dict[str, Any], format_report: Any) -> None:
    """lm-eval's results table, then the examples, forward passes and seconds of every task."""
    print(format_report(report))
    d = report["details"]
    for t, s in d["task_seconds"].items():
        print(f"{t}: {report['n-samples'][t]['effective']} examples, {d['forward_passes'][t]} forward "
              f"passes, {s:.1f}s")
    if "lm_eval" in d:
        h = d["lm_eval"]
        print(f"lm-eval tasks {','.join(h['tasks'])}: {h['forward_passes']} forward passes, "
              f"{h['seconds']:.1f}s ({h['model_seconds']:.1f}s scoring)")
    print(f"total: {report['seconds']:.1f}s")


def run_perplexity(args: argparse.Namespace) -> int:
    if printed(args):
        return 0
    from headbudget.evaluation.perplexity import loss_by_context_length, perplexity
    from headbudget.experiments._common import parse_int_list
    from headbudget.io import read_text

    if args.json:  # checked before the model loads, not after the scoring
        check_output_file(args.json, "--json", inputs=_inputs(args))
    lengths = parse_int_list(args.context_lengths, "--context-lengths") if args.context_lengths else None
    if lengths:  # one row per length, shortest first (the gains are against the shortest)
        twice = next((k for i, k in enumerate(lengths) if k in lengths[:i]), None)
        if twice is not None:
            raise ValueError(f"--context-lengths: {twice} is given twice in {args.context_lengths!r}")
        lengths = sorted(lengths)
        if lengths[-1] >= args.context:
            raise ValueError(f"--context-lengths: {lengths[-1]} is not below --context {args.context}")
    _check_model_flags(args)
    text = read_text(args.data, split=args.split)
    model, tok = _load(args)
    ids = tok.encode(text, add_special_tokens=False)  # once, for both scorings
    res = perplexity(model, tok, input_ids=ids, context=args.context, stride=args.stride,
                     max_windows=args.max_windows, progress=not args.quiet)
    print(f"loss {res['loss']:.4f}  ppl {res['ppl']:.3f}  ({res['tokens_scored']:,} of "
          f"{res['tokens_total']:,} tokens scored, {res['windows']} windows of {res['context']}, "
          f"stride {res['stride']}, {res['seconds']:.1f}s)")
    if lengths:
        if lengths[-1] >= res["context"]:  # the model has fewer positions than --context
            raise ValueError(f"--context-lengths: {lengths[-1]} is not below the model's {res['context']} "
                             "positions")
        by = loss_by_context_length(model, ids, lengths=tuple(lengths), every=max(1, len(ids) // 2048))
        res["by_context_length"] = by
        print(f"the same {by['targets']:,} targets with k tokens of left context (gain: loss with "
              f"{by['lengths'][0]} minus loss with k, ± standard error):")
        for k, loss, g, se in zip(by["lengths"], by["loss"], by["gain_vs_shortest"], by["gain_sem"]):
            print(f"  k={k:<6} loss {loss:.4f}  gain {g:+.4f} ± {se:.4f}")
    if args.json:
        atomic_write_json(args.json, dict(res, model=str(args.model), data=str(args.data)))
        print(f"wrote {args.json}")
    return 0


def run_attention(args: argparse.Namespace, out: Path | None = None) -> int:
    """``headbudget attention`` writing into ``out`` (default ``--out``: the claim may give a staging folder)."""
    from headbudget.analysis.attention import (
        attention_summary_from_text,
        plot_distance,
        plot_distance_comparison,
        write_json,
    )
    from headbudget.io import read_text

    _check_model_flags(args)
    text = read_text(args.data)
    out = Path(out or args.out)
    models = [args.model] + ([args.compare] if args.compare else [])
    summaries: dict[str, Any] = {}
    for i, name in enumerate(models):
        model, tok = _load(args, name if i else None)
        s = attention_summary_from_text(model, tok, text, seq_len=args.seq_len, n_seqs=args.n_seqs,
                                        local_window=args.local_window)
        label = Path(str(name).rstrip("/")).name or str(name)
        if label in summaries:
            label = f"{label}_{i}"
        summaries[label] = s
        write_json(s, out / f"attention_{label}.json")
        plot_distance(s, out / f"distance_{label}.png", title=f"{label}: mean attention distance")
        print(f"{label}: mean distance per layer "
              + " ".join(f"{d:.2f}" for d in s["mean_distance"])
              + f" (a plain average over the prefix: {s['plain_average_distance']:.2f})")
    if len(summaries) > 1:
        plot_distance_comparison(summaries, out / "distance_comparison.png")
    print(f"wrote {args.out}/")
    return 0


def _attention_in_out(args: argparse.Namespace) -> int:
    """``run_attention`` holding ``--out`` (headbudget.run_dir: another run's results refused, one writer)."""
    from headbudget.run_dir import claim_output_dir

    if printed(args):
        return 0
    with claim_output_dir(args.out, command="headbudget attention", overwrite=args.overwrite,
                          inputs=_inputs(args)) as out:
        return run_attention(args, out)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="zero-shot multiple-choice accuracy (lm-eval's numbers)",
                              description="Zero-shot PIQA/HellaSwag/ARC/WinoGrande with "
                              "lm-evaluation-harness's prompts and metrics.")
    add_settings(p, EvalSettings, "the evaluation's settings", positional=("model",))
    p.set_defaults(func=run_eval)

    p = subparsers.add_parser("perplexity", help="sliding-window token perplexity",
                              description="Token-level loss and perplexity with a sliding window.")
    add_settings(p, PerplexitySettings, "the perplexity run's settings", positional=("model",))
    p.set_defaults(func=run_perplexity)

    p = subparsers.add_parser("attention", help="per-head attention distance/entropy/locality",
                              description="Mean attention distance, entropy and local share per "
                              "layer and head; JSON and PNG plots.")
    add_settings(p, AttentionSettings, "the attention run's settings", positional=("model",))
    add_overwrite_flag(p)
    p.set_defaults(func=_attention_in_out)


if __name__ == "__main__":  # pragma: no cover
    from headbudget.cli.main import main

    sys.exit(main(["eval", *sys.argv[1:]]))
