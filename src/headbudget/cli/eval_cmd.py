"""``headbudget eval``, ``headbudget perplexity`` and ``headbudget attention``.

    headbudget eval runs/prism --tasks piqa,hellaswag,arc_easy,winogrande \\
        --data-dir ../shared/data/zeroshot --limit 200 --json results.json
    headbudget eval /tmp/smol --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --tasks arc_easy \\
        --data-dir ../shared/data/zeroshot
    headbudget perplexity runs/prism --data ../shared/data/text/wikitext2_valid.tokens \\
        --tokenizer ../shared/data/tokenizers/gpt2 --context 1024 --stride 512
    headbudget attention runs/uniform --data ../shared/data/text/tinyshakespeare.txt \\
        --out attn/ --compare runs/prism
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from headbudget.io import atomic_write_json


def _clean_nan(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean_nan(v) for v in obj]
    return obj


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="headbudget checkpoint dir, HF model dir or hub name")
    p.add_argument("--tokenizer", help="tokenizer dir / hub name, or a dir with GPT-2's encoder.json "
                   "+ vocab.bpe (default: the model's own)")
    p.add_argument("--gguf-file", help="GGUF file name inside MODEL (a directory)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads for this run (on a shared CPU, "
                   "1 can be much faster than several)")


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from headbudget.evaluation.loading import load_model_and_tokenizer

    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    return load_model_and_tokenizer(args.model, tokenizer=args.tokenizer,
                                    gguf_file=args.gguf_file, device=args.device)


def _load_threads(n: int) -> None:
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)


def run_eval(args: argparse.Namespace) -> int:
    from headbudget.evaluation.tasks import get_task
    from headbudget.evaluation.zeroshot import evaluate_tasks, format_table

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty")
    for t in tasks:
        get_task(t)
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir: no directory {args.data_dir}")
    model, tok = _load(args)
    report = evaluate_tasks(model, tok, tasks, data_dir=args.data_dir, limit=args.limit,
                            batch_size=args.batch_size, strategy=args.strategy, device=args.device,
                            progress=not args.quiet)
    print(format_table(report))
    for t in tasks:
        print(f"{t}: {report['results'][t]['n']} examples, {report['forward_passes'][t]} forward "
              f"passes, {report['task_seconds'][t]:.1f}s")
    print(f"total: {report['seconds']:.1f}s")
    if args.json:
        out = {"results": report["results"], "predictions": report["predictions"],
               "seconds": report["seconds"],
               "details": {"model": str(args.model), "task_seconds": report["task_seconds"],
                           "forward_passes": report["forward_passes"], "limit": args.limit}}
        atomic_write_json(args.json, _clean_nan(out))
        print(f"wrote {args.json}")
    return 0


def run_perplexity(args: argparse.Namespace) -> int:
    from headbudget.evaluation.perplexity import perplexity, read_text

    text = read_text(args.data, split=args.split)
    model, tok = _load(args)
    res = perplexity(model, tok, text, context=args.context, stride=args.stride,
                     max_windows=args.max_windows, progress=not args.quiet)
    print(f"loss {res['loss']:.4f}  ppl {res['ppl']:.3f}  ({res['tokens_scored']:,} of "
          f"{res['tokens_total']:,} tokens scored, {res['windows']} windows of {res['context']}, "
          f"stride {res['stride']}, {res['seconds']:.1f}s)")
    if args.json:
        atomic_write_json(args.json, dict(res, model=str(args.model), data=str(args.data)))
        print(f"wrote {args.json}")
    return 0


def run_attention(args: argparse.Namespace) -> int:
    from headbudget.analysis.attention import (
        attention_summary_from_text,
        plot_distance,
        plot_distance_comparison,
        write_json,
    )
    from headbudget.evaluation.loading import load_model_and_tokenizer
    from headbudget.evaluation.perplexity import read_text

    text = read_text(args.data)
    out = Path(args.out)
    if args.threads is not None:
        _load_threads(args.threads)
    models = [args.model] + ([args.compare] if args.compare else [])
    summaries: dict[str, Any] = {}
    for i, name in enumerate(models):
        model, tok = load_model_and_tokenizer(
            name, tokenizer=args.tokenizer, gguf_file=args.gguf_file if i == 0 else None,
            device=args.device)
        s = attention_summary_from_text(model, tok, text, seq_len=args.seq_len, n_seqs=args.n_seqs,
                                        local_window=args.local_window)
        label = Path(str(name).rstrip("/")).name or str(name)
        if label in summaries:
            label = f"{label}_{i}"
        summaries[label] = s
        write_json(s, out / f"attention_{label}.json")
        plot_distance(s, out / f"distance_{label}.png", title=f"{label}: mean attention distance")
        print(f"{label}: mean distance per layer "
              + " ".join(f"{d:.2f}" for d in s["mean_distance"]))
    if len(summaries) > 1:
        plot_distance_comparison(summaries, out / "distance_comparison.png")
    print(f"wrote {out}/")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="zero-shot multiple-choice accuracy (lm-eval's numbers)",
                              description="Zero-shot PIQA/HellaSwag/ARC/WinoGrande with "
                              "lm-evaluation-harness's prompts and metrics.")
    _add_model_args(p)
    p.add_argument("--tasks", default="piqa,hellaswag,arc_easy,winogrande",
                   help="comma-separated: piqa,hellaswag,arc_easy,arc_challenge,openbookqa,"
                   "winogrande,copa")
    p.add_argument("--data-dir", help="local JSONL files (e.g. ../shared/data/zeroshot); default: "
                   "the Hugging Face hub")
    p.add_argument("--limit", type=int, help="first N examples per task")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--strategy", default="prefix", choices=["prefix", "full"],
                   help="prefix: shared context once via the KV cache (default); full: every choice "
                   "in full, batched by length")
    p.add_argument("--json", help="write results, predictions and seconds here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_eval)

    p = subparsers.add_parser("perplexity", help="sliding-window token perplexity",
                              description="Token-level loss and perplexity with a sliding window.")
    _add_model_args(p)
    p.add_argument("--data", required=True, help="text file, or HF dataset NAME[:CONFIG]")
    p.add_argument("--split", default="test", help="HF split (default test)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--max-windows", type=int, help="score only the first N windows")
    p.add_argument("--json")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_perplexity)

    p = subparsers.add_parser("attention", help="per-head attention distance/entropy/locality",
                              description="Mean attention distance, entropy and local share per "
                              "layer and head; JSON and PNG plots.")
    _add_model_args(p)
    p.add_argument("--data", required=True, help="text file, or HF dataset NAME[:CONFIG]")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--compare", help="a second model, plotted side by side")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-seqs", type=int, default=4)
    p.add_argument("--local-window", type=int, default=8)
    p.set_defaults(func=run_attention)


if __name__ == "__main__":  # pragma: no cover
    from headbudget.cli.main import main

    sys.exit(main(["eval", *sys.argv[1:]]))
