"""lm-evaluation-harness's result files, written from a :func:`~headbudget.evaluation.suite.evaluate_suite`
report as ``lm_eval --output_path DIR --log_samples`` writes them (headbudget's own fields under the one key
``"headbudget"``), without importing lm-eval.  See docs/evaluation.md.

    >>> write_lm_eval_files(rep, output_path="out", model_name="runs/prism")          # doctest: +SKIP
    [PosixPath('out/runs__prism/samples_piqa_2026-12-02T05-40-00.123456.jsonl'),
     PosixPath('out/runs__prism/results_2026-12-02T05-40-00.123456.json')]
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from headbudget.io import atomic_write_text

#: the report keys that are headbudget's own; the files keep them under this one key
HEADBUDGET_KEY = "headbudget"
HEADBUDGET_FIELDS = ("predictions", "seconds", "details")


def hash_string(text: str) -> str:
    """lm_eval.utils.hash_string: the SHA-256 hex digest of the UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def handle_non_serializable(o: Any) -> Any:
    """lm_eval.utils.handle_non_serializable: numpy scalars as Python numbers, sets as lists, else str."""
    import numpy as np

    for kind, cast in ((np.bool_, bool), (np.integer, int), (np.floating, float), (set, list)):
        if isinstance(o, kind):
            return cast(o)
    return str(o)


def sanitize_model_name(name: str) -> str:
    """lm_eval.utils.sanitize_model_name: the folder lm-eval writes a model's files in."""
    return re.sub(r"[\"<>:/|\\?*\[\]]+", "__", name)


def _strings(sub: Any) -> Any:
    """lm_eval.utils.sanitize_list: every leaf of nested lists/tuples as a string."""
    if isinstance(sub, (list, tuple)):
        out = [_strings(x) for x in sub]
        return out if isinstance(sub, list) else tuple(out)
    return str(sub)


def sample_line(sample: dict[str, Any]) -> str:
    """One of ``report["samples"][task]`` as the JSONL line lm-eval's ``save_results_samples`` writes."""
    rec = dict(sample)  # key order kept: lm-eval rewrites its records in place
    rec["arguments"] = {f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(args)}
                        for i, args in enumerate(sample["arguments"])}
    rec["resps"], rec["filtered_resps"] = _strings(sample["resps"]), _strings(sample["filtered_resps"])
    rec["target"] = str(sample["target"])
    return json.dumps(rec, default=handle_non_serializable, ensure_ascii=False) + "\n"


def task_hashes(samples: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """lm-eval's ``task_hashes``: per task, the hash of its documents' doc/prompt/target hashes."""
    return {task: hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in recs))
            for task, recs in samples.items()}


def _nan_to_none(obj: Any) -> Any:
    """NaN (a stderr of one document) as null: strict JSON readers (jq, JavaScript) reject NaN."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def results_document(report: dict[str, Any], *, model_name: str, model_args: str | None = None,
                     date: float | None = None) -> dict[str, Any]:
    """The results file's content: lm-eval's keys in lm-eval's order, then ``"headbudget"``.
    ``model_name``: the ``pretrained=`` path; ``model_args``: default ``pretrained=<model_name>``."""
    out: dict[str, Any] = {"results": report["results"]}
    if report.get("groups"):
        out["groups"] = report["groups"]
    for key in ("group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples"):
        out[key] = report.get(key, {})
    config = dict(report.get("config") or {})
    if not config.get("model_args") or model_args:
        config["model_args"] = model_args or f"pretrained={model_name}"
    out.update({"config": config, "date": date if date is not None else datetime.now().timestamp(),
                "transformers_version": _package_version("transformers"),
                "lm_eval_version": _package_version("lm_eval")})
    tokenizer_keys = ("tokenizer_pad_token", "tokenizer_eos_token", "tokenizer_bos_token", "eot_token_id",
                      "max_length")  # lm-eval's add_tokenizer_info, when the report has them
    out.update({key: report[key] for key in tokenizer_keys if key in report})
    out["task_hashes"] = task_hashes(report["samples"]) if report.get("samples") else {}
    out.update({"model_source": "headbudget", "model_name": model_name,
                "model_name_sanitized": sanitize_model_name(model_name), "system_instruction": None,
                "system_instruction_sha": None, "fewshot_as_multiturn": True, "chat_template": None,
                "chat_template_sha": None, "total_evaluation_time_seconds": str(report.get("seconds", ""))})
    out[HEADBUDGET_KEY] = {k: report[k] for k in HEADBUDGET_FIELDS if k in report}
    return _nan_to_none(out)


def output_paths(output_path: str | Path, model_name: str, tasks: list[str],
                 date_id: str) -> tuple[Path, dict[str, Path]]:
    """``(results file, {task: samples file})`` under lm-eval's ``--output_path`` rules."""
    path = Path(output_path)
    if path.suffix == ".json":
        folder, results = path.parent, path.with_name(f"{path.stem}_{date_id}.json")
    else:
        folder = path / sanitize_model_name(model_name)
        results = folder / f"results_{date_id}.json"
    return results, {t: folder / f"samples_{t}_{date_id}.jsonl" for t in tasks}


def check_output_args(*, output_path: str | None = None, json_path: str | None = None,
                      log_samples: bool = False, model_name: str | None = None) -> None:
    """The cheap checks of ``--output-path``/``--log-samples`` before any evaluation (one-line ValueErrors
    naming the flag; ``--json`` is :func:`headbudget.run_dir.check_output_file`'s), with ``model_name`` also
    a write probe where the results file would go, so that a read-only folder fails now, not after."""
    if log_samples and not (output_path or json_path):
        raise ValueError("--log-samples writes lm-eval's samples_<task>_<datetime>.jsonl files: give "
                         "--output-path DIR (or --json FILE: written next to it)")
    if not output_path:
        return
    path = Path(output_path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--output-path: {output_path} is an existing file; give a folder (lm-eval's "
                         "layout: DIR/<model>/results_<datetime>.json)")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--output-path: {parent} is a file, not a folder, so {output_path} cannot be written")
    if model_name is not None:
        from headbudget.run_dir import check_output_file

        check_output_file(output_paths(output_path, model_name, [], "<datetime>")[0], "--output-path")


def write_lm_eval_files(report: dict[str, Any], *, model_name: str, output_path: str | Path | None = None,
                        json_path: str | Path | None = None, model_args: str | None = None,
                        date_id: str | None = None) -> list[Path]:
    """Write the report as lm-eval does and return the files written (samples files first).
    ``output_path``: lm-eval's ``--output_path``; ``json_path``: the results dict at exactly this file,
    samples files beside it.  Atomic per file; if one fails, the files this call wrote are removed."""
    if (output_path is None) == (json_path is None):
        raise ValueError("give exactly one of output_path and json_path")
    date_id = date_id or datetime.now().isoformat().replace(":", "-")
    samples = report.get("samples") or {}
    tasks = [t for t in report.get("configs", {}) if t in samples]
    if output_path is not None:
        results_path, sample_paths = output_paths(output_path, model_name, tasks, date_id)
    else:
        results_path = Path(json_path)  # type: ignore[arg-type]
        sample_paths = {t: results_path.parent / f"samples_{t}_{date_id}.jsonl" for t in tasks}
    doc = results_document(report, model_name=model_name, model_args=model_args)
    written: list[Path] = []
    try:
        for task, path in sample_paths.items():
            written.append(atomic_write_text(path, "".join(sample_line(s) for s in samples[task])))
        written.append(atomic_write_text(results_path, json.dumps(
            doc, indent=2, default=handle_non_serializable, ensure_ascii=False)))
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    return written
