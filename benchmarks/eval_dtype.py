"""bf16 vs fp32 evaluation of SmolLM2-135M-Instruct: wall time, whether the scorer's fast path is
kept, and agreement with fp32 (same predictions, largest |Δ log-likelihood|).

One process, the model loaded once and cast; the configurations run interleaved, task by task (so
a noisy neighbour slows them alike), each with a fresh scorer (its own fast-path checks):

* ``float32`` -- the reference;
* ``bfloat16`` -- the fast path, checked per token at bf16's tolerance;
* ``bfloat16 full`` -- every choice in full: what bf16 cost before, when its check always failed.

Tasks: the first ``--limit`` documents of piqa and arc_easy (local JSONL files) and a rolling
log-likelihood (perplexity) over ``--ppl-docs`` WikiText-2 passages in windows of ``--ppl-context``.

    python benchmarks/eval_dtype.py --limit 100 --threads 1 --json benchmarks/results/eval_dtype.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CONFIGS = [("float32", "prefix"), ("bfloat16", "prefix"), ("bfloat16", "full")]


def label(dtype: str, strategy: str) -> str:
    return dtype if strategy == "prefix" else f"{dtype} full"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct's .gguf file")
    ap.add_argument("--data-dir", type=Path, default=SHARED / "zeroshot")
    ap.add_argument("--tasks", default="piqa,arc_easy")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ppl-data", type=Path, default=SHARED / "text" / "wikitext2_valid.tokens")
    ap.add_argument("--ppl-docs", type=int, default=4, help="passages of --ppl-chars characters")
    ap.add_argument("--ppl-chars", type=int, default=4000)
    ap.add_argument("--ppl-context", type=int, default=512, help="rolling window length (tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "eval_dtype.json")
    args = ap.parse_args(argv)
    if not args.gguf.is_file() or not args.data_dir.is_dir():
        print(f"skipped: needs {args.gguf} and {args.data_dir}", file=sys.stderr)
        return 0

    import copy
    import warnings

    import numpy as np
    import torch

    from headbudget.evaluation.harness import HeadBudgetLM
    from headbudget.evaluation.tasks import load_examples
    from headbudget.io import atomic_write_json
    from headbudget.loading import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model32, tok = load_model_and_tokenizer(args.gguf)
    models = {"float32": model32.to(torch.float32), "bfloat16": copy.deepcopy(model32).to(torch.bfloat16)}
    load_s = time.perf_counter() - t0
    lms = {label(d, s): HeadBudgetLM(pretrained=models[d], tokenizer=tok, strategy=s, max_length=args.ppl_context,
                                     batch_size=args.batch_size, progress=False) for d, s in CONFIGS}
    text = args.ppl_data.read_text(encoding="utf-8")
    passages = [text[i * args.ppl_chars: (i + 1) * args.ppl_chars] for i in range(args.ppl_docs)]
    work: list[tuple[str, object]] = [(t, load_examples(t, args.data_dir)[: args.limit])
                                      for t in args.tasks.split(",")]
    work.append(("rolling", [SimpleNamespace(args=(p,), task_name="rolling", doc_id=i, idx=0)
                             for i, p in enumerate(passages)]))
    n_tok = sum(len(tok.encode(p, add_special_tokens=False)) for p in passages)  # the ppl denominator
    res: dict[str, dict] = {}
    for task, data in work:
        out = res[task] = {"n": len(data), "configs": {}}
        for name, lm in lms.items():
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                t = time.perf_counter()
                if task == "rolling":
                    lls = [[x] for x in lm.loglikelihood_rolling(data)]
                else:
                    lls = lm.scorer.score(data, desc=task)
                sec = time.perf_counter() - t
            row = {"seconds": round(sec, 2), "strategy": lm.scorer.strategy,
                   "fast_path_kept": lm.scorer.strategy == "prefix",
                   "fallback_warnings": [str(w.message) for w in record if "in full" in str(w.message)],
                   "loglik": lls}
            if task == "rolling":
                row["ppl"] = math.exp(-sum(x[0] for x in lls) / n_tok)
            else:
                pred = [int(np.argmax(s)) for s in lls]
                row["pred"] = pred
                row["acc"] = float(np.mean([p == ex.target for p, ex in zip(pred, data, strict=True)]))
            out["configs"][name] = row
            print(f"{task:>9} {name:>14}: {sec:7.1f}s  strategy {row['strategy']}", flush=True)
        ref = out["configs"]["float32"]
        for row in out["configs"].values():
            diffs = [abs(a - b) for x, y in zip(row["loglik"], ref["loglik"], strict=True)
                     for a, b in zip(x, y, strict=True)]
            row["max_abs_dloglik_vs_fp32"] = round(max(diffs), 4)
            if "pred" in row:
                row["same_predictions_as_fp32"] = sum(a == b for a, b in zip(row["pred"], ref["pred"], strict=True))
    for task_res in res.values():  # keep the JSON small: the summaries, not every log-likelihood
        for row in task_res["configs"].values():
            row.pop("loglik")
            row.pop("pred", None)

    print(f"\nSmolLM2-135M-Instruct ({args.gguf.name}), {args.threads} thread(s), batch {args.batch_size}, "
          f"load {load_s:.1f}s")
    print("| task | n | config | seconds | strategy used | same predictions as fp32 | max abs dloglik | acc / ppl |")
    print("|---|---|---|---|---|---|---|---|")
    for task, task_res in res.items():
        for name, row in task_res["configs"].items():
            same = row.get("same_predictions_as_fp32")
            same_text = "-" if same is None else f"{same}/{task_res['n']}"
            metric = f"ppl {row['ppl']:.3f}" if "ppl" in row else f"acc {row['acc']:.3f}"
            print(f"| {task} | {task_res['n']} | {name} | {row['seconds']:.1f} | "
                  f"{row['strategy']} | {same_text} | "
                  f"{row['max_abs_dloglik_vs_fp32']:.3g} | {metric} |")
    totals = {name: round(sum(r["configs"][name]["seconds"] for r in res.values()), 1) for name in lms}
    print("total seconds: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    checked = {name: lm.scorer.stats.checked for name, lm in lms.items()}
    if args.json:
        atomic_write_json(args.json, {"model": str(args.gguf.name), "threads": args.threads,
                                      "batch_size": args.batch_size, "limit": args.limit,
                                      "ppl_context": args.ppl_context, "load_seconds": round(load_s, 1),
                                      "tasks": res, "total_seconds": totals, "checked": checked}, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
