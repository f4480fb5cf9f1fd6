"""One evaluation run over built-in and lm-eval tasks, reported in headbudget's JSON and lm-eval's.

A task name is built in (:mod:`headbudget.evaluation.tasks`, rows from ``data_dir``, no lm-eval
needed) when it is one of the seven declared there, zero-shot, and no ``include_path`` YAML
defines the same name; any other name goes to lm-eval's task system
(:func:`headbudget.evaluation.harness.evaluate_harness`).  Both are scored by the same
shared-prefix :class:`~headbudget.evaluation.zeroshot.Scorer`.

    >>> from headbudget.evaluation.suite import evaluate_suite
    >>> rep = evaluate_suite(model, tok, ["piqa", "arc_easy_5shot"], data_dir="../shared/data/zeroshot",
    ...                      include_path="benchmarks/lm_eval_tasks", limit=100)   # doctest: +SKIP
    >>> rep["results"]["piqa"]["acc,none"], rep["n-samples"]["piqa"]["effective"]  # doctest: +SKIP
    (0.62, 100)

The report is what ``lm_eval.simple_evaluate`` returns for the same tasks -- ``results`` (per task
``name``, ``alias``, ``sample_len`` and ``"acc,none"``-style keys only, so ``lm_eval.utils.make_table``
prints each metric once), ``groups`` when a group aggregates, ``group_subtasks``, ``configs``,
``versions``, ``n-shot``, ``higher_is_better``, ``n-samples``, ``config`` and, with ``log_samples``,
``samples`` (lm-eval's in-memory records) -- plus headbudget's own ``predictions``, ``seconds`` and
``details``.  :func:`headbudget.evaluation.lm_eval_files.write_lm_eval_files` writes it as lm-eval's
files, headbudget's fields under one ``"headbudget"`` key.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from importlib.util import find_spec
from itertools import islice
from pathlib import Path
from typing import Any

from headbudget.evaluation.tasks import TASKS, get_task, iter_jsonl, load_examples
from headbudget.evaluation.zeroshot import evaluate_tasks, format_table

DEFAULT_SEEDS = (0, 1234, 1234, 1234)  # lm-eval's --seed default: python, numpy, torch, few-shot

# lm-eval's version of the task each built-in one reproduces (its YAML `metadata.version`)
_LM_EVAL_VERSIONS = {"piqa": 1.0, "hellaswag": 1.0, "arc_easy": 1.0, "arc_challenge": 1.0,
                     "openbookqa": 1.0, "winogrande": 1.0, "copa": 1.0}


def parse_seed(value: str | int | Sequence[int | None] | None) -> tuple[int | None, ...]:
    """lm-eval's ``--seed``: one integer for all four seeds (python, numpy, torch, few-shot), or
    four comma-separated values where ``None`` leaves one unset.

        >>> parse_seed("42"), parse_seed("0,None,8,52"), parse_seed(None)
        ((42, 42, 42, 42), (0, None, 8, 52), (0, 1234, 1234, 1234))
    """
    if value is None:
        return DEFAULT_SEEDS
    if isinstance(value, int):
        return (value,) * 4
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[int | None] = []
    for item in items:
        text = str(item).strip()
        if text.lower() == "none":
            out.append(None)
            continue
        try:
            out.append(int(text))
        except ValueError:
            raise ValueError(f"--seed: {text!r} is not an integer or None (e.g. --seed 42 or "
                             "--seed 0,1234,1234,1234)") from None
    if len(out) == 1:
        return (out[0],) * 4
    if len(out) != 4:
        raise ValueError(f"--seed: expected 1 or 4 comma-separated values, got {len(out)}")
    return tuple(out)


def lm_eval_installed() -> bool:
    """Whether the optional ``lmeval`` extra can be imported (without importing it)."""
    try:
        return find_spec("lm_eval") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["lm_eval"] is None (blocked)
        return False


def check_eval_args(tasks: Sequence[str], *, data_dir: str | None = None, include_path: Any = None,
                    num_fewshot: int | None = None, seed: Any = None, limit: int | None = None) -> None:
    """The checks that need no model and no task building (one-line errors naming the flag)."""
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
    builtin, harness = split_tasks(tasks, num_fewshot=num_fewshot, include_path=include_path)
    for t in builtin:
        get_task(t)
    if harness and not lm_eval_installed():
        raise ValueError(f"task {harness[0]!r} is not built in ({', '.join(TASKS)}); lm-eval tasks "
                         "need the optional extra: pip install \"headbudget[lmeval]\"")


def split_tasks(tasks: Sequence[str], *, num_fewshot: int | None = None,
                include_path: Any = None) -> tuple[list[str], list[str]]:
    """``(built-in names, lm-eval names)``, see the module docstring."""
    local: set[str] = set()
    if include_path is not None and any(t in TASKS for t in tasks) and lm_eval_installed():
        from headbudget.evaluation.harness import task_manager

        local = set(task_manager([], include_path).all_tasks)
    builtin = [t for t in tasks if t in TASKS and not num_fewshot and t not in local]
    return builtin, [t for t in tasks if t not in builtin]


def prepare_suite(tasks: Sequence[str], *, data_dir: str | None = None, include_path: Any = None,
                  num_fewshot: int | None = None, seed: Any = None,
                  limit: int | None = None) -> dict[str, Any] | None:
    """Check the arguments and load the lm-eval tasks among ``tasks`` (their data included), so that a
    bad flag, an unknown or generation task or unreachable data fails before the model is loaded;
    returns what :func:`evaluate_suite` takes as ``harness_tasks`` (None without lm-eval tasks).

        >>> pre = prepare_suite(["arc_easy_local"], include_path="benchmarks/lm_eval_tasks")  # doctest: +SKIP
        >>> evaluate_suite(model, tok, ["arc_easy_local"], include_path=..., harness_tasks=pre)  # doctest: +SKIP
    """
    check_eval_args(tasks, data_dir=data_dir, include_path=include_path, num_fewshot=num_fewshot,
                    seed=seed, limit=limit)
    _, harness = split_tasks(tasks, num_fewshot=num_fewshot, include_path=include_path)
    if not harness:
        return None
    from headbudget.evaluation.harness import load_harness_tasks

    return load_harness_tasks(harness, include_path)[1]


def _lm_eval_keys(res: dict[str, Any], filt: str = "none") -> dict[str, Any]:
    """headbudget's metric keys -> lm-eval's ``"metric,filter"`` keys (``n`` is lm-eval's
    ``sample_len``)."""
    return {f"{k},{filt}": v for k, v in res.items() if k != "n"}


def _plain_keys(res: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``"acc,none"`` -> ``"acc"`` (the ``none`` filter only; other filters keep theirs)."""
    return {k[: -len(",none")]: v for k, v in res.items() if k.endswith(",none")}


def evaluate_suite(model: Any, tokenizer: Any, tasks: Sequence[str], *, data_dir: str | None = None,
                   include_path: Any = None, num_fewshot: int | None = None, seed: Any = None,
                   limit: int | None = None, batch_size: int = 16, strategy: str = "prefix",
                   device: str | None = None, log_samples: bool = False,
                   bootstrap_iters: int = 100000, progress: bool = True,
                   harness_tasks: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate ``tasks`` (built-in and lm-eval) and return the combined report (module docstring).

    ``harness_tasks``: the lm-eval tasks already loaded by :func:`prepare_suite` (which fails on a
    bad task before any model is loaded).

    ``details`` holds ``model``-independent run facts: ``task_seconds`` and ``forward_passes`` per
    built-in task, ``lm_eval`` (its tasks' seconds, model seconds and forward passes, scored
    together), ``limit``, ``num_fewshot``, ``batch_size``.
    """
    check_eval_args(tasks, data_dir=data_dir, include_path=include_path, num_fewshot=num_fewshot,
                    seed=seed, limit=limit)
    builtin, harness = split_tasks(tasks, num_fewshot=num_fewshot, include_path=include_path)
    t0 = time.perf_counter()
    rep: dict[str, Any] = {"results": {}, "group_subtasks": {}, "configs": {}, "versions": {},
                           "n-shot": {}, "higher_is_better": {}, "n-samples": {}, "predictions": {}}
    seeds = parse_seed(seed)
    # lm-eval's config (its model's get_model_info included); model_args is the caller's to name
    config: dict[str, Any] = {
        "model": "headbudget", "model_args": None, "model_class": type(model).__name__,
        "strategy": strategy, "batch_size": batch_size, "device": device, "limit": limit,
        "bootstrap_iters": bootstrap_iters, "random_seed": seeds[0], "numpy_seed": seeds[1],
        "torch_seed": seeds[2], "fewshot_seed": seeds[3]}
    details: dict[str, Any] = {"task_seconds": {}, "forward_passes": {}, "limit": limit,
                               "num_fewshot": num_fewshot, "batch_size": batch_size}
    samples: dict[str, list[dict[str, Any]]] = {}
    if harness:  # first: its task building fails fast on unknown or generation tasks
        from headbudget.evaluation.harness import evaluate_harness

        out = evaluate_harness(model, tokenizer, harness, include_path=include_path,
                               num_fewshot=num_fewshot, seed=seed, limit=limit,
                               batch_size=batch_size, strategy=strategy, device=device,
                               log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                               progress=progress, loaded=harness_tasks)
        rep["results"].update(out["results"])
        for key in ("group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples"):
            rep[key].update(out.get(key, {}))
        if out.get("groups"):
            rep["groups"] = out["groups"]
        config.update({k: v for k, v in out["config"].items() if k != "model_args"})
        rep["predictions"].update(out["predictions"])
        samples.update(out.get("samples") or {})
        details["lm_eval"] = {"tasks": harness, "seconds": out["seconds"],
                              "model_seconds": out["model_seconds"],
                              "forward_passes": out["forward_passes"]}
    if builtin:
        scores: dict[str, list[list[float]]] = {}
        got = evaluate_tasks(model, tokenizer, builtin, data_dir=data_dir, limit=limit,
                             batch_size=batch_size, strategy=strategy, device=device,
                             progress=progress, scores_out=scores)
        for name in builtin:
            res = got["results"][name]
            spec = get_task(name)
            metrics = _lm_eval_keys(res)
            if bootstrap_iters <= 0 or res["n"] < 2:  # lm-eval reports no stderr then
                metrics.update({k: "N/A" for k in metrics if k.split(",")[0].endswith("_stderr")})
            rep["results"][name] = {"name": name, "alias": name, "sample_len": res["n"], **metrics}
            rep["predictions"][name] = got["predictions"][name]
            rep["versions"][name] = _LM_EVAL_VERSIONS.get(name, 1.0)
            rep["n-shot"][name] = 0
            rep["higher_is_better"][name] = {m: True for m in spec.metrics}
            rep["n-samples"][name] = {"original": _builtin_size(name, data_dir, limit, res["n"]),
                                      "effective": res["n"]}
            rep["configs"][name] = {
                "task": name, "output_type": "multiple_choice", "num_fewshot": 0,
                "target_delimiter": spec.target_delimiter, "metric_list": [
                    {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in spec.metrics],
                "dataset_path": str(Path(data_dir) / spec.local_file) if data_dir else spec.hf_path,
                "dataset_name": None if data_dir else spec.hf_name,
                "test_split": None if data_dir else spec.hf_split,
                "metadata": {"version": rep["versions"][name], "source": "headbudget built-in task"}}
            details["task_seconds"][name] = got["task_seconds"][name]
            details["forward_passes"][name] = got["forward_passes"][name]
            if log_samples:
                samples[name] = _builtin_samples(name, data_dir, limit, scores[name],
                                                 got["predictions"][name])
    rep["config"] = config
    rep.update(_tokenizer_info(tokenizer, config.get("max_length")))
    if log_samples:
        rep["samples"] = samples
    rep["seconds"] = round(time.perf_counter() - t0, 3)
    rep["details"] = details
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


def _builtin_docs(name: str, data_dir: str | None, limit: int | None) -> list[dict[str, Any]]:
    """The rows :func:`load_examples` built the task's examples from, in the same order."""
    spec = get_task(name)
    if data_dir is not None:
        rows = (row for _, row in iter_jsonl(Path(data_dir) / spec.local_file))
        return list(islice(rows, limit))
    import datasets  # the hub's rows, cached by load_examples' own call

    split = spec.hf_split if limit is None else f"{spec.hf_split}[:{limit}]"
    return [dict(r) for r in datasets.load_dataset(spec.hf_path, spec.hf_name, split=split)]


def _builtin_samples(name: str, data_dir: str | None, limit: int | None,
                     scores: list[list[float]], preds: list[int]) -> list[dict[str, Any]]:
    """A built-in task's per-document records in lm-eval's evaluator form (``doc`` is the task
    file's row; ``arguments`` (context, continuation) per choice; ``resps`` ``[[(loglik, False)]]``:
    multiple-choice metrics do not read is_greedy, which the built-in scorer does not compute)."""
    import numpy as np

    from headbudget.evaluation.lm_eval_files import doc_hash, hash_string

    out = []
    examples = load_examples(name, data_dir, limit)
    docs = _builtin_docs(name, data_dir, limit)
    for i, (ex, doc, lls, pred) in enumerate(zip(examples, docs, scores, preds, strict=True)):
        norm = int(np.argmax(np.asarray(lls) / np.asarray(ex.norm_lengths)))
        metrics = list(get_task(name).metrics)
        rec: dict[str, Any] = {
            "doc_id": i, "doc": doc, "target": ex.target,
            "arguments": [(c, k) for c, k in zip(ex.contexts, ex.continuations, strict=True)],
            "resps": [[(ll, False)] for ll in lls], "filtered_resps": [(ll, False) for ll in lls],
            "filter": "none", "metrics": metrics, "doc_hash": doc_hash(doc),
            "prompt_hash": hash_string(ex.contexts[0]), "target_hash": hash_string(str(ex.target)),
            "acc": float(pred == ex.target)}
        if "acc_norm" in metrics:
            rec["acc_norm"] = float(norm == ex.target)
        out.append(rec)
    return out


def format_report(rep: dict[str, Any]) -> str:
    """The built-in tasks' table, then lm-eval's own table for its tasks (and groups)."""
    builtin = {k: {**{m: float("nan") if x == "N/A" else x for m, x in _plain_keys(v).items()},
                   "n": v["sample_len"]}
               for k, v in rep["results"].items() if k in rep["details"]["task_seconds"]}
    parts = [format_table({"results": builtin})] if builtin else []
    if "lm_eval" in rep["details"]:
        from lm_eval.utils import make_table

        lm = {k: v for k, v in rep["results"].items() if k not in builtin}
        sub = {"results": lm, "versions": rep["versions"], "n-shot": rep["n-shot"],
               "higher_is_better": rep["higher_is_better"], "group_subtasks": rep["group_subtasks"]}
        parts.append(make_table(sub))
        if rep.get("groups"):
            parts.append(make_table({**sub, "groups": rep["groups"]}, "groups"))
    return "\n".join(parts)
