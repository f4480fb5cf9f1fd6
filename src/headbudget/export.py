"""``headbudget export``: write a model folder as a file another runtime serves (llama.cpp's GGUF).

Opens anything :func:`headbudget.loading.load_model_and_tokenizer` opens (a headbudget model, uniform or
pruned; a transformers Llama/Mistral/Qwen2 folder; a GGUF file) and writes it with
:func:`headbudget.models.export_gguf.export_gguf`.  A model read from a GGUF file keeps that file's tokenizer
metadata unless another tokenizer is named.

    >>> from headbudget.export import export_model
    >>> result = export_model("runs/smol-pruned/model", "smol-pruned.gguf", outtype="f16")   # doctest: +SKIP
    >>> result["arch"], result["warning"]                                                   # doctest: +SKIP
    ('deci', None)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FORMATS = ("gguf",)


def export_model(model: str | os.PathLike, out: str | os.PathLike, *, fmt: str = "gguf", outtype: str = "f32",
                 gguf_file: str | None = None, tokenizer: str | None = None, tokenizer_pre: str | None = None,
                 overwrite: bool = False, name: str | None = None) -> dict[str, Any]:
    """Write ``model`` to ``out``; returns what was written (``arch``, per-layer heads, ``bytes``, ``warning``:
    the one-line cost of duplicated key/value heads, or None)."""
    from headbudget.loading import load_model_and_tokenizer, resolve_model
    from headbudget.models.export_gguf import OUTTYPES, export_gguf
    from headbudget.run_dir import check_not_an_input, check_output_file

    # a GGUF exported onto itself, or into the model folder it reads, would replace or mix with its input
    check_not_an_input(out, {"MODEL": str(model), "--tokenizer": tokenizer}, "--out")
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if outtype not in OUTTYPES:
        raise ValueError(f"--outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"--out {out}: is a folder (name the .gguf file to write)")
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out}: exists (pass --overwrite to replace it)")
    check_output_file(out, "--out")  # a real write probe (a read-only folder): now, not after loading the model
    src = resolve_model(model, gguf_file)
    source_gguf = Path(src.where) / src.gguf_file if src.gguf_file is not None and tokenizer is None else None
    hf_model, tok = load_model_and_tokenizer(model, tokenizer=tokenizer, gguf_file=gguf_file, as_headbudget=True)
    plan = export_gguf(hf_model, tok, out, outtype, source_gguf=source_gguf, tokenizer_pre=tokenizer_pre,
                       name=name or Path(str(model)).name)
    return {"out": str(out), "format": fmt, "outtype": outtype, "arch": plan.arch, "head_dim": plan.head_dim,
            "n_heads": plan.n_heads, "n_kv_heads": plan.n_kv_heads, "source_kv_heads": plan.source_kv_heads,
            "feed_forward": plan.feed_forward, "extra_bytes": plan.extra_bytes, "bytes": out.stat().st_size,
            "tokenizer": "copied from " + str(source_gguf) if source_gguf else "written from the tokenizer",
            "warning": plan.duplication_note()}


__all__ = ["FORMATS", "export_model"]
