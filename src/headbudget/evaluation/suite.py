"""One evaluation run over headbudget's built-in and lm-eval's tasks, reported in lm-eval's form.

With lm-eval installed every name goes to lm-eval (:func:`headbudget.evaluation.harness.evaluate_harness`);
without it (an optional extra) the built-in tasks run zero-shot through
:func:`headbudget.evaluation.zeroshot.evaluate_tasks`, with the same prompts and scorer, so the numbers
are the same either way.  The report has ``lm_eval.simple_evaluate``'s keys plus headbudget's
``predictions``, ``seconds`` and ``details``; see docs/evaluation.md.

    >>> rep = evaluate_suite(model, tok, ["piqa", "arc_easy_mmlu_style"], data_dir="../shared/data/zeroshot",
    ...                      include_path="benchmarks/lm_eval_tasks", limit=100)   # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from headbudget.evaluation.harness import SEED_KEYS, parse_seed
from headbudget.evaluation.tasks import TASKS, get_task, load_examples
from headbudget.evaluation.zeroshot import evaluate_tasks, format_table

#: the ``metadata.version`` of every built-in task file (lm-eval's own tasks of the same names say 1.0)
BUILTIN_TASK_VERSION = 1.0


def lm_eval_installed() -> bool:
    """Whether the optional ``lmeval`` extra can be imported (without importing it)."""
    try:
        return find_spec("lm_eval") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["lm_eval"] is None (blocked)
        return False


def check_eval_args(tasks: Sequence[str], *, data_dir: str | None = None, include_path: Any = None,
                    num_fewshot: int | None = None, seed: Any = None, limit: int | None = None,
                    log_samples: bool = False) -> None:
    """The checks that need no model and no task building (one-line errors naming the flag), and
    without lm-eval that only what the built-in path does is asked for."""
    if not tasks:
        raise ValueError("--tasks is empty")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    parse_seed(seed)
    if data_dir is not None and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir: no directory {data_dir}")
    if include_path is not None and not Path(include_path).is_dir():
        raise FileNotFoundError(f"--include-path: no directory {include_path}")
    if lm_eval_installed():
        return
    other = [t for t in tasks if t not in TASKS]
    need = (f"task {other[0]!r} is not built in ({', '.join(TASKS)}); lm-eval tasks" if other else
            "--num-fewshot" if num_fewshot else "--include-path" if include_path is not None else
            "--log-samples (lm-eval's per-document records)" if log_samples else None)
    if need:
        raise ValueError(f"{need} need the optional extra: pip install \"headbudget[lmeval]\"")


def prepare_suite(tasks: Sequence[str], *, data_dir: str | None = None, include_path: Any = None,
                  num_fewshot: int | None = None, seed: Any = None, limit: int | None = None,
                  log_samples: bool = False, allow_code: bool = False) -> dict[str, Any] | None:
    """Check the arguments and load the tasks through lm-eval (data included), so that a bad flag or task,
    a malformed row or unreachable data fails before the model is loaded: :func:`evaluate_suite`'s
    ``harness_tasks`` (None without lm-eval).  ``allow_code``: let a user's task YAML run Python.

        >>> pre = prepare_suite(["arc_easy_local"], include_path="benchmarks/lm_eval_tasks")  # doctest: +SKIP
    """
    check_eval_args(tasks, data_dir=data_dir, include_path=include_path, num_fewshot=num_fewshot,
                    seed=seed, limit=limit, log_samples=log_samples)
    if not lm_eval_installed():
        for name in tasks:  # a bad row fails here too, before the model loads
            load_examples(name, data_dir, limit)
        return None
    from headbudget.evaluation.harness import load_harness_tasks

    return load_harness_tasks(tasks, include_path, data_dir, limit, allow_code=allow_code)[1]


def evaluate_suite(model: Any, tokenizer: Any, tasks: Sequence[str], *, data_dir: str | None = None,
                   include_path: Any = None, num_fewshot: int | None = None, seed: Any = None,
                   limit: int | None = None, batch_size: int = 16, strategy: str = "prefix",
                   device: str | None = None, log_samples: bool = False,
                   bootstrap_iters: int = 100000, progress: bool = True,
                   harness_tasks: dict[str, Any] | None = None, allow_code: bool = False) -> dict[str, Any]:
    """Evaluate ``tasks`` and return the report (module docstring); ``harness_tasks``: what
    :func:`prepare_suite` returned.  ``details``: ``lm_eval`` (tasks, seconds, model seconds, forward passes)
    or without lm-eval ``task_seconds`` and ``forward_passes`` per task, and ``limit``, ``num_fewshot``,
    ``batch_size``."""
    check_eval_args(tasks, data_dir=data_dir, include_path=include_path, num_fewshot=num_fewshot,
                    seed=seed, limit=limit, log_samples=log_samples)
    t0 = time.perf_counter()
    run = {"limit": limit, "batch_size": batch_size, "strategy": strategy, "device": device,
           "progress": progress, "data_dir": data_dir, "seed": seed, "bootstrap_iters": bootstrap_iters}
    details: dict[str, Any] = {"task_seconds": {}, "forward_passes": {}, "limit": limit,
                               "num_fewshot": num_fewshot, "batch_size": batch_size}
    if lm_eval_installed():
        rep = _lm_eval_report(model, tokenizer, tasks, details, include_path=include_path,
                              num_fewshot=num_fewshot, log_samples=log_samples, loaded=harness_tasks,
                              allow_code=allow_code, **run)
    else:
        rep = _builtin_report(model, tokenizer, tasks, details, **run)
    rep.update(_tokenizer_info(tokenizer, rep["config"].get("max_length")))
    rep.update(seconds=round(time.perf_counter() - t0, 3), details=details)
    return rep


_REPORT_KEYS = ("results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better",
                "n-samples", "predictions")


def _lm_eval_report(model: Any, tokenizer: Any, tasks: Sequence[str], details: dict[str, Any],
                    log_samples: bool, **kwargs: Any) -> dict[str, Any]:
    """Every task through lm-eval (:func:`~headbudget.evaluation.harness.evaluate_harness`)."""
    from headbudget.evaluation.harness import evaluate_harness

    out = evaluate_harness(model, tokenizer, tasks, log_samples=log_samples, **kwargs)
    rep = {key: out.get(key, {}) for key in _REPORT_KEYS}
    if out.get("groups"):
        rep["groups"] = out["groups"]
    rep["config"] = {**out["config"], "model_args": None}  # the caller names the model it loaded
    if log_samples:
        rep["samples"] = out.get("samples") or {}
    details["lm_eval"] = {"tasks": list(tasks), "seconds": out["seconds"],
                          "model_seconds": out["model_seconds"], "forward_passes": out["forward_passes"]}
    return rep


def _builtin_report(model: Any, tokenizer: Any, tasks: Sequence[str], details: dict[str, Any], *,
                    data_dir: str | None, seed: Any, bootstrap_iters: int, **run: Any) -> dict[str, Any]:
    """The built-in tasks without lm-eval (:func:`evaluate_tasks`), in the keys lm-eval reports them under."""
    got = evaluate_tasks(model, tokenizer, tasks, data_dir=data_dir, **run)
    rep: dict[str, Any] = {key: {} for key in _REPORT_KEYS}
    for name, res in got["results"].items():
        spec = get_task(name)
        metrics = {f"{k},none": v for k, v in res.items() if k != "n"}  # lm-eval's "metric,filter" keys
        if bootstrap_iters <= 0 or res["n"] < 2:  # lm-eval reports no stderr then
            metrics.update({k: "N/A" for k in metrics if k.split(",")[0].endswith("_stderr")})
        rep["results"][name] = {"name": name, "alias": name, "sample_len": res["n"], **metrics}
        rep["versions"][name] = BUILTIN_TASK_VERSION
        rep["n-shot"][name] = 0
        rep["higher_is_better"][name] = dict.fromkeys(spec.metrics, True)
        rep["n-samples"][name] = {"original": _builtin_size(name, data_dir, run["limit"], res["n"]),
                                  "effective": res["n"]}
        rep["configs"][name] = {
            "task": name, "output_type": "multiple_choice", "num_fewshot": 0,
            "target_delimiter": spec.target_delimiter, "metric_list": [
                {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in spec.metrics],
            "dataset_path": str(Path(data_dir) / spec.local_file) if data_dir else spec.hf_path,
            "dataset_name": None if data_dir else spec.hf_name,
            "metadata": {"version": BUILTIN_TASK_VERSION, "source": "headbudget built-in task"}}
    rep["predictions"] = got["predictions"]
    details["task_seconds"], details["forward_passes"] = got["task_seconds"], got["forward_passes"]
    rep["config"] = {  # lm-eval's config keys (its model's get_model_info included)
        "model": "headbudget", "model_args": None, "model_class": type(model).__name__,
        "strategy": run["strategy"], "batch_size": run["batch_size"], "device": run["device"],
        "limit": run["limit"], "bootstrap_iters": bootstrap_iters, **dict(zip(SEED_KEYS, parse_seed(seed)))}
    return rep


def _tokenizer_info(tok: Any, max_length: int | None) -> dict[str, Any]:
    """lm-eval's ``add_tokenizer_info`` fields (special tokens as ``[token, "id"]``)."""
    info: dict[str, Any] = {
        f"tokenizer_{kind}_token": [getattr(tok, f"{kind}_token", None), str(getattr(tok, f"{kind}_token_id", None))]
        for kind in ("pad", "eos", "bos")}
    return {**info, "eot_token_id": getattr(tok, "eos_token_id", None), "max_length": max_length}


def _builtin_size(name: str, data_dir: str | None, limit: int | None, n: int) -> int:
    """lm-eval's ``n-samples.original``: the documents in the task's file (``--limit`` or not); from
    the hub, the ``n`` scored when a limit cut the split (counting it would load it whole)."""
    if data_dir is None or limit is None or n < limit:
        return n
    with (Path(data_dir) / get_task(name).local_file).open(encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip())


def format_report(rep: dict[str, Any]) -> str:
    """lm-eval's table of the tasks (and groups); without lm-eval, the built-in tasks' table."""
    if "lm_eval" not in rep["details"]:
        return format_table({"results": {  # "acc,none" -> "acc"
            k: {**{m.removesuffix(",none"): float("nan") if x == "N/A" else x for m, x in v.items()
                   if m.endswith(",none")}, "n": v["sample_len"]} for k, v in rep["results"].items()}})
    from lm_eval.utils import make_table

    sub = {k: rep[k] for k in ("results", "versions", "n-shot", "higher_is_better", "group_subtasks")}
    parts = [make_table(sub)]
    if rep.get("groups"):
        parts.append(make_table({**sub, "groups": rep["groups"]}, "groups"))
    return "\n".join(parts)
