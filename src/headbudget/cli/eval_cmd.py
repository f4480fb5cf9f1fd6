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

from headbudget.analysis.attention import AttentionSettings
from headbudget.analysis.attention import run_attention as attention_run
from headbudget.cli.dataclass_flags import add_overwrite_flag, add_settings, printed
from headbudget.evaluation.perplexity import PerplexitySettings
from headbudget.evaluation.perplexity import run_perplexity as perplexity_run
from headbudget.evaluation.suite import SuiteSettings
from headbudget.io import atomic_write_json
from headbudget.loading import ModelSettings
from headbudget.progress import library_bars
from headbudget.run_dir import check_not_an_input, check_output_file
from headbudget.typed_config import option


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
    device = args.settings.resolved_device()  # a bad --device or --dtype: one line, before the tasks load
    with library_bars(not args.quiet):
        harness_tasks = prepare_suite(args.settings)
        model, tok = args.settings.load()
        report = evaluate_suite(model, tok, args.settings, device=device, progress=not args.quiet,
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
    """``headbudget perplexity``: :func:`headbudget.evaluation.perplexity.run_perplexity`, its lines printed."""
    if printed(args):
        return 0
    settings: PerplexitySettings = args.settings
    if settings.json:  # checked before the model loads, not after the scoring
        check_output_file(settings.json, "--json", inputs=_inputs(args))
    res = perplexity_run(settings, on_scored=_print_perplexity)
    if "by_context_length" in res:
        by = res["by_context_length"]
        print(f"the same {by['targets']:,} targets with k tokens of left context (gain: loss with "
              f"{by['lengths'][0]} minus loss with k, ± standard error):")
        for k, loss, g, se in zip(by["lengths"], by["loss"], by["gain_vs_shortest"], by["gain_sem"]):
            print(f"  k={k:<6} loss {loss:.4f}  gain {g:+.4f} ± {se:.4f}")
    if settings.json:
        atomic_write_json(settings.json, res)
        print(f"wrote {settings.json}")
    return 0


def _print_perplexity(res: dict[str, Any]) -> None:
    print(f"loss {res['loss']:.4f}  ppl {res['ppl']:.3f}  ({res['tokens_scored']:,} of "
          f"{res['tokens_total']:,} tokens scored, {res['windows']} windows of {res['context']}, "
          f"stride {res['stride']}, {res['seconds']:.1f}s)")


def run_attention(args: argparse.Namespace, out: Path | None = None) -> int:
    """``headbudget attention`` writing into ``out`` (default ``--out``: the claim may give a staging folder):
    :func:`headbudget.analysis.attention.run_attention`, a line per model printed."""
    attention_run(args.settings, out, on_model=_print_attention)
    print(f"wrote {args.out}/")
    return 0


def _print_attention(label: str, s: dict[str, Any]) -> None:
    print(f"{label}: mean distance per layer "
          + " ".join(f"{d:.2f}" for d in s["mean_distance"])
          + f" (a plain average over the prefix: {s['plain_average_distance']:.2f})")


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
