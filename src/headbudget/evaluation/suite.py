"""One evaluation run over headbudget's built-in and lm-eval's tasks, reported in lm-eval's form.

With lm-eval installed every name goes to lm-eval (:func:`headbudget.evaluation.harness.evaluate_harness`);
without it (an optional extra) the built-in tasks run zero-shot through
:func:`headbudget.evaluation.zeroshot.evaluate_tasks`, with the same prompts and scorer, so the numbers
are the same either way.  The report has ``lm_eval.simple_evaluate``'s keys plus headbudget's
``predictions``, ``seconds`` and ``details``; see docs/evaluation.md.

    >>> settings = SuiteSettings(tasks=("piqa", "arc_easy_mmlu_style"), data_dir="../shared/data/zeroshot",
    ...                          include_path="benchmarks/lm_eval_tasks", allow_code=True, limit=100)
    >>> rep = evaluate_suite(model, tok, settings)   # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

# harness and zeroshot import torch, so they are imported where used: the CLI imports SuiteSettings from
# here to build its flags, and --help and --print_config stay free of torch
from headbudget.evaluation.tasks import TASKS, get_task, load_examples
from headbudget.typed_config import coerce, option

#: the ``metadata.version`` of every built-in task file (lm-eval's own tasks of the same names say 1.0)
BUILTIN_TASK_VERSION = 1.0


def lm_eval_installed() -> bool:
    """Whether the optional ``lmeval`` extra can be imported (without importing it)."""
    try:
        return find_spec("lm_eval") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["lm_eval"] is None (blocked)
        return False


@dataclass(kw_only=True)
class SuiteSettings:
    """The tasks of one evaluation and how they are scored: ``headbudget eval``'s flags of the same names
    (:class:`headbudget.cli.eval_cmd.EvalSettings` adds the model's and the output's).  ``tasks`` may also be
    given as one comma-separated string, as on the command line.

        >>> settings = SuiteSettings(tasks=("piqa", "arc_easy"), data_dir="../shared/data/zeroshot", limit=200)
        >>> rep = evaluate_suite(model, tok, settings, device="cuda")   # doctest: +SKIP
    """

    tasks: tuple[str, ...] = option(
        ("piqa", "hellaswag", "arc_easy", "winogrande"),
        help="comma-separated: built in (piqa,hellaswag,arc_easy,arc_challenge,openbookqa,winogrande,"
             "copa) or lm-eval task/group names and YAML files (pip install \"headbudget[lmeval]\")")
    include_path: str | None = option(
        None, help="folder of lm-eval task YAML files of your own (as lm-eval's flag)")
    allow_code: bool = option(False, help="let your task YAML files (in --tasks, under --include-path, or pulled "
                                          "in by include: or a group) run the Python they name with !function; "
                                          "without it such a task is refused before anything loads")
    num_fewshot: int | None = option(None, help="few-shot examples for lm-eval tasks (as lm-eval; a built-in "
                                                "name with N > 0 runs lm-eval's task of that name)")
    seed: str | None = option(None, help="lm-eval's seeds: one integer for all, or PYTHON,NUMPY,TORCH,FEWSHOT "
                                         "(default 0,1234,1234,1234)")
    log_samples: bool = option(False, help="also write lm-eval's per-document samples_<task>_<datetime>.jsonl "
                                           "files (needs --output-path or --json)")
    bootstrap_iters: int = option(100000, help="lm-eval's bootstrap resamples for non-mean stderrs (0: none)")
    data_dir: str | None = option(None, help="local JSONL files (e.g. ../shared/data/zeroshot); default: the "
                                             "Hugging Face hub")
    limit: int | None = option(None, help="first N examples per task")
    batch_size: int = option(16, help="sequences per forward pass")
    strategy: str = option("prefix", choices=("prefix", "full"),
                           help="prefix: each document's choices (and documents sharing a few-shot context) as one "
                                "token trie, shared tokens run once (default); full: every choice in full, batched "
                                "by length")

    def __post_init__(self) -> None:
        # a caller's "piqa,arc_easy" or list becomes the tuple the flag gives (a string would iterate by letter)
        self.tasks = coerce(self.tasks, tuple[str, ...], "tasks")


def check_eval_args(settings: SuiteSettings) -> None:
    """The checks that need no model and no task building (one-line errors naming the flag), and
    without lm-eval that only what the built-in path does is asked for."""
    from headbudget.evaluation.harness import parse_seed

    if not isinstance(settings, SuiteSettings):
        raise TypeError(f"the tasks and how they are scored come as one SuiteSettings (e.g. "
                        f"SuiteSettings(tasks=('piqa',), limit=100)), not a {type(settings).__name__}")

    s = settings
    if not s.tasks:
        raise ValueError("--tasks is empty")
    if s.limit is not None and s.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {s.limit}")
    if s.num_fewshot is not None and s.num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {s.num_fewshot}")
    parse_seed(s.seed)
    if s.data_dir is not None and not Path(s.data_dir).is_dir():
        raise FileNotFoundError(f"--data-dir: no directory {s.data_dir}")
    if s.include_path is not None and not Path(s.include_path).is_dir():
        raise FileNotFoundError(f"--include-path: no directory {s.include_path}")
    if lm_eval_installed():
        return
    other = [t for t in s.tasks if t not in TASKS]
    need = (f"task {other[0]!r} is not built in ({', '.join(TASKS)}); lm-eval tasks" if other else
            "--num-fewshot" if s.num_fewshot else "--include-path" if s.include_path is not None else
            "--log-samples (lm-eval's per-document records)" if s.log_samples else None)
    if need:
        raise ValueError(f"{need} need the optional extra: pip install \"headbudget[lmeval]\"")


def prepare_suite(settings: SuiteSettings) -> dict[str, Any] | None:
    """Check the settings and load the tasks through lm-eval (data included), so that a bad flag or task,
    a malformed row or unreachable data fails before the model is loaded: :func:`evaluate_suite`'s
    ``harness_tasks`` (None without lm-eval).  ``settings.allow_code``: let a user's task YAML run Python.

        >>> pre = prepare_suite(SuiteSettings(tasks=("arc_easy_local",),
        ...                                   include_path="benchmarks/lm_eval_tasks"))  # doctest: +SKIP
    """
    check_eval_args(settings)
    tasks, data_dir, limit = list(settings.tasks), settings.data_dir, settings.limit
    if not lm_eval_installed():
        for name in tasks:  # a bad row fails here too, before the model loads
            load_examples(name, data_dir, limit)
        return None
    from headbudget.evaluation.harness import load_harness_tasks

    return load_harness_tasks(tasks, settings.include_path, data_dir, limit, allow_code=settings.allow_code)[1]


def evaluate_suite(model: Any, tokenizer: Any, settings: SuiteSettings, *, device: str | None = None,
                   progress: bool = True, harness_tasks: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate ``settings.tasks`` and return the report (module docstring); ``harness_tasks``: what
    :func:`prepare_suite` returned.  ``details``: ``lm_eval`` (tasks, seconds, model seconds, forward passes)
    or without lm-eval ``task_seconds`` and ``forward_passes`` per task, and ``limit``, ``num_fewshot``,
    ``batch_size``."""
    check_eval_args(settings)
    s, tasks = settings, list(settings.tasks)
    t0 = time.perf_counter()
    run = {"limit": s.limit, "batch_size": s.batch_size, "strategy": s.strategy, "device": device,
           "progress": progress, "data_dir": s.data_dir, "seed": s.seed, "bootstrap_iters": s.bootstrap_iters}
    details: dict[str, Any] = {"task_seconds": {}, "forward_passes": {}, "limit": s.limit,
                               "num_fewshot": s.num_fewshot, "batch_size": s.batch_size}
    if lm_eval_installed():
        rep = _lm_eval_report(model, tokenizer, tasks, details, include_path=s.include_path,
                              num_fewshot=s.num_fewshot, log_samples=s.log_samples, loaded=harness_tasks,
                              allow_code=s.allow_code, **run)
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
    from headbudget.evaluation.harness import SEED_KEYS, parse_seed
    from headbudget.evaluation.zeroshot import evaluate_tasks

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
        from headbudget.evaluation.zeroshot import format_table

        return format_table({"results": {  # "acc,none" -> "acc"
            k: {**{m.removesuffix(",none"): float("nan") if x == "N/A" else x for m, x in v.items()
                   if m.endswith(",none")}, "n": v["sample_len"]} for k, v in rep["results"].items()}})
    from lm_eval.utils import make_table

    sub = {k: rep[k] for k in ("results", "versions", "n-shot", "higher_is_better", "group_subtasks")}
    parts = [make_table(sub)]
    if rep.get("groups"):
        parts.append(make_table({**sub, "groups": rep["groups"]}, "groups"))
    return "\n".join(parts)
