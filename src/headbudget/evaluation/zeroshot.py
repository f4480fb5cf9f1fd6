"""Zero-shot multiple-choice evaluation with lm-evaluation-harness's numbers, faster.

A choice's score is the summed log-likelihood of its continuation tokens given its context
(:mod:`headbudget.evaluation.encoding`, :class:`headbudget.evaluation.scorer.Scorer`); ``acc`` picks the
highest score, ``acc_norm`` the highest per character of the choice; stderrs are sample std / sqrt(n).

    >>> report = evaluate_tasks(model, tok, ["piqa"], data_dir="../shared/data/zeroshot")  # doctest: +SKIP
    >>> report["results"]["piqa"]["acc"]                          # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from headbudget.evaluation.scorer import Scorer
from headbudget.evaluation.tasks import MCExample, get_task, load_examples

__all__ = ["evaluate_tasks", "format_table", "mc_metrics", "mean_stderr"]


def mean_stderr(values: Sequence[float]) -> float:
    """Sample standard deviation / sqrt(n) (the harness's ``mean_stderr``); NaN when n < 2."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)


def mc_metrics(examples: Sequence[MCExample], scores: Sequence[Sequence[float]],
               metrics: Sequence[str] = ("acc", "acc_norm")) -> tuple[dict[str, float], list[int]]:
    """``acc``/``acc_norm`` with standard errors, and the predictions by ``acc`` (ties go to the first
    choice, as in the harness)."""
    acc, acc_norm, preds = [], [], []
    for ex, lls in zip(examples, scores, strict=True):
        lls_a = np.asarray(lls, dtype=np.float64)
        preds.append(int(np.argmax(lls_a)))
        acc.append(1.0 if preds[-1] == ex.target else 0.0)
        acc_norm.append(1.0 if int(np.argmax(lls_a / np.asarray(ex.norm_lengths))) == ex.target else 0.0)
    res: dict[str, float] = {"acc": float(np.mean(acc)), "acc_stderr": mean_stderr(acc)}
    if "acc_norm" in metrics:
        res.update(acc_norm=float(np.mean(acc_norm)), acc_norm_stderr=mean_stderr(acc_norm))
    res["n"] = len(examples)
    return res, preds


def evaluate_tasks(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[str], *,
                   data_dir: str | None = None, limit: int | None = None, batch_size: int = 16,
                   strategy: str = "prefix", device: str | None = None,
                   add_bos_token: bool | None = None, progress: bool = True,
                   scores_out: dict[str, list[list[float]]] | None = None) -> dict[str, Any]:
    """Evaluate ``model`` zero-shot on ``tasks``: ``{"results": {task: {"acc", "acc_stderr", ["acc_norm",
    "acc_norm_stderr"], "n"}}, "predictions": {task: [index chosen by acc, ...]}, "seconds", "task_seconds",
    "forward_passes"}``.  ``scores_out`` (optional) receives every choice's score."""
    if device is not None:
        model.to(device)
    report: dict[str, Any] = {"results": {}, "predictions": {}, "seconds": 0.0,
                              "task_seconds": {}, "forward_passes": {}}
    specs = [get_task(t) for t in tasks]  # unknown names fail before any work
    t_all = time.perf_counter()
    for spec in specs:
        t0 = time.perf_counter()
        examples = load_examples(spec, data_dir, limit)
        scorer = Scorer(model, tokenizer, batch_size=batch_size, strategy=strategy,
                        add_bos_token=add_bos_token, device=device, progress=progress)
        scores = scorer.score(examples, desc=spec.name)
        report["results"][spec.name], report["predictions"][spec.name] = mc_metrics(
            examples, scores, spec.metrics)
        report["task_seconds"][spec.name] = round(time.perf_counter() - t0, 3)
        report["forward_passes"][spec.name] = scorer.stats.forward_passes
        if scores_out is not None:
            scores_out[spec.name] = scores
    report["seconds"] = round(time.perf_counter() - t_all, 3)
    return report


def format_table(report: dict[str, Any]) -> str:
    """An lm-eval-like markdown table of ``report["results"]``."""
    lines = ["|   Tasks   |  n  |Metric  |   |Value |   |Stderr|",
             "|-----------|----:|--------|---|-----:|---|-----:|"]
    for task, res in report["results"].items():
        for k, m in enumerate(x for x in ("acc", "acc_norm") if x in res):
            name, n = (f"{task:<11}", f"{res['n']:>5}") if k == 0 else (" " * 11, " " * 5)
            se = res[m + "_stderr"]
            se = f"{se:.4f}" if isinstance(se, (int, float)) and se == se else "   N/A"  # NaN: one document
            lines.append(f"|{name}|{n}|{m:<8}|↑  |{res[m]:.4f}|±  |{se}|")
    return "\n".join(lines)
