"""lm-evaluation-harness's task library, scored by headbudget's shared-prefix engine.

lm-eval (the optional ``lmeval`` extra) builds the requests -- task names, groups, headbudget's built-in
task files (``lm_eval_tasks/``), the user's YAML (``include_path``), few-shot contexts, seeds -- and computes
the metrics; :class:`HeadBudgetLM` answers them with :class:`~headbudget.evaluation.scorer.Scorer`
(log-likelihoods equal the ``hf`` backend's; generation tasks are refused) and is registered as lm-eval's
model ``headbudget`` by ``import headbudget``.  See docs/evaluation.md.

    >>> out = evaluate_harness(model, tok, ["arc_easy"], num_fewshot=5, limit=100)        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import difflib
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headbudget.evaluation.scorer import Scorer
from headbudget.evaluation.task_code import (
    BUILTIN_TASKS_DIR,
    check_task_code,
    code_guard,
    sandboxed_templates,
)
from headbudget.io import NotUTF8Error, read_text

try:
    from lm_eval.api.model import LM
except ImportError:  # the optional extra: parse_seed and the checks work without it, HeadBudgetLM does not
    LM = object

SUPPORTED_OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
DEFAULT_BATCH_SIZE = 16
DEFAULT_SEEDS = (0, 1234, 1234, 1234)  # lm-eval's --seed default: python, numpy, torch, few-shot
SEED_KEYS = ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")  # their names in lm-eval's config


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
    out: list[int | None] = []
    for item in value.split(",") if isinstance(value, str) else value:
        text = str(item).strip()
        try:
            out.append(None if text.lower() == "none" else int(text))
        except ValueError:
            raise ValueError(f"--seed: {text!r} is not an integer or None (e.g. --seed 42 or "
                             "--seed 0,1234,1234,1234)") from None
    if len(out) == 1:
        return (out[0],) * 4
    if len(out) != 4:
        raise ValueError(f"--seed: expected 1 or 4 comma-separated values, got {len(out)}")
    return tuple(out)


def _batch_size(value: Any) -> int:
    """lm-eval passes ``batch_size`` as given on its command line: None, an int, "8" or "auto"."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE  # no memory probing on CPU: the scorer bounds rows per pass
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"batch_size must be a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise ValueError(f"batch_size must be a positive integer, got {value!r}")
    return n


class HeadBudgetLM(LM):
    """An lm-eval model whose log-likelihoods come from headbudget's shared-prefix scorer.  ``pretrained``:
    a model directory/hub name (headbudget's loader; ``gguf_file=`` inside a directory) or a loaded
    ``torch.nn.Module`` (then ``tokenizer`` is the tokenizer object, and the model is cast to ``dtype`` but
    stays on its device).  ``dtype``/``device`` as lm-eval's hf backend.

        >>> lm = HeadBudgetLM(pretrained="runs/prism/model")             # doctest: +SKIP
        >>> lm_eval.simple_evaluate(model=lm, tasks=["piqa"])            # doctest: +SKIP
    """

    def __init__(self, pretrained: Any = None, tokenizer: Any = None, gguf_file: str | None = None,
                 batch_size: Any = DEFAULT_BATCH_SIZE, device: str | None = None,
                 strategy: str = "prefix", add_bos_token: Any = None, max_length: Any = None,
                 progress: Any = True, max_batch_size: Any = None, dtype: Any = None,
                 **unknown: Any) -> None:
        from headbudget.devices import resolve_device, resolve_dtype

        super().__init__()
        if unknown:
            raise ValueError(f"model_args: unknown argument(s) {', '.join(sorted(unknown))} for the "
                             "headbudget model (pretrained, tokenizer, gguf_file, batch_size, device, "
                             "dtype, strategy, add_bos_token, max_length)")
        torch_dtype = resolve_dtype(dtype, flag="model_args dtype")
        if pretrained is None:
            raise ValueError("model_args: pretrained=DIR is required for the headbudget model")
        if isinstance(pretrained, torch.nn.Module):
            if tokenizer is None or isinstance(tokenizer, (str, Path)):
                raise ValueError("a loaded model needs its tokenizer object (tokenizer=...)")
            model, tok, self.model_name = pretrained, tokenizer, type(pretrained).__name__
            if torch_dtype is not None:
                model.to(torch_dtype)
        else:
            from headbudget.loading import load_model_and_tokenizer

            device = str(resolve_device(device, flag="model_args device"))
            model, tok = load_model_and_tokenizer(pretrained, tokenizer=tokenizer, gguf_file=gguf_file,
                                                  device=device, dtype=torch_dtype)
            self.model_name = str(pretrained)
        self.tokenizer = tok
        self.scorer = Scorer(model, tok, batch_size=_batch_size(batch_size), strategy=strategy,
                             max_length=int(max_length) if max_length else None,
                             add_bos_token=_bool_or_none(add_bos_token), device=device,
                             progress=_bool_or_none(progress) is not False)
        self.records: dict[tuple[str, Any, int], tuple[float, bool]] = {}  # (task, doc, idx) -> prediction
        self.seconds = 0.0  # seconds spent scoring (model time), summed over calls

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log P(continuation | context), is_greedy)`` per request, one scorer item per document."""
        t0 = time.perf_counter()
        groups: dict[tuple[Any, Any], list[int]] = {}
        for i, req in enumerate(requests):
            key = (getattr(req, "task_name", None), getattr(req, "doc_id", None))
            groups.setdefault(key if key != (None, None) else ("", -1 - i), []).append(i)
        keys = list(groups)
        items = [[tuple(requests[i].args) for i in groups[k]] for k in keys]
        progress, self.scorer.progress = self.scorer.progress, self.scorer.progress and not disable_tqdm
        try:
            scored = self.scorer.score_pairs(items, desc="loglikelihood")
        except ValueError as exc:  # a request the model cannot score: name its task and document
            raise ValueError(f"{_failing_item(self.scorer, keys, items)}: {exc}") from None
        finally:
            self.scorer.progress = progress
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for key, item in zip(keys, scored, strict=True):
            for i, res in zip(groups[key], item, strict=True):
                out[i] = res
                self.records[(str(key[0]), key[1], getattr(requests[i], "idx", 0))] = res
        self.seconds += time.perf_counter() - t0
        return out

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each string under the ``hf`` backend's disjoint rolling windows
        (``max_length`` tokens, one token of context, the prefix token first)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        t0 = time.perf_counter()
        enc, max_len = self.scorer.encoder, self.scorer.max_length
        rows: list[tuple[list[int], int]] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            (string,) = req.args
            windows = get_rolling_token_windows(token_list=enc.encode(string), max_seq_len=max_len,
                                                prefix_token=enc.prefix_token_id, context_len=1)
            for ctx, cont in map(make_disjoint_window, windows):
                rows.append(((ctx + cont)[-(max_len + 1):], len(cont)))
                owner.append(i)
        progress, self.scorer.progress = self.scorer.progress, self.scorer.progress and not disable_tqdm
        try:
            scored = self.scorer.score_rows(rows, desc="loglikelihood_rolling") if rows else []
        finally:
            self.scorer.progress = progress
        per_request: list[list[float]] = [[] for _ in requests]
        for i, (ll, _) in zip(owner, scored, strict=True):
            per_request[i].append(ll)
        self.seconds += time.perf_counter() - t0
        return [sum(lls) for lls in per_request]  # summed in window order, as the hf backend

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("generation (generate_until) is not supported by the headbudget "
                                  "model: it scores log-likelihoods only; use lm-eval's hf backend")

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        dtype = next((p.dtype for p in self.scorer.model.parameters() if p.is_floating_point()), None)
        return {"model_class": type(self.scorer.model).__name__, "strategy": self.scorer.strategy,
                "dtype": str(dtype).removeprefix("torch."), "device": str(self.scorer.device),
                "fallbacks": list(self.scorer.stats.fallbacks),
                "batch_size": self.scorer.batch_size, "max_length": self.scorer.max_length}


def _failing_item(scorer: Scorer, keys: list[tuple[Any, Any]], items: list[list[tuple[str, str]]]) -> str:
    """``task piqa, document 3``: the first item whose requests cannot be scored (tokenization only)."""
    for (task, doc), pairs in zip(keys, items, strict=True):
        try:
            scorer._sequences(pairs)
        except ValueError:
            return f"task {task}, document {doc}" if task else f"request {-doc - 1}"
    return "loglikelihood"


def _bool_or_none(value: Any) -> bool | None:
    """model_args arrive as strings from lm-eval's ``key=value`` parser."""
    if value is None or isinstance(value, bool):
        return value
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False,
             "none": None, "": None}
    text = str(value).strip().lower()
    if text not in words:
        raise ValueError(f"expected true/false, got {value!r}")
    return words[text]


# Evaluation: what lm_eval.simple_evaluate does, minus model loading and environment probing


def task_manager(tasks: Sequence[str], include_path: str | Sequence[str] | None = None) -> Any:
    """An lm-eval ``TaskManager`` that knows ``tasks``: built-in task files, then ``include_path`` (which
    wins), then lm-eval's library -- only when a name is not found before it (indexing it takes ~10 s)."""
    from lm_eval.tasks import TaskManager

    paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
    for p in paths:
        if not Path(p).is_dir():
            raise FileNotFoundError(f"--include-path: no directory {p}")
    paths = [str(BUILTIN_TASKS_DIR), *map(str, paths)]
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(t in local.all_tasks or Path(t).is_file() for t in tasks):
        return local
    return TaskManager(include_path=paths)


def builtin_task_spec(tm: Any, name: str, data_dir: str | Path | None,
                      limit: int | float | None = None) -> str | dict[str, Any]:
    """What ``tm.load`` takes for task ``name``: the name, or for a built-in task read from ``data_dir`` its
    config with the data at ``data_dir/<metadata.local_file>``, whose rows are checked first (DataError).

        >>> builtin_task_spec(task_manager(["piqa"]), "piqa", "tests/fixtures/zeroshot")["dataset_kwargs"]
        {'data_files': {'validation': 'tests/fixtures/zeroshot/piqa_validation.jsonl'}}
    """
    yaml_path = _builtin_task_file(tm, name)
    if data_dir is None or yaml_path is None:
        return name
    from lm_eval.tasks._yaml_loader import load_yaml  # the !function tags resolved as lm-eval does

    from headbudget.evaluation.tasks import load_examples

    load_examples(name, data_dir, limit if isinstance(limit, int) else None)  # the rows lm-eval will read
    cfg = load_yaml(yaml_path, resolve_func=True)
    split = cfg.get("test_split") or cfg["validation_split"]
    data = str(Path(data_dir) / cfg["metadata"]["local_file"])
    # one local file: no training split, so few-shot examples come from the same file (never the document)
    return {**cfg, "dataset_path": "json", "dataset_name": None, "training_split": None,
            "dataset_kwargs": {"data_files": {split: data}},
            "metadata": {**cfg["metadata"], "task_file": str(yaml_path)}}  # lm-eval's source reads "inline"


def _builtin_task_file(tm: Any, name: str) -> str | None:
    """The YAML file of ``name`` if a built-in task file (not a user's of the same name), else None."""
    yaml_path = getattr(tm.task_index.get(name), "yaml_path", None)
    return yaml_path if yaml_path is not None and Path(yaml_path).resolve().parent == BUILTIN_TASKS_DIR else None


def _malformed_yaml(include_path: Any, name: str) -> ValueError | None:
    """A ValueError naming the YAML file under ``include_path`` that lm-eval skipped because it does not
    parse (the one mentioning ``name`` first), with the YAML error; None when every file parses."""
    import yaml

    _AnyTag = type("_AnyTag", (yaml.SafeLoader,), {})  # lm-eval's !function tags parse: syntax only
    _AnyTag.add_multi_constructor("!", lambda loader, suffix, node: None)
    paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
    bad: list[tuple[bool, str]] = []  # (mentions the task, "file[:line:col]: what is wrong")
    for root in paths:
        for f in sorted(Path(root).rglob("*.yaml")):
            try:
                text = read_text(f)
                yaml.load(text, Loader=_AnyTag)  # noqa: S506 (a SafeLoader subclass)
            except NotUTF8Error as exc:  # names the file, byte, offset and line
                bad.append((name.encode() in f.read_bytes(), str(exc)))
            except OSError:
                pass
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
                problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                bad.append((name in text, f"{f}{where}: invalid YAML ({problem})"))
    if not bad:
        return None
    problem = min(bad, key=lambda b: not b[0])[1]
    return ValueError(f"{problem}; lm-eval skips such a file, so task {name!r} is not defined")


def _unknown_task(name: str, tm: Any, include_path: Any) -> ValueError:
    from headbudget.evaluation.tasks import TASKS

    if include_path and (malformed := _malformed_yaml(include_path, name)) is not None:
        return malformed
    near = difflib.get_close_matches(name, [*TASKS, *tm.all_tasks], n=3)
    where = "lm-eval's task library" + (f" or --include-path {include_path}" if include_path else "")
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    return ValueError(f"unknown task {name!r}: not a built-in task ({', '.join(TASKS)}) and not in "
                      f"{where}{hint}")


def load_harness_tasks(tasks: Sequence[str], include_path: Any = None, data_dir: str | Path | None = None,
                       limit: int | float | None = None, allow_code: bool = False) -> tuple[Any, dict[str, Any]]:
    """``(TaskManager, loaded)`` for lm-eval task names, groups, tags or YAML paths (built-in tasks' data
    from ``data_dir`` when given); unknown names, generation tasks and a user's task YAML naming Python
    without ``allow_code`` (:func:`check_task_code`) are ValueErrors naming them, before any model work."""
    tm = task_manager(tasks, include_path)
    for name in tasks:
        if name not in tm.all_tasks and not Path(name).is_file():
            raise _unknown_task(name, tm, include_path)
    check_task_code(tm, tasks, allow_code)
    specs = [builtin_task_spec(tm, name, data_dir, limit) for name in tasks]
    try:
        with code_guard(allow_code):
            loaded = tm.load(specs)
    except (KeyError, FileNotFoundError) as exc:
        msg = exc.args[0] if exc.args else exc
        raise ValueError(f"cannot build lm-eval task(s) {', '.join(tasks)}: {msg}") from None
    except (ConnectionError, OSError) as exc:  # a hub dataset while offline, or unreachable
        from_hub = [n for n, spec in zip(tasks, specs) if isinstance(spec, str) and _builtin_task_file(tm, n)]
        fix = (f"give the built-in task(s) {', '.join(from_hub)} their local JSON lines with --data-dir DIR"
               if from_hub else "point a task YAML at local files and pass its folder with --include-path "
               "(see benchmarks/lm_eval_tasks)")
        raise ValueError(f"cannot load the data of lm-eval task(s) {', '.join(tasks)}: {exc}; offline, "
                         f"{fix}") from None
    generation = sorted(f"{n} ({t.OUTPUT_TYPE})" for n, t in loaded["tasks"].items()
                        if t.OUTPUT_TYPE not in SUPPORTED_OUTPUT_TYPES)
    if generation:
        raise ValueError(f"generation is not supported: {', '.join(generation)}; headbudget scores "
                         f"{', '.join(SUPPORTED_OUTPUT_TYPES)} tasks (run generation tasks with "
                         "lm-eval's hf backend)")
    return tm, loaded


@contextlib.contextmanager
def lm_eval_bars(enabled: bool) -> Iterator[None]:
    """lm-eval's own progress bars off unless ``enabled`` (it has no switch: its ``tqdm`` is a silent one)."""
    if enabled:
        yield
        return
    import lm_eval.api.task as lm_task
    import tqdm as tqdm_module

    base, saved = tqdm_module.tqdm, lm_task.tqdm

    class Silent(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    tqdm_module.tqdm = lm_task.tqdm = Silent  # module-level (api/task.py) and in-function (api/metrics.py) imports
    try:
        yield
    finally:
        tqdm_module.tqdm, lm_task.tqdm = base, saved


def evaluate_harness(model: Any, tokenizer: Any, tasks: Sequence[str], *,
                     include_path: str | Sequence[str] | None = None, data_dir: str | None = None,
                     num_fewshot: int | None = None, seed: str | int | Sequence[int | None] | None = None,
                     limit: int | float | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
                     strategy: str = "prefix", device: str | None = None, log_samples: bool = False,
                     bootstrap_iters: int = 100000, progress: bool = True,
                     lm: HeadBudgetLM | None = None, loaded: dict[str, Any] | None = None,
                     allow_code: bool = False) -> dict[str, Any]:
    """Evaluate ``model`` on lm-eval tasks as ``lm_eval.simple_evaluate`` does (same seeds, ``num_fewshot``
    rule and ``evaluate``), scoring with :class:`HeadBudgetLM`: lm-eval's result dict (``samples`` only with
    ``log_samples``) plus ``predictions`` (:func:`harness_predictions`), ``seconds``, ``model_seconds`` and
    ``forward_passes``.  ``loaded``: :func:`load_harness_tasks`'s tasks (else loaded here)."""
    from lm_eval import evaluator
    from lm_eval.utils import set_torch_seed

    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    t0 = time.perf_counter()
    seeds = parse_seed(seed)
    if loaded is None:
        _, loaded = load_harness_tasks(tasks, include_path, data_dir, limit, allow_code=allow_code)
    if lm is None:
        lm = HeadBudgetLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                          strategy=strategy, device=device, progress=progress)
    for set_seed, value in zip((random.seed, np.random.seed, set_torch_seed), seeds):
        if value is not None:
            set_seed(value)
    for task in loaded["tasks"].values():
        # simple_evaluate's rule: --num-fewshot overrides a task's default unless the task fixes 0
        if num_fewshot is not None:
            if task.get_config("num_fewshot") != 0:
                task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seeds[3])
    model_s0, passes0 = lm.seconds, lm.scorer.stats.forward_passes
    lm.records.clear()  # predictions of this run only
    with lm_eval_bars(progress), sandboxed_templates(allow_code):
        res = evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters,
                                 log_samples=log_samples, fewshot_as_multiturn=True)
    out = {k: v for k, v in res.items() if log_samples or k != "samples"}
    out["config"] = {"model": "headbudget", "model_args": lm.model_name, **lm.get_model_info(),
                     "limit": limit, "bootstrap_iters": bootstrap_iters, **dict(zip(SEED_KEYS, seeds))}
    out["predictions"] = harness_predictions(lm, loaded["tasks"])
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["model_seconds"] = round(lm.seconds - model_s0, 3)
    out["forward_passes"] = lm.scorer.stats.forward_passes - passes0  # of this run (lm may be reused)
    return out


def harness_predictions(lm: HeadBudgetLM, tasks: dict[str, Any]) -> dict[str, list[int]]:
    """Per multiple-choice task, each document's argmax choice (first on ties), ordered by doc id."""
    by_doc: dict[str, dict[Any, dict[int, float]]] = {}
    for (task, doc, idx), (ll, _) in lm.records.items():
        by_doc.setdefault(task, {}).setdefault(doc, {})[idx] = ll
    return {name: [int(np.argmax([docs[d][i] for i in sorted(docs[d])])) for d in sorted(docs)]
            for name, task in tasks.items()
            if task.OUTPUT_TYPE == "multiple_choice" and (docs := by_doc.get(name))}
