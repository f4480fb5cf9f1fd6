"""headbudget's zero-shot scorer vs lm-evaluation-harness: same per-example predictions, seconds.

Runs lm_eval.simple_evaluate (``hf`` backend) and ``headbudget.evaluation.evaluate_tasks`` on the
same model, the same local JSONL rows (``--data-dir``, Hugging Face schemas) and ``--limit``, then
compares every example's prediction (argmax of the log-likelihoods, and of the length-normalised
ones) and the wall-clock seconds per task.

    HF_HUB_OFFLINE=1 python benchmarks/eval_vs_lm_eval.py --model /tmp/smol --gguf-file smol.gguf \\
        --data-dir ../shared/data/zeroshot --limit 100 --tasks piqa,hellaswag,arc_easy,winogrande

Without ``--model`` it builds a tiny random GPT-2 (GPT-2 BPE from ../shared/data/tokenizers/gpt2)
in a temporary directory.  The lm-eval task configs below point the harness's own default task
definitions (prompts, choices, targets; its hellaswag/winogrande helper functions) at local files.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def lm_eval_task_configs(data_dir: Path, tasks: list[str]) -> list[dict]:
    """lm-eval task configs = the harness's defaults, reading ``data_dir``'s JSONL files."""
    from lm_eval.tasks.hellaswag import utils as hs
    from lm_eval.tasks.winogrande import preprocess_winogrande as wg

    from headbudget.evaluation.tasks import get_task

    def process_hellaswag(ds):  # the shared copy has `ctx` (already cleaned), not ctx_a/ctx_b
        def one(doc):
            if "ctx_a" in doc and "ctx_b" in doc:
                query = hs.preprocess(doc["activity_label"] + ": " + doc["ctx_a"] + " "
                                      + doc["ctx_b"].capitalize())
            else:
                query = doc["activity_label"] + ": " + doc["ctx"]
            return {"query": query, "choices": [hs.preprocess(e) for e in doc["endings"]],
                    "gold": int(doc["label"])}
        return ds.map(one)

    base = {"output_type": "multiple_choice", "test_split": "test",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    defs = {
        "piqa": {"doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_target": "label",
                 "doc_to_choice": "{{[sol1, sol2]}}"},
        "hellaswag": {"process_docs": process_hellaswag, "doc_to_text": "{{query}}",
                      "doc_to_target": "{{label}}", "doc_to_choice": "choices"},
        "arc_easy": {"doc_to_text": "Question: {{question}}\nAnswer:",
                     "doc_to_target": "{{choices.label.index(answerKey)}}",
                     "doc_to_choice": "{{choices.text}}"},
        "arc_challenge": {"doc_to_text": "Question: {{question}}\nAnswer:",
                          "doc_to_target": "{{choices.label.index(answerKey)}}",
                          "doc_to_choice": "{{choices.text}}"},
        "winogrande": {"doc_to_text": wg.doc_to_text, "doc_to_target": wg.doc_to_target,
                       "doc_to_choice": wg.doc_to_choice, "metric_list": [{"metric": "acc"}]},
    }
    out = []
    for t in tasks:
        cfg = dict(base, **defs[t])
        cfg["task"] = f"hb_local_{t}"
        cfg["dataset_path"] = "json"
        cfg["dataset_kwargs"] = {"data_files": {"test": str(data_dir / get_task(t).local_file)}}
        out.append(cfg)
    return out


def tiny_gpt2(directory: Path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from headbudget.models.tokenizers import gpt2_hf_tokenizer

    torch.manual_seed(0)
    tok = gpt2_hf_tokenizer(SHARED / "tokenizers" / "gpt2")
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=512)).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def run_lm_eval(model_path: str, gguf_file: str | None, data_dir: Path, tasks: list[str],
                limit: int, batch_size: int) -> dict:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    lm = HFLM(pretrained=model_path, batch_size=batch_size, device="cpu", **kw)
    timer = {"s": 0.0}
    inner = lm.loglikelihood

    def timed_loglikelihood(*a, **k):  # the harness's model time alone (no dataset building)
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            timer["s"] += time.perf_counter() - t0

    lm.loglikelihood = timed_loglikelihood
    out = {"seconds": {}, "model_seconds": {}, "pred": {}, "acc": {}}
    for t, cfg in zip(tasks, lm_eval_task_configs(data_dir, tasks), strict=True):
        timer["s"] = 0.0
        t0 = time.perf_counter()
        res = lm_eval.simple_evaluate(model=lm, tasks=[cfg], limit=limit, log_samples=True,
                                      bootstrap_iters=0, verbosity="ERROR")
        out["seconds"][t] = time.perf_counter() - t0
        out["model_seconds"][t] = timer["s"]
        samples = sorted(res["samples"][cfg["task"]], key=lambda s: s["doc_id"])
        lls = [[r[0] for r in s["filtered_resps"]] for s in samples]
        out["pred"][t] = [int(np.argmax(x)) for x in lls]
        out["lls"] = out.get("lls", {}) | {t: lls}
        out["acc"][t] = res["results"][cfg["task"]]["acc,none"]
    return out


def run_ours(model_path: str, gguf_file: str | None, data_dir: Path, tasks: list[str], limit: int,
             batch_size: int, strategy: str) -> dict:
    from headbudget.evaluation.zeroshot import evaluate_tasks
    from headbudget.loading import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(model_path, gguf_file=gguf_file)
    scores: dict = {}
    rep = evaluate_tasks(model, tok, tasks, data_dir=str(data_dir), limit=limit,
                         batch_size=batch_size, strategy=strategy, progress=False, scores_out=scores)
    return {"seconds": rep["task_seconds"], "pred": rep["predictions"], "lls": scores,
            "acc": {t: r["acc"] for t, r in rep["results"].items()},
            "forward_passes": rep["forward_passes"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model dir/name (default: a tiny random GPT-2)")
    ap.add_argument("--gguf-file")
    ap.add_argument("--data-dir", type=Path, default=SHARED / "zeroshot")
    ap.add_argument("--tasks", default="piqa,hellaswag,arc_easy,winogrande")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=8, help="both tools (lm-eval's default is 1)")
    ap.add_argument("--strategy", default="prefix", choices=["prefix", "full"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared CPU, 2+ threads can be 10x slower)")
    ap.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    tasks = args.tasks.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_gpt2(Path(tmp) / "tiny"))
        ours = run_ours(model, args.gguf_file, args.data_dir, tasks, args.limit, args.batch_size,
                        args.strategy)
        ref = run_lm_eval(model, args.gguf_file, args.data_dir, tasks, args.limit, args.batch_size)
    rows, ok = [], True
    print(f"{'task':<12}{'n':>5}{'same pred':>10}{'max|dll|':>10}{'lm-eval s':>11}"
          f"{'(model s)':>10}{'ours s':>8}{'speed-up':>9}{'(model)':>8}{'passes':>8}")
    for t in tasks:
        same = sum(a == b for a, b in zip(ours["pred"][t], ref["pred"][t], strict=True))
        n = len(ref["pred"][t])
        dll = max(abs(a - b) for x, y in zip(ours["lls"][t], ref["lls"][t], strict=True)
                  for a, b in zip(x, y, strict=True))
        speed = ref["seconds"][t] / ours["seconds"][t]
        speed_model = ref["model_seconds"][t] / ours["seconds"][t]
        ok &= same == n
        rows.append({"task": t, "n": n, "same_predictions": same, "max_abs_loglik_diff": dll,
                     "lm_eval_seconds": ref["seconds"][t],
                     "lm_eval_loglikelihood_seconds": ref["model_seconds"][t],
                     "ours_seconds": ours["seconds"][t], "speedup": speed,
                     "speedup_vs_loglikelihood_only": speed_model, "acc_ours": ours["acc"][t], "acc_lm_eval": ref["acc"][t],
                     "forward_passes": ours["forward_passes"][t]})
        print(f"{t:<12}{n:>5}{same:>10}{dll:>10.2e}{ref['seconds'][t]:>11.2f}"
              f"{ref['model_seconds'][t]:>10.2f}{ours['seconds'][t]:>8.2f}{speed:>8.2f}x"
              f"{speed_model:>7.2f}x{ours['forward_passes'][t]:>8}")
    tot_ref = sum(r["lm_eval_seconds"] for r in rows)
    tot_ref_model = sum(r["lm_eval_loglikelihood_seconds"] for r in rows)
    tot_ours = sum(r["ours_seconds"] for r in rows)
    n_all, same_all = sum(r["n"] for r in rows), sum(r["same_predictions"] for r in rows)
    print(f"{'total':<12}{n_all:>5}{same_all:>10}{'':>10}{tot_ref:>11.2f}{tot_ref_model:>10.2f}"
          f"{tot_ours:>8.2f}{tot_ref / tot_ours:>8.2f}x{tot_ref_model / tot_ours:>7.2f}x"
          f"{sum(r['forward_passes'] for r in rows):>8}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
