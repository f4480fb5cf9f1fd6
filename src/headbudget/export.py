"""``headbudget export``: write a model folder as a file another runtime serves (llama.cpp's GGUF).

Opens anything :func:`headbudget.loading.load_model_and_tokenizer` opens and writes it with
:func:`headbudget.models.export_gguf.export_gguf`; a model read from a GGUF file keeps that file's tokenizer
metadata unless another tokenizer is named.  See docs/export.md.

    >>> from headbudget.export import ExportJob, export_model
    >>> result = export_model(ExportJob("runs/smol-pruned/model", "smol-pruned.gguf", outtype="f16"))  # doctest: +SKIP
    >>> result["arch"], result["warning"]                                                   # doctest: +SKIP
    ('deci', None)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headbudget.typed_config import option

FORMATS = ("gguf",)


@dataclass
class ExportJob:
    """``headbudget export``'s settings (each flag declared once, on its field)."""

    model: str = option(help="model or run folder, or GGUF file", metavar="MODEL")
    out: str = option(help="the file to write (e.g. model.gguf)")
    fmt: str = option("gguf", help="output format (gguf)", flag="--format", choices=FORMATS)
    outtype: str = option("f32", help="type of the 2-D weights (1-D norms stay f32, as llama.cpp's converter "
                                      "writes them)", choices=("f32", "f16"))
    gguf_file: str | None = option(None, help="the GGUF file to read, in a folder holding several")
    tokenizer: str | None = option(None, help="tokenizer folder or spec (default: the model's own; a GGUF source "
                                              "keeps its tokenizer metadata)")
    tokenizer_pre: str | None = option(None, help="llama.cpp's pre-tokenizer name (gpt-2, smollm, llama-bpe, "
                                                  "qwen2, ...) when the tokenizer's is not recognised")


def export_model(job: ExportJob, *, overwrite: bool = False) -> dict[str, Any]:
    """Write ``job.model`` to ``job.out`` (``overwrite``: replace an existing file); returns what was written
    (``arch``, per-layer heads, ``bytes``, ``warning``: the one-line cost of duplicated key/value heads, or None;
    ``kv_cache_bytes_per_token``: :func:`kv_cache_costs`; ``kv_warning``: :func:`kv_warning`)."""
    from headbudget.loading import load_model_and_tokenizer, resolve_model
    from headbudget.models.export_gguf import OUTTYPES, export_gguf
    from headbudget.run_dir import check_not_an_input, check_output_file

    # a GGUF exported onto itself, or into the model folder it reads, would replace or mix with its input
    check_not_an_input(job.out, {"MODEL": str(job.model), "--tokenizer": job.tokenizer}, "--out")
    if job.fmt not in FORMATS:
        raise ValueError(f"--format {job.fmt!r} is not one of {', '.join(FORMATS)}")
    if job.outtype not in OUTTYPES:
        raise ValueError(f"--outtype {job.outtype!r} is not one of {', '.join(OUTTYPES)}")
    out = Path(job.out)
    if out.is_dir():
        raise ValueError(f"--out {out}: is a folder (name the .gguf file to write)")
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out}: exists (pass --overwrite to replace it)")
    check_output_file(out, "--out")  # a real write probe (a read-only folder): now, not after loading the model
    src = resolve_model(job.model, job.gguf_file)
    source_gguf = Path(src.where) / src.gguf_file if src.gguf_file is not None and job.tokenizer is None else None
    hf_model, tok = load_model_and_tokenizer(job.model, tokenizer=job.tokenizer, gguf_file=job.gguf_file,
                                             as_headbudget=True)
    plan = export_gguf(hf_model, tok, out, job.outtype, source_gguf=source_gguf, tokenizer_pre=job.tokenizer_pre,
                       name=Path(str(job.model)).name)
    kv = kv_cache_costs(plan, hf_model, src)
    return {"out": str(out), "format": job.fmt, "outtype": job.outtype, "arch": plan.arch, "head_dim": plan.head_dim,
            "n_heads": plan.n_heads, "n_kv_heads": plan.n_kv_heads, "source_kv_heads": plan.source_kv_heads,
            "feed_forward": plan.feed_forward, "extra_bytes": plan.extra_bytes, "bytes": out.stat().st_size,
            "tokenizer": "copied from " + str(source_gguf) if source_gguf else "written from the tokenizer",
            "warning": plan.duplication_note(), "kv_cache_bytes_per_token": kv, "kv_warning": kv_warning(kv)}


def _dense_gguf_kv(src: Any, dtype: Any) -> tuple[int, str] | None:
    """llama.cpp's KV-cache bytes per token of the dense model a pruned one came from, and the prune
    ``report.json`` that says so (an older report's ``kv_cache_bytes_per_token``, recounted at f16)."""
    import torch

    from headbudget.models.export_gguf import LLAMACPP_CACHE_BYTES

    if not src.is_local or src.gguf_file is not None:
        return None
    for report in (Path(src.where) / "report.json", Path(src.where).parent / "report.json"):
        try:
            rep = json.loads(report.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        cost = rep.get("cost") if isinstance(rep, dict) and "heads_total" in rep else None
        if not isinstance(cost, dict):
            continue
        if isinstance(cost.get("gguf_kv_cache_bytes_per_token"), dict):
            return int(cost["gguf_kv_cache_bytes_per_token"]["before"]), str(report)
        if isinstance(cost.get("kv_cache_bytes_per_token"), dict):
            elements = int(cost["kv_cache_bytes_per_token"]["before"]) // torch.empty((), dtype=dtype).element_size()
            return elements * LLAMACPP_CACHE_BYTES, str(report)
    return None


def kv_cache_costs(plan: Any, model: Any, src: Any) -> dict[str, Any]:
    """KV-cache bytes per token as each runtime stores the model: ``gguf`` (llama.cpp's f16 cache, duplicated
    key/value heads included), ``headbudget`` (its own cache at the model's dtype), and ``dense_gguf`` with
    ``dense_from`` (the dense original's in llama.cpp, when a prune report says; else None)."""
    from headbudget.accounting import kv_cache_bytes_per_token

    dtype = next(model.parameters()).dtype
    dense_gguf, dense_from = _dense_gguf_kv(src, dtype) or (None, None)
    return {"gguf": plan.kv_cache_bytes_per_token, "headbudget": kv_cache_bytes_per_token(model.config, dtype),
            "headbudget_dtype": str(dtype).removeprefix("torch."), "dense_gguf": dense_gguf,
            "dense_from": dense_from}


def kv_cache_line(kv: dict[str, Any]) -> str:
    """The one line ``headbudget export`` prints about the KV cache.

    >>> kv_cache_line({"gguf": 1360, "headbudget": 1536, "headbudget_dtype": "float32", "dense_gguf": 1024,
    ...                "dense_from": "runs/p/report.json"})
    'KV cache per token: 1360 bytes in llama.cpp (f16), 1536 in headbudget (float32); dense model 1024 bytes in llama.cpp (runs/p/report.json): 1.328x dense'
    """
    line = (f"KV cache per token: {kv['gguf']} bytes in llama.cpp (f16), {kv['headbudget']} in headbudget "
            f"({kv['headbudget_dtype']})")
    if kv["dense_gguf"]:
        line += (f"; dense model {kv['dense_gguf']} bytes in llama.cpp ({kv['dense_from']}): "
                 f"{kv['gguf'] / kv['dense_gguf']:.3f}x dense")
    return line


def kv_warning(kv: dict[str, Any]) -> str | None:
    """One line when the GGUF's KV cache is larger than the dense model's (in llama.cpp), else None."""
    if not kv["dense_gguf"] or kv["gguf"] <= kv["dense_gguf"]:
        return None
    return (f"the GGUF's KV cache is larger than the dense model's: {kv['gguf']} against {kv['dense_gguf']} bytes "
            f"per token in llama.cpp ({kv['gguf'] / kv['dense_gguf']:.3f}x), because unequal query groups are written "
            "with duplicated key/value heads; prune with --granularity group or balanced for equal groups")


__all__ = ["ExportJob", "FORMATS", "export_model", "kv_cache_costs", "kv_cache_line", "kv_warning"]
